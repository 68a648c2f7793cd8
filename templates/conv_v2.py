"""ConvV2: filter trimming - taps that only ever meet padding are neither read nor multiplied.

The implicit GEMM predicates every out-of-bounds term to zero and still multiplies it.  ConvV2
gives each block a region where it knows exactly which terms are real (algorithms.md), so its
reduction runs over those only: no bounds tests in the loads, no padding reads, no workspace.
Border blocks simply run shorter reductions.  One GemmView per direction:

forward (any stride/dilation), applies with padding > 0.  Rows are batch-fastest, m = position * N
+ n, so with N % BM == 0 every row of a block is the same output position o, and per dim
    lo = max(0, ceil((pad - o*stride) / dil)),   hi = min(F, ceil((size + pad - o*stride) / dil)).
The reduction is (trimmed taps) x C/groups with C/groups % BK == 0: a BK slice is one tap.

backward-data, stride 1 in every dim: dx[n, i, c] = sum_(t, k) dy[n, i + pad - t*dil, k] w[k, t, c],
the correlation of dy with the rotated filter.  Same row order (a block is one dx position i); the
real taps are those with 0 <= i + pad - t*dil < O:
    lo = max(0, ceil((i + pad - O + 1) / dil)),   hi = min(F, floor((i + pad) / dil) + 1),
trimmed along dims with dil*(F-1) > pad (elsewhere every tap lands in dy; if no dim has one the
variant does not apply).  K/groups % BK == 0.  Strided backward-data is KS-deconv's.

backward-weight (any stride/dilation), applies with padding > 0.  The reduction runs over (o, n)
and which o contribute depends on the tap alone: o*stride - pad + t*dil must land in x, i.e.
    o_lo = max(0, ceil((pad - t*dil) / stride)),   o_hi = min(O, ceil((size + pad - t*dil) / stride)).
Columns (tap, c) would tie the trim to BN | C/groups and still could not trim a slice that mixes
taps, so the tap goes to the grid's z axis instead (GemmView.groups = groups x taps, as KS-deconv
does with its classes): each z slice is the GEMM dw[:, t, :] = dy^T x over the tap's box of o,
with a per-block reduction length.  Batch is fastest in the reduction: with N % BK == 0 a slice is
one o (decoded once per slice, no bounds test), otherwise it is decoded per element behind a length
test.  No split-K: the taps already multiply the grid (and tiled_gemm's per-block reduction needs
split_k = stages = 1 everywhere).

conv_v2 is never the automatic choice: algo="conv_v2" or a tuned database entry selects it.
"""
from __future__ import annotations

from ..ir import Buffer, Call, Const, Load, Store, all_of

from .config import TileConfig
from .implicit_gemm import _flatten, _prod, _unflatten, epilogue_value
from .tile_space import TiledGemmVariant
from .tiled_gemm import GemmView, Operand, tiled_gemm

NAME = "conv_v2"
DIRECTIONS = ("fwd", "bwd_data", "bwd_weight")


def _bwd_data_trims(p):
    """Dims along which some dx position has taps outside dy (stride 1)."""
    return [d * (f - 1) > pd for f, pd, d in zip(p.filter_size, p.padding, p.dilation)]


def applies(p):
    if p.direction == "bwd_data":
        return all(s == 1 for s in p.stride) and any(_bwd_data_trims(p))
    return any(pd > 0 for pd in p.padding)


def config_ok(p, cfg: TileConfig):
    """Forward / backward-data: block rows share one position and slices do not straddle taps.
    Backward-weight: only the per-block reduction's split_k = stages = 1."""
    plain = cfg.split_k == 1 and cfg.stages == 1
    if p.direction == "fwd":
        return plain and p.N % cfg.BM == 0 and p.Cg % cfg.BK == 0
    if p.direction == "bwd_data":
        return plain and p.N % cfg.BM == 0 and p.Kg % cfg.BK == 0
    return plain


def _ceil_div(a, b):
    return Const(0) - (Const(0) - a) // b  # floor semantics: exact for negative numerators too


def _max(a, b):
    return Call("max", (a, b))


def _min(a, b):
    return Call("min", (a, b))


def _block_position(m0, N, sizes):
    """First row of a batch-fastest block -> its spatial position, per dim (outermost first)."""
    pos, out = m0 // N, []
    for size in reversed(sizes):
        out.append(pos % size)
        pos = pos // size
    return out[::-1]


def _decode(index, lo, cnt):
    """Row-major index over a runtime box (cnt per dim) -> coordinates offset by lo."""
    out, rest = [], index
    for ax in (2, 1, 0):
        out.append(lo[ax] + rest % cnt[ax])
        rest = rest // cnt[ax]
    return out[::-1]


