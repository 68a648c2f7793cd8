"""Block-tiled Im2col-Winograd schedule: alpha batched GEMMs sharing one reduction (issue 6).

1D Winograd F(n, S) along the output width turns the convolution into alpha independent GEMMs
(one per state a), all with the same reduction over (filter row (t, r), input channel c):

    M[a][m, k] = sum_{t, r, c} V[a][(t, r, c), m] * U[a][(t, r, c), k]
    V[a] = (BT d)[a]   d = the alpha input items of output tile m at filter row (t, r), channel c
    U[a] = (G g)[a]    g = the S taps of filter row (t, r) for (k, c)
    y[m, k, o] = sum_a AT[o][a] M[a][m, k]     (n outputs per tile, o < n)

m runs over output tiles (batch, out-depth, out-row, width tile of n outputs), k over output
channels.  A block owns BM tiles x BN channels; per reduction step (one filter row, a BK-chunk of
channels) its threads gather the input windows, apply BT (constants, unrolled) into V[alpha][BK][BM]
in shared memory, gather the filter row chunk and apply G into U[alpha][BK][BN]; after a barrier each
thread accumulates alpha x TM x TN products in registers (constant indices after unrolling, so the
scalarize pass keeps them out of local memory).  AT is applied once, in registers, in the epilogue.
Compared with implicit GEMM, the multiply count per output is S * alpha / n instead of S * S
(3x3: F(2,3) 1.5x fewer, F(6,3) 2.25x; 5x5: F(4,5) 2.5x; 7x7: F(2,7) 1.75x; 9x9: F(8,9) 4.5x).
The transforms cost nnz(BT) / (alpha BN) and S / BM of the GEMM work per step: ~10 %.

With cfg.stages == 2 the reduction steps are software-pipelined as in tiled_gemm: the raw gathers
of step i+1 (alpha input items per (tile, channel), S taps per (channel, k)) are issued into staging
registers before the outer products of step i, and transformed into the other half of double-buffered
V and U after them, so their global latency hides behind the FMA loop; one barrier per step.  The
staging holds the untransformed items (EV alpha + EU S registers, fewer than the transformed
alpha (EV + EU)).  Steps are flattened over (t, r, cb) and unrolled by two, so each half has a
constant stage index in its shared addresses.

Backward-data is the forward schedule on dy with the 180-degree rotated, channel-transposed filter,
read in place.  Stride 1, dilation 1.

Parts: _schedule (the sizes and buffers every part reads, once), _prologue (per-thread invariants), the input and
filter transforms (_stage; _fetch + _commit when pipelined), _products, the main loops (_single_stage,
_double_buffer) and the output transform (_epilogue), assembled by _kernel.
"""
from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

from kernelgen.ir import (Assign, Barrier, Buffer, Comment, Const, For, If, Kernel, Load, Store, Var, all_of, as_expr,
                          select)
from kernelgen.templates.config import TileConfig
from kernelgen.templates.gemm_schedule import _cdiv
from kernelgen.templates.implicit_gemm import epilogue_value
from kernelgen.templates.winograd_transforms import row_pairs, winograd_matrices


def _combo(coeffs, terms):
    """sum coeffs[j] * terms[j] with exact zeros dropped and unit coefficients not multiplied."""
    out = None
    for c, t in zip(coeffs, terms):
        if c == 0:
            continue
        term = t if c == 1 else Const(float(c)) * t
        out = term if out is None else out + term
    return out if out is not None else Const(0.0)


def _transform(m, terms, name):
    """(temporaries, [row . terms for each row of m]): the rows of points p and -p (row_pairs) share their even
    and odd halves E and O, each computed once into a temporary: E + O and lam (E - O)."""
    pre, out = [], [None] * len(m)
    for k, (i, j, lam, odd) in enumerate(row_pairs(m)):
        e, o = Var(f"{name}_e{k}"), Var(f"{name}_o{k}")
        pre += [_assign(e.name, _combo([0 if c in odd else v for c, v in enumerate(m[i])], terms)),
                _assign(o.name, _combo([v if c in odd else 0 for c, v in enumerate(m[i])], terms))]
        out[i] = e + o
        out[j] = e - o if lam == 1 else o - e if lam == -1 else Const(float(lam)) * (e - o)
    for i, row in enumerate(m):
        if out[i] is None:
            out[i] = _combo(row, terms)
    return pre, out


