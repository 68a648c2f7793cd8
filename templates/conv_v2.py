"""ConvV2: forward convolution with filter trimming - padded zeros are never read nor multiplied.

The implicit GEMM predicates every tap that falls in the padding to zero and still multiplies it.
ConvV2 reorders the GEMM rows batch-fastest, m = position * N + n, so that with N % BM == 0 every
row of a block is the same output position.  The block then knows exactly which taps land inside
the input (algorithms.md):

    lo = max(0, ceil((pad - o*stride) / dil)),   hi = min(F, ceil((size + pad - o*stride) / dil))

per spatial dim, and its reduction runs over the trimmed window (hi - lo taps per dim) x C only:
no bounds tests in the loads, no padding reads, no workspace.  Border blocks simply run shorter
reductions (4x4 maps with a 3x3 filter: 6.25 taps on average instead of 9).  Needs a whole number
of BK slices per tap (C_g % BK == 0) and N % BM == 0; elsewhere the implicit GEMM runs.
"""
from __future__ import annotations

from ..ir import Buffer, Call, Const, Load, Store

from .config import TileConfig
from .implicit_gemm import _flatten, _prod, epilogue_value
from .tiled_gemm import GemmView, Operand, tiled_gemm

NAME = "conv_v2"
DIRECTIONS = ("fwd",)


def applies(p):
    return p.direction == "fwd" and any(pd > 0 for pd in p.padding)


def config_ok(p, cfg: TileConfig):
    """Block rows must share one output position, and slices must not straddle taps."""
    return p.N % cfg.BM == 0 and p.Cg % cfg.BK == 0 and cfg.split_k == 1 and cfg.stages == 1


def _ceil_div(a, b):
    return Const(0) - (Const(0) - a) // b  # floor semantics: exact for negative numerators too


def _max(a, b):
    return Call("max", (a, b))


def _min(a, b):
    return Call("min", (a, b))


def v2_view(p, cfg: TileConfig) -> GemmView:
    if not config_ok(p, cfg):
        raise ValueError(f"config must have N % BM == 0, C/groups % BK == 0, split_k = stages = 1 for conv_v2 "
                         f"(N={p.N}, C/groups={p.Cg}), got {cfg}")
    TRS = _prod(p.filter_size)
    P = _prod(p.out_size)
    M, Ng, Kr = p.N * P, p.Kg, TRS * p.Cg
    per_tap = p.Cg // cfg.BK

    def window(ctx):
        """The block's output position, window corner and trimmed tap range, per dim."""
        pos, o = ctx.m0 // p.N, []
        for size in reversed(p.out_size):
            o.append(pos % size)
            pos = pos // size
        o = o[::-1]
        corner = [o[ax] * p.stride[ax] - p.padding[ax] for ax in range(3)]
        lo, cnt = [], []
        for ax in range(3):
            if p.padding[ax] == 0:  # nothing to trim along this dim
                lo.append(Const(0)), cnt.append(Const(p.filter_size[ax]))
                continue
            l = _max(Const(0), _ceil_div(Const(0) - corner[ax], p.dilation[ax]))
            h = _min(Const(p.filter_size[ax]), _ceil_div(p.in_size[ax] - corner[ax], p.dilation[ax]))
            lo.append(l), cnt.append(_max(Const(0), h - l))
        return corner, lo, cnt

    def taps(kt, ctx):
        """Slice kt -> real filter tap per dim (uniform over the slice) and channel offset."""
        _, lo, cnt = window(ctx)
        t, rest = [], kt // per_tap
        for ax in (2, 1, 0):
            t.append(lo[ax] + rest % cnt[ax])
            rest = rest // cnt[ax]
        return t[::-1], (kt % per_tap) * cfg.BK

    def k_tiles(ctx):
        _, _, cnt = window(ctx)
        return cnt[0] * cnt[1] * cnt[2] * per_tap

    def a_inv(m, g):
        return {"base": (m % p.N) * _prod(p.in_size) * p.C + g * p.Cg}

    def a_elem(inv, kk, kt, col, ctx):
        corner, _, _ = window(ctx)
        t, c0 = taps(kt, ctx)
        coords = [corner[ax] + t[ax] * p.dilation[ax] for ax in range(3)]
        return Const(True), Load("x", (inv["base"] + _flatten(coords, p.in_size) * p.C + c0 + col,))

    def b_inv(n, g):
        return {"base": (g * p.Kg + n) * Kr}

    def b_elem(inv, kk, kt, row, ctx):
        t, c0 = taps(kt, ctx)
        return Const(True), Load("w", (inv["base"] + _flatten(t, p.filter_size) * p.Cg + c0 + row,))

    def store(m, n, g, value, atomic):
        ch = g * p.Kg + n
        row = (m % p.N) * P + m // p.N  # back to (n, position) order
        return [Store("y", (row * p.K + ch,), epilogue_value(p, value, ch), "atomic" if atomic else False)]

    params = [Buffer("x", (p.N * _prod(p.in_size) * p.C,), p.dtype), Buffer("w", (p.K * Kr,), p.dtype)]
    if p.has_bias:
        params.append(Buffer("bias", (p.K,), p.dtype))
    params.append(Buffer("y", (M * p.K,), p.dtype, role="out"))
    return GemmView(M, Ng, Kr, p.groups, Operand("k", a_inv, a_elem, context=True),
                    Operand("k", b_inv, b_elem, context=True), store, tuple(params), p.dtype,
                    doc=f"ConvV2 forward (filter trimming): y[{M} x {p.K}] = x * w over in-bounds taps only",
                    k_tiles=k_tiles)


def build(p, cfg: TileConfig):
    k = tiled_gemm(f"conv_{p.direction}_v2", v2_view(p, cfg), cfg)
    return k.__class__(k.name, k.params, k.locals, k.body, k.grid, k.threads,
                       {**k.meta, "problem": p.key(), "template": NAME})
