"""Direct depthwise convolution (issue 28): groups = C, K = m * C filters, every direction, at memory speed.

Not a GEMM view: a depthwise layer does a handful of FMAs per byte, so the kernel is built around the bytes.
Channels-last with each thread's channels contiguous (16-byte loads of 4 float32 channels), each thread a register
strip of PW output pixels along W whose source positions are loaded once per filter row and reused by every tap,
the filter taps of its channels in registers, and the block's input window (the halo) copied once into shared
memory (`halo`).  Forward fuses bias and relu; backward-data is the same gather on the flipped filter, strides as
residue classes (a strip gathers only the taps that land on it); backward-weight reduces per channel over the batch
and pixels, split over blocks that add into a zeroed dw (`split_k`; float16 tensors: into a float32 workspace the
launcher rounds into dw).  Narrow groups (issue 28: C / groups = Cg in 2..8, ResNeXt's 4 and 8 channels a group)
are the same kernels with each output summing its group's Cg sources, not a GEMM per group (whose N is Kg = 4):
forward and backward-data; their backward-weight stays with the GEMM variants.  The geometry is
depthwise_geometry.py, the
IR depthwise_ir.py and depthwise_kernels.py, the config depthwise_config.py; the cost model and the tuner's space
are here.

Precisions: fp32 FMAs; "tf32" computes the same fp32 FMAs (no tensor cores: the layer is memory-bound, and fp32 is
at least as exact); "fp16" / "bf16" round float32 operands to fp16 / bf16 as they are read and accumulate in fp32;
float16 tensors (precision "fp16") are read as they are stored, accumulated in fp32, rounded once when stored.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import NamedTuple

from kernelgen.ir import Kernel
from kernelgen.problem import ConvProblem
from kernelgen.storage import HALF_DTYPES, PRECISIONS_BY_DTYPE
from kernelgen.target import Target
from kernelgen.templates import implicit_gemm, tile_space
from kernelgen.templates.depthwise_config import DepthwiseConfig
from kernelgen.templates.depthwise_geometry import (MAX_FILTER_WORDS, Geometry, cdiv, geometry, max_split,
                                                    narrow_problem_unmet, over_limits, unmet)
from kernelgen.templates.depthwise_kernels import gather_kernel, weight_kernel

NAME = "depthwise"
DIRECTIONS = ("fwd", "bwd_data", "bwd_weight")
PRECISIONS = ("fp32", "tf32", "fp16", "bf16")

# The cost model's guesses, until the tuner measures (GPU memory-bound kernels): bytes per FMA of compute time
# (an H100 does ~60 TFLOP/s fp32 FMA against ~3 TB/s), the traffic cost of reading the window through the caches
# instead of shared memory, of an atomic add, and the threads an SM wants resident to saturate memory.
FLOPS_PER_BYTE = 20.0
NO_HALO_TRAFFIC = 1.3
ATOMIC_BYTES = 16
SATURATING_THREADS = 1024
THREADS_PER_SM = 2048
SECTOR = 32
DEFAULT_THREADS = (256,)  # the default's block size, the window in shared memory (the tuner tries 64..512, both)


def applies(p: ConvProblem) -> bool:
    """Depthwise (groups = C), with the m filters of a channel's taps few enough for a thread's registers (a C = 1
    layer of 64 filters is a GEMM, better served by the GEMM variants); or narrow groups (2..8 channels and at most 8
    filters a group, a group's taps x sources within a thread's filter registers), in every direction.  An
    ungrouped convolution (groups = 1) is a GEMM, however few its channels."""
    if p.groups == p.C:
        return math.prod(p.filter_size) * (p.K // p.C) <= MAX_FILTER_WORDS
    return p.groups > 1 and p.Cg > 1 and not narrow_problem_unmet(p)


def _rounding(p, precision):
    """The operand rounding of a precision on this problem's tensors (None: none)."""
    return precision if precision in ("fp16", "bf16") and p.dtype == "float32" else None


def itemsize(p):
    """Bytes of one element of the problem's tensors (the depthwise model's features read it too)."""
    return {"float64": 8, "float16": 2, "bfloat16": 2}.get(p.dtype, 4)


