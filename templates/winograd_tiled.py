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
"""
from __future__ import annotations

from ..ir import (Assign, Barrier, Buffer, Comment, Const, For, If, Kernel, Load, Store, Var, all_of, as_expr,
                  select)

from .config import TileConfig
from .implicit_gemm import epilogue_value
from .tiled_gemm import _cdiv
from .winograd_transforms import row_pairs, winograd_matrices


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


def build_tiled(p, cfg: TileConfig, alpha: int) -> Kernel:
    cfg.validate()
    T, R, S = p.filter_size
    n = alpha - S + 1
    AT, G, BT = winograd_matrices(n, S)
    bwd = p.direction == "bwd_data"
    src, dst, (ID, IH, IW), (OD, OH, OW), Cin, Kout, pads, CS, KS = conv_geometry(p)
    BM, BN, BK, TM, TN, NT, pad = cfg.BM, cfg.BN, cfg.BK, cfg.TM, cfg.TN, cfg.threads, cfg.smem_pad
    TW = _cdiv(OW, n)                   # width tiles per output row
    M = p.N * OD * OH * TW              # GEMM rows: output tiles
    nkc = _cdiv(Cin, BK)                # channel chunks per filter row
    dt = p.dtype
    EV, EU = _cdiv(BM * BK, NT), _cdiv(BK * BN, NT)  # (tile, channel) / (channel, k) pairs per thread
    if (error := reduction_error(p, cfg, alpha)) is not None:
        raise ValueError(error)
    SK, nsteps = cfg.split_k, T * R * nkc
    per_split = nsteps // SK

    SP = cfg.stages
    lead = (SP,) if SP > 1 else ()  # a stage axis only when pipelined: stages=1 renders as it always did
    V = Buffer("V", lead + (alpha, BK, BM + pad), dt, "shared")
    U = Buffer("U", lead + (alpha, BK, BN + pad), dt, "shared")
    SG = cfg.state_groups  # thread groups that split the states (each AL of them); 1: every thread has all
    AL = alpha // SG
    acc = Buffer("acc", (AL, TM, TN), dt, "register")
    vf = Buffer("vf", (TM,), dt, "register")
    uf = Buffer("uf", (TN,), dt, "register")
    d = Buffer("d", (alpha,), dt, "register")
    gw = Buffer("gw", (S,), dt, "register")
    dv = Buffer("dv", (EV, alpha), dt, "register")  # stages=2: a whole step's raw gathers stay in flight
    gv = Buffer("gv", (EU, S), dt, "register")
    # per-thread invariants of the tiles this thread gathers (index math hoisted out of the k loop)
    iv = {nm: Buffer(f"iv_{nm}", (EV,), "int64", "register") for nm in ("base", "d", "h", "w")}
    iu = Buffer("iu_base", (EU,), "int64", "register")
    tid, bz = Var("tid"), Var("bz")
    g = bz // SK if SK > 1 else bz
    split = bz % SK if SK > 1 else None  # split-K: this block adds steps split*per_split.. into a zeroed y
    k_lo = split * per_split if SK > 1 else Const(0)
    m0, n0 = Var("bm") * BM, Var("bn") * BN
    t, r, cb = Var("t"), Var("r"), Var("cb")

    def v_pair(e):  # channel fastest: consecutive threads read consecutive channels (coalesced)
        idx = tid + e * NT
        return idx % BK, idx // BK, idx < BM * BK

    def u_pair(e):  # the filter's contiguous axis fastest: c forward, k for the transposed filter
        idx = tid + e * NT
        if bwd:
            return idx // BN, idx % BN, idx < BK * BN
        return idx % BK, idx // BK, idx < BK * BN

    def guarded(stmts, in_tile, total):
        return list(stmts) if total % NT == 0 else [If(in_tile, tuple(stmts))]

    # Loops over pairs, states and register-tile entries are `unroll` loops: straight-line code with
    # constant register indices on CUDA, compact loops on the CPU (whose compile time grows with size).
    ev, eu, av, sv, iv_, jv = Var("e"), Var("eu"), Var("a"), Var("s"), Var("i"), Var("j")
    unroll = lambda var, extent, stmts: For(var, extent, tuple(stmts), "unroll")

    # --- prologue: invariants, zero accumulators -------------------------------------------------
    _, row, _ = v_pair(ev)
    m = m0 + row
    orow, tw = m // TW, m % TW
    oh, rest = orow % OH, orow // OH
    od, nb = rest % OD, rest // OD
    corner = [od - pads[0], oh - pads[1], tw * n - pads[2]]
    TRS = T * R * S
    _, col, _ = u_pair(eu)
    prologue = [Comment("per-thread invariants: the window corner of each gathered tile"),
                unroll("e", EV, [iv["d"].store(ev, corner[0]), iv["h"].store(ev, corner[1]),
                                 iv["w"].store(ev, corner[2]),
                                 iv["base"].store(ev, _lin((nb, p.N), (corner[0], ID), (corner[1], IH),
                                                           (corner[2], IW)) * CS + g * Cin)]),
                unroll("eu", EU, [iu.store(eu, (g * Cin * TRS * p.Cg + n0 + col) if bwd
                                           else (g * Kout + n0 + col) * TRS * p.Cg)]),
                unroll("a", AL, [unroll("i", TM, [unroll("j", TN, [acc.store((av, iv_, jv), Const(0.0))])])])]

    # --- gather + transform one reduction step into shared memory ---------------------------------
    need_lo = [pads[0] > 0, pads[1] > 0, pads[2] > 0]
    # the last width tile may read past the row when OW is not a multiple of n
    need_hi = [pads[0] > 0, pads[1] > 0, (TW - 1) * n + alpha - 1 - pads[2] > IW - 1]
    c, row, v_in = v_pair(ev)
    ch = cb * BK + c
    rd, rh, rw = iv["d"][ev] + t, iv["h"][ev] + r, iv["w"][ev]
    row_ok = [x >= 0 for x, nd in zip((rd, rh), need_lo[:2]) if nd] + \
             [x < size for x, size, nd in zip((rd, rh), (ID, IH), need_hi[:2]) if nd]
    row_ok += [m0 + row < M] if M % BM else []
    row_ok += [ch < Cin] if Cin % BK else []
    ok = row_ok + ([rw + av >= 0] if need_lo[2] else []) + ([rw + av < IW] if need_hi[2] else [])
    addr = iv["base"][ev] + ((t * IH + r) * IW + av) * CS + ch
    v_item = select(all_of(ok), _load(src, addr), Const(0.0))
    v_at = (c, row)
    c, col, u_in = u_pair(eu)
    ch = cb * BK + c
    ok = ([n0 + col < Kout] if Kout % BN else []) + ([ch < Cin] if Cin % BK else [])
    if bwd:  # w[g*Cin + ch, T-1-t, R-1-r, S-1-s, k]: rotated, channel-transposed, in place
        waddr = iu[eu] + (((ch * T + (T - 1) - t) * R + (R - 1) - r) * S + (S - 1) - sv) * p.Cg
    else:    # w[g*Kout + k, t, r, s, ch]
        waddr = iu[eu] + ((t * R + r) * S + sv) * p.Cg + ch
    u_item = select(all_of(ok), _load("w", waddr), Const(0.0))
    u_at = (c, col)

    def v_loop(body):
        return unroll("e", EV, guarded(body, v_in, BM * BK))

    def u_loop(body):
        return unroll("eu", EU, guarded(body, u_in, BK * BN))

    def v_commit(st, items):
        pre, values = _transform(BT, items, "bt")
        return pre + [V.store(st + (a, *v_at), values[a]) for a in range(alpha)]

    def u_commit(st, items):
        pre, values = _transform(G, items, "g")
        return pre + [U.store(st + (a, *u_at), values[a]) for a in range(alpha)]

    header = Comment(f"V = BT d: {alpha} input items per (tile, channel); U = G g per (channel, k)")
    if SP == 1:
        stage = [header,
                 v_loop([unroll("a", alpha, [d.store(av, v_item)]), *v_commit((), [d[j] for j in range(alpha)])]),
                 u_loop([unroll("s", S, [gw.store(sv, u_item)]), *u_commit((), [gw[s] for s in range(S)])])]
    else:
        # fetch: the global loads of a step, into staging registers; commit: their transforms into stage st
        fetch = [header, v_loop([unroll("a", alpha, [dv.store((ev, av), v_item)])]),
                 u_loop([unroll("s", S, [gv.store((eu, sv), u_item)])])]

        def commit(st):
            return [v_loop(v_commit((st,), [dv[ev, j] for j in range(alpha)])),
                    u_loop(u_commit((st,), [gv[eu, s] for s in range(S)]))]

    # --- alpha register-tiled outer products per channel of the chunk -----------------------------
    ty, tx, sg = Var("ty"), Var("tx"), Var("sg")
    if SG == 1:
        thread_xy = [Comment("thread (ty, tx) owns tiles ty*TM.. and channels tx*TN.. of the block"),
                     *[_assign("ty", tid // (BN // TN)), _assign("tx", tid % (BN // TN))]]
    else:  # the group index in the high bits of tid: whole warps share their states (broadcast V/U reads)
        per = NT // SG
        thread_xy = [Comment(f"thread (sg, ty, tx) owns states sg*{AL}.., tiles ty*TM.. and channels tx*TN.."),
                     _assign("sg", tid // per), _assign("ty", (tid % per) // (BN // TN)),
                     _assign("tx", tid % (BN // TN))]
    state = (lambda a: sg * AL + a) if SG > 1 else (lambda a: a)
    kc = Var("kc")

    def products(st):
        return [unroll("kc", BK, [unroll("a", AL, [
            unroll("i", TM, [vf.store(iv_, V[st + (state(av), kc, ty * TM + iv_)])]),
            unroll("j", TN, [uf.store(jv, U[st + (state(av), kc, tx * TN + jv)])]),
            unroll("i", TM, [unroll("j", TN, [acc.store((av, iv_, jv), vf[iv_] * uf[jv], accumulate=True)])])])])]

    # --- epilogue: y = AT M per (tile, channel), n outputs, trimmed at the row end ------------------
    m = m0 + ty * TM + iv_
    orow, tw = m // TW, m % TW
    kk = n0 + tx * TN + jv
    kch = g * Kout + kk
    guard = ([m < M] if M % BM else []) + ([kk < Kout] if Kout % BN else [])

    def outputs(grp):
        """The n outputs of (tile i, channel j) from the states of group grp: group 0 stores them (with the
        bias), the others add theirs in turn."""
        stores = []
        for o in range(n):
            ow = tw * n + o
            value = _combo(AT[o][grp * AL:(grp + 1) * AL], [acc[a, iv_, jv] for a in range(AL)])
            if not bwd and grp == 0:
                value = epilogue_value(p, value, kch, split)
            st = _store(dst, (orow * OW + ow) * KS + kch, value, "atomic" if SK > 1 else grp > 0)
            stores.append(If(ow < OW, (st,)) if OW % n else st)
        stores = [If(all_of(guard), tuple(stores))] if guard else stores
        return [unroll("i", TM, [unroll("j", TN, stores)])]

    if SG == 1:
        epilogue = (For("tid", NT, tuple(list(thread_xy) + outputs(0)), "thread"),)
    else:  # one group after another, a barrier between: the adds read what the group before stored
        epilogue = ()
        for grp in range(SG):
            epilogue += (Barrier(),) if grp else ()
            epilogue += (For("tid", NT, tuple(thread_xy + [If(sg.eq(grp), tuple(outputs(grp)))]), "thread"),)

    def position(ks):  # (t, r, cb) of flattened step ks; channel chunks fastest, as the nested loops
        return [_assign("t", ks // (R * nkc) if R * nkc > 1 else ks),
                _assign("r", ((ks // nkc) % R if nkc > 1 else ks % R) if R > 1 else Const(0)),
                _assign("cb", ks % nkc if nkc > 1 else Const(0))]

    if SP == 1:
        def step(where):
            return (For("tid", NT, tuple(where + stage), "thread"), Barrier(),
                    For("tid", NT, tuple(thread_xy + products(())), "thread"), Barrier())
        if SK == 1:
            kloop = (For("t", T, (For("r", R, (For("cb", nkc, step([]), "serial"),), "serial"),), "serial"),)
        else:  # the split's steps, flattened
            kloop = (For("ks", per_split, step(position(Var("ks"))), "serial", start=k_lo),)
        block = (For("tid", NT, tuple(prologue), "thread"),) + kloop
    else:
        def one_step(ks, st, last_possible):
            # step ks computes from stage st while step ks + 1 fills the other; its loads are in flight
            # during the products, the barrier after the commit orders both halves of the next step
            nxt = ks + 1
            guard = (lambda b: [If(nxt < end, tuple(b))]) if last_possible else list
            phase = thread_xy + guard(position(nxt) + fetch) + products((st,)) + guard(commit(1 - st))
            return (For("tid", NT, tuple(phase), "thread"), Barrier())

        kp = Var("kp")
        end = k_lo + per_split if SK > 1 else Const(nsteps)
        ks0 = (lambda j: k_lo + j) if SK > 1 else (lambda j: j)
        # pairs of steps: a constant stage per half; only the second half of an even count can be the last
        kloop = (For("kp", per_split // 2, one_step(ks0(kp * 2), 0, False)
                     + one_step(ks0(kp * 2 + 1), 1, per_split % 2 == 0), "serial"),)
        if per_split % 2:
            kloop += one_step(ks0(Const(per_split - 1)), 0, True)
        first = [Comment("first step: global -> shared"), *position(k_lo), *fetch, *commit(0)]
        block = (For("tid", NT, tuple(prologue + first), "thread"), Barrier()) + kloop
    block += epilogue
    grid = (_cdiv(M, BM), _cdiv(Kout, BN), p.groups * SK)
    body = (For("bm", grid[0], (For("bn", grid[1], (For("bz", grid[2], block, "grid", axis=2),), "grid", axis=1),),
                "grid", axis=0),)
    params = [Buffer(src, (p.N * ID * IH * IW * CS,), dt), Buffer("w", (p.K * TRS * p.Cg,), dt)]
    if p.has_bias and not bwd:
        params.append(Buffer("bias", (p.K,), dt))
    params.append(Buffer(dst, (p.N * OD * OH * OW * KS,), dt, role="out"))
    staging = (d, gw) if SP == 1 else (dv, gv)
    locals_ = (V, U, acc, vf, uf) + staging + (iu,) + tuple(iv.values())
    meta = {"doc": f"im2col-winograd F({n},{S}), {alpha} states, {p.direction}: {alpha} GEMMs "
                   f"[{M} tiles x {Kout}] reduced over {T * R} filter rows x {Cin} channels",
            "config": str(cfg), "zero_output": SK > 1,
            "work": p.N * OD * OH * OW * Kout * p.groups * TRS * Cin,  # direct-conv MACs (the FLOP count reported)
            "gemm_macs": alpha * M * Kout * p.groups * T * R * Cin,
            # two blocks per SM: NVVM otherwise takes ~145 registers for the 8-state 3x3 kernels (one
            # block per SM); ptxas fits them in 128 with no spills (scripts/ptxas_report.py --maxrreg)
            "launch_bounds": (NT, max(1, min(2, 65536 // (128 * NT))))}
    return Kernel(f"winograd_{p.direction}_a{alpha}_s{S}", tuple(params), locals_, body, grid, NT, meta)


def _load(buf, index):
    return Load(buf, (as_expr(index),))


def _store(buf, index, value, accumulate=False):
    return Store(buf, (as_expr(index),), as_expr(value), accumulate)


def _assign(name, value):
    return Assign(name, as_expr(value))
