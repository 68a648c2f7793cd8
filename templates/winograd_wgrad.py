"""Winograd backward-weight: 1D Winograd F(S, n) along the output width, the weight gradient as alpha GEMMs.

For one filter row (t, r) the weight gradient is a correlation along the width of dy (n taps a tile) with x:

    dw[k, t, r, s, c] = sum over tiles of  sum_{j < n} dy[tile, w0 + j, k] * x[tile @ (t, r), w0 + j + s - pw, c]

which F(S, n) computes from alpha = S + n - 1 products per (tile, k, c) instead of S n:

    U[a][tile, k] = (G dy[tile, :, k])[a]        n dy items of the tile's output row, a width tile of n
    V[a][tile, c] = (BT x[window, c])[a]         the alpha x items its S taps read
    M[a][k, c]    = sum over tiles of U[a][tile, k] V[a][tile, c]       (alpha GEMMs sharing the reduction)
    dw[k, t, r, s, c] = sum_a AT[s][a] M[a][k, c]                        (once, in the epilogue)

with (AT, G, BT) = winograd_matrices(S, n) - the forward's F(n, S) with the roles of filter and data exchanged, as
cuDNN's Winograd backward-filter does.  3x3 at 8 states: n = 6, 18 multiplies per tile become 8 (2.25x fewer).

The block owns BM output channels x BN input channels of one filter row (t, r) (the grid's z axis, with the group
and the split-K index); each reduction step gathers BK tiles, transforms them into shared U[alpha][BK][BM] and
V[alpha][BK][BN], and its threads add alpha x TM x TN register products - winograd_tiled's forward schedule with
(tiles, k) -> (k, c) and (filter rows, channels) -> tiles.  Stride 1, any dilation; float32 / float64 arrays; the
reduction split over split_k blocks that add into a zeroed dw.  Not among the variants the chain ranks
(templates.OPT_IN_VARIANTS: the performance model leaves its records out); the planner takes it by its own rule
(suits; kernelgen.planner._winograd_wgrad_choice), a tune times it where that rule would
(tuner.winograd_wgrad_candidates), and algo="winograd_wgrad" forces it.
"""
from __future__ import annotations

from collections import namedtuple

from kernelgen.ir import Barrier, Buffer, Comment, Const, For, If, Kernel, Var, all_of, select
from kernelgen.target import STATIC_SHARED_BYTES, Target, as_target
from kernelgen.templates.config import TileConfig
from kernelgen.templates.gemm_schedule import _cdiv
from kernelgen.templates.tile_space import fill_split
from kernelgen.templates.winograd_tiled import _assign, _combo, _guarded, _load, _store, _transform, _unroll
from kernelgen.templates.winograd_transforms import STATES, winograd_matrices

NAME = "winograd_wgrad"
DIRECTIONS = ("bwd_weight",)
DTYPES = ("float32", "float64")

_TID, _E, _A, _I, _J = (Var(nm) for nm in ("tid", "e", "a", "i", "j"))
# U, V in shared memory; the accumulators, fragments and one pair's staged items in registers
_Buffers = namedtuple("_Buffers", "U V acc uf vf gy dx")
Geometry = namedtuple("Geometry", "p cfg alpha n matrices TW tiles nsteps per_split EU EV buf dil NT")


def unmet(p, cfg: TileConfig | None = None):
    """What this template needs that problem p (and cfg, when given) lacks: an empty list where it builds."""
    why = [w for bad, w in ((p.direction != "bwd_weight", "a backward-weight problem"),
                            (any(s != 1 for s in p.stride), "stride 1"),
                            (p.dtype not in DTYPES, "float32 or float64 arrays"),
                            (not 2 <= p.filter_size[2] <= 9, "a filter 2-9 wide")) if bad]
    if cfg is not None and not why:
        alpha = states_of(p, cfg)
        if alpha not in STATES or alpha - p.filter_size[2] + 1 < 2:
            why.append(f"states 4, 8 or 16 giving 2 or more dy items a tile (filter width {p.filter_size[2]})")
        if cfg.tensor_core or cfg.state_groups != 1 or cfg.stages != 1 or cfg.col2im or cfg.tma:
            why.append("an fp32 register tile, one stage, one state group")
        elif cfg.BM % cfg.TM or cfg.BN % cfg.TN or not 1 <= cfg.threads <= 1024:
            why.append("BM a multiple of TM, BN of TN, 1-1024 threads")
        elif shared_bytes(cfg, alpha or 4, 8 if p.dtype == "float64" else 4) > STATIC_SHARED_BYTES:
            why.append(f"shared U and V within {STATIC_SHARED_BYTES} bytes")
    return why


