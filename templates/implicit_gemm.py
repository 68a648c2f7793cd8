"""Implicit-GEMM convolution: forward, backward-data and backward-weight as GEMM views.

Each view says what the convolution is as C[m, n] = sum_k A[m, k] B[k, n] (channels-last):

    forward      m = (n, od, oh, ow)   n = k_out           k = (t, r, s, c)
    backward-dx  m = (n, id, ih, iw)   n = c               k = (t, r, s, k_out)   (zero-insertion form)
    backward-dw  m = k_out             n = (t, r, s, c)    k = (n, od, oh, ow)

The reduction index always has the channel fastest, so when the per-group channel count is a
multiple of BK a whole BK-slice shares one filter tap: the tap is decoded once per slice, not
per element.  Bounds tests are emitted only for dims that can leave the tensor (padding > 0).
"""
from __future__ import annotations

from dataclasses import replace

from kernelgen.ir import Buffer, Const, If, Load, Store, all_of, maximum, select
from kernelgen.storage import HALF_DTYPES, WIDE_SUFFIX

from .config import TileConfig
from .implicit_gemm_tma import backward_weight_tma, forward_tma
from .tile_space import TiledGemmVariant
from .tiled_gemm import GemmView, Operand, tiled_gemm

NAME = "implicit_gemm"
DIRECTIONS = ("fwd", "bwd_data", "bwd_weight")


def _prod(t):
    out = 1
    for v in t:
        out *= v
    return out


def _unflatten(i, sizes):
    """Row-major decode of a flat index over `sizes` -> list of index Exprs (outermost first)."""
    out = []
    for size in reversed(sizes):
        out.append(i % size)
        i = i // size
    return list(reversed(out))


def _flatten(idx, sizes):
    lin = Const(0)
    for i, size in zip(idx, sizes):
        lin = lin * size + i
    return lin


def reduction_split(kk, kt, col, inner, BK):
    """kk -> (tap, channel) with `inner` channels fastest; uniform per slice when inner % BK == 0."""
    if inner % BK == 0:
        per_tap = inner // BK
        return kt // per_tap, (kt % per_tap) * BK + col
    return kk // inner, kk % inner


def _in_range(coords, sizes, needed):
    return [c >= 0 for c, need in zip(coords, needed) if need] + \
           [c < n for c, n, need in zip(coords, sizes, needed) if need]


def epilogue_value(p, value, bias_index, split=None):
    """bias and activation of a finished output; split (the split-K index expression, None without split-K):
    the partial sums of all splits add up in y, so only split 0 adds the bias and no activation is possible."""
    if split is not None and p.activation:
        raise ValueError(f"config: split_k must be 1 with activation={p.activation!r}")
    if p.has_bias:
        bias = Load("bias", (bias_index,))
        value = value + (bias if split is None else select(split.eq(0), bias, Const(0.0)))
    if p.activation == "relu":
        value = maximum(value, Const(0.0))
    return value


def _split_output(name, p, cfg: TileConfig):
    """(buffer, dtype) a view stores its output in: a split 16-bit output adds into a float32 workspace (there are
    no 16-bit atomic adds) that the launcher zeroes and rounds into the caller's array (storage.WIDE_SUFFIX)."""
    if p.dtype in HALF_DTYPES and cfg.split_k > 1:
        return name + WIDE_SUFFIX, "float32"
    return name, p.dtype


