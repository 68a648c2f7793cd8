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
"""
from __future__ import annotations

from ..ir import Buffer, If, Load, Store, all_of

from .config import TileConfig
from .implicit_gemm import _flatten, _prod, _unflatten, reduction_split
from .tiled_gemm import GemmView, Operand, _cdiv, tiled_gemm

NAME = "ks_deconv"
DIRECTIONS = ("bwd_data",)



def applies(p):
    return p.direction == "bwd_data" and any(s > 1 for s in p.stride) and all(d == 1 for d in p.dilation)


def ks_view(p, cfg: TileConfig) -> GemmView:
    st, T, I, O = p.stride, p.filter_size, p.in_size, p.out_size
    U = [_cdiv(I[ax], st[ax]) for ax in range(3)]   # positions per class, the largest class
    J = [_cdiv(T[ax], st[ax]) for ax in range(3)]   # taps per sub-filter, the largest sub-filter
    classes = _prod(st)
    M, Ng, Kr = p.N * _prod(U), p.Cg, _prod(J) * p.Kg
    TRS = _prod(T)

    def split_class(g):
        """grid-z index -> (group, class coordinates a, first position i0, dy offset b), per dim."""
        a = _unflatten(g % classes, st)
        i0 = [(a[ax] - p.padding[ax]) % st[ax] for ax in range(3)]
        b = [(i0[ax] + p.padding[ax]) // st[ax] for ax in range(3)]
        return g // classes, a, i0, b

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

    def store(m, n, g, value, atomic):
        grp, _, i0, _ = split_class(g)
        nb, *u = _unflatten(m, (p.N,) + tuple(U))
        i = [i0[ax] + u[ax] * st[ax] for ax in range(3)]
        ok = all_of([u[ax] < class_size(i0[ax], ax) for ax in range(3) if I[ax] % st[ax]])
        off = (nb * _prod(I) + _flatten(i, I)) * p.C + grp * p.Cg + n
        return [If(ok, (Store("dx", (off,), value, "atomic" if atomic else False),))]

    params = (Buffer("dy", (p.N * _prod(O) * p.K,), p.dtype), Buffer("w", (p.K * TRS * p.Cg,), p.dtype),
              Buffer("dx", (p.N * _prod(I) * p.C,), p.dtype, role="out"))
    return GemmView(M, Ng, Kr, p.groups * classes, Operand("k", a_inv, a_elem, context=True),
                    Operand("mn", b_inv, b_elem, context=True), store, params, p.dtype,
                    doc=f"KS-deconv backward-data: {classes} stride-1 classes of dx[{p.N * _prod(I)} x {p.C}]")


def build(p, cfg: TileConfig):
    k = tiled_gemm(f"conv_{p.direction}_ks", ks_view(p, cfg), cfg)
    return k.__class__(k.name, k.params, k.locals, k.body, k.grid, k.threads,
                       {**k.meta, "problem": p.key(), "template": NAME})
