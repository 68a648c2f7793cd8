"""The variant library: each module builds a Kernel from (ConvProblem, TileConfig).

A variant module exposes NAME, DIRECTIONS, applies(problem) -> bool and build(problem, config).
"""
from __future__ import annotations

from . import conv_v2, implicit_gemm, implicit_gemm_tc, ks_deconv, sk_dilated, winograd
import math

from .config import CPU_DEFAULT, CUDA_DEFAULT, TileConfig  # noqa: F401 (CUDA_DEFAULT re-exported)
from .tiled_gemm import _cdiv

# preference order for the automatic choice; conv_v2 runs where forced or where the tuner picked it
VARIANTS = {m.NAME: m for m in (ks_deconv, implicit_gemm, conv_v2, sk_dilated, winograd)}


# variants that compute in a reduced precision: never candidates, only planned for precision="tf32"
TENSOR_CORE_VARIANTS = {implicit_gemm_tc.NAME: implicit_gemm_tc}


def get_variant(name):
    if not isinstance(name, str):
        raise TypeError(f"algo must be None or one of {sorted(VARIANTS)}, got {name!r}")
    try:
        return VARIANTS[name] if name in VARIANTS else TENSOR_CORE_VARIANTS[name]
    except KeyError:
        raise ValueError(f"algo must be None or one of {sorted(VARIANTS)}, got {name!r}") from None


def computes(variant, problem):
    """Can the variant module compute this problem (its direction, and its applies())?"""
    return problem.direction in variant.DIRECTIONS and variant.applies(problem)


def candidates(problem):
    """Variants that can compute this problem, in preference order."""
    return [m for m in VARIANTS.values() if computes(m, problem)]


# Relative per-FLOP efficiency and resident blocks per SM of each CUDA tile (H100 measurements,
# BENCHMARKS.md run 2): the inputs of the cost model used when the tuned database has nothing.
CUDA_TILES = {  # (BM, BN, BK, TM, TN): (efficiency, blocks per SM)
    (128, 64, 8, 8, 4): (1.0, 2), (64, 64, 8, 4, 4): (0.85, 3), (128, 32, 8, 8, 2): (0.65, 2),
    (128, 128, 8, 8, 8): (0.88, 1), (64, 128, 8, 4, 8): (0.85, 2), (256, 64, 8, 8, 4): (0.88, 1),
    # narrow tiles for GEMMs with a handful of columns (3-channel backward-data); not yet measured
    (256, 16, 8, 8, 2): (0.6, 2), (256, 8, 8, 8, 2): (0.45, 3),
    # a short tile, so that ConvV2 (whose blocks must not straddle a batch of N rows) runs at N = 32
    (32, 64, 8, 4, 4): (0.7, 4),
}
SM_COUNT = 132
# Schedule knobs on top of the tile, best first: padded shared rows (conflict-free transposed store)
# with the 2-stage register-prefetch pipeline won 27 of 33 problems of the full ResNet-18 tune, 1.10x
# geo-mean over the plain schedule on the same tiles (PERF_NOTES.md #13).
CUDA_SCHEDULES = (dict(smem_pad=4, stages=2), dict(smem_pad=4), {})



def gemm_shape(problem):
    """(M, N, K, groups) of the implicit GEMM a problem maps to."""
    taps = 1
    for f in problem.filter_size:
        taps *= f
    outs = problem.N * math.prod(problem.out_size)
    if problem.direction == "fwd":
        return outs, problem.Kg, taps * problem.Cg, problem.groups
    if problem.direction == "bwd_data":
        return problem.N * math.prod(problem.in_size), problem.Cg, taps * problem.Kg, problem.groups
    return problem.Kg, taps * problem.Cg, outs, problem.groups


def estimated_cost(problem, tile, split_k=1):
    """Model time of a tile on the problem: the blocks one SM runs x padded work per block, over the
    tile's efficiency and how well the blocks resident together hide latency."""
    (bm, bn, bk, _, _), (eff, per_sm) = tile, CUDA_TILES[tile]
    M, N, K, G = gemm_shape(problem)
    blocks = _cdiv(M, bm) * _cdiv(N, bn) * G * split_k
    per_sm_run = _cdiv(blocks, SM_COUNT)
    hiding = {1: 0.8, 2: 1.0}.get(min(per_sm_run, per_sm), 1.05)
    return per_sm_run * bm * bn * _cdiv(_cdiv(K, bk), split_k) * bk / (eff * hiding)


def split_for(problem, tile):
    """Enough reduction splits that the grid fills about two waves (backward-weight's small output)."""
    if problem.direction != "bwd_weight":
        return 1
    M, N, K, G = gemm_shape(problem)
    blocks = _cdiv(M, tile[0]) * _cdiv(N, tile[1]) * G
    return max(1, min(128, _cdiv(K, tile[2]) // 8, _cdiv(2 * SM_COUNT, blocks)))


def config_ok(variant, problem, cfg):
    check = getattr(variant, "config_ok", None)
    return check is None or check(problem, cfg)


def default_config(problem, backend, variant=None) -> TileConfig:
    """Heuristic schedule when no tuned entry exists: the CPU default (shrunk until the variant
    accepts it), or the cheapest CUDA tile under the cost model above that the variant accepts.
    A variant with its own schedule space (Winograd: state counts, tiles sized by alpha) decides."""
    own = getattr(variant, "default_config", None)
    if own is not None:
        return own(problem, backend)
    if backend != "cuda":
        for bm in (32, 16, 8, 4, 2, 1):
            for bk in (8, 4, 2, 1):
                cfg = TileConfig(bm, CPU_DEFAULT.BN, bk, min(bm, CPU_DEFAULT.TM), CPU_DEFAULT.TN)
                if config_ok(variant, problem, cfg):
                    return cfg
        raise ValueError(f"no CPU schedule fits variant {variant.NAME} on {problem.key()}")
    tiles = [t for t in CUDA_TILES if config_ok(variant, problem, TileConfig(*t, split_k=split_for(problem, t)))]
    if tiles:
        best = min(tiles, key=lambda t: estimated_cost(problem, t, split_for(problem, t)))
        for schedule in CUDA_SCHEDULES:
            cfg = TileConfig(*best, split_k=split_for(problem, best), **schedule)
            if config_ok(variant, problem, cfg):
                return cfg
    for bk in (8, 4, 2, 1):  # variants with their own constraints (ConvV2: no split-K, BK | C/groups)
        fitting = [t for t in CUDA_TILES if config_ok(variant, problem, TileConfig(t[0], t[1], bk, t[3], t[4]))]
        if fitting:
            best = min(fitting, key=lambda t: estimated_cost(problem, t))
            return TileConfig(best[0], best[1], bk, best[3], best[4])
    for bm in (16, 8, 4, 2, 1):  # row-count constraints (ConvV2: BM | N) that no listed tile meets
        for bk in (8, 4, 2, 1):
            cfg = TileConfig(bm, 64, bk, min(bm, 4), 4)
            if config_ok(variant, problem, cfg):
                return cfg
    raise ValueError(f"no CUDA tile fits variant {variant.NAME} on {problem.key()}")