def _lin(*pairs):
    out = Const(0)
    for i, size in pairs:
        out = out * size + i
    return out


def conv_geometry(p):
    """The problem seen as a stride-1 forward conv: (src, dst, in size, out size, Cin, Kout, pads,
    src channel stride, dst channel stride)."""
    if p.direction == "bwd_data":
        pads = [f - 1 - pd for f, pd in zip(p.filter_size, p.padding)]
        return "dy", "dx", p.out_size, p.in_size, p.Kg, p.Cg, pads, p.K, p.C
    return "x", "y", p.in_size, p.out_size, p.Cg, p.Kg, list(p.padding), p.C, p.K


def reduction_error(p, cfg, alpha):
    """Why this schedule cannot split the reduction of p as cfg asks (None: it can).  split_k blocks each take a
    whole share of the (filter row, channel chunk) steps; state groups split the states.  Both add parts of y,
    so neither can apply an activation, and they do not combine."""
    T, R, _ = p.filter_size
    _, _, _, _, cin, _, _, _, _ = conv_geometry(p)
    nsteps = T * R * _cdiv(cin, cfg.BK)
    if nsteps % cfg.split_k:
        return f"config: split_k must divide the {nsteps} Winograd reduction steps, got {cfg}"
    SG = cfg.state_groups
    if alpha % SG or (SG > 1 and (cfg.split_k > 1 or p.activation)):
        return (f"config: state_groups must divide the {alpha} states and needs split_k=1 and no activation "
                f"(the groups add their parts of y in turn), got {cfg}")
    if cfg.split_k > 1 and p.activation:
        return f"config: split_k must be 1 with activation={p.activation!r}"
    return None


def shared_bytes(cfg, alpha, itemsize=4):
    return cfg.stages * itemsize * alpha * cfg.BK * (cfg.BM + cfg.BN + 2 * cfg.smem_pad)


# Shared V, U (a stage axis first when pipelined); registers: the accumulators acc, the fragments vf, uf, the staged
# items d, gw (one stage) or dv, gv (a whole step in flight), the invariants iu and iv {base, d, h, w}
_Buffers = namedtuple("_Buffers", "V U acc vf uf d gw dv gv iu iv")


@dataclass(frozen=True)
class _Schedule:
    """The facts every part of one Winograd kernel reads (build_tiled derives them once).  Geometry: conv_geometry's
    (src, dst, in / out size, Cin, Kout, pads, channel strides); TW width tiles per output row, M output tiles (GEMM
    rows), nkc channel chunks per filter row, EV / EU the (tile, channel) / (channel, k) pairs a thread gathers;
    nsteps reduction steps, per_split of them per split-K block from k_lo; SG state groups of AL states each."""
    p: object
    cfg: TileConfig
    alpha: int
    n: int
    matrices: tuple  # AT, G, BT
    geometry: tuple  # src, dst, (ID, IH, IW), (OD, OH, OW), Cin, Kout, pads, CS, KS
    TW: int
    M: int
    nkc: int
    EV: int
    EU: int
    nsteps: int
    per_split: int
    AL: int
    g: object
    split: object
    k_lo: object
    m0: object
    n0: object
    buf: _Buffers

    @property
    def bwd(self):
        return self.p.direction == "bwd_data"

    @property
    def NT(self):
        return self.cfg.threads

    @property
    def SG(self):
        return self.cfg.state_groups

    @property
    def SK(self):
        return self.cfg.split_k


