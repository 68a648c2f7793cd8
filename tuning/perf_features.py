"""The features the performance model (tuning/perf_model.py) ranks configs by: analytic terms of one (problem,
variant, config) on one Target - waves and their quantisation, padding waste of the tile against the GEMM, arithmetic
intensity per tile, occupancy from registers and shared memory - and the config's schedule knobs (pipeline, stages,
split-K, swizzle, Winograd states) as indicators.

Every count of SMs, registers or shared memory is the Target's; the register and shared-memory estimates are rough
(ptxas decides), which is why the model learns a weight for each term rather than trusting one formula.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from kernelgen.problem import ConvProblem
from kernelgen.storage import HALF_DTYPES
from kernelgen.target import Target
from kernelgen.templates import conv_v2, implicit_gemm, implicit_gemm_tc, ks_deconv, sk_dilated, winograd
from kernelgen.templates.config import TileConfig
from kernelgen.templates.tile_space import estimated_registers, gemm_shape
from kernelgen.templates.winograd_tiled import conv_geometry, shared_bytes as winograd_shared_bytes
from kernelgen.templates.winograd_transforms import tile_width

# Resident threads per SM on every GPU since sm_70 (Target has no field for it; the register file bounds it
# the same way: 65536 registers / 32 per thread).
MAX_THREADS_PER_SM = 2048
MAX_BLOCKS_PER_SM = 32
# the pipelines a config may run (TileConfig.pipeline), and the variants the fp32 / tensor-core databases hold
PIPELINES = ("single_stage", "register_double_buffer", "cp_async", "cp_async_wgmma", "tma", "tma_warp_specialised")
VARIANT_NAMES = ("implicit_gemm", "ks_deconv", "conv_v2", "sk_dilated", "winograd", "implicit_gemm_tc")
DIRECTIONS = ("fwd", "bwd_data", "bwd_weight")
TRIMMING = (conv_v2.NAME, sk_dilated.NAME)  # the variants that skip taps meeting only padding

# The names of the columns features() returns, in order (the fitted model's JSON records them: a model fitted on
# other columns is refused, not misread).
NAMES = (
    ("log_waves_quantisation", "log_tile_padding", "log_k_padding", "log_intensity", "log_blocks_per_sm",
     "log_sm_fill", "log_threads", "log_split_k", "log_stages", "log_work_per_sm", "log_reduction_steps",
     "log_split_k_bwd_weight", "log_registers", "log_loads_per_fma", "log_real_taps", "smem_pad", "swizzle",
     "swizzle2", "b_mn", "min_blocks", "log_state_groups", "states_8", "states_16", "log_bm_over_bn",
     "tma_small_grid", "a_mn", "a_mn_x_log_split_k", "a_mn_x_log_bm")
    + tuple(f"pipeline_{p}" for p in PIPELINES)
    + tuple(f"variant_{v}" for v in VARIANT_NAMES)
    + tuple(f"variant_{v}_x_log_flops" for v in VARIANT_NAMES)
    + tuple(f"variant_{v}_x_{d}" for v in VARIANT_NAMES for d in DIRECTIONS)
)


def _cdiv(a, b):
    return -(-a // b)


class Gemm(NamedTuple):
    """The GEMM a variant runs: M x N outputs in `groups` GEMMs (KS-deconv: per group and stride class; conv_v2
    backward-weight: per group and tap), `states` of them each (Winograd's alpha, else 1), reduced over `taps`
    slices of `inner` (a tap-major reduction pads each tap's channels to BK) of which `real` (a fraction) is not
    trimmed padding."""
    M: int
    N: int
    groups: int
    states: int
    taps: int
    inner: int
    real: float = 1.0


def real_taps(problem: ConvProblem) -> float:
    """The fraction of (output position, tap) pairs whose input is inside the map, not padding: the work that
    filter trimming (conv_v2, sk_dilated) keeps."""
    frac = 1.0
    for size, f, s, pad, d, out in zip(problem.in_size, problem.filter_size, problem.stride, problem.padding,
                                       problem.dilation, problem.out_size):
        if f > 1 and out > 0:
            hits = sum(1 for o in range(out) for t in range(f) if 0 <= o * s - pad + t * d < size)
            frac *= hits / (out * f)
    return frac


def _winograd_gemm(problem: ConvProblem, config: TileConfig) -> Gemm:
    """Output tiles of n = alpha - S + 1 widths x output channels, reduced over the filter's other taps x input
    channels; alpha GEMMs (one per state), computed by the same block."""
    alpha = winograd.states_for(problem, config) or config.states or 8
    _, _, _, out_size, cin, kout, _, _, _ = conv_geometry(problem)
    n = max(1, tile_width(alpha, problem.filter_size[2]))
    tiles = problem.N * out_size[0] * out_size[1] * _cdiv(out_size[2], n)
    return Gemm(tiles, kout, problem.groups, alpha, problem.filter_size[0] * problem.filter_size[1], cin)


def gemm_of(problem: ConvProblem, variant: str, config: TileConfig) -> Gemm:
    """The GEMM the variant runs on the problem."""
    if variant == winograd.NAME:
        return _winograd_gemm(problem, config)
    if getattr(config, "col2im", 0):  # the GEMM over dy's pixels (implicit_gemm.col2im_view), whatever the stride
        M, N, K, G = gemm_shape(implicit_gemm.col2im_gemm(problem))
        return Gemm(M, N, G, 1, 1, K)
    if variant == ks_deconv.NAME or (variant == implicit_gemm_tc.NAME and ks_deconv.applies(problem)):
        M, N, K, G = ks_deconv.ks_shape(problem)
        return Gemm(M, N, G, 1, 1, K)
    M, N, K, G = gemm_shape(problem)
    taps = math.prod(problem.filter_size)
    real = real_taps(problem) if variant in TRIMMING else 1.0
    if variant == conv_v2.NAME and problem.direction == "bwd_weight":  # the tap on the grid's z axis
        return Gemm(problem.Kg, problem.Cg, G * taps, 1, 1, K, real)
    if variant == conv_v2.NAME:  # a slice is one tap's BK channels
        return Gemm(M, N, G, 1, taps, K // taps, real)
    return Gemm(M, N, G, 1, 1, K, real)


def _itemsize(problem: ConvProblem, config: TileConfig):
    return 2 if problem.dtype in HALF_DTYPES and config.tensor_core else 4


def registers(variant: str, config: TileConfig, alpha: int):
    """Registers per thread, estimated: accumulators + fragments + staging + ~40 for addresses and loop state."""
    if config.tensor_core:
        lanes = 128 if config.wgmma else 32
        acc = config.WM * config.WN // lanes
        staged = 0 if (config.tma or config.async_copy) else config.stages * _cdiv(
            config.BK * (config.BM + config.BN), max(1, config.threads))
        return min(255, acc + staged + 40)
    if variant == winograd.NAME:
        acc = alpha // max(1, config.state_groups) * config.TM * config.TN
        return min(255, acc + config.stages * (alpha + 4) + 40)
    return min(255, estimated_registers(config))


def shared_memory(problem: ConvProblem, variant: str, config: TileConfig, alpha: int):
    """Shared bytes per block: the staged slices (TMA / async copies: every stage in flight)."""
    if variant == winograd.NAME:
        return winograd_shared_bytes(config, alpha, 4)
    pad = 0 if config.tensor_core else 2 * config.smem_pad
    return max(1, config.stages) * config.BK * (config.BM + config.BN + pad) * _itemsize(problem, config)


def blocks_per_sm(problem: ConvProblem, variant: str, config: TileConfig, target: Target, alpha: int):
    """Resident blocks per SM: the least of the register, shared-memory and thread limits (at least 1)."""
    threads = max(1, config.threads)
    regs = registers(variant, config, alpha)
    by_regs = target.registers_per_sm // (threads * _cdiv(regs, 8) * 8)
    smem = shared_memory(problem, variant, config, alpha)
    by_smem = target.shared_per_sm // smem if smem else MAX_BLOCKS_PER_SM
    by_threads = MAX_THREADS_PER_SM // threads
    limit = min(by_regs, by_smem, by_threads, MAX_BLOCKS_PER_SM)
    if config.min_blocks:
        limit = max(limit, min(config.min_blocks, by_smem, by_threads))
    return max(1, limit)


def _loads_per_fma(config: TileConfig):
    """Shared-memory words a thread (a warp, for tensor cores) reads per multiply-add of its register tile."""
    if config.tensor_core:
        return (config.WM + config.WN) / (config.WM * config.WN)
    return (config.TM + config.TN) / (config.TM * config.TN)


def features(problem: ConvProblem, variant: str, config: TileConfig, target: Target) -> np.ndarray:
    """The NAMES columns of one candidate (finite floats; the same input gives the same row)."""
    g = gemm_of(problem, variant, config)
    M, N, inner = max(g.M, 1), max(g.N, 1), max(g.inner, 1)
    bm, bn, bk, sk = config.BM, config.BN, max(1, config.BK), max(1, config.split_k)
    blocks = _cdiv(M, bm) * _cdiv(N, bn) * g.groups * sk  # (a Winograd block computes all alpha states of its tile)
    bps = blocks_per_sm(problem, variant, config, target, g.states)
    waves = blocks / (target.sm_count * bps)
    steps = g.taps * _cdiv(inner, bk)  # BK slices of the whole reduction
    depth = _cdiv(steps, sk) * bk      # a split's padded reduction
    padding = (_cdiv(M, bm) * bm * _cdiv(N, bn) * bn) / (M * N)
    k_padding = depth * sk / (g.taps * inner)
    work_per_sm = math.ceil(waves) * bps * bm * bn * depth * g.states * g.real  # padded MACs one SM works through
    flops = 2.0 * M * N * g.taps * inner * g.groups * g.states
    row = [math.log(math.ceil(waves) / waves), math.log(padding), math.log(k_padding),
           math.log(bm * bn / (bm + bn)), math.log(bps), math.log(min(1.0, blocks / target.sm_count)),
           math.log(max(1, config.threads)), math.log(sk), math.log(max(1, config.stages)),
           math.log(work_per_sm * target.sm_count * 2.0 / flops), math.log(_cdiv(steps, sk)),
           math.log(sk) if problem.direction == "bwd_weight" else 0.0,
           math.log(registers(variant, config, g.states)), math.log(_loads_per_fma(config)), math.log(g.real),
           float(config.smem_pad > 0), float(config.swizzle == 1), float(config.swizzle == 2), float(config.b_mn),
           float(config.min_blocks > 0), math.log(max(1, config.state_groups)), float(g.states == 8),
           float(g.states == 16), math.log(bm / bn), float(bool(config.tma) and blocks < target.sm_count),
           # backward-weight's TMA tiles (both operands MN-major): their own split and tile-height terms
           float(config.a_mn), config.a_mn * math.log(sk), config.a_mn * math.log(bm)]
    row += [float(config.pipeline == p) for p in PIPELINES]
    row += [float(variant == v) for v in VARIANT_NAMES]
    row += [float(variant == v) * math.log(flops) for v in VARIANT_NAMES]
    row += [float(variant == v and problem.direction == d) for v in VARIANT_NAMES for d in DIRECTIONS]
    return np.asarray(row, dtype=np.float64)