def _limits(p, target: Target) -> dict:
    """over_limits' arguments for a CUDA target."""
    return {"itemsize": 8 if p.dtype == "float64" else 4,  # shared words hold the computed (widened) values
            "max_shared": target.static_shared_per_block, "max_registers": target.max_registers_per_thread,
            "max_threads": target.max_threads_per_block}


def precision_note(p, precision, split=False):
    if precision == "tf32":
        return "tf32 computed as fp32 FMAs (no tensor cores: depthwise is memory-bound, fp32 is at least as exact)"
    if precision in ("fp16", "bf16") and p.dtype == "float32":
        return f"{precision} operands (float32 tensors rounded as read), fp32 accumulation"
    if p.dtype in HALF_DTYPES:
        return f"{p.dtype} tensors, fp32 accumulation, outputs rounded once" + (
            " (split dw summed in a float32 workspace)" if split else "")
    return f"{'fp64' if p.dtype == 'float64' else 'fp32'} FMAs"


def build(p: ConvProblem, cfg: DepthwiseConfig, precision="fp32") -> Kernel:
    """(ConvProblem, DepthwiseConfig, precision) -> Kernel."""
    if not isinstance(cfg, DepthwiseConfig):
        raise TypeError(f"config: {NAME} needs a DepthwiseConfig, got {type(cfg).__name__} {cfg}")
    if precision not in PRECISIONS_BY_DTYPE[p.dtype]:
        raise ValueError(f"precision: {NAME} computes {p.dtype} tensors at {PRECISIONS_BY_DTYPE[p.dtype]}, got "
                         f"{precision!r}")
    if not applies(p):
        raise ValueError(f"{NAME} computes depthwise problems (groups = C) and narrow groups (C / groups <= 8, at "
                         f"most 8 filters a group), got {p.key()}")
    why = unmet(p, cfg)
    if why:
        raise ValueError(f"config: {cfg} needs {'; '.join(why)} on {p.key()}")
    g = geometry(p, cfg)
    rnd = _rounding(p, precision)
    k = weight_kernel(g, rnd) if p.direction == "bwd_weight" else gather_kernel(g, rnd)
    work = p.N * math.prod(p.out_size) * p.K * g.taps * p.Cg
    kind = (f"narrow groups {p.direction}: {p.Cg} channel(s) and {p.Kg} filter(s) a group, each thread 1/"
            f"{cfg.group_split} of a group's outputs" if g.narrow else f"depthwise {p.direction}: {g.m} filter(s) per "
                                                                       f"channel")
    doc = (f"direct {kind}, {g.h.classes * g.w.classes} residue "
           f"class(es), window {'in shared memory' if cfg.halo else 'read through the caches'}; "
           f"{precision_note(p, precision, cfg.split_k > 1)}")
    meta = {"doc": doc, "problem": p.key(), "template": NAME, "config": str(cfg), "zero_output": cfg.split_k > 1,
            "precision": precision, "work": work}
    return Kernel(k.name, k.params, k.locals, k.body, k.grid, k.threads, meta)


# --- the cost model and the tuner's space ----------------------------------------------------------------------------

def _sectors(run_bytes):
    """Bytes moved for a contiguous run: whole 32-byte sectors (a run of one float32 channel per pixel moves 8x)."""
    return cdiv(run_bytes, SECTOR) * SECTOR


class ModelTerms(NamedTuple):
    """model_time's parts: global traffic (bytes, whole sectors), FMAs, the grid's blocks, blocks resident per SM,
    the waves they take, the last wave's fill and the memory parallelism the SMs reach (tuning/depthwise_model.py's
    features are these)."""
    traffic: float
    fmas: float
    blocks: int
    resident: int
    waves: int
    fill: float
    parallel: float