def _schedule(p, cfg: TileConfig, alpha: int) -> _Schedule:
    T, R, S = p.filter_size
    n = alpha - S + 1
    matrices = winograd_matrices(n, S)
    geometry = conv_geometry(p)
    _, _, _, (OD, OH, OW), Cin, _, _, _, _ = geometry
    BM, BN, BK, TM, TN, NT, pad = cfg.BM, cfg.BN, cfg.BK, cfg.TM, cfg.TN, cfg.threads, cfg.smem_pad
    TW = _cdiv(OW, n)                   # width tiles per output row
    nkc = _cdiv(Cin, BK)                # channel chunks per filter row
    EV, EU = _cdiv(BM * BK, NT), _cdiv(BK * BN, NT)  # (tile, channel) / (channel, k) pairs per thread
    if (error := reduction_error(p, cfg, alpha)) is not None:
        raise ValueError(error)
    SK, nsteps = cfg.split_k, T * R * nkc
    per_split = nsteps // SK
    dt, SP, AL = p.dtype, cfg.stages, alpha // cfg.state_groups
    lead = (SP,) if SP > 1 else ()  # a stage axis only when pipelined: stages=1 renders as it always did
    reg = lambda name, shape, dtype=dt: Buffer(name, shape, dtype, "register")
    buf = _Buffers(Buffer("V", lead + (alpha, BK, BM + pad), dt, "shared"),
                   Buffer("U", lead + (alpha, BK, BN + pad), dt, "shared"),
                   reg("acc", (AL, TM, TN)), reg("vf", (TM,)), reg("uf", (TN,)), reg("d", (alpha,)), reg("gw", (S,)),
                   reg("dv", (EV, alpha)), reg("gv", (EU, S)),  # stages=2: a whole step's raw gathers in flight
                   # per-thread invariants of the tiles this thread gathers (index math hoisted out of the k loop)
                   reg("iu_base", (EU,), "int64"),
                   {nm: reg(f"iv_{nm}", (EV,), "int64") for nm in ("base", "d", "h", "w")})
    bz = Var("bz")
    g = bz // SK if SK > 1 else bz
    split = bz % SK if SK > 1 else None  # split-K: this block adds steps split*per_split.. into a zeroed y
    k_lo = split * per_split if SK > 1 else Const(0)
    return _Schedule(p, cfg, alpha, n, matrices, geometry, TW, p.N * OD * OH * TW, nkc, EV, EU, nsteps, per_split, AL,
                     g, split, k_lo, Var("bm") * BM, Var("bn") * BN, buf)


def build_tiled(p, cfg: TileConfig, alpha: int) -> Kernel:
    cfg.validate()
    s = _schedule(p, cfg, alpha)
    block = _single_stage(s) if cfg.stages == 1 else _double_buffer(s)
    return _kernel(s, block + _epilogue(s))


# Loops over pairs, states and register-tile entries are `unroll` loops: straight-line code with constant register
# indices on CUDA, compact loops on the CPU (whose compile time grows with size).
_TID, _EV, _EU, _AV, _SV, _IV, _JV = (Var(nm) for nm in ("tid", "e", "eu", "a", "s", "i", "j"))


def _unroll(var, extent, stmts):
    return For(var, extent, tuple(stmts), "unroll")


def _v_pair(s, e):
    """(channel, tile, in_tile) of pair e: channel fastest, so consecutive threads read consecutive channels."""
    idx = _TID + e * s.NT
    return idx % s.cfg.BK, idx // s.cfg.BK, idx < s.cfg.BM * s.cfg.BK


def _u_pair(s, e):
    """(channel, k, in_tile) of pair e: the filter's contiguous axis fastest (c forward, k for the transposed
    filter)."""
    BK, BN = s.cfg.BK, s.cfg.BN
    idx = _TID + e * s.NT
    if s.bwd:
        return idx // BN, idx % BN, idx < BK * BN
    return idx % BK, idx // BK, idx < BK * BN


def _guarded(s, stmts, in_tile, total):
    return list(stmts) if total % s.NT == 0 else [If(in_tile, tuple(stmts))]


# --- prologue: the window corner of each gathered tile, zero accumulators ----------------------------------------