def forward_view(p, cfg: TileConfig) -> GemmView:
    TRS = _prod(p.filter_size)
    M, Ng, Kr = p.N * _prod(p.out_size), p.Kg, TRS * p.Cg
    pads = [pd > 0 for pd in p.padding]

    def a_inv(m, g):
        *o, = _unflatten(m, (p.N,) + p.out_size)
        n, o = o[0], o[1:]
        inv = {"base": n * _prod(p.in_size) * p.C + g * p.Cg}
        for ax, name in enumerate("dhw"):
            inv[name] = o[ax] * p.stride[ax] - p.padding[ax]
        return inv

    def a_elem(inv, kk, kt, col):
        tap, c = reduction_split(kk, kt, col, p.Cg, cfg.BK)
        taps = _unflatten(tap, p.filter_size)
        coords = [inv[nm] + taps[ax] * p.dilation[ax] for ax, nm in enumerate("dhw")]
        pred = _in_range(coords, p.in_size, pads) + ([kk < Kr] if Kr % cfg.BK else [])
        return all_of(pred), Load("x", (inv["base"] + _flatten(coords, p.in_size) * p.C + c,))

    def b_inv(n, g):
        return {"base": (g * p.Kg + n) * Kr}

    def b_elem(inv, kk, kt, row):
        pred = ([kk < Kr] if Kr % cfg.BK else [])
        return all_of(pred), Load("w", (inv["base"] + kk,))

    y, y_dtype = _split_output("y", p, cfg)

    def store(m, n, g, value, split):
        ch = g * p.Kg + n
        return [Store(y, (m * p.K + ch,), epilogue_value(p, value, ch, split),
                      "atomic" if split is not None else False)]

    params = [Buffer("x", (p.N * _prod(p.in_size) * p.C,), p.dtype),
              Buffer("w", (p.K * Kr,), p.dtype)]
    if p.has_bias:
        params.append(Buffer("bias", (p.K,), p.dtype))
    params.append(Buffer(y, (M * p.K,), y_dtype, role="out"))
    vec = p.Cg % 4 == 0  # a tap's channels in chunks of 4: consecutive addresses of x and of w
    return GemmView(M, Ng, Kr, p.groups, Operand("k", a_inv, a_elem, vector=vec), Operand("k", b_inv, b_elem, vector=vec),
                    store, tuple(params), p.dtype, doc=f"implicit-GEMM forward: y[{M} x {p.K}] = x * w",
                    tma=lambda cfg, ctx: forward_tma(p, cfg, ctx.m0, ctx.n0), pairs=True,
                    batch=("M", _prod(p.out_size)))


