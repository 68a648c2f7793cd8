"""Implicit-GEMM convolution on tensor cores: the views of implicit_gemm.py, with the block tile's inner
product done by warps of m16n8k8 TF32 MMAs or m16n8k16 fp16 / bf16 MMAs (warp_mma.py).

Never chosen automatically: it computes with rounded operands (TF32: 10 mantissa bits; fp16: 10 bits
and fp16's range; bf16: 7 bits) and fp32 accumulation, so it runs only when the caller asks for
precision="tf32", "fp16" or "bf16" (kernelgen.api.make_plan).  Inputs and outputs are float32 arrays (the
rounding happens when a slice is staged in shared memory), or float16 / bfloat16 arrays with precision="fp16" /
"bf16" (kernelgen.storage: staging then rounds nothing, shared tiles and registers stay float32 (TMA tiles: as
stored), each output is rounded to 16 bits once, when stored; no split-K outside backward-weight, whose atomic
adds need a float32 output).  bfloat16 elements travel as uint16 bit patterns (NumPy and numba have no bfloat16).
On CUDA a plan without a config= runs the tuned database's config for (problem, precision) when
`python -m kernelgen tune TABLE --precision ...` measured one (kernelgen.api._tensor_core_plan), else
default_config.  The configs a tune tries (config_space: CUDA_TC_TILES with split-K and swizzles, the TMA tiles) and
the cost model that orders them are here too, every wave count and gate the Target's.
"""
from __future__ import annotations

from kernelgen.ir import Kernel
from kernelgen.storage import HALF_DTYPES, can_split, check_split_k, stored_exactly
from kernelgen.target import Target, as_target

from . import config as tile_configs, implicit_gemm, implicit_gemm_tma, ks_deconv
from .config import CPU_TC16_DEFAULT, CPU_TC_DEFAULT, CUDA_TC_DEFAULT, TileConfig
from .tile_space import gemm_shape, split_choices
from .tiled_gemm import _cdiv, shared_bytes, shared_limit, tiled_gemm
from .tma_schedule import swizzled_row


def tma_unmet(p):
    """What the TMA schedules (TileConfig.tma) need that problem p lacks, from the module whose boxes build it:
    KS-deconv's classes for a strided backward-data, else the implicit GEMM's views (an empty list: they build);
    a 3-D problem with a 2-D form as that form (implicit_gemm.computed), any other through 5-D im2col maps."""
    p = implicit_gemm.computed(p)
    if p.direction == "bwd_data" and any(s > 1 for s in p.stride):
        return ks_deconv.tma_unmet(p)
    return implicit_gemm_tma.tma_unmet(p)

NAME = "implicit_gemm_tc"
DIRECTIONS = implicit_gemm.DIRECTIONS
PRECISIONS = ("tf32", "fp16", "bf16")

# (BM, BN, WM, WN) of the CUDA tiles tried by default_config, widest first
CUDA_TC_TILES = ((128, 64, 64, 32), (64, 64, 32, 32), (128, 32, 32, 32), (64, 32, 32, 16), (128, 16, 32, 16))
# SASS instructions per HMMA of each tile relative to 128 x 64 (bwd-weight kernels of r18_c64_32 / r50_3x3_28,
# scripts/ptx_check.py: 29.5-31.0, 37.5-45.5, 41.6-42.5, 44.3-62.9; 128 x 16 not measured, assumed worst).  The
# first H100 run delivered TFLOP/s ~ 1350 / (instructions per HMMA) (PERF_NOTES #20).
ISSUE_COST = {(128, 64): 1.0, (64, 64): 1.35, (128, 32): 1.4, (64, 32): 1.75, (128, 16): 2.0}


def applies(p):
    return p.dtype in ("float32",) + HALF_DTYPES


def config_ok(p, cfg):
    return cfg.tensor_core and not (cfg.async_copy and p.dtype != "float32")  # copies move float32 words


