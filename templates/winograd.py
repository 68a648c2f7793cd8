"""Im2col-Winograd (seed §5.3): 1D Winograd F(n, S) along the output width, channels-last.

One thread per (batch, out-depth, out-row, width tile of n outputs, output channel). It keeps an
alpha-element accumulator in the transformed domain: for every filter tap row (t, r) and input
channel c it transforms alpha input items (BT d) and the filter row (G g, computed in-kernel) and
accumulates their element-wise product; AT is applied once at the end. All transforms are
unrolled scalar statements on register buffers with constant indices (scalarized by the passes).
Backward-data reuses the forward kernel on dy with the 180°-rotated, channel-transposed filter,
read in place (padding S-1-pad). Stride 1 and dilation 1 only.
"""
from __future__ import annotations

from ..ir import Assign, Buffer, Const, For, If, Kernel, Load, Select, Store, Var, all_of

from .config import TileConfig
from .tiled_gemm import _cdiv
from .implicit_gemm import epilogue_value
from .winograd_transforms import STATES, supported, winograd_matrices

NAME = "winograd"
DIRECTIONS = ("fwd", "bwd_data")
ALLOW_16_STATES = False          # 16-state kernels are ~1e-4 relative in fp32: opt in
ENABLED_STATES = {4: True, 8: True, 16: True}
THREADS = 64



def choose_states(S):
    """Smallest enabled state count giving n >= 2 outputs per tile (largest n is not always best)."""
    for alpha in STATES:
        if alpha == 16 and not ALLOW_16_STATES:
            continue
        if ENABLED_STATES.get(alpha) and supported(alpha, S):
            return alpha
    return None


def settings():
    """The module settings this variant's choices read (part of every prepared call's key)."""
    return ALLOW_16_STATES, tuple(sorted(ENABLED_STATES.items()))


def key_extra(p):
    """What the kernel depends on beyond (problem, config): the state count the settings select."""
    return ("states", choose_states(p.filter_size[2]))


def applies(p):
    if p.direction not in DIRECTIONS or any(s != 1 for s in p.stride) or any(d != 1 for d in p.dilation):
        return False
    return choose_states(p.filter_size[2]) is not None


def _lin(*pairs):
    out = Const(0)
    for i, size in pairs:
        out = out * size + i
    return out


def build(p, cfg: TileConfig, alpha=None):
    T, R, S = p.filter_size
    alpha = alpha or choose_states(S)
    if alpha is None or not supported(alpha, S):
        raise ValueError(f"winograd: no enabled state count for filter width {S} (states {ENABLED_STATES}, "
                         f"ALLOW_16_STATES={ALLOW_16_STATES})")
    n = alpha - S + 1
    AT, G, BT = winograd_matrices(n, S)
    bwd = p.direction == "bwd_data"
    # Conv seen as forward: src (N, ID, IH, IW, Cin) * filter -> dst (N, OD, OH, OW, Kout).
    if bwd:
        src, dst, (ID, IH, IW), (OD, OH, OW) = "dy", "dx", p.out_size, p.in_size
        Cin, Kout, pads = p.Kg, p.Cg, [f - 1 - pd for f, pd in zip(p.filter_size, p.padding)]
        CS, KS = p.K, p.C
    else:
        src, dst, (ID, IH, IW), (OD, OH, OW) = "x", "y", p.in_size, p.out_size
        Cin, Kout, pads = p.Cg, p.Kg, list(p.padding)
        CS, KS = p.C, p.K
    tiles = _cdiv(OW, n)
    total = p.N * OD * OH * tiles * p.groups * Kout
    idx, v = Var("idx"), Var
    body = [Assign("idx", Var("bm") * THREADS + Var("tid"))]
    decode = []
    rest = idx
    for name, size in (("k", Kout), ("g", p.groups), ("tw", tiles), ("oh", OH), ("od", OD)):
        decode.append(Assign(name, rest % size))
        rest = rest // size
    decode.append(Assign("nb", rest))
    acc = Buffer("acc", (alpha,), p.dtype, "register")
    d = Buffer("d", (alpha,), p.dtype, "register")
    gw = Buffer("gw", (S,), p.dtype, "register")
    inner = [Assign("ih", v("oh") + v("r") - pads[1]), Assign("id_", v("od") + v("t") - pads[0])]
    row_ok = [v("ih") >= 0, v("ih") < IH, v("id_") >= 0, v("id_") < ID] if (pads[0] or pads[1]) else []
    kch, cch = v("g") * Kout + v("k"), v("g") * Cin + v("c")
    for a in range(alpha):
        iw = v("tw") * n + (a - pads[2])
        pred = all_of(row_ok + [iw >= 0, iw < IW])
        addr = _lin((v("nb"), p.N), (v("id_"), ID), (v("ih"), IH), (iw, IW)) * CS + cch
        inner.append(d.store(a, Select(pred, Load(src, (addr,)), Const(0.0))))
    for s in range(S):
        if bwd:  # w[cin_as_k, T-1-t, R-1-r, S-1-s, k_as_c]: rotated and channel-transposed, in place
            waddr = _lin((cch, p.K), (T - 1 - v("t"), T), (R - 1 - v("r"), R), (S - 1 - s, S)) * p.Cg + v("k")
        else:
            waddr = _lin((kch, p.K), (v("t"), T), (v("r"), R), (s, S)) * p.Cg + v("c")
        inner.append(gw.store(s, Load("w", (waddr,))))
    for i in range(alpha):
        gi = _combo(G[i], [gw[j] for j in range(S)])
        bi = _combo(BT[i], [d[j] for j in range(alpha)])
        inner.append(acc.store(i, gi * bi, accumulate=True))
    loops = For("t", T, (For("r", R, (For("c", Cin, tuple(inner)),)),))
    out = []
    for o in range(n):
        ow = v("tw") * n + o
        value = _combo(AT[o], [acc[i] for i in range(alpha)])
        addr = _lin((v("nb"), p.N), (v("od"), OD), (v("oh"), OH), (ow, OW)) * KS + kch
        if not bwd:
            value = epilogue_value(p, value, kch)
        st = Store(dst, (addr,), value)
        out.append(If(ow < OW, (st,)) if OW % n else st)
    work = decode + [acc.store(i, Const(0.0)) for i in range(alpha)] + [loops] + out
    body.append(If(idx < total, tuple(work)))
    grid = (_cdiv(total, THREADS),)
    kbody = (For("bm", grid[0], (For("tid", THREADS, tuple(body), "thread"),), "grid", axis=0),)
    params = [Buffer(src, (p.N * ID * IH * IW * CS,), p.dtype),
              Buffer("w", (p.K * T * R * S * p.Cg,), p.dtype)]
    if p.has_bias and not bwd:
        params.append(Buffer("bias", (p.K,), p.dtype))
    params.append(Buffer(dst, (p.N * OD * OH * OW * KS,), p.dtype, role="out"))
    meta = {"doc": f"im2col-winograd F({n},{S}) alpha={alpha} {p.direction}", "config": f"alpha={alpha}",
            "zero_output": False, "work": total * n * T * R * S * Cin}
    return Kernel(f"winograd_{p.direction}_a{alpha}_s{S}", tuple(params), (acc, d, gw), kbody, grid, THREADS, meta)


def _combo(coeffs, terms):
    """sum coeffs[j] * terms[j] with exact zeros dropped and unit coefficients not multiplied."""
    out = None
    for c, t in zip(coeffs, terms):
        if c == 0:
            continue
        term = t if c == 1 else (-t if False else Const(float(c)) * t)
        out = term if out is None else out + term
    return out if out is not None else Const(0.0)
