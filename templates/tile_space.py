"""The fp32 register-tile schedule space of the GEMM-shaped variants (implicit_gemm, ks_deconv, conv_v2,
sk_dilated): the tiles the cost model knows, the model itself, the tuner's candidates, and `TiledGemmVariant`,
the Variant those four are.  Every limit and wave count is the Target's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from kernelgen.ir import Kernel
from kernelgen.problem import ConvProblem
from kernelgen.target import Target

from .config import TileConfig, cpu_base_tile
from .tiled_gemm import _cdiv

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
# Schedule knobs on top of the tile, best first: padded shared rows (conflict-free transposed store)
# with the 2-stage register-prefetch pipeline won 27 of 33 problems of the full ResNet-18 tune, 1.10x
# geo-mean over the plain schedule on the same tiles (PERF_NOTES.md #13).
CUDA_SCHEDULES = (dict(smem_pad=4, stages=2), dict(smem_pad=4), {})

# Block shapes a tune tries (BM, BN, BK, TM, TN); pipelining and split-K are layered on top.
TILES = [(128, 64, 8, 8, 4), (128, 128, 8, 8, 8), (64, 64, 8, 4, 4), (128, 32, 8, 8, 2), (64, 128, 8, 4, 8),
         (256, 64, 8, 8, 4)]
WIDE_TILES = TILES + [(64, 32, 8, 4, 4), (128, 64, 16, 8, 4), (32, 64, 8, 4, 4), (256, 32, 8, 8, 4)]
# shared-row padding: 0, or 4 floats, which spreads the transposed tile store over all 32 banks and
# keeps rows 16-byte aligned for the vectorised fragment loads
SMEM_PADS = (0, 4)


def gemm_shape(problem):
    """(M, N, K, groups) of the implicit GEMM a problem maps to."""
    taps = math.prod(problem.filter_size)
    outs = problem.N * math.prod(problem.out_size)
    if problem.direction == "fwd":
        return outs, problem.Kg, taps * problem.Cg, problem.groups
    if problem.direction == "bwd_data":
        return problem.N * math.prod(problem.in_size), problem.Cg, taps * problem.Kg, problem.groups
    return problem.Kg, taps * problem.Cg, outs, problem.groups


def estimated_cost(problem, tile, target: Target, split_k=1):
    """Model time of a tile on the problem: the blocks one SM runs x padded work per block, over the
    tile's efficiency and how well the blocks resident together hide latency."""
    (bm, bn, bk, _, _), (eff, per_sm) = tile, CUDA_TILES[tile]
    M, N, K, G = gemm_shape(problem)
    blocks = _cdiv(M, bm) * _cdiv(N, bn) * G * split_k
    per_sm_run = _cdiv(blocks, target.sm_count)
    hiding = {1: 0.8, 2: 1.0}.get(min(per_sm_run, per_sm), 1.05)
    return per_sm_run * bm * bn * _cdiv(_cdiv(K, bk), split_k) * bk / (eff * hiding)


