"""KS-deconv: backward-data / transposed convolution with stride > 1, without inserted zeros.

dx[n, i, c] = sum over taps t and channels k of dy[n, o, k] * w[k, t, c], where i + pad = o*s + t
(per spatial dim, dilation 1).  The zero-insertion form (implicit_gemm's backward-data view) tests
`(i + pad - t) % s == 0` for every reduction element and throws away (s-1)/s of its work per dim.
KS-deconv splits the output positions by class a = (i + pad) mod s instead:

    positions of class a:  i = i0 + u*s,   i0 = (a - pad) mod s,   u = 0 .. U_a - 1
    taps of class a:       t = a + j*s,    j  = 0 .. J_a - 1,      J_a = ceil((T - a) / s)
    and then               o = b_a + u - j,  with b_a = (i0 + pad) // s

so each class is a stride-1 correlation of the un-dilated dy with its own sub-filter (the taps
t ≡ a mod s, read in place from w: no rearranged copy).  All s^D classes run in ONE launch: the
class is part of the grid's z axis (GemmView.groups = groups x s^D).  Sub-filters and class sizes
differ when T or the output size is not a multiple of s (3x3 at s=2 -> 2x2, 2x1, 1x2, 1x1): the
GEMM uses the largest (U, J) and predicates the rest, which the tile loads turn into zeros and the
stores skip.  kernelgen.deconv is this backward-data pass, so it uses KS-deconv too.

KS-deconv-V2 (opt-in: the setting ks_deconv_trim, not yet measured on a GPU) adds ConvV2's filter trimming per
class: rows batch-fastest (m = u * N + n), so with N % BM == 0 a block is one class position u and
only the sub-filter taps whose dy position lands inside dy are in its reduction,
    j_lo = max(0, b_a + u - O + 1),   j_hi = min(J_a, b_a + u + 1),
with the class's own J_a (no predicated taps of a smaller sub-filter) and an empty reduction for
positions past the class's size.  Needs K/groups % BK == 0 and split_k = stages = 1 (the per-block
reduction); with any other schedule the predicated form above runs.
"""
from __future__ import annotations

from kernelgen import settings
from kernelgen.storage import HALF_DTYPES

from ..ir import Buffer, Call, Const, If, Load, Store, TensorMap, all_of, select

from .config import TileConfig
from .implicit_gemm import _flatten, _prod, _unflatten, reduction_split
from .implicit_gemm_tma import b_mn_operands
from .tile_space import TiledGemmVariant
from .tiled_gemm import GemmView, Operand, _cdiv, tiled_gemm
from .tma_schedule import TmaOperands, swizzled_row

NAME = "ks_deconv"
DIRECTIONS = ("bwd_data",)
# KS-deconv-V2 where the schedule fits: opt in (kernelgen.settings ks_deconv_trim) until measured


def applies(p):
    return p.direction == "bwd_data" and any(s > 1 for s in p.stride) and all(d == 1 for d in p.dilation)