def _prologue(s):
    p, cfg, n, buf = s.p, s.cfg, s.n, s.buf
    iv = buf.iv
    T, R, S = p.filter_size
    _, _, (ID, IH, IW), (OD, OH, _), Cin, Kout, pads, CS, _ = s.geometry
    _, row, _ = _v_pair(s, _EV)
    m = s.m0 + row
    orow, tw = m // s.TW, m % s.TW
    oh, rest = orow % OH, orow // OH
    od, nb = rest % OD, rest // OD
    corner = [od - pads[0], oh - pads[1], tw * n - pads[2]]
    TRS = T * R * S
    _, col, _ = _u_pair(s, _EU)
    g, n0 = s.g, s.n0
    base = _lin((nb, p.N), (corner[0], ID), (corner[1], IH), (corner[2], IW)) * CS + g * Cin
    return [Comment("per-thread invariants: the window corner of each gathered tile"),
            _unroll("e", s.EV, [iv["d"].store(_EV, corner[0]), iv["h"].store(_EV, corner[1]),
                                iv["w"].store(_EV, corner[2]), iv["base"].store(_EV, base)]),
            _unroll("eu", s.EU, [buf.iu.store(_EU, (g * Cin * TRS * p.Cg + n0 + col) if s.bwd
                                            else (g * Kout + n0 + col) * TRS * p.Cg)]),
            _unroll("a", s.AL, [_unroll("i", cfg.TM, [_unroll("j", cfg.TN,
                                                                [buf.acc.store((_AV, _IV, _JV), Const(0.0))])])])]


# --- input and filter transforms: gather one reduction step, V = BT d and U = G g into shared memory -------------

def _v_item(s):
    """Input item a (Var "a") of pair e's window at filter row (t, r), channel chunk cb; zero outside the image."""
    cfg, iv = s.cfg, s.buf.iv
    src, _, (ID, IH, IW), _, Cin, _, pads, CS, _ = s.geometry
    t, r, cb = Var("t"), Var("r"), Var("cb")
    need_lo = [pads[0] > 0, pads[1] > 0, pads[2] > 0]
    # the last width tile may read past the row when OW is not a multiple of n
    need_hi = [pads[0] > 0, pads[1] > 0, (s.TW - 1) * s.n + s.alpha - 1 - pads[2] > IW - 1]
    c, row, _ = _v_pair(s, _EV)
    ch = cb * cfg.BK + c
    rd, rh, rw = iv["d"][_EV] + t, iv["h"][_EV] + r, iv["w"][_EV]
    row_ok = [x >= 0 for x, nd in zip((rd, rh), need_lo[:2]) if nd] + \
             [x < size for x, size, nd in zip((rd, rh), (ID, IH), need_hi[:2]) if nd]
    row_ok += [s.m0 + row < s.M] if s.M % cfg.BM else []
    row_ok += [ch < Cin] if Cin % cfg.BK else []
    ok = row_ok + ([rw + _AV >= 0] if need_lo[2] else []) + ([rw + _AV < IW] if need_hi[2] else [])
    addr = iv["base"][_EV] + ((t * IH + r) * IW + _AV) * CS + ch
    return select(all_of(ok), _load(src, addr), Const(0.0))


def _u_item(s):
    """Filter tap s (Var "s") of pair eu's filter row (t, r) at channel chunk cb."""
    p, cfg, iu = s.p, s.cfg, s.buf.iu
    T, R, S = p.filter_size
    _, _, _, _, Cin, Kout, _, _, _ = s.geometry
    t, r, cb = Var("t"), Var("r"), Var("cb")
    c, col, _ = _u_pair(s, _EU)
    ch = cb * cfg.BK + c
    ok = ([s.n0 + col < Kout] if Kout % cfg.BN else []) + ([ch < Cin] if Cin % cfg.BK else [])
    if s.bwd:  # w[g*Cin + ch, T-1-t, R-1-r, S-1-s, k]: rotated, channel-transposed, in place
        waddr = iu[_EU] + (((ch * T + (T - 1) - t) * R + (R - 1) - r) * S + (S - 1) - _SV) * p.Cg
    else:    # w[g*Kout + k, t, r, s, ch]
        waddr = iu[_EU] + ((t * R + r) * S + _SV) * p.Cg + ch
    return select(all_of(ok), _load("w", waddr), Const(0.0))