def model_terms(p: ConvProblem, cfg: DepthwiseConfig, target: Target, g: Geometry | None = None) -> ModelTerms:
    """The global traffic in whole sectors (each block's window, its filter, the outputs; dy and the atomic adds of
    backward-weight), the FMAs, and the SMs' memory parallelism (resident threads, up to SATURATING_THREADS, and
    the last wave's idle SMs)."""
    g, item = g or geometry(p, cfg), itemsize(p)
    pixel = _sectors(cfg.block_groups * g.src_per_group * item)  # a window pixel's channels of one block
    window = math.prod(g.window_shape[:3]) * pixel * (1.0 if cfg.halo else NO_HALO_TRAFFIC)
    outputs = p.N * g.out_depth * g.h.out_size * g.w.out_size
    if p.direction == "bwd_weight":
        blocks = g.channel_blocks * cfg.split_k
        traffic = (window * g.spatial_tiles * g.channel_blocks + outputs * g.channel_blocks
                   * _sectors(cfg.block_groups * g.out_per_group * item) + p.K * g.taps * p.Cg * ATOMIC_BYTES
                   * cfg.split_k)
    else:
        blocks = g.spatial_tiles * g.channel_blocks
        traffic = (window * blocks + outputs * g.channel_blocks * _sectors(cfg.block_groups * g.out_per_group * item)
                   + blocks * cfg.block_groups * p.Kg * p.Cg * g.taps * item)
    shared = g.shared_words * _limits(p, target)["itemsize"]
    resident = max(1, min(THREADS_PER_SM // cfg.threads, target.registers_per_sm // (g.registers * cfg.threads),
                          target.shared_per_sm // shared if shared else THREADS_PER_SM))
    waves = cdiv(blocks, target.sm_count * resident)
    fill = blocks / (waves * target.sm_count * resident)
    parallel = min(1.0, resident * cfg.threads / SATURATING_THREADS) * fill
    return ModelTerms(traffic, p.N * math.prod(p.out_size) * p.K * g.taps * p.Cg, blocks, resident, waves, fill,
                      parallel)


def model_time(p: ConvProblem, cfg: DepthwiseConfig, target: Target, g: Geometry | None = None) -> float:
    """Modeled time (bytes-equivalent): model_terms' traffic plus its FMAs at FLOPS_PER_BYTE, over its memory
    parallelism."""
    t = model_terms(p, cfg, target, g)
    return (t.traffic + 2.0 * t.fmas / FLOPS_PER_BYTE) / t.parallel


def _split_choices(p, channel_blocks, target: Target):
    if p.direction != "bwd_weight":
        return (1,)
    h = max(1, cdiv(2 * target.sm_count, channel_blocks))
    return tuple(sorted({1, h, 4 * h}))


def group_splits(p: ConvProblem):
    """The group_split choices: 1 for depthwise; for narrow groups every divisor of a group's outputs (y: Kg, dx:
    Cg), the unmet filter-register limit dropping the small ones later."""
    if p.Cg == 1:
        return (1,)
    outs = p.Cg if p.direction == "bwd_data" else p.Kg
    return tuple(d for d in range(1, outs + 1) if outs % d == 0)


def _shapes(p: ConvProblem, vector_widths, threads):
    """(VC, TC, TW, TH, PW, PH, group_split) a CUDA block may have: `threads` threads; a block's channels at least
    one sector of a pixel (or all of them), no more than twice the problem's groups, rows or columns."""
    (_, H, W), (_, OH, OW) = p.in_size, p.out_size
    rows, cols = (H, W) if p.direction == "bwd_data" else (OH, OW)
    spg, item = (p.Kg if p.direction == "bwd_data" else p.Cg), itemsize(p)
    pow2 = (1, 2, 4, 8, 16, 32, 64)
    for vc, tc, th, pw, ph, gs in itertools.product(vector_widths, pow2, (1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4),
                                                    group_splits(p)):
        tw, groups = threads // (tc * th), tc // gs * vc
        if tw < 1 or tw * tc * th != threads or tc % gs or groups > 2 * max(p.groups, vc):
            continue
        if groups * spg * item < min(SECTOR, p.groups * spg * item):
            continue
        if tw * pw > 2 * max(cols, pw) or th * ph > 2 * max(rows, ph):
            continue
        yield vc, tc, tw, th, pw, ph, gs


def candidate_configs(p: ConvProblem, target: Target, precision="fp32", threads=(64, 128, 256, 512),
                      windows=((1, 0), (1, 1), (0, 0))) -> list:
    """Every block shape (`threads` per block) x (halo, smem_pad) of `windows` x split that builds and fits the
    target, cheapest under model_time first."""
    widths = (1, 2, 4, 8) if p.dtype in HALF_DTYPES else (1, 2, 4)
    limits, scored = _limits(p, target), []
    for n in threads:
        for vc, tc, tw, th, pw, ph, gs in _shapes(p, widths, n):
            for halo, pad in windows:
                # a block's geometry and limits do not depend on its split: checked once, on the unsplit config
                # (the planner enumerates this space for every problem its fitted model ranks)
                base = DepthwiseConfig(tc, tw, th, vc, pw, ph, halo, pad, 1, gs)
                g = geometry(p, base)
                if unmet(p, base, g) or over_limits(g, **limits):
                    continue
                for split in _split_choices(p, cdiv(p.groups, tc // gs * vc), target):
                    if split > max_split(g):  # (unmet's one test of the split)
                        continue
                    cfg = base if split == 1 else dataclasses.replace(base, split_k=split)
                    scored.append((model_time(p, cfg, target, g), str(cfg), cfg))
    return [cfg for _, _, cfg in sorted(scored)]


def spread(configs, keep=None) -> list:
    """`keep` of `configs` (model order) taken in turns from the groups of one (block size, channel vector, window,
    group split),
    each group's cheapest first: the model's order alone fills a short list with one shape's smem_pad and
    row variants, and the model is not yet fitted to measurements, so a tune should see every kind of block."""
    groups = {}
    for cfg in configs:
        groups.setdefault((cfg.threads, cfg.VC, cfg.halo, cfg.group_split), []).append(cfg)
    turns = [cfg for rank in itertools.zip_longest(*groups.values()) for cfg in rank if cfg is not None]
    return turns[:keep or None]


# share_rows where a config's PH output rows can share their source rows (forward and backward-data, PH >= 2) and the
# PH strips' accumulators stay within this estimate (depthwise_geometry's Geometry.registers).  Measured on the H100
# (BENCHMARKS.md, tenth session: each config of the depthwise table's bench against its share_rows twin, 110 pairs):
# 1.10x geo-mean, by filter and PH 1.04x (3x3, PH 2) to 1.28x (5x5, PH 4); the one pair above this estimate (170:
# 254 registers compiled) ran at 0.81x.
SHARE_ROWS_MAX_REGISTERS = 128


def with_shared_rows(p: ConvProblem, cfg: DepthwiseConfig, target: Target) -> DepthwiseConfig:
    """cfg with share_rows on where it applies and fits (see SHARE_ROWS_MAX_REGISTERS), else cfg: the planner's last
    step for a config it chose itself (a tuned entry, the model's or the cost model's pick), never for one given."""
    if cfg.share_rows or cfg.PH < 2 or p.direction == "bwd_weight" or target.backend != "cuda":
        return cfg
    shared = dataclasses.replace(cfg, share_rows=1)
    g = geometry(p, shared)
    if g.registers > SHARE_ROWS_MAX_REGISTERS or unmet(p, shared, g) or over_limits(g, **_limits(p, target)):
        return cfg
    return shared


def cpu_config(p: ConvProblem) -> DepthwiseConfig:
    """Small blocks for the CPU backend (a block is one prange iteration; its threads a loop): the window read in
    place, 4 channels and 4 pixels per thread (narrow groups: up to 4 groups, each thread the fewest sharers of a
    group whose filter fits its registers)."""
    (_, _, OW) = p.out_size
    rows = p.in_size[1] if p.direction == "bwd_data" else p.out_size[1]
    if p.Cg > 1:
        for vc, gs in itertools.product([v for v in (4, 2, 1) if v <= max(1, p.groups)], group_splits(p)):
            cfg = DepthwiseConfig(TC=gs, TW=4, TH=2 if rows > 1 else 1, VC=vc, PW=4 if OW >= 4 else 1, PH=1, halo=0,
                                  group_split=gs)
            if not unmet(p, cfg):
                return cfg
    vc = 4 if p.C >= 4 else (2 if p.C >= 2 else 1)
    return DepthwiseConfig(TC=1, TW=4, TH=2 if rows > 1 else 1, VC=vc, PW=4 if OW >= 4 else 1, PH=1, halo=0)


def default_config(p: ConvProblem, target: Target, precision="fp32") -> DepthwiseConfig:
    if target.backend != "cuda":
        return cpu_config(p)
    cfg = cuda_default_config(p, target, precision)
    if cfg is None:
        raise ValueError(f"{NAME}: no CUDA block fits {p.key()}")
    return cfg


def cuda_default_config(p: ConvProblem, target: Target, precision="fp32") -> DepthwiseConfig | None:
    """The cost model's CUDA block for p, or None where none fits (narrow groups whose filter outgrows a thread's
    registers at every group split: 3 channels and 5 filters a group of a 3x2x3 filter, say)."""
    cands = candidate_configs(p, target, precision, DEFAULT_THREADS, windows=((1, 0),)) or \
        candidate_configs(p, target, precision)
    if cands:
        return cands[0]
    # a problem smaller than any block the search keeps (it drops blocks with more than twice the threads the
    # output has work for: a map of a pixel or two and two channels, say): one warp, a channel and a pixel each
    for halo, gs in itertools.product((1, 0), group_splits(p)):
        cfg = DepthwiseConfig(TC=gs, TW=target.warp_size, TH=1, VC=1, PW=1, PH=1, halo=halo, group_split=gs)
        if not unmet(p, cfg) and not over_limits(geometry(p, cfg), **_limits(p, target)):
            return cfg
    return None


def gemm_model_time(p: ConvProblem, target: Target) -> float:
    """The GEMM variants' cost for a narrow-group problem in model_time's units: the tile_space cost model's padded
    FMAs (per SM, over the tile's efficiency) of implicit_gemm's default tile, on all SMs at FLOPS_PER_BYTE, plus
    one pass over the tensors (that model counts no bytes, and a per-group GEMM with N = Kg = 4 moves as many bytes as
    the direct kernel's outputs: without them the comparison would favour it wherever padding is small)."""
    cfg = implicit_gemm.VARIANT.default_config(p, target)
    tile = (cfg.BM, cfg.BN, cfg.BK, cfg.TM, cfg.TN)
    if tile not in tile_space.CUDA_TILES:
        return math.inf
    fmas = tile_space.estimated_cost(p, tile, target, cfg.split_k) * target.sm_count
    tensors = (math.prod(p.x_shape) + math.prod(p.w_shape) + math.prod(p.y_shape)) * itemsize(p)
    return tensors + 2.0 * fmas / FLOPS_PER_BYTE


def narrow_groups_verdict(p: ConvProblem, target: Target):
    """(direct faster?, its model time, the GEMM's) of a narrow-group problem under the two cost models, on a CUDA
    target (the CPU backend plans as the GPU would: a guess there as well, and the same IR on both); where no CUDA
    block fits, the GEMM variants take it."""
    cfg = cuda_default_config(p, target)
    direct = math.inf if cfg is None else model_time(p, cfg, target)
    gemm = gemm_model_time(p, target)
    return direct < gemm, direct, gemm


class Depthwise:
    """The Variant (templates/variant.py) of this module: its own config (DepthwiseConfig) and cost model."""
    name = NAME
    directions = DIRECTIONS
    precisions = PRECISIONS

    def applies(self, problem, precision="fp32") -> bool:
        return (problem.direction in DIRECTIONS and precision in PRECISIONS_BY_DTYPE[problem.dtype]
                and applies(problem))

    def accepts(self, problem, config, precision="fp32") -> bool:
        return (isinstance(config, DepthwiseConfig) and self.applies(problem, precision)
                and not unmet(problem, config))

    def build(self, problem, config, precision="fp32") -> Kernel:
        return build(problem, config, precision)

    def config_space(self, problem, target: Target, precision="fp32", *, keep=None, tiles=None) -> list:
        """candidate_configs, `keep` of them spread over the knobs (spread; tiles: the GEMM variants' option, not
        used here)."""
        return spread(candidate_configs(problem, target, precision), keep)

    def default_config(self, problem, target: Target, precision="fp32") -> DepthwiseConfig:
        return default_config(problem, target, precision)

    def key_extra(self, problem):
        return None


VARIANT = Depthwise()