def _class_split(p):
    classes = _prod(p.stride)

    def split_class(g):
        """grid-z index -> (group, class coordinates a, first position i0, dy offset b), per dim."""
        a = _unflatten(g % classes, p.stride)
        i0 = [(a[ax] - p.padding[ax]) % p.stride[ax] for ax in range(3)]
        b = [(i0[ax] + p.padding[ax]) // p.stride[ax] for ax in range(3)]
        return g // classes, a, i0, b
    return split_class


def ks_shape(p):
    """(M, N, K, groups) of the classes' GEMM (ks_view): the largest class's positions x channels, the largest
    sub-filter's taps x K, one GEMM per group and class."""
    U = [_cdiv(i, s) for i, s in zip(p.in_size, p.stride)]   # positions per class, the largest class
    J = [_cdiv(t, s) for t, s in zip(p.filter_size, p.stride)]   # taps per sub-filter, the largest sub-filter
    return p.N * _prod(U), p.Cg, _prod(J) * p.Kg, p.groups * _prod(p.stride)


def ks_view(p, cfg: TileConfig) -> GemmView:
    st, T, I, O = p.stride, p.filter_size, p.in_size, p.out_size
    U = [_cdiv(I[ax], st[ax]) for ax in range(3)]
    J = [_cdiv(T[ax], st[ax]) for ax in range(3)]
    classes = _prod(st)
    M, Ng, Kr, _ = ks_shape(p)
    TRS = _prod(T)

    split_class = _class_split(p)

    def class_size(i0, ax):
        return (I[ax] - i0 + st[ax] - 1) // st[ax]  # U_a: positions of this class along ax

    def a_inv(m, g):
        grp, a, i0, b = split_class(g)
        n, *u = _unflatten(m, (p.N,) + tuple(U))
        inv = {"base": n * _prod(O) * p.K + grp * p.Kg}
        for ax, name in enumerate("dhw"):
            inv["o" + name] = b[ax] + u[ax]          # dy coordinate for j = 0
            inv["ok" + name] = u[ax] < class_size(i0[ax], ax)
        return inv

    def taps_of(tap, g):
        _, a, _, _ = split_class(g)
        j = _unflatten(tap, J)
        return j, [a[ax] + j[ax] * st[ax] for ax in range(3)]

    def a_elem(inv, kk, kt, col, ctx):
        tap, k = reduction_split(kk, kt, col, p.Kg, cfg.BK)
        j, t = taps_of(tap, ctx.g)
        o = [inv["o" + nm] - j[ax] for ax, nm in enumerate("dhw")]
        pred = [inv["ok" + nm].ne(0) for nm in "dhw"] + [t[ax] < T[ax] for ax in range(3) if T[ax] % st[ax]]
        pred += [o[ax] >= 0 for ax in range(3)] + [o[ax] < O[ax] for ax in range(3)]
        pred += [kk < Kr] if Kr % cfg.BK else []
        return all_of(pred), Load("dy", (inv["base"] + _flatten(o, O) * p.K + k,))

    def b_inv(n, g):
        grp = g // classes
        return {"col": grp * p.Kg * TRS * p.Cg + n}

    def b_elem(inv, kk, kt, row, ctx):
        tap, k = reduction_split(kk, kt, row, p.Kg, cfg.BK)
        _, t = taps_of(tap, ctx.g)
        pred = [t[ax] < T[ax] for ax in range(3) if T[ax] % st[ax]] + ([kk < Kr] if Kr % cfg.BK else [])
        return all_of(pred), Load("w", (inv["col"] + (k * TRS + _flatten(t, T)) * p.Cg,))

    def store(m, n, g, value, split):
        grp, _, i0, _ = split_class(g)
        nb, *u = _unflatten(m, (p.N,) + tuple(U))
        i = [i0[ax] + u[ax] * st[ax] for ax in range(3)]
        ok = all_of([u[ax] < class_size(i0[ax], ax) for ax in range(3) if I[ax] % st[ax]])
        off = (nb * _prod(I) + _flatten(i, I)) * p.C + grp * p.Cg + n
        return [If(ok, (Store("dx", (off,), value, "atomic" if split is not None else False),))]

    params = (Buffer("dy", (p.N * _prod(O) * p.K,), p.dtype), Buffer("w", (p.K * TRS * p.Cg,), p.dtype),
              Buffer("dx", (p.N * _prod(I) * p.C,), p.dtype, role="out"))
    # 4 consecutive k of dy share a tap and its tests (the tensor-core tiles read them as one 16-byte load)
    return GemmView(M, Ng, Kr, p.groups * classes, Operand("k", a_inv, a_elem, context=True, vector=p.Kg % 4 == 0),
                    Operand("mn", b_inv, b_elem, context=True), store, params, p.dtype,
                    doc=f"KS-deconv backward-data: {classes} stride-1 classes of dx[{p.N * _prod(I)} x {p.C}]",
                    tma=lambda cfg, ctx: ks_tma(p, cfg, ctx), pairs=True,
                    k_tiles=(lambda ctx: _tma_slices(p, cfg, ctx)) if _tma_trims(cfg) else None,
                    batch=("M", _prod(U)))


def tma_unmet(p):
    """What KS-deconv's TMA boxes (ks_tma) need that problem p lacks (an empty list: they build)."""
    if not applies(p):
        return ["a backward-data with stride > 1 and dilation 1"]
    if p.dtype not in ("float32",) + HALF_DTYPES:
        return ["float32, float16 or bfloat16 arrays"]
    J, U = [_cdiv(t, s) for t, s in zip(p.filter_size, p.stride)], [_cdiv(i, s) for i, s in zip(p.in_size, p.stride)]
    corners = [1 - j for j in J[1:]] + [u - j + 1 - o for u, j, o in zip(U[1:], J[1:], p.out_size[1:])]
    return [w for bad, w in ((p.groups != 1, "groups=1"),
                             (p.in_size[0] != 1 or p.filter_size[0] != 1 or p.stride[0] != 1,
                              "a 1-D or 2-D convolution"),
                             (not all(-128 <= c <= 127 for c in corners), "an im2col box whose corners lie in "
                                                                          "-128..127"),
                             (p.K % swizzled_row(p.dtype), f"channels a multiple of {swizzled_row(p.dtype)} (of the "
                                                           f"reduction, {p.dtype})")) if bad]


def _tma_trims(cfg):
    """Do KS-deconv's TMA boxes run each class over its own sub-filter's taps only (a per-block reduction length;
    not with split-K, whose splits share out one length)?  Else every class runs the largest sub-filter, the taps
    it lacks read as zeros."""
    return cfg.tensor_core and cfg.wgmma and cfg.tma and cfg.split_k == 1


def _tma_taps(p, cfg, ctx):
    """(class a, dy offsets b, the taps of block z's reduction along h and along w): the class's own sub-filter of
    J_a = ceil((T - a) / s) taps per dim (_tma_trims), else the largest one's J per dim."""
    _, a, _, b = _class_split(p)(ctx.g)
    (_, sh, sw), (_, th, tw) = p.stride, p.filter_size
    if not _tma_trims(cfg):
        return a, b, Const(_cdiv(th, sh)), Const(_cdiv(tw, sw))
    return a, b, (th - a[1] + (sh - 1)) // sh, (tw - a[2] + (sw - 1)) // sw


def _tma_slices(p, cfg, ctx):
    """The slices of block z's reduction (GemmView.k_tiles): its class's taps x BK-channel slices of K."""
    _, _, taps_h, taps_w = _tma_taps(p, cfg, ctx)
    return taps_h * taps_w * (p.K // cfg.BK)


def ks_tma(p, cfg: TileConfig, ctx):
    """KS-deconv's operands as TMA boxes: block z's class a is a stride-1 correlation of dy with the sub-filter
    of taps a + j s (module docstring), so A is one im2col map of dy for every class: the U positions of the
    largest class per dim as the bounding box (lower corner 1 - J), base pixel u + 1 - J, the tap and the class's
    dy offset b_a as the offsets b_a + J - 1 - j (>= 0); B reads the launcher's flipped copy of w (as the stride-1
    backward-data does: TensorMap.flip) through a 4-D tiled map (k, w, h, c) at tap T - 1 - (a + j s) per dim, so
    a tap the class's sub-filter lacks (a + j s >= T) is a coordinate below 0: zeros.  Classes smaller than the
    largest compute extra rows that the store drops."""
    why = tma_unmet(p)
    if why:
        raise ValueError(f"config: tma={cfg.tma} needs {', '.join(why)}; got {p.key()} with {cfg}")
    ROW, e = swizzled_row(p.dtype), 4 if p.dtype == "float32" else 2
    if cfg.BK != ROW:
        raise ValueError(f"config: tma={cfg.tma} on {p.dtype} arrays needs BK={ROW} (a 128-byte row), got {cfg}")
    (_, sh, sw), (_, th, tw), (_, ih, iw), (_, oh, ow) = p.stride, p.filter_size, p.in_size, p.out_size
    uh, uw, jh, jw = _cdiv(ih, sh), _cdiv(iw, sw), _cdiv(th, sh), _cdiv(tw, sw)
    rounding = "tf32" if p.dtype == "float32" else ""
    a_map = TensorMap("dy_map", "dy", "im2col", (p.K, ow, oh, p.N), (e * p.K, e * ow * p.K, e * oh * ow * p.K),
                      (ROW, cfg.BM), (1 - jw, 1 - jh), (uw - (jw - 1) - ow, uh - (jh - 1) - oh), 128, rounding,
                      dtype=p.dtype)
    a, b, taps_h, taps_w = _tma_taps(p, cfg, ctx)
    n, u_h, u_w = ctx.m0 // (uh * uw), (ctx.m0 % (uh * uw)) // uw, ctx.m0 % uw
    chunks = p.K // ROW  # channel slices per sub-filter tap
    # the class's taps j < J_a are the last J_a of q = J - 1 - j; a class without taps runs no slice (max: no
    # division by 0 in the copies' coordinates, which are not issued then)
    span = Call("max", (Const(1), taps_w))
    q0_h, q0_w = jh - taps_h, jw - taps_w

    def taps(kt):  # the slice's (q_h, q_w) = (J - 1 - j) per dim, and its first channel
        tap = kt // chunks
        return q0_h + tap // span, q0_w + tap % span, (kt % chunks) * ROW

    def a_box(kt, part=0):
        qh, qw, k0 = taps(kt)
        return (k0, u_w - (jw - 1), u_h - (jh - 1), n), (b[2] + qw, b[1] + qh)

    def w_tap(kt):  # the slice's tap of w, a + j s per dim (w, h), and its first channel
        qh, qw, k0 = taps(kt)
        return a[2] + ((jw - 1) - qw) * sw, a[1] + ((jh - 1) - qh) * sh, k0

    if cfg.b_mn:  # w as stored, read MN-major (TileConfig.b_mn): a tap the sub-filter lacks lies past the filter
        return b_mn_operands(p, cfg, a_map, a_box, lambda kt: (ctx.n0, *w_tap(kt)))
    b_map = TensorMap("w_map", "w", "tiled", (p.K, tw, th, p.C), (e * p.K, e * p.K * tw, e * p.K * tw * th),
                      (ROW, 1, 1, cfg.BN), swizzle=128, rounding=rounding, flip=(p.K, th * tw, p.C), dtype=p.dtype)

    def b_box(kt, part):  # the flipped copy's tap T - 1 - (a + j s), below 0 where the sub-filter lacks one
        t_w, t_h, k0 = w_tap(kt)
        return (k0, (tw - 1) - t_w, (th - 1) - t_h, ctx.n0), ()
    return TmaOperands(a_map, b_map, a_box, b_box)


def trim_ok(p, cfg: TileConfig):
    """KS-deconv-V2's schedule: block rows share one class position, slices do not straddle taps."""
    return p.N % cfg.BM == 0 and p.Kg % cfg.BK == 0 and cfg.split_k == 1 and cfg.stages == 1


def ks_v2_view(p, cfg: TileConfig) -> GemmView:
    if not trim_ok(p, cfg):
        raise ValueError(f"config must have N % BM == 0, K/groups % BK == 0, split_k = stages = 1 for "
                         f"KS-deconv-V2 (N={p.N}, K/groups={p.Kg}), got {cfg}")
    st, T, I, O = p.stride, p.filter_size, p.in_size, p.out_size
    U = [_cdiv(I[ax], st[ax]) for ax in range(3)]
    classes, TRS = _prod(st), _prod(T)
    M, Ng, Kr = p.N * _prod(U), p.Cg, _prod([_cdiv(T[ax], st[ax]) for ax in range(3)]) * p.Kg
    per_tap = p.Kg // cfg.BK
    split_class = _class_split(p)

    def window(ctx):
        """The block's class, dy anchor b_a + u (dy position of j = 0) and trimmed sub-filter range."""
        _, a, i0, b = split_class(ctx.g)
        pos, u = ctx.m0 // p.N, []
        for size in reversed(U):
            u.append(pos % size)
            pos = pos // size
        u = u[::-1]
        anchor = [b[ax] + u[ax] for ax in range(3)]
        lo, cnt = [], []
        for ax in range(3):
            l = Call("max", (Const(0), anchor[ax] - (O[ax] - 1)))
            h = Call("min", (Const(0) - (Const(0) - (T[ax] - a[ax])) // st[ax], anchor[ax] + 1))  # J_a
            n = Call("max", (Const(0), h - l))
            if I[ax] % st[ax]:  # this class may have fewer positions than the largest one
                n = select(u[ax] < (I[ax] - i0[ax] + st[ax] - 1) // st[ax], n, Const(0))
            lo.append(l), cnt.append(n)
        return a, anchor, lo, cnt

    def taps(kt, ctx):
        a, anchor, lo, cnt = window(ctx)
        j, rest = [], kt // per_tap
        for ax in (2, 1, 0):
            j.append(lo[ax] + rest % cnt[ax])
            rest = rest // cnt[ax]
        j = j[::-1]
        return anchor, j, [a[ax] + j[ax] * st[ax] for ax in range(3)], (kt % per_tap) * cfg.BK

    def k_tiles(ctx):
        _, _, _, cnt = window(ctx)
        return cnt[0] * cnt[1] * cnt[2] * per_tap

    def a_inv(m, g):
        return {"base": (m % p.N) * _prod(O) * p.K + (g // classes) * p.Kg}

    def a_elem(inv, kk, kt, col, ctx):
        anchor, j, _, k0 = taps(kt, ctx)
        o = [anchor[ax] - j[ax] for ax in range(3)]
        return Const(True), Load("dy", (inv["base"] + _flatten(o, O) * p.K + k0 + col,))

    def b_inv(n, g):
        return {"col": (g // classes) * p.Kg * TRS * p.Cg + n}

    def b_elem(inv, kk, kt, row, ctx):
        _, _, t, k0 = taps(kt, ctx)
        return Const(True), Load("w", (inv["col"] + ((k0 + row) * TRS + _flatten(t, T)) * p.Cg,))

    def store(m, n, g, value, split):
        grp, _, i0, _ = split_class(g)
        u = _unflatten(m // p.N, tuple(U))
        i = [i0[ax] + u[ax] * st[ax] for ax in range(3)]
        ok = all_of([i[ax] < I[ax] for ax in range(3) if I[ax] % st[ax]])
        off = ((m % p.N) * _prod(I) + _flatten(i, I)) * p.C + grp * p.Cg + n
        return [If(ok, (Store("dx", (off,), value, "atomic" if split is not None else False),))]

    params = (Buffer("dy", (p.N * _prod(O) * p.K,), p.dtype), Buffer("w", (p.K * TRS * p.Cg,), p.dtype),
              Buffer("dx", (p.N * _prod(I) * p.C,), p.dtype, role="out"))
    return GemmView(M, Ng, Kr, p.groups * classes, Operand("k", a_inv, a_elem, context=True),
                    Operand("mn", b_inv, b_elem, context=True), store, params, p.dtype,
                    doc=f"KS-deconv-V2 backward-data: {classes} trimmed stride-1 classes of dx[{p.N * _prod(I)} x {p.C}]",
                    k_tiles=k_tiles)


def trimmed(p, cfg):
    return settings.get("ks_deconv_trim") and trim_ok(p, cfg)


def build(p, cfg: TileConfig):
    view, name = (ks_v2_view(p, cfg), f"conv_{p.direction}_ks_v2") if trimmed(p, cfg) else \
        (ks_view(p, cfg), f"conv_{p.direction}_ks")
    k = tiled_gemm(name, view, cfg)
    return k.__class__(k.name, k.params, k.locals, k.body, k.grid, k.threads,
                       {**k.meta, "problem": p.key(), "template": NAME, "trimmed": trimmed(p, cfg)})


VARIANT = TiledGemmVariant(NAME, DIRECTIONS, applies, build)