def _tap_walk(window, per_tap, BK):
    """(taps, k_tiles) over a block's trimmed window: slice kt -> (real tap per dim, channel offset),
    and the block's slice count.  A slice is one tap (per_tap slices of BK channels each)."""
    def taps(kt, ctx):
        _, lo, cnt = window(ctx)
        return _decode(kt // per_tap, lo, cnt), (kt % per_tap) * BK

    def k_tiles(ctx):
        _, _, cnt = window(ctx)
        return cnt[0] * cnt[1] * cnt[2] * per_tap
    return taps, k_tiles


def _check(p, cfg):
    if not config_ok(p, cfg):
        need = {"fwd": f"N % BM == 0, C/groups % BK == 0, split_k = stages = 1 (N={p.N}, C/groups={p.Cg})",
                "bwd_data": f"N % BM == 0, K/groups % BK == 0, split_k = stages = 1 (N={p.N}, K/groups={p.Kg})",
                "bwd_weight": "split_k = stages = 1"}[p.direction]
        raise ValueError(f"config must have {need} for conv_v2 {p.direction}, got {cfg}")


def _view(p, M, Ng, Kr, groups, a, b, store, params, doc, k_tiles):
    return GemmView(M, Ng, Kr, groups, a, b, store, tuple(params), p.dtype, doc=doc, k_tiles=k_tiles)


def forward_view(p, cfg: TileConfig) -> GemmView:
    _check(p, cfg)
    TRS, P = _prod(p.filter_size), _prod(p.out_size)
    M, Ng, Kr = p.N * P, p.Kg, TRS * p.Cg
    per_tap = p.Cg // cfg.BK

    def window(ctx):
        """The block's window corner and trimmed tap range, per dim."""
        o = _block_position(ctx.m0, p.N, p.out_size)
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

    taps, k_tiles = _tap_walk(window, per_tap, cfg.BK)

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

    def store(m, n, g, value, split):
        ch = g * p.Kg + n
        row = (m % p.N) * P + m // p.N  # back to (n, position) order
        return [Store("y", (row * p.K + ch,), epilogue_value(p, value, ch, split),
                      "atomic" if split is not None else False)]

    params = [Buffer("x", (p.N * _prod(p.in_size) * p.C,), p.dtype), Buffer("w", (p.K * Kr,), p.dtype)]
    if p.has_bias:
        params.append(Buffer("bias", (p.K,), p.dtype))
    params.append(Buffer("y", (M * p.K,), p.dtype, role="out"))
    return _view(p, M, Ng, Kr, p.groups, Operand("k", a_inv, a_elem, context=True),
                 Operand("k", b_inv, b_elem, context=True), store, params,
                 f"ConvV2 forward (filter trimming): y[{M} x {p.K}] = x * w over in-bounds taps only", k_tiles)


def backward_data_view(p, cfg: TileConfig) -> GemmView:
    _check(p, cfg)
    if any(s != 1 for s in p.stride):
        raise ValueError(f"stride must be 1 in every dim for conv_v2 bwd_data (KS-deconv runs strided), "
                         f"got {p.stride}")
    TRS, I, O = _prod(p.filter_size), p.in_size, p.out_size
    M, Ng, Kr = p.N * _prod(I), p.Cg, TRS * p.Kg
    per_tap = p.Kg // cfg.BK
    trims = _bwd_data_trims(p)

    def window(ctx):
        """The block's dy anchor (i + pad: the dy position of tap 0) and trimmed tap range, per dim."""
        i = _block_position(ctx.m0, p.N, I)
        anchor = [i[ax] + p.padding[ax] for ax in range(3)]
        lo, cnt = [], []
        for ax in range(3):
            if not trims[ax]:
                lo.append(Const(0)), cnt.append(Const(p.filter_size[ax]))
                continue
            l = _max(Const(0), _ceil_div(anchor[ax] - (O[ax] - 1), p.dilation[ax]))
            h = _min(Const(p.filter_size[ax]), anchor[ax] // p.dilation[ax] + 1)
            lo.append(l), cnt.append(_max(Const(0), h - l))
        return anchor, lo, cnt

    taps, k_tiles = _tap_walk(window, per_tap, cfg.BK)

    def a_inv(m, g):
        return {"base": (m % p.N) * _prod(O) * p.K + g * p.Kg}

    def a_elem(inv, kk, kt, col, ctx):
        anchor, _, _ = window(ctx)
        t, k0 = taps(kt, ctx)
        o = [anchor[ax] - t[ax] * p.dilation[ax] for ax in range(3)]
        return Const(True), Load("dy", (inv["base"] + _flatten(o, O) * p.K + k0 + col,))

    def b_inv(n, g):
        return {"col": g * p.Kg * TRS * p.Cg + n}

    def b_elem(inv, kk, kt, row, ctx):
        t, k0 = taps(kt, ctx)
        return Const(True), Load("w", (inv["col"] + ((k0 + row) * TRS + _flatten(t, p.filter_size)) * p.Cg,))

    def store(m, n, g, value, split):
        row = (m % p.N) * _prod(I) + m // p.N
        return [Store("dx", (row * p.C + g * p.Cg + n,), value, "atomic" if split is not None else False)]

    params = (Buffer("dy", (p.N * _prod(O) * p.K,), p.dtype), Buffer("w", (p.K * TRS * p.Cg,), p.dtype),
              Buffer("dx", (M * p.C,), p.dtype, role="out"))
    return _view(p, M, Ng, Kr, p.groups, Operand("k", a_inv, a_elem, context=True),
                 Operand("mn", b_inv, b_elem, context=True), store, params,
                 f"ConvV2 backward-data (filter trimming): dx[{M} x {p.C}] = dy * rot(w) over taps inside dy",
                 k_tiles)


def backward_weight_view(p, cfg: TileConfig) -> GemmView:
    _check(p, cfg)
    TRS, I, O = _prod(p.filter_size), p.in_size, p.out_size
    M, Ng, Kr = p.Kg, p.Cg, p.N * _prod(O)
    BK = cfg.BK
    uniform = p.N % BK == 0  # a slice is BK images at one output position
    per_pos = p.N // BK

    def box(g):
        """grid-z index -> filter tap, and the trimmed box of output positions it meets x at."""
        t = _unflatten(g % TRS, p.filter_size)
        lo, cnt = [], []
        for ax in range(3):
            if p.padding[ax] == 0:  # every output position reads x at every tap
                lo.append(Const(0)), cnt.append(Const(O[ax]))
                continue
            edge = p.padding[ax] - t[ax] * p.dilation[ax]
            l = _max(Const(0), _ceil_div(edge, p.stride[ax]))
            h = _min(Const(O[ax]), _ceil_div(edge + I[ax], p.stride[ax]))
            lo.append(l), cnt.append(_max(Const(0), h - l))
        return t, lo, cnt

    def length(cnt):
        return cnt[0] * cnt[1] * cnt[2] * p.N

    def k_tiles(ctx):
        _, _, cnt = box(ctx.g)
        return length(cnt) // BK if uniform else (length(cnt) + (BK - 1)) // BK

    def reduction(kk, kt, col, ctx):
        """Reduction element -> (image, output position per dim, predicates)."""
        _, lo, cnt = box(ctx.g)
        if uniform:
            return (kt % per_pos) * BK + col, _decode(kt // per_pos, lo, cnt), []
        return kk % p.N, _decode(kk // p.N, lo, cnt), [kk < length(cnt)]

    def a_inv(m, g):
        return {"col": (g // TRS) * p.Kg + m}

    def a_elem(inv, kk, kt, col, ctx):
        n, o, pred = reduction(kk, kt, col, ctx)
        return all_of(pred), Load("dy", ((n * _prod(O) + _flatten(o, O)) * p.K + inv["col"],))

    def b_inv(nn, g):
        return {"c": (g // TRS) * p.Cg + nn}

    def b_elem(inv, kk, kt, row, ctx):
        n, o, pred = reduction(kk, kt, row, ctx)
        t, _, _ = box(ctx.g)
        coords = [o[ax] * p.stride[ax] - p.padding[ax] + t[ax] * p.dilation[ax] for ax in range(3)]
        return all_of(pred), Load("x", ((n * _prod(I) + _flatten(coords, I)) * p.C + inv["c"],))

    def store(m, n, g, value, split):
        off = (((g // TRS) * p.Kg + m) * TRS + g % TRS) * p.Cg + n
        return [Store("dw", (off,), value, "atomic" if split is not None else False)]

    params = (Buffer("x", (p.N * _prod(I) * p.C,), p.dtype), Buffer("dy", (Kr * p.K,), p.dtype),
              Buffer("dw", (p.K * TRS * p.Cg,), p.dtype, role="out"))
    return _view(p, M, Ng, Kr, p.groups * TRS, Operand("mn", a_inv, a_elem, context=True),
                 Operand("mn", b_inv, b_elem, context=True), store, params,
                 f"ConvV2 backward-weight (trimmed output range per tap): dw[{p.K} x {TRS} x {p.Cg}] = dy^T * x, "
                 f"{p.groups * TRS} tap GEMMs", k_tiles)


VIEWS = {"fwd": forward_view, "bwd_data": backward_data_view, "bwd_weight": backward_weight_view}


def v2_view(p, cfg: TileConfig) -> GemmView:
    return VIEWS[p.direction](p, cfg)


def build(p, cfg: TileConfig):
    k = tiled_gemm(f"conv_{p.direction}_v2", v2_view(p, cfg), cfg)
    return k.__class__(k.name, k.params, k.locals, k.body, k.grid, k.threads,
                       {**k.meta, "problem": p.key(), "template": NAME})


VARIANT = TiledGemmVariant(NAME, DIRECTIONS, applies, build, config_ok)