def _v_loop(s, body):
    """body for each (tile, channel) pair e of this thread."""
    return _unroll("e", s.EV, _guarded(s, body, _v_pair(s, _EV)[2], s.cfg.BM * s.cfg.BK))


def _u_loop(s, body):
    """body for each (channel, k) pair eu of this thread."""
    return _unroll("eu", s.EU, _guarded(s, body, _u_pair(s, _EU)[2], s.cfg.BK * s.cfg.BN))


def _v_commit(s, st, items):
    """V[st][a][pair e] = (BT items)[a]: the input transform."""
    c, row, _ = _v_pair(s, _EV)
    pre, values = _transform(s.matrices[2], items, "bt")
    return pre + [s.buf.V.store(st + (a, c, row), values[a]) for a in range(s.alpha)]


def _u_commit(s, st, items):
    """U[st][a][pair eu] = (G items)[a]: the filter transform."""
    c, col, _ = _u_pair(s, _EU)
    pre, values = _transform(s.matrices[1], items, "g")
    return pre + [s.buf.U.store(st + (a, c, col), values[a]) for a in range(s.alpha)]


def _header(s):
    return Comment(f"V = BT d: {s.alpha} input items per (tile, channel); U = G g per (channel, k)")


def _stage(s):
    """One step, gathered and transformed into the (only) stage."""
    S, d, gw = s.p.filter_size[2], s.buf.d, s.buf.gw
    return [_header(s),
            _v_loop(s, [_unroll("a", s.alpha, [d.store(_AV, _v_item(s))]),
                        *_v_commit(s, (), [d[j] for j in range(s.alpha)])]),
            _u_loop(s, [_unroll("s", S, [gw.store(_SV, _u_item(s))]), *_u_commit(s, (), [gw[k] for k in range(S)])])]


def _fetch(s):
    """The global loads of a step, into staging registers (stages=2)."""
    return [_header(s), _v_loop(s, [_unroll("a", s.alpha, [s.buf.dv.store((_EV, _AV), _v_item(s))])]),
            _u_loop(s, [_unroll("s", s.p.filter_size[2], [s.buf.gv.store((_EU, _SV), _u_item(s))])])]


def _commit(s, st):
    """The transforms of the staged items into stage st (stages=2)."""
    dv, gv = s.buf.dv, s.buf.gv
    return [_v_loop(s, _v_commit(s, (st,), [dv[_EV, j] for j in range(s.alpha)])),
            _u_loop(s, _u_commit(s, (st,), [gv[_EU, k] for k in range(s.p.filter_size[2])]))]


# --- alpha register-tiled outer products per channel of the chunk -----------------------------------------------