# The planner's rule (suits), from one H200 run of both tables (2026-11-28_h200_winograd_wgrad_vs_plan_*, default tile
# against the planned or tuned GEMM, same process): it ran 1.2-1.8x faster than gpu_md's tuned entries where the
# output width fills its width tiles (14 of 18 columns or more) or is dilated, and tied (0.97-0.99) at widths 4-8;
# then, held out, every unseen row the rule takes ran faster (1.06-3.5x: VGG, U-Net, DeepLab's dilated layer4, 1-D
# and (2+1)-D rows).  Fewer than 16 channels or filters a group (first layers, narrow groups: 0.01-0.36x) leave the
# 64 x 32 tile mostly idle.
MIN_CHANNELS, MIN_WIDTH_FILL = 16, 0.75


def suits(p) -> bool:
    """Is p a problem the planner's rule takes this template for?  (The rule's other conditions - a GPU, fp32, no
    tune that timed the template on p - are the planner's checks: planner._winograd_wgrad_choice.)"""
    if p.dtype != "float32" or min(p.Cg, p.Kg) < MIN_CHANNELS or unmet(p, TileConfig(**CUDA_DEFAULT_TILE)):
        return False  # (the default tile at 16 states, filters 8-9 wide, outgrows static shared memory)
    n = default_states(p.filter_size[2]) - p.filter_size[2] + 1
    return p.dilation[2] > 1 or p.out_size[2] >= MIN_WIDTH_FILL * width_tiles(p, n)[0] * n


def default_states(S):
    """8 states (n = 9 - S dy items a tile) up to a 7-wide filter, else 16."""
    return 8 if S <= 7 else 16


def states_of(p, cfg):
    return cfg.states or default_states(p.filter_size[2])


def shared_bytes(cfg, alpha, itemsize=4):
    return itemsize * alpha * cfg.BK * (cfg.BM + cfg.BN + 2 * cfg.smem_pad)


def width_tiles(p, n):
    """(width tiles a dy row, tiles in all): n output columns a tile; a width dilated dil times is dil interleaved
    correlations, each tiled on its own (a tile's items dil apart: _tile)."""
    dil = p.dilation[2]
    TW = dil * _cdiv(_cdiv(p.out_size[2], dil), n)
    return TW, p.N * p.out_size[0] * p.out_size[1] * TW


def _geometry(p, cfg: TileConfig) -> Geometry:
    why = unmet(p, cfg)
    if why:
        raise ValueError(f"config: {NAME} needs {', '.join(why)}; got {p.key()} with {cfg}")
    S = p.filter_size[2]
    alpha = states_of(p, cfg)
    n = alpha - S + 1
    TW, tiles = width_tiles(p, n)
    nsteps = _cdiv(tiles, cfg.BK)
    NT, pad, dt = cfg.threads, cfg.smem_pad, p.dtype
    reg = lambda name, shape: Buffer(name, shape, dt, "register")
    buf = _Buffers(Buffer("U", (alpha, cfg.BK, cfg.BM + pad), dt, "shared"),
                   Buffer("V", (alpha, cfg.BK, cfg.BN + pad), dt, "shared"),
                   reg("acc", (alpha, cfg.TM, cfg.TN)), reg("uf", (cfg.TM,)), reg("vf", (cfg.TN,)),
                   reg("gy", (n,)), reg("dx", (alpha,)))
    return Geometry(p, cfg, alpha, n, winograd_matrices(S, n), TW, tiles, nsteps, _cdiv(nsteps, cfg.split_k),
                    _cdiv(cfg.BK * cfg.BM, NT), _cdiv(cfg.BK * cfg.BN, NT), buf, p.dilation[2], NT)