def check_config(cfg, precision):
    if not cfg.tensor_core:
        raise ValueError(f"config: {NAME} needs a tensor-core TileConfig (WM, WN > 0), got {cfg}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS} for {NAME}, got {precision!r}")
    if cfg.wgmma and not (precision == "tf32" or precision in ("fp16", "bf16") and cfg.tma):
        raise ValueError(f"config: wgmma=1 computes in TF32 (fp16 / bf16 with tma=1 or 2, on float16 / bfloat16 "
                         f"arrays), got precision={precision!r} ({cfg})")
    if cfg.tma and cfg.BK != {"tf32": 32, "fp16": 64, "bf16": 64}.get(precision):  # a 128-byte row of the operands
        raise ValueError(f"config: tma={cfg.tma} needs BK 32 at tf32 or BK 64 at fp16 / bf16, got "
                         f"precision={precision!r} ({cfg})")
    if precision != "tf32" and cfg.BK % 16:  # one m16n8k16 per two 8-deep steps
        raise ValueError(f"config: precision={precision!r} needs BK a multiple of 16, got {cfg}")
    if shared_bytes(cfg) > shared_limit(cfg):
        raise ValueError(f"config: {cfg.stages} stages of {cfg.BM + cfg.BN} x {cfg.BK} float32 exceed a block's "
                         f"{shared_limit(cfg)} bytes of shared memory, got {cfg}")


def accepts(cfg, precision):
    """Would this config build at `precision` (TileConfig.validate and check_config, as a bool)?  The tuner
    filters its candidates with it, the database the configs of its entries."""
    try:
        check_config(cfg.validate(), precision)
    except ValueError:
        return False
    return True


def gemm_view(p, cfg: TileConfig):
    """implicit_gemm.py's view of the problem; strided backward-data as KS-deconv's stride-1 classes
    (ks_deconv.ks_view): the zero-insertion view spends (s-1)/s of its MMAs per strided dim on zeros.  A 3-D
    problem with a 2-D form is viewed as that form (implicit_gemm.folded_view)."""
    return implicit_gemm.folded_view(p, cfg, lambda q, c: ks_deconv.ks_view(q, c) if ks_deconv.applies(q) and
                                     not c.col2im else implicit_gemm.view_of(q, c))


def build(p, cfg: TileConfig, precision="tf32"):
    """(ConvProblem, TileConfig with WM, WN, precision) -> Kernel."""
    check_config(cfg, precision)
    view = gemm_view(p, cfg)
    k = tiled_gemm(f"conv_{p.direction}_{precision}", view, cfg, precision)
    return k.__class__(k.name, k.params, k.locals, k.body, k.grid, k.threads,
                       {**k.meta, "problem": p.key(), "template": NAME})