def backward_data_view(p, cfg: TileConfig) -> GemmView:
    """dx[n, i, c] = sum over (tap, k) of dy[n, (i + pad - tap*dil) / stride, k] * w[k, tap, c]."""
    TRS = _prod(p.filter_size)
    M, Ng, Kr = p.N * _prod(p.in_size), p.Cg, TRS * p.Kg
    checks = [not (f == 1 and pd == 0 and st == 1) for f, pd, st in zip(p.filter_size, p.padding, p.stride)]

    unit_stride = all(st == 1 for st in p.stride)

    def a_inv(m, g):
        n, *i = _unflatten(m, (p.N,) + p.in_size)
        nums = [i[ax] + p.padding[ax] for ax in range(3)]
        inv = {"base": n * _prod(p.out_size) * p.K + g * p.Kg}
        if unit_stride:  # dy index is linear in (position - tap): fold the position part in once
            inv["base"] = inv["base"] + _flatten(nums, p.out_size) * p.K
            inv.update({name: nums[ax] for ax, name in enumerate("dhw") if checks[ax]})
        else:
            inv.update({name: nums[ax] for ax, name in enumerate("dhw")})
        return inv

    def a_elem(inv, kk, kt, col):
        tap, k = reduction_split(kk, kt, col, p.Kg, cfg.BK)
        step = [t * d for t, d in zip(_unflatten(tap, p.filter_size), p.dilation)]
        pred = [kk < Kr] if Kr % cfg.BK else []
        if unit_stride:
            coords = [inv[nm] - step[ax] for ax, nm in enumerate("dhw") if checks[ax]]
            sizes = [o for o, ch in zip(p.out_size, checks) if ch]
            pred = _in_range(coords, sizes, [True] * len(coords)) + pred
            return all_of(pred), Load("dy", (inv["base"] - _flatten(step, p.out_size) * p.K + k,))
        nums = [inv[nm] - step[ax] for ax, nm in enumerate("dhw")]
        pred += [(nums[ax] % p.stride[ax]).eq(0) for ax in range(3) if p.stride[ax] > 1 and checks[ax]]
        coords = [nums[ax] // p.stride[ax] for ax in range(3)]
        pred += [nums[ax] >= 0 for ax in range(3) if checks[ax]]
        pred += [coords[ax] < p.out_size[ax] for ax in range(3) if checks[ax]]
        return all_of(pred), Load("dy", (inv["base"] + _flatten(coords, p.out_size) * p.K + k,))

    def b_inv(n, g):
        return {"col": g * p.Kg * TRS * p.Cg + n}

    def b_elem(inv, kk, kt, row):
        tap, k = reduction_split(kk, kt, row, p.Kg, cfg.BK)
        pred = [kk < Kr] if Kr % cfg.BK else []
        return all_of(pred), Load("w", (inv["col"] + (k * TRS + tap) * p.Cg,))

    dx, dx_dtype = _split_output("dx", p, cfg)

    def store(m, n, g, value, split):
        return [Store(dx, (m * p.C + g * p.Cg + n,), value, "atomic" if split is not None else False)]

    params = (Buffer("dy", (p.N * _prod(p.out_size) * p.K,), p.dtype), Buffer("w", (p.K * TRS * p.Cg,), p.dtype),
              Buffer(dx, (M * p.C,), dx_dtype, role="out"))
    return GemmView(M, Ng, Kr, p.groups, Operand("k", a_inv, a_elem, vector=p.Kg % 4 == 0), Operand("mn", b_inv, b_elem),
                    store, params, p.dtype, doc=f"implicit-GEMM backward-data: dx[{M} x {p.C}] = dy * w^T",
                    tma=lambda cfg, ctx: forward_tma(p, cfg, ctx.m0, ctx.n0), pairs=True,
                    batch=("M", _prod(p.in_size)))


def backward_weight_view(p, cfg: TileConfig) -> GemmView:
    """dw[k, tap, c] = sum over (n, o) of dy[n, o, k] * x[n, o*stride - pad + tap*dil, c]."""
    TRS = _prod(p.filter_size)
    M, Ng, Kr = p.Kg, TRS * p.Cg, p.N * _prod(p.out_size)
    pads = [pd > 0 for pd in p.padding]

    def a_inv(m, g):
        return {"col": g * p.Kg + m}

    def a_elem(inv, kk, kt, col):
        pred = [kk < Kr] if Kr % cfg.BK else []
        return all_of(pred), Load("dy", (kk * p.K + inv["col"],))

    def b_inv(nn, g):
        tap, c = nn // p.Cg, nn % p.Cg
        taps = _unflatten(tap, p.filter_size)
        inv = {"c": g * p.Cg + c}
        for ax, name in enumerate("dhw"):
            inv[name] = taps[ax] * p.dilation[ax] - p.padding[ax]
        return inv

    def b_elem(inv, kk, kt, row):
        if p.out_size[2] % cfg.BK == 0:  # a slice stays in one output row: decode it once per slice
            o = _unflatten(kt * cfg.BK, (p.N,) + p.out_size)
            o[-1] = o[-1] + row
        else:
            o = _unflatten(kk, (p.N,) + p.out_size)
        coords = [o[ax + 1] * p.stride[ax] + inv[nm] for ax, nm in enumerate("dhw")]
        pred = _in_range(coords, p.in_size, pads) + ([kk < Kr] if Kr % cfg.BK else [])
        off = o[0] * _prod(p.in_size) * p.C + _flatten(coords, p.in_size) * p.C + inv["c"]
        return all_of(pred), Load("x", (off,))

    dw, dw_dtype = _split_output("dw", p, cfg)

    def store(m, n, g, value, split):
        return [Store(dw, ((g * p.Kg + m) * Ng + n,), value, "atomic" if split is not None else False)]

    params = (Buffer("x", (p.N * _prod(p.in_size) * p.C,), p.dtype),
              Buffer("dy", (Kr * p.K,), p.dtype), Buffer(dw, (p.K * Ng,), dw_dtype, role="out"))
    return GemmView(M, Ng, Kr, p.groups, Operand("mn", a_inv, a_elem), Operand("mn", b_inv, b_elem), store,
                    params, p.dtype, doc=f"implicit-GEMM backward-weight: dw[{p.K} x {Ng}] = dy^T * x",
                    tma=lambda cfg, ctx: backward_weight_tma(p, cfg, ctx.m0, ctx.n0), tma_a_mn=True,
                    batch=("K", _prod(p.out_size)))


def col2im_view(p, cfg: TileConfig) -> GemmView:
    """Backward-data over dy's pixels, the col2im in the epilogue (TileConfig.col2im):
        t[m, (tap, c)] = sum over k of dy[m, k] * w[k, tap, c]    m = (n, od, oh, ow)
        dx[n, o * stride - pad + tap * dil, c] += t[m, (tap, c)]  (atomically, into a zeroed dx; stored where taps
                                                                   never meet, a strided 1x1)
    The products are backward_data_view's, grouped by the dy pixel they read: the tile's columns are taps x C
    (147 for a 7x7 filter over C = 3) where that view's are C of a BN-wide tile, and dy is read as stored (no
    stride classes, no bounds tests).  The cost is an atomic add per (pixel, tap, c), one per Kg products."""
    TRS = _prod(p.filter_size)
    M, Ng, Kr = p.N * _prod(p.out_size), TRS * p.Cg, p.Kg
    below = [pd > 0 for pd in p.padding]  # may a tap land before the first input position / past the last?
    past = [(o - 1) * st - pd + (f - 1) * d >= i for o, st, pd, f, d, i in
            zip(p.out_size, p.stride, p.padding, p.filter_size, p.dilation, p.in_size)]

    def a_inv(m, g):
        return {"base": m * p.K + g * p.Kg}

    def a_elem(inv, kk, kt, col):
        return all_of([kk < Kr] if Kr % cfg.BK else []), Load("dy", (inv["base"] + kk,))

    def b_inv(n, g):
        return {"col": g * p.Kg * Ng + n}

    def b_elem(inv, kk, kt, row):
        return all_of([kk < Kr] if Kr % cfg.BK else []), Load("w", (inv["col"] + kk * Ng,))

    # taps that never meet ((f - 1) * dil < stride on every axis: a strided 1x1) store; overlapping ones add
    # atomically, 16-bit dx into a float32 workspace (no 16-bit atomic adds) the launcher zeroes and rounds into dx
    disjoint = taps_never_meet(p)
    widened = p.dtype in HALF_DTYPES and not disjoint
    dx, dx_dtype = ("dx" + WIDE_SUFFIX, "float32") if widened else ("dx", p.dtype)

    def store(m, n, g, value, split):
        img, *o = _unflatten(m, (p.N,) + p.out_size)
        taps = _unflatten(n // p.Cg, p.filter_size)
        at = [o[ax] * p.stride[ax] - p.padding[ax] + taps[ax] * p.dilation[ax] for ax in range(3)]
        inside = [a >= 0 for a, need in zip(at, below) if need] + \
            [a < i for a, i, need in zip(at, p.in_size, past) if need]
        add = Store(dx, ((img * _prod(p.in_size) + _flatten(at, p.in_size)) * p.C + g * p.Cg + n % p.Cg,), value,
                    False if disjoint else "atomic")
        return [If(all_of(inside), (add,))] if inside else [add]

    params = (Buffer("dy", (M * p.K,), p.dtype), Buffer("w", (p.K * Ng,), p.dtype),
              Buffer(dx, (p.N * _prod(p.in_size) * p.C,), dx_dtype, role="out"))
    a = Operand("k", a_inv, a_elem, vector=p.Kg % 4 == 0)
    return GemmView(M, Ng, Kr, p.groups, a, Operand("mn", b_inv, b_elem),
                    store, params, p.dtype, doc=f"implicit-GEMM backward-data, col2im: dx[{p.N} x {p.in_size} x {p.C}] "
                    f"+= (dy[{M} x {p.K}] * w[{p.K} x {Ng}]) folded", meta={"zero_output": True, "col2im": True},
                    batch=("M", _prod(p.out_size)))


def col2im_unmet(p):
    """What TileConfig.col2im needs that problem p lacks (an empty list: col2im_view builds)."""
    return ["a backward-data problem"] if p.direction != "bwd_data" else []


# The planner's rule (planner._col2im_choice): backward-data of at most this many input channels a group, with at
# least COL2IM_MIN_COLUMNS columns (taps x channels) and COL2IM_MIN_FILTERS filters a group (products per atomic add):
# a first layer (C = 1 or 3), an image-producing transposed convolution; and strided backward-data whose taps never
# meet (a strided 1x1) unless the chain's own plan is a TMA tile (docs/variants.md has the measurements)
COL2IM_MAX_CHANNELS, COL2IM_MIN_COLUMNS, COL2IM_MIN_FILTERS = 4, 16, 16


def taps_never_meet(p) -> bool:
    """(f - 1) * dil < stride on every axis: no two taps of two dy pixels reach one dx element (a strided 1x1)."""
    return all((f - 1) * d < st for f, d, st in zip(p.filter_size, p.dilation, p.stride))


def few_channels(p) -> bool:
    """The rule's first clause: few input channels a group, enough filters and columns (a first layer)."""
    columns = _prod(p.filter_size) * p.Cg
    return p.Cg <= COL2IM_MAX_CHANNELS and p.Kg >= COL2IM_MIN_FILTERS and columns >= COL2IM_MIN_COLUMNS


def col2im_suits(p) -> bool:
    """Is p a backward-data problem the planner computes with TileConfig.col2im (the rule above; groups 1)?"""
    return (p.direction == "bwd_data" and p.groups == 1
            and (few_channels(p) or max(p.stride) > 1 and taps_never_meet(p)))


def col2im_gemm(p):
    """The 1x1 forward convolution whose GEMM is col2im_view's (M = dy's pixels, N = taps x C, reduction K): the
    planner takes its tile for p's (its tuned entry, model or default)."""
    ones = (1, 1, 1)
    return replace(p, direction="fwd", C=p.K, K=_prod(p.filter_size) * p.C, in_size=p.out_size, filter_size=ones,
                   stride=ones, padding=(0, 0, 0), dilation=ones, has_bias=False, activation=None)


VIEWS = {"fwd": forward_view, "bwd_data": backward_data_view, "bwd_weight": backward_weight_view}


def computed(p):
    """The problem whose kernel computes p: the 2-D convolution on the same memory where p is a 3-D one that has
    such a form (ConvProblem.folded_2d: a filter one deep, or one wide and high), else p itself."""
    return p.folded_2d() or p


def folded_view(p, cfg: TileConfig, make_view):
    """make_view(q, cfg) for q = computed(p), its batch (GemmView.batch) counted in p's images: a depth folded into
    the batch makes each of p's images D of q's, and their rows stay together, image-major."""
    q = computed(p)
    view = make_view(q, cfg)
    if q is p or view.batch is None or not p.N:
        return view
    axis, per_image = view.batch
    return replace(view, batch=(axis, per_image * (q.N // p.N)))


def applies(p):
    return True


def view_of(q, cfg: TileConfig) -> GemmView:
    """The view that computes problem q with cfg: VIEWS' for its direction, or col2im_view (TileConfig.col2im)."""
    if cfg.col2im:
        why = col2im_unmet(q)
        if why:
            raise ValueError(f"config: col2im=1 needs {', '.join(why)}; got {q.key()} with {cfg}")
        return col2im_view(q, cfg)
    return VIEWS[q.direction](q, cfg)


def build(p, cfg: TileConfig):
    """(ConvProblem, TileConfig) -> Kernel."""
    view = folded_view(p, cfg, view_of)
    k = tiled_gemm(f"conv_{p.direction}", view, cfg)
    return k.__class__(k.name, k.params, k.locals, k.body, k.grid, k.threads,
                       {**k.meta, "problem": p.key(), "template": NAME})


VARIANT = TiledGemmVariant(NAME, DIRECTIONS, applies, build, lambda p, cfg: not (cfg.col2im and col2im_unmet(p)))