def split_for(problem, tile, target: Target):
    """Enough reduction splits that the grid fills about two waves (backward-weight's small output)."""
    if problem.direction != "bwd_weight":
        return 1
    M, N, K, G = gemm_shape(problem)
    blocks = _cdiv(M, tile[0]) * _cdiv(N, tile[1]) * G
    return max(1, min(128, _cdiv(K, tile[2]) // 8, _cdiv(2 * target.sm_count, blocks)))


def default_tile_config(problem, target: Target, accepts: Callable[[TileConfig], bool], name: str) -> TileConfig:
    """Heuristic schedule when no tuned entry exists: the CPU default (shrunk until the variant accepts it), or
    the cheapest CUDA tile under the cost model above that the variant accepts."""
    if target.backend != "cuda":
        base = cpu_base_tile(problem.flops)
        for bm in (bm for bm in (32, 16, 8, 4, 2, 1) if bm <= base.BM):
            for bk in (8, 4, 2, 1):
                cfg = TileConfig(bm, base.BN, bk, min(bm, base.TM), base.TN)
                if accepts(cfg):
                    return cfg
        raise ValueError(f"no CPU schedule fits variant {name} on {problem.key()}")
    split = lambda t: split_for(problem, t, target)
    tiles = [t for t in CUDA_TILES if accepts(TileConfig(*t, split_k=split(t)))]
    if tiles:
        best = min(tiles, key=lambda t: estimated_cost(problem, t, target, split(t)))
        for schedule in CUDA_SCHEDULES:
            cfg = TileConfig(*best, split_k=split(best), **schedule)
            if accepts(cfg):
                return cfg
    for bk in (8, 4, 2, 1):  # variants with their own constraints (ConvV2: no split-K, BK | C/groups)
        fitting = [t for t in CUDA_TILES if accepts(TileConfig(t[0], t[1], bk, t[3], t[4]))]
        if fitting:
            best = min(fitting, key=lambda t: estimated_cost(problem, t, target))
            return TileConfig(best[0], best[1], bk, best[3], best[4])
    for bm in (16, 8, 4, 2, 1):  # row-count constraints (ConvV2: BM | N) that no listed tile meets
        for bk in (8, 4, 2, 1):
            cfg = TileConfig(bm, 64, bk, min(bm, 4), 4)
            if accepts(cfg):
                return cfg
    raise ValueError(f"no CUDA tile fits variant {name} on {problem.key()}")


def estimated_registers(cfg):
    """Accumulators + fragments + staging + index invariants + ~40 for addresses and loop state."""
    ea, eb = _cdiv(cfg.BM * cfg.BK, cfg.threads), _cdiv(cfg.BK * cfg.BN, cfg.threads)
    return cfg.TM * cfg.TN + cfg.TM + cfg.TN + cfg.stages * (ea + eb) + 4 * (ea + eb) + 40


def fits(cfg, target: Target):
    """Does an fp32 tile fit a block of the target: threads, static shared memory, registers per thread?"""
    smem = 4 * cfg.stages * cfg.BK * (cfg.BM + cfg.BN + 2 * cfg.smem_pad)
    return (target.warp_size <= cfg.threads <= target.max_threads_per_block
            and smem <= target.static_shared_per_block and estimated_registers(cfg) <= target.max_registers_per_thread)


def fill_split(blocks: int, slices: int, target: Target, per_sm: int, most: int) -> int:
    """The split-K factor a grid of `blocks` is given (a power of two up to `most`): the largest that keeps it within
    per_sm blocks a SM and each split at 8 or more of the `slices` BK slices of its reduction (1: none)."""
    split = 1
    while blocks * split * 2 <= per_sm * target.sm_count and slices // (2 * split) >= 8 and split < most:
        split *= 2
    return split


def split_choices(problem, bm, bn, bk, target: Target):
    """split-K factors that give the grid about one or two waves of blocks (backward-weight only)."""
    if problem.direction != "bwd_weight":
        return [1]
    blocks = _cdiv(problem.Kg, bm) * _cdiv(math.prod(problem.filter_size) * problem.Cg, bn) * problem.groups
    k_tiles = _cdiv(problem.N * math.prod(problem.out_size), bk)
    h = max(1, min(128, k_tiles // 8, -(-2 * target.sm_count // blocks)))
    return sorted({h, max(1, min(k_tiles // 8, 2 * h))})


def candidate_configs(problem, target: Target, tiles=TILES):
    """Every tile x stages (1, 2) x shared-row padding x split-K choice that fits the target."""
    out = []
    for bm, bn, bk, tm, tn in tiles:
        for stages in (1, 2):
            for pad in SMEM_PADS:
                for sk in split_choices(problem, bm, bn, bk, target):
                    cfg = TileConfig(bm, bn, bk, tm, tn, split_k=sk, smem_pad=pad, stages=stages)
                    if fits(cfg, target):
                        out.append(cfg)
    return out


@dataclass(frozen=True)
class TiledGemmVariant:
    """A variant on the fp32 tiled-GEMM schedule (templates.variant.Variant): its configs are this module's
    register tiles, filtered by the variant's own config_ok."""
    name: str
    directions: tuple[str, ...]
    computes: Callable[[ConvProblem], bool]                   # the variant's conditions beyond the direction
    build_kernel: Callable[[ConvProblem, TileConfig], Kernel]
    config_ok: Callable[[ConvProblem, TileConfig], bool] = lambda problem, config: True
    precisions: tuple[str, ...] = ("fp32",)

    def applies(self, problem, precision="fp32") -> bool:
        return precision in self.precisions and problem.direction in self.directions and self.computes(problem)

    def accepts(self, problem, config, precision="fp32") -> bool:
        return precision in self.precisions and self.config_ok(problem, config)

    def build(self, problem, config, precision="fp32") -> Kernel:
        if precision not in self.precisions:
            raise ValueError(f"precision: {self.name} computes in {self.precisions}, got {precision!r}")
        return self.build_kernel(problem, config)

    def config_space(self, problem, target: Target, precision="fp32", *, keep=None, tiles=None) -> list:
        """The tiles (default TILES) the variant accepts; with `keep`, the `keep` cheapest under the cost model
        (a tile it does not model last)."""
        cfgs = [c for c in candidate_configs(problem, target, tiles or TILES) if self.config_ok(problem, c)]
        if keep:
            def cost(c):
                tile = (c.BM, c.BN, c.BK, c.TM, c.TN)
                return estimated_cost(problem, tile, target, c.split_k) if tile in CUDA_TILES else float("inf")
            cfgs = sorted(cfgs, key=cost)[:keep]
        return cfgs

    def default_config(self, problem, target: Target, precision="fp32") -> TileConfig:
        return default_tile_config(problem, target, lambda c: self.config_ok(problem, c), self.name)

    def key_extra(self, problem):
        return None