def default_config(p, target: Target | str, precision="tf32") -> TileConfig:
    """The CPU default (BK 16 for the 16-bit MMAs), or the CUDA tile with the least padded work per SM (narrow tiles for GEMMs with
    few columns); backward-weight splits its long reduction until the grid fills two waves (float16 tensors into a
    float32 workspace).
    target: a Target, or a backend name for the target in effect on it."""
    target = as_target(target)
    if target.backend != "cuda":
        return CPU_TC_DEFAULT if precision == "tf32" else CPU_TC16_DEFAULT
    M, N, K, G = gemm_shape(p)
    sms = target.sm_count

    def cost(t):
        blocks = _cdiv(M, t[0]) * _cdiv(N, t[1]) * G
        return _cdiv(blocks, sms) * t[0] * t[1] * (1.0 if t[0] * t[1] >= 128 * 64 else 1.25)
    bm, bn, wm, wn = min(CUDA_TC_TILES, key=cost)
    split = 1
    # (float16 tensors too: their split adds into a float32 workspace the launcher rounds into dw)
    if p.direction == "bwd_weight":
        # split-K supplies the blocks here, so the tile is picked by padded work x issue cost per MMA
        # (PERF_NOTES #21), not by waves
        bm, bn, wm, wn = min(CUDA_TC_TILES, key=lambda t: _cdiv(M, t[0]) * t[0] * _cdiv(N, t[1]) * t[1]
                             * ISSUE_COST[t[:2]])
        blocks = _cdiv(M, bm) * _cdiv(N, bn) * G
        split = max(1, min(64, _cdiv(K, CUDA_TC_DEFAULT.BK) // 8, _cdiv(2 * sms, blocks)))
    return TileConfig(bm, bn, CUDA_TC_DEFAULT.BK, split_k=split, stages=2, WM=wm, WN=wn, swizzle=1)


# --- the configs a tune tries -------------------------------------------------------------------------------------

def tc_cost(problem, cfg, target: Target):
    """Model time of a tensor-core config: waves of blocks x padded MMA work per block x the tile's SASS
    issue cost per MMA (ISSUE_COST) - the terms default_config weighs, split-K included."""
    M, N, K, G = gemm_shape(problem)
    blocks = _cdiv(M, cfg.BM) * _cdiv(N, cfg.BN) * G * cfg.split_k
    depth = _cdiv(_cdiv(K, cfg.split_k), cfg.BK) * cfg.BK
    issue = ISSUE_COST.get((cfg.BM, cfg.BN), max(ISSUE_COST.values()))  # a tile not yet measured: assumed the worst
    return _cdiv(blocks, target.sm_count) * cfg.BM * cfg.BN * depth * issue


def tc_gemm_shape(problem):
    """(M, N, K, groups) of this template's GEMM: a strided backward-data runs as KS-deconv's classes (a 3-D problem
    with a 2-D form: that form's)."""
    problem = implicit_gemm.computed(problem)
    return ks_deconv.ks_shape(problem) if ks_deconv.applies(problem) else gemm_shape(problem)


def tc_split_choices(problem, bm, bn, bk, target: Target, divides=False, waves=(1, 2), half=False):
    """split-K factors of a tensor-core tile: backward-weight's (tile_space.split_choices); for the other directions
    1, and where the tile leaves SMs idle (fewer blocks than SMs: the small maps of deep layers) the factors that
    fill about `waves` waves, each split keeping >= 4 slices.  divides: only factors that divide the slices (TMA
    boxes must not run past the filter), the nearest such to each target.  A 16-bit output splits only with `half`
    (into a float32 workspace: kernelgen.storage.check_split_k; never a strided backward-data's, KS-deconv's
    classes): the TMA tiles' splits, which a tune times; the mma.sync space stays unsplit, so the cheapest KEEP
    configs the model ranks are those it was fitted on (perf_model_predict.unfitted)."""
    if problem.direction == "bwd_weight":
        return split_choices(problem, bm, bn, bk, target)
    if problem.dtype in HALF_DTYPES and not (half and can_split(problem)):
        return [1]
    M, N, K, G = tc_gemm_shape(problem)
    blocks, k_tiles = _cdiv(M, bm) * _cdiv(N, bn) * G, _cdiv(K, bk)
    if blocks >= target.sm_count:
        return [1]
    usable = [s for s in range(2, k_tiles // 4 + 1) if not divides or k_tiles % s == 0]
    goals = [_cdiv(w * target.sm_count, blocks) for w in waves]
    return sorted({1} | {min(usable, key=lambda s: abs(s - t)) for t in goals if usable})


# TMA-fed warpgroup tiles (TileConfig.tma; forward at stride 1 and backward-data, channels a multiple of 32):
# (BM, BN, WM, WN, stages, tma).  The two measured best on the H100 (PERF_NOTES #38: 128 x 128 with 6 stages,
# 256 x 128 warp-specialised), and a 64-wide one for grids with few blocks.
TMA_TILES = ((128, 128, 64, 128, 6, 1), (128, 64, 64, 64, 8, 1), (256, 128, 128, 128, 4, 2))
# fp16 (float16 arrays, BK 64: the same 128-byte rows) adds a 128 x 256 tile (its MMAs take half the time of
# TF32's, so wider tiles, fewer bytes of shared memory read per MMA, may pay) and the 128 x 64 tile warp-specialised
# (the first fp16 tune picked 128 x 64 x 8 stages on 9 of 15 forward rows), and the 128 x 128 one too (no drain per
# round there: PERF_NOTES #44)
TMA_TILES_FP16 = TMA_TILES + ((128, 256, 64, 256, 4, 2), (128, 64, 64, 64, 8, 2), (128, 128, 64, 128, 6, 2))
# fp16 takes no split-K (float16 outputs): where 128 x 128 tiles leave SMs idle (r50_3x3_7: 52 blocks), one-warpgroup
# tiles of 64 rows give the grid twice or four times the blocks
TMA_TILES_SMALL_GRID = ((64, 128, 64, 128, 6, 2), (64, 64, 64, 64, 8, 2))
# a reduction of a few slices (the 1x1 layers: r50_1x1_56 forward is one 64-deep fp16 slice) has nothing to keep in
# flight: 2 stages leave shared memory for 2-3 blocks per SM, whose loads and stores overlap, where the 6-8 stage
# tiles run one block per SM, load, multiply and store in turn
TMA_TILES_SHORT = ((128, 128, 64, 128, 2, 1), (128, 64, 64, 64, 2, 1))
# fp16 backward-data TMA tiles read w as stored (TileConfig.b_mn, PERF_NOTES #49) wherever its rows allow, in place
# of the flipped copy: on the H100 the MN-major descriptor reading matched float64 and every gpu_md row ran faster
# with it (geo-mean 0.778 -> 0.941 of cuDNN, BENCHMARKS.md 2026-11-25).  False tunes the flipped-copy tiles instead.
B_MN_WHERE_ALLOWED = True
# fp16 / bf16 backward-weight (both operands MN-major: TileConfig.a_mn, b_mn): M = output channels, N = taps x
# channels, the reduction over the output pixels long, so every tile is split to fill about one and about two
# waves (its boxes past the last pixel read zeros from dy: any split builds); warp-specialised (tma=2), the tiles
# the forward measured best, and 64 rows for the layers of 64 output channels
TMA_TILES_BWD_WEIGHT = ((128, 128, 64, 128, 6, 2), (128, 256, 64, 256, 4, 2), (256, 128, 128, 128, 4, 2),
                        (64, 128, 64, 128, 6, 2), (64, 256, 64, 256, 4, 2))


def tma_bwd_weight_splits(problem, bm, bn, bk, target: Target):
    """split-K factors of a backward-weight TMA tile: about one and about two waves of blocks, each split keeping
    >= 8 slices (a pipeline of up to 8 stages to fill)."""
    m, n, k, groups = gemm_shape(problem)
    blocks, k_tiles = _cdiv(m, bm) * _cdiv(n, bn) * groups, _cdiv(k, bk)
    most = max(1, k_tiles // 8)
    return sorted({max(1, min(most, _cdiv(w * target.sm_count, blocks))) for w in (1, 2)})


def tma_candidate_configs(problem, precision, target: Target):
    """The TMA tiles, each also split to fill about one wave where it leaves SMs idle (an even split:
    tc_split_choices; float16 outputs into a float32 workspace), where the target has TMA and warpgroup MMAs and the
    TMA boxes build (tma_unmet): TF32 on float32 arrays, fp16 / bf16 on float16 / bfloat16 arrays; fp16 / bf16
    backward-weight: TMA_TILES_BWD_WEIGHT, split as tma_bwd_weight_splits."""
    if not (target.has("tma") and target.has("wgmma")):
        return []
    if not ((precision, problem.dtype) == ("tf32", "float32") or stored_exactly(problem.dtype, precision)) \
            or tma_unmet(problem):
        return []
    bk = swizzled_row(problem.dtype)
    if problem.direction == "bwd_weight":
        return [TileConfig(bm, bn, bk, split_k=sk, stages=st, WM=wm, WN=wn, wgmma=1, tma=tma, a_mn=1, b_mn=1)
                for bm, bn, wm, wn, st, tma in TMA_TILES_BWD_WEIGHT
                for sk in tma_bwd_weight_splits(problem, bm, bn, bk, target)]
    tiles = TMA_TILES if precision == "tf32" else TMA_TILES_FP16  # (bf16 as fp16: the same bytes and MMA rate)
    m, n, k, groups = tc_gemm_shape(problem)
    if precision != "tf32" and -(-m // 128) * -(-n // 128) * groups < target.sm_count:
        tiles = tiles + TMA_TILES_SMALL_GRID
    if -(-k // bk) <= 4:
        tiles = tiles + TMA_TILES_SHORT
    if n <= 32:  # few GEMM columns (the stem's backward-data: C = 3): only the narrowest wgmma that holds them
        bn = -(-n // 8) * 8
        tiles = tuple((128, bn, 64, bn, 8, tma) for tma in (1, 2))
    flat = not implicit_gemm_tma.has_depth(implicit_gemm.computed(problem))  # (b_mn's map of w is a 2-D filter's)
    b_mn = B_MN_WHERE_ALLOWED and precision != "tf32" and problem.direction == "bwd_data" and flat \
        and problem.C % 8 == 0  # rows of w as stored: a multiple of 16 bytes
    return [TileConfig(bm, bn, bk, split_k=sk, stages=st, WM=wm, WN=wn, wgmma=1, tma=tma,
                       b_mn=int(b_mn and bn % 64 == 0 and wn % 64 == 0))
            for bm, bn, wm, wn, st, tma in tiles
            for sk in tc_split_choices(problem, bm, bn, bk, target, divides=True, waves=(1,), half=True)]


# fp16 without a tuned entry on an sm_90 GPU (kernelgen.planner): over the 30 fp16 forward / backward-data problems of
# the shipped H100 database whose tunes tried TMA tiles, this one reached 0.89 of the tuned kernel's speed
# (geo-mean, worst 0.68), mma.sync's cost-model default (default_config) 0.375
UNTUNED_TMA_TILE_FP16 = (128, 64, 64, 64, 8, 2)
# ... and for 16-bit backward-weight, split to about one wave (the lowest of tma_bwd_weight_splits): over the 15 fp16
# gpu_md problems the TMA tiles take, 0.887 of the tuned best's speed (geo-mean, worst 0.685; the other tiles 0.69-0.89;
# tuning/results/2026-11-27_h100_gpu_md_fp16_bwd_weight_tma_tune_db.json)
UNTUNED_TMA_TILE_BWD_WEIGHT = (64, 128, 64, 128, 6, 2)


def untuned_tma_config(problem, precision, target: Target | str = "cuda"):
    """The TMA tile for an fp16 problem no tune has seen: UNTUNED_TMA_TILE_FP16 (backward-weight:
    UNTUNED_TMA_TILE_BWD_WEIGHT at its lowest split), with w read as stored where tma_candidate_configs would, or
    None where that tile does not take the problem (no TMA view, or a GEMM of
    32 columns or fewer, whose narrow tiles only a tune picks) or the target has no TMA.  target: a Target, or a
    backend name for the target in effect on it."""
    if precision not in ("fp16", "bf16"):
        return None
    shape = lambda c: (c.BM, c.BN, c.WM, c.WN, c.stages, c.tma)
    tile = UNTUNED_TMA_TILE_BWD_WEIGHT if problem.direction == "bwd_weight" else UNTUNED_TMA_TILE_FP16
    return min((c for c in tma_candidate_configs(problem, precision, as_target(target)) if shape(c) == tile),
               key=lambda c: c.split_k, default=None)


def fits_storage(problem, cfg):
    """Can a tensor-core config compute the problem's storage dtype (float16: split-K where storage.can_split, no
    float32 async copies), as the planner checks?"""
    try:
        check_split_k(problem, cfg)
    except ValueError:
        return False
    return config_ok(problem, cfg)


def candidate_configs(problem, precision, target: Target, keep=None):
    """Tensor-core configs to try at `precision`: the default first, then BK of the CUDA default (16) and twice it x
    CUDA_TC_TILES x split-K (tc_split_choices) x swizzle 1 and 2, two stages, each kept only where the template
    accepts it (swizzle 2 needs BK 8 or 16; fp16/bf16 need BK % 16 == 0).  With `keep`, the default and the
    keep - 1 cheapest others under tc_cost (a tune never loses to the default).  Then, where the TMA tiles take
    the problem, every tma_candidate_configs (tc_cost does not model them)."""
    default = default_config(problem, target, precision)
    out = [default]
    # twice the default depth too: half the barriers per MMA and twice the math to hide each slice's loads
    # behind (the H100 runs after #26 point at latency), for twice the staging registers.  (The depth is read
    # from the config module when asked: a test swaps it.)
    depth = tile_configs.CUDA_TC_DEFAULT.BK
    for bk in (depth, 2 * depth):
        for bm, bn, wm, wn in CUDA_TC_TILES:
            for sk in tc_split_choices(problem, bm, bn, bk, target):
                for swizzle in (1, 2):
                    cfg = TileConfig(bm, bn, bk, split_k=sk, stages=2, WM=wm, WN=wn, swizzle=swizzle)
                    if cfg not in out and accepts(cfg, precision):
                        out.append(cfg)
    if keep:
        out = out[:1] + sorted(out[1:], key=lambda c: tc_cost(problem, c, target))[:keep - 1]
    return out + [c for c in tma_candidate_configs(problem, precision, target) if accepts(c, precision)]


class TensorCoreGemm:
    """The Variant (templates.variant) of this module: never a candidate of an fp32 plan, planned for the
    precisions it computes in."""
    name = NAME
    directions = DIRECTIONS
    precisions = PRECISIONS
    PRECISIONS = PRECISIONS  # the name scripts/golden_source.py reads

    def applies(self, problem, precision="tf32") -> bool:
        return precision in PRECISIONS and problem.direction in DIRECTIONS and applies(problem)

    def accepts(self, problem, config, precision="tf32") -> bool:
        return precision in PRECISIONS and accepts(config, precision) and fits_storage(problem, config) and \
            not (config.col2im and implicit_gemm.col2im_unmet(problem))

    def build(self, problem, config, precision="tf32") -> Kernel:
        return build(problem, config, precision)

    def config_space(self, problem, target: Target, precision="tf32", *, keep=None, tiles=None) -> list:
        """candidate_configs that the problem's storage takes (tiles: the fp32 variants' option, not used here)."""
        return [c for c in candidate_configs(problem, precision, target, keep) if fits_storage(problem, c)]

    def default_config(self, problem, target: Target, precision="tf32") -> TileConfig:
        return default_config(problem, target, precision)

    def key_extra(self, problem):
        return None


VARIANT = TensorCoreGemm()