def _tile(g: Geometry, kk):
    """(image, out-depth, out-row, first output column, in range) of reduction tile ks * BK + kk.  Along a width
    dilated dil times, a tile's n output columns (and the x items its taps read) are dil apart: width tile tw is
    residue tw % dil, n columns from (tw // dil) * n of that residue's."""
    p = g.p
    OD, OH, _ = p.out_size
    tile = Var("ks") * g.cfg.BK + kk
    tw, rest = tile % g.TW, tile // g.TW
    oh, rest = rest % OH, rest // OH
    od, nb = rest % OD, rest // OD
    w0 = tw * g.n if g.dil == 1 else tw % g.dil + (tw // g.dil) * (g.n * g.dil)
    return nb, od, oh, w0, tile < g.tiles


def _u_pair(g: Geometry, e):
    """(tile kk, output channel m, in block) of this thread's dy pair e: channels fastest (dy's contiguous axis)."""
    idx = _TID + e * g.cfg.threads
    return idx // g.cfg.BM, idx % g.cfg.BM, idx < g.cfg.BK * g.cfg.BM


def _v_pair(g: Geometry, e):
    idx = _TID + e * g.cfg.threads
    return idx // g.cfg.BN, idx % g.cfg.BN, idx < g.cfg.BK * g.cfg.BN


def _stage_u(g: Geometry):
    """U[a][kk][m] = (G dy items)[a]: the n dy items of pair e's tile row at its output channel."""
    p, cfg, buf = g.p, g.cfg, g.buf
    _, OH, OW = p.out_size
    kk, m, in_block = _u_pair(g, _E)
    nb, od, oh, w0, live = _tile(g, kk)
    k = Var("gk") * p.Kg + Var("bm") * cfg.BM + m
    ok = [live] + ([Var("bm") * cfg.BM + m < p.Kg] if p.Kg % cfg.BM else [])
    row = ((nb * p.out_size[0] + od) * OH + oh) * OW
    items = []
    for j in range(g.n):
        w = w0 + j * g.dil
        inside = ok + ([w < OW] if OW % g.n or g.dil > 1 else [])
        items.append(buf.gy.store(j, _select(inside, _load("dy", (row + w) * p.K + k))))
    pre, values = _transform(g.matrices[1], [buf.gy[j] for j in range(g.n)], "g")
    body = items + pre + [buf.U.store((a, kk, m), values[a]) for a in range(g.alpha)]
    return _unroll("e", g.EU, _guarded(g, body, in_block, cfg.BK * cfg.BM))


def _stage_v(g: Geometry):
    """V[a][kk][c] = (BT x items)[a]: the alpha x items pair e's tile reads at filter row (t, r), channel c."""
    p, cfg, buf = g.p, g.cfg, g.buf
    ID, IH, IW = p.in_size
    pd, ph, pw = p.padding
    kk, cn, in_block = _v_pair(g, _E)
    nb, od, oh, w0, live = _tile(g, kk)
    c = Var("bn") * cfg.BN + cn
    d, h = od + Var("t") * p.dilation[0] - pd, oh + Var("r") * p.dilation[1] - ph
    ok = [live] + ([c < p.Cg] if p.Cg % cfg.BN else []) + ([d >= 0, d < ID] if pd else []) + \
        ([h >= 0, h < IH] if ph else [])
    row = ((nb * ID + d) * IH + h) * IW
    chan = Var("gk") * p.Cg + c
    last = (g.TW - 1) % g.dil + ((g.TW - 1) // g.dil * g.n + g.alpha - 1) * g.dil - pw  # the last window's end
    items = []
    for i in range(g.alpha):
        w = w0 + (i * g.dil - pw)
        inside = ok + ([w >= 0] if i * g.dil < pw else []) + ([w < IW] if last > IW - 1 else [])
        items.append(buf.dx.store(i, _select(inside, _load("x", (row + w) * p.C + chan))))
    pre, values = _transform(g.matrices[2], [buf.dx[i] for i in range(g.alpha)], "bt")
    body = items + pre + [buf.V.store((a, kk, cn), values[a]) for a in range(g.alpha)]
    return _unroll("e", g.EV, _guarded(g, body, in_block, cfg.BK * cfg.BN))


def _select(conds, value):
    return select(all_of(conds), value, Const(0.0)) if conds else value


def _products(g: Geometry):
    cfg, buf = g.cfg, g.buf
    ty, tx, kc = Var("ty"), Var("tx"), Var("kc")
    return [_unroll("kc", cfg.BK, [_unroll("a", g.alpha, [
        _unroll("i", cfg.TM, [buf.uf.store(_I, buf.U[_A, kc, ty * cfg.TM + _I])]),
        _unroll("j", cfg.TN, [buf.vf.store(_J, buf.V[_A, kc, tx * cfg.TN + _J])]),
        _unroll("i", cfg.TM, [_unroll("j", cfg.TN, [buf.acc.store((_A, _I, _J), buf.uf[_I] * buf.vf[_J],
                                                                accumulate=True)])])])])]


def _epilogue(g: Geometry):
    """dw[k, t, r, s, c] = sum_a AT[s][a] acc[a] for the thread's TM x TN (k, c), atomically where split."""
    p, cfg, buf = g.p, g.cfg, g.buf
    T, R, S = p.filter_size
    k = Var("bm") * cfg.BM + Var("ty") * cfg.TM + _I
    c = Var("bn") * cfg.BN + Var("tx") * cfg.TN + _J
    guard = ([k < p.Kg] if p.Kg % cfg.BM else []) + ([c < p.Cg] if p.Cg % cfg.BN else [])
    stores = []
    for s in range(S):
        value = _combo(g.matrices[0][s], [buf.acc[a, _I, _J] for a in range(g.alpha)])
        at = ((((Var("gk") * p.Kg + k) * T + Var("t")) * R + Var("r")) * S + s) * p.Cg + c
        stores.append(_store("dw", at, value, "atomic" if cfg.split_k > 1 else False))
    stores = [If(all_of(guard), tuple(stores))] if guard else stores
    return [_unroll("i", cfg.TM, [_unroll("j", cfg.TN, stores)])]


def build(p, cfg: TileConfig) -> Kernel:
    g = _geometry(p, cfg)
    T, R, S = p.filter_size
    NT, SK, buf = cfg.threads, cfg.split_k, g.buf
    per_thread = [_assign("ty", _TID // (cfg.BN // cfg.TN)), _assign("tx", _TID % (cfg.BN // cfg.TN))]
    bz = Var("bz")  # (group, t, r, split), split fastest
    where = [_assign("sk", bz % SK), _assign("r", (bz // SK) % R), _assign("t", (bz // (SK * R)) % T),
             _assign("gk", bz // (SK * R * T))]
    zero = [_unroll("a", g.alpha, [_unroll("i", cfg.TM, [_unroll("j", cfg.TN, [buf.acc.store((_A, _I, _J),
                                                                                           Const(0.0))])])])]
    step = (For("tid", NT, tuple(where + [Comment(f"U = G dy ({g.n} items), V = BT x ({g.alpha} items) per "
                                                   f"(tile, channel)"), _stage_u(g), _stage_v(g)]), "thread"),
            Barrier(), For("tid", NT, tuple(per_thread + _products(g)), "thread"), Barrier())
    kloop = For("ks", g.per_split, step, "serial", start=Var("sk") * g.per_split if SK > 1 else 0)
    block = (For("tid", NT, tuple(where + zero), "thread"), kloop,
             For("tid", NT, tuple(where + per_thread + _epilogue(g)), "thread"))
    grid = (_cdiv(p.Kg, cfg.BM), _cdiv(p.Cg, cfg.BN), p.groups * T * R * SK)
    body = (For("bm", grid[0], (For("bn", grid[1], (For("bz", grid[2], block, "grid", axis=2),), "grid", axis=1),),
                "grid", axis=0),)
    ID, IH, IW = p.in_size
    params = (Buffer("x", (p.N * ID * IH * IW * p.C,), p.dtype),
              Buffer("dy", (p.N * p.out_size[0] * p.out_size[1] * p.out_size[2] * p.K,), p.dtype),
              Buffer("dw", (p.K * T * R * S * p.Cg,), p.dtype, role="out"))
    locals_ = (buf.U, buf.V, buf.acc, buf.uf, buf.vf, buf.gy, buf.dx)
    meta = {"doc": f"winograd backward-weight F({S},{g.n}), {g.alpha} states: {g.alpha} GEMMs [{p.Kg} x {p.Cg}] "
                   f"per filter row, reduced over {g.tiles} tiles of {g.n} output columns",
            "config": str(cfg), "zero_output": SK > 1, "problem": p.key(), "template": NAME,
            "work": p.Kg * p.Cg * p.groups * T * R * S * p.N * p.out_size[0] * p.out_size[1] * p.out_size[2],
            "gemm_macs": g.alpha * g.tiles * p.Kg * p.Cg * p.groups * T * R,
            "launch_bounds": (NT, max(1, min(2, 65536 // (128 * NT))))}
    return Kernel(f"winograd_bwd_weight_a{g.alpha}_s{S}", params, locals_, body, grid, NT, meta)


# --- the Variant --------------------------------------------------------------------------------------------------

CUDA_DEFAULT_TILE = dict(BM=64, BN=32, BK=8, TM=4, TN=2, smem_pad=4)  # alpha 8: 64 accumulators, 256 threads
CPU_TILE = dict(BM=8, BN=8, BK=4, TM=2, TN=2)


def split_for(p, cfg: TileConfig, target: Target) -> int:
    """The split_k that gives the grid up to four blocks a SM (two resident at 128 registers: two waves), each
    split keeping 8 or more steps (1 to 64)."""
    blocks = _cdiv(p.Kg, cfg.BM) * _cdiv(p.Cg, cfg.BN) * p.groups * p.filter_size[0] * p.filter_size[1]
    _, tiles = width_tiles(p, states_of(p, cfg) - p.filter_size[2] + 1)
    return fill_split(blocks, _cdiv(tiles, cfg.BK), target, 4, 64)


class WinogradWgrad:
    """The Variant (templates.variant) of this module; an opt-in one (templates.OPT_IN_VARIANTS)."""
    name = NAME
    directions = DIRECTIONS
    precisions = ("fp32",)

    def applies(self, problem, precision="fp32") -> bool:
        return precision == "fp32" and not unmet(problem)

    def accepts(self, problem, config, precision="fp32") -> bool:
        return precision == "fp32" and isinstance(config, TileConfig) and not unmet(problem, config)

    def build(self, problem, config, precision="fp32") -> Kernel:
        if precision != "fp32":
            raise ValueError(f"precision: {NAME} computes in fp32, got {precision!r}")
        return build(problem, config)

    def config_space(self, problem, target: Target, precision="fp32", *, keep=None, tiles=None) -> list:
        """The default tile at 4 / 8 states (16 for wide filters) and its splits around split_for's."""
        out = []
        for alpha in (4, 8, 16):
            base = TileConfig(**CUDA_DEFAULT_TILE, states=alpha)
            if unmet(problem, base):
                continue
            best = split_for(problem, base, target)
            for split in sorted({max(1, best // 2), best, best * 2}):
                out.append(TileConfig(**CUDA_DEFAULT_TILE, states=alpha, split_k=split))
        return out[:keep or None]

    def default_config(self, problem, target: Target, precision="fp32") -> TileConfig:
        target = as_target(target)
        if target.backend != "cuda":
            return TileConfig(**CPU_TILE)
        base = TileConfig(**CUDA_DEFAULT_TILE)
        return TileConfig(**CUDA_DEFAULT_TILE, split_k=split_for(problem, base, target))

    def key_extra(self, problem):
        return None


VARIANT = WinogradWgrad()
