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

Backward-data is the forward schedule on dy with the 180-degree rotated, channel-transposed filter,
read in place.  Stride 1, dilation 1.
"""
from __future__ import annotations

from ..ir import (Assign, Barrier, Buffer, Comment, Const, For, If, Kernel, Load, Store, Var, all_of, as_expr,
                  select)

from .config import TileConfig
from .implicit_gemm import epilogue_value
from .tiled_gemm import _cdiv
from .winograd_transforms import winograd_matrices


def _combo(coeffs, terms):
    """sum coeffs[j] * terms[j] with exact zeros dropped and unit coefficients not multiplied."""
    out = None
    for c, t in zip(coeffs, terms):
        if c == 0:
            continue
        term = t if c == 1 else Const(float(c)) * t
        out = term if out is None else out + term
    return out if out is not None else Const(0.0)


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


def shared_bytes(cfg, alpha, itemsize=4):
    return itemsize * alpha * cfg.BK * (cfg.BM + cfg.BN + 2 * cfg.smem_pad)


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

    V = Buffer("V", (alpha, BK, BM + pad), dt, "shared")
    U = Buffer("U", (alpha, BK, BN + pad), dt, "shared")
    acc = Buffer("acc", (alpha, TM, TN), dt, "register")
    vf = Buffer("vf", (TM,), dt, "register")
    uf = Buffer("uf", (TN,), dt, "register")
    d = Buffer("d", (alpha,), dt, "register")
    gw = Buffer("gw", (S,), dt, "register")
    # per-thread invariants of the tiles this thread gathers (index math hoisted out of the k loop)
    iv = {nm: Buffer(f"iv_{nm}", (EV,), "int64", "register") for nm in ("base", "d", "h", "w")}
    iu = Buffer("iu_base", (EU,), "int64", "register")
    tid, g = Var("tid"), Var("bz")
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
                unroll("a", alpha, [unroll("i", TM, [unroll("j", TN, [acc.store((av, iv_, jv), Const(0.0))])])])]

    # --- gather + transform one reduction step into shared memory ---------------------------------
    need_lo = [pads[0] > 0, pads[1] > 0, pads[2] > 0]
    # the last width tile may read past the row when OW is not a multiple of n
    need_hi = [pads[0] > 0, pads[1] > 0, (TW - 1) * n + alpha - 1 - pads[2] > IW - 1]
    stage = [Comment(f"V = BT d: {alpha} input items per (tile, channel); U = G g per (channel, k)")]
    c, row, in_tile = v_pair(ev)
    ch = cb * BK + c
    rd, rh, rw = iv["d"][ev] + t, iv["h"][ev] + r, iv["w"][ev]
    row_ok = [x >= 0 for x, nd in zip((rd, rh), need_lo[:2]) if nd] + \
             [x < size for x, size, nd in zip((rd, rh), (ID, IH), need_hi[:2]) if nd]
    row_ok += [m0 + row < M] if M % BM else []
    row_ok += [ch < Cin] if Cin % BK else []
    ok = row_ok + ([rw + av >= 0] if need_lo[2] else []) + ([rw + av < IW] if need_hi[2] else [])
    addr = iv["base"][ev] + ((t * IH + r) * IW + av) * CS + ch
    body = [unroll("a", alpha, [d.store(av, select(all_of(ok), _load(src, addr), Const(0.0)))])]
    body += [V.store((a, c, row), _combo(BT[a], [d[j] for j in range(alpha)])) for a in range(alpha)]
    stage.append(unroll("e", EV, guarded(body, in_tile, BM * BK)))
    c, col, in_tile = u_pair(eu)
    ch = cb * BK + c
    ok = ([n0 + col < Kout] if Kout % BN else []) + ([ch < Cin] if Cin % BK else [])
    if bwd:  # w[g*Cin + ch, T-1-t, R-1-r, S-1-s, k]: rotated, channel-transposed, in place
        waddr = iu[eu] + (((ch * T + (T - 1) - t) * R + (R - 1) - r) * S + (S - 1) - sv) * p.Cg
    else:    # w[g*Kout + k, t, r, s, ch]
        waddr = iu[eu] + ((t * R + r) * S + sv) * p.Cg + ch
    body = [unroll("s", S, [gw.store(sv, select(all_of(ok), _load("w", waddr), Const(0.0)))])]
    body += [U.store((a, c, col), _combo(G[a], [gw[s] for s in range(S)])) for a in range(alpha)]
    stage.append(unroll("eu", EU, guarded(body, in_tile, BK * BN)))

    # --- alpha register-tiled outer products per channel of the chunk -----------------------------
    ty, tx = Var("ty"), Var("tx")
    thread_xy = [Comment("thread (ty, tx) owns tiles ty*TM.. and channels tx*TN.. of the block"),
                 *[_assign("ty", tid // (BN // TN)), _assign("tx", tid % (BN // TN))]]
    kc = Var("kc")
    products = [unroll("i", TM, [vf.store(iv_, V[av, kc, ty * TM + iv_])]),
                unroll("j", TN, [uf.store(jv, U[av, kc, tx * TN + jv])]),
                unroll("i", TM, [unroll("j", TN, [acc.store((av, iv_, jv), vf[iv_] * uf[jv], accumulate=True)])])]
    compute = thread_xy + [unroll("kc", BK, [unroll("a", alpha, products)])]

    # --- epilogue: y = AT M per (tile, channel), n outputs, trimmed at the row end ------------------
    m = m0 + ty * TM + iv_
    orow, tw = m // TW, m % TW
    kk = n0 + tx * TN + jv
    kch = g * Kout + kk
    guard = ([m < M] if M % BM else []) + ([kk < Kout] if Kout % BN else [])
    stores = []
    for o in range(n):
        ow = tw * n + o
        value = _combo(AT[o], [acc[a, iv_, jv] for a in range(alpha)])
        if not bwd:
            value = epilogue_value(p, value, kch)
        st = _store(dst, (orow * OW + ow) * KS + kch, value)
        stores.append(If(ow < OW, (st,)) if OW % n else st)
    stores = [If(all_of(guard), tuple(stores))] if guard else stores
    epilogue = list(thread_xy) + [unroll("i", TM, [unroll("j", TN, stores)])]

    step = (For("tid", NT, tuple(stage), "thread"), Barrier(), For("tid", NT, tuple(compute), "thread"), Barrier())
    kloop = For("t", T, (For("r", R, (For("cb", nkc, step, "serial"),), "serial"),), "serial")
    block = (For("tid", NT, tuple(prologue), "thread"), kloop, For("tid", NT, tuple(epilogue), "thread"))
    grid = (_cdiv(M, BM), _cdiv(Kout, BN), p.groups)
    body = (For("bm", grid[0], (For("bn", grid[1], (For("bz", grid[2], block, "grid", axis=2),), "grid", axis=1),),
                "grid", axis=0),)
    params = [Buffer(src, (p.N * ID * IH * IW * CS,), dt), Buffer("w", (p.K * TRS * p.Cg,), dt)]
    if p.has_bias and not bwd:
        params.append(Buffer("bias", (p.K,), dt))
    params.append(Buffer(dst, (p.N * OD * OH * OW * KS,), dt, role="out"))
    locals_ = (V, U, acc, vf, uf, d, gw, iu) + tuple(iv.values())
    meta = {"doc": f"im2col-winograd F({n},{S}), {alpha} states, {p.direction}: {alpha} GEMMs "
                   f"[{M} tiles x {Kout}] reduced over {T * R} filter rows x {Cin} channels",
            "config": str(cfg), "zero_output": False,
            "work": p.N * OD * OH * OW * Kout * p.groups * TRS * Cin,  # direct-conv MACs (the FLOP count reported)
            "gemm_macs": alpha * M * Kout * p.groups * T * R * Cin,
            # two blocks per SM: NVVM otherwise takes ~145 registers for the 8-state 3x3 kernels (one
            # block per SM); ptxas fits them in 128 with no spills (scripts/ptxas_report.py --maxrreg)
            "launch_bounds": (NT, max(1, min(2, 65536 // (128 * NT))))}
    return Kernel(f"winograd_{p.direction}_a{alpha}_s{S}", tuple(params), locals_, body, grid, NT, meta)


def _load(buf, index):
    return Load(buf, (as_expr(index),))


def _store(buf, index, value):
    return Store(buf, (as_expr(index),), as_expr(value))


def _assign(name, value):
    return Assign(name, as_expr(value))