def _thread_xy(s):
    BN, TN = s.cfg.BN, s.cfg.TN
    if s.SG == 1:
        return [Comment("thread (ty, tx) owns tiles ty*TM.. and channels tx*TN.. of the block"),
                *[_assign("ty", _TID // (BN // TN)), _assign("tx", _TID % (BN // TN))]]
    # the group index in the high bits of tid: whole warps share their states (broadcast V/U reads)
    per = s.NT // s.SG
    return [Comment(f"thread (sg, ty, tx) owns states sg*{s.AL}.., tiles ty*TM.. and channels tx*TN.."),
            _assign("sg", _TID // per), _assign("ty", (_TID % per) // (BN // TN)), _assign("tx", _TID % (BN // TN))]


def _products(s, st):
    cfg, AL, buf = s.cfg, s.AL, s.buf
    TM, TN = cfg.TM, cfg.TN
    ty, tx, sg, kc = Var("ty"), Var("tx"), Var("sg"), Var("kc")
    state = (lambda a: sg * AL + a) if s.SG > 1 else (lambda a: a)
    return [_unroll("kc", cfg.BK, [_unroll("a", AL, [
        _unroll("i", TM, [buf.vf.store(_IV, buf.V[st + (state(_AV), kc, ty * TM + _IV)])]),
        _unroll("j", TN, [buf.uf.store(_JV, buf.U[st + (state(_AV), kc, tx * TN + _JV)])]),
        _unroll("i", TM, [_unroll("j", TN, [buf.acc.store((_AV, _IV, _JV), buf.vf[_IV] * buf.uf[_JV],
                                                           accumulate=True)])])])])]


# --- main loops ---------------------------------------------------------------------------------------------------

def _position(s, ks):
    """(t, r, cb) of flattened step ks; channel chunks fastest, as the nested loops."""
    R, nkc = s.p.filter_size[1], s.nkc
    return [_assign("t", ks // (R * nkc) if R * nkc > 1 else ks),
            _assign("r", ((ks // nkc) % R if nkc > 1 else ks % R) if R > 1 else Const(0)),
            _assign("cb", ks % nkc if nkc > 1 else Const(0))]


def _single_stage(s):
    """Per step: gather and transform into shared memory, barrier, products, barrier."""
    NT, stage, thread_xy = s.NT, _stage(s), _thread_xy(s)
    T, R, _ = s.p.filter_size

    def step(where):
        return (For("tid", NT, tuple(where + stage), "thread"), Barrier(),
                For("tid", NT, tuple(thread_xy + _products(s, ())), "thread"), Barrier())
    if s.SK == 1:
        kloop = (For("t", T, (For("r", R, (For("cb", s.nkc, step([]), "serial"),), "serial"),), "serial"),)
    else:  # the split's steps, flattened
        kloop = (For("ks", s.per_split, step(_position(s, Var("ks"))), "serial", start=s.k_lo),)
    return (For("tid", NT, tuple(_prologue(s)), "thread"),) + kloop


def _double_buffer(s):
    """stages=2: the raw gathers of step ks + 1 are issued into staging registers before the products of step ks
    and transformed into the other stage after them; one barrier per step."""
    NT, SK, k_lo, per_split = s.NT, s.SK, s.k_lo, s.per_split
    fetch, commit = _fetch(s), (lambda st: _commit(s, st))
    thread_xy = _thread_xy(s)
    end = k_lo + per_split if SK > 1 else Const(s.nsteps)

    def one_step(ks, st, last_possible):
        # step ks computes from stage st while step ks + 1 fills the other; its loads are in flight during the
        # products, the barrier after the commit orders both halves of the next step
        nxt = ks + 1
        guard = (lambda b: [If(nxt < end, tuple(b))]) if last_possible else list
        phase = thread_xy + guard(_position(s, nxt) + fetch) + _products(s, (st,)) + guard(commit(1 - st))
        return (For("tid", NT, tuple(phase), "thread"), Barrier())

    kp = Var("kp")
    ks0 = (lambda j: k_lo + j) if SK > 1 else (lambda j: j)
    # pairs of steps: a constant stage per half; only the second half of an even count can be the last
    kloop = (For("kp", per_split // 2, one_step(ks0(kp * 2), 0, False)
                 + one_step(ks0(kp * 2 + 1), 1, per_split % 2 == 0), "serial"),)
    if per_split % 2:
        kloop += one_step(ks0(Const(per_split - 1)), 0, True)
    first = [Comment("first step: global -> shared"), *_position(s, k_lo), *fetch, *commit(0)]
    return (For("tid", NT, tuple(_prologue(s) + first), "thread"), Barrier()) + kloop


# --- output transform: y = AT M per (tile, channel), n outputs, trimmed at the row end ----------------------------

def _outputs(s, grp):
    """The n outputs of (tile i, channel j) from the states of group grp: group 0 stores them (with the bias), the
    others add theirs in turn."""
    p, cfg, AL, n = s.p, s.cfg, s.AL, s.n
    _, dst, _, (_, _, OW), _, Kout, _, _, KS = s.geometry
    AT = s.matrices[0]
    m = s.m0 + Var("ty") * cfg.TM + _IV
    orow, tw = m // s.TW, m % s.TW
    kk = s.n0 + Var("tx") * cfg.TN + _JV
    kch = s.g * Kout + kk
    guard = ([m < s.M] if s.M % cfg.BM else []) + ([kk < Kout] if Kout % cfg.BN else [])
    stores = []
    for o in range(n):
        ow = tw * n + o
        value = _combo(AT[o][grp * AL:(grp + 1) * AL], [s.buf.acc[a, _IV, _JV] for a in range(AL)])
        if not s.bwd and grp == 0:
            value = epilogue_value(p, value, kch, s.split)
        st = _store(dst, (orow * OW + ow) * KS + kch, value, "atomic" if s.SK > 1 else grp > 0)
        stores.append(If(ow < OW, (st,)) if OW % n else st)
    stores = [If(all_of(guard), tuple(stores))] if guard else stores
    return [_unroll("i", cfg.TM, [_unroll("j", cfg.TN, stores)])]


def _epilogue(s):
    thread_xy = _thread_xy(s)
    if s.SG == 1:
        return (For("tid", s.NT, tuple(list(thread_xy) + _outputs(s, 0)), "thread"),)
    epilogue = ()  # one group after another, a barrier between: the adds read what the group before stored
    for grp in range(s.SG):
        epilogue += (Barrier(),) if grp else ()
        epilogue += (For("tid", s.NT, tuple(thread_xy + [If(Var("sg").eq(grp), tuple(_outputs(s, grp)))]),
                         "thread"),)
    return epilogue


def _kernel(s, block):
    p, cfg, alpha, n = s.p, s.cfg, s.alpha, s.n
    T, R, S = p.filter_size
    src, dst, (ID, IH, IW), (OD, OH, OW), Cin, Kout, _, CS, KS = s.geometry
    TRS, NT = T * R * S, s.NT
    grid = (_cdiv(s.M, cfg.BM), _cdiv(Kout, cfg.BN), p.groups * s.SK)
    body = (For("bm", grid[0], (For("bn", grid[1], (For("bz", grid[2], block, "grid", axis=2),), "grid", axis=1),),
                "grid", axis=0),)
    params = [Buffer(src, (p.N * ID * IH * IW * CS,), p.dtype), Buffer("w", (p.K * TRS * p.Cg,), p.dtype)]
    if p.has_bias and not s.bwd:
        params.append(Buffer("bias", (p.K,), p.dtype))
    params.append(Buffer(dst, (p.N * OD * OH * OW * KS,), p.dtype, role="out"))
    buf = s.buf
    staging = (buf.d, buf.gw) if cfg.stages == 1 else (buf.dv, buf.gv)
    locals_ = (buf.V, buf.U, buf.acc, buf.vf, buf.uf) + staging + (buf.iu,) + tuple(buf.iv.values())
    meta = {"doc": f"im2col-winograd F({n},{S}), {alpha} states, {p.direction}: {alpha} GEMMs "
                   f"[{s.M} tiles x {Kout}] reduced over {T * R} filter rows x {Cin} channels",
            "config": str(cfg), "zero_output": s.SK > 1,
            "work": p.N * OD * OH * OW * Kout * p.groups * TRS * Cin,  # direct-conv MACs (the FLOP count reported)
            "gemm_macs": alpha * s.M * Kout * p.groups * T * R * Cin,
            # two blocks per SM: NVVM otherwise takes ~145 registers for the 8-state 3x3 kernels (one
            # block per SM); ptxas fits them in 128 with no spills (scripts/ptxas_report.py --maxrreg)
            "launch_bounds": (NT, max(1, min(2, 65536 // (128 * NT)))),
            # image-major GEMM rows, BM a block: fewer blocks compute fewer images (tiled_gemm.batch_grid)
            "batch_grid": (0, OD * OH * s.TW, cfg.BM)}
    return Kernel(f"winograd_{p.direction}_a{alpha}_s{S}", tuple(params), locals_, body, grid, NT, meta)


def _load(buf, index):
    return Load(buf, (as_expr(index),))


def _store(buf, index, value, accumulate=False):
    return Store(buf, (as_expr(index),), as_expr(value), accumulate)


def _assign(name, value):
    return Assign(name, as_expr(value))
