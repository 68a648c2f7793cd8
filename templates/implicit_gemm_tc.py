"""Implicit-GEMM convolution on tensor cores: the views of implicit_gemm.py, with the block tile's inner
product done by warps of m16n8k8 TF32 MMAs or m16n8k16 fp16 / bf16 MMAs (warp_mma.py).

Never chosen automatically: it computes with rounded operands (TF32: 10 mantissa bits; fp16: 10 bits
and fp16's range; bf16: 7 bits) and fp32 accumulation, so it runs only when the caller asks for
precision="tf32", "fp16" or "bf16" (kernelgen.api.make_plan).  Inputs and outputs are float32 arrays (the
rounding happens when a slice is staged in shared memory), or float16 arrays with precision="fp16"
(kernelgen.storage: staging then rounds nothing, shared tiles and registers stay float32, each output is
rounded to float16 once, when stored; no split-K, whose atomic adds need a float32 output).  (bfloat16
arrays are not accepted: NumPy has no bfloat16, and torch does not export bfloat16 tensors through
__cuda_array_interface__.)
On CUDA a plan without a config= runs the tuned database's config for (problem, precision) when
`python -m kernelgen tune TABLE --precision ...` measured one (kernelgen.api._tensor_core_plan), else
default_config.
"""
from __future__ import annotations

from . import implicit_gemm, ks_deconv
from .config import CPU_TC16_DEFAULT, CPU_TC_DEFAULT, CUDA_TC_DEFAULT, TileConfig
from .tiled_gemm import _cdiv, shared_bytes, shared_limit, tiled_gemm


def tma_unmet(p):
    """What the TMA schedules (TileConfig.tma) need that problem p lacks, from the module whose boxes build it:
    KS-deconv's classes for a strided backward-data, else the implicit GEMM's forward view (an empty list: they
    build)."""
    if p.direction == "bwd_data" and any(s > 1 for s in p.stride):
        return ks_deconv.tma_unmet(p)
    return implicit_gemm.tma_unmet(p)

NAME = "implicit_gemm_tc"
DIRECTIONS = implicit_gemm.DIRECTIONS
PRECISIONS = ("tf32", "fp16", "bf16")

# (BM, BN, WM, WN) of the CUDA tiles tried by default_config, widest first
CUDA_TC_TILES = ((128, 64, 64, 32), (64, 64, 32, 32), (128, 32, 32, 32), (64, 32, 32, 16), (128, 16, 32, 16))
SM_COUNT = 132
# SASS instructions per HMMA of each tile relative to 128 x 64 (bwd-weight kernels of r18_c64_32 / r50_3x3_28,
# scripts/ptx_check.py: 29.5-31.0, 37.5-45.5, 41.6-42.5, 44.3-62.9; 128 x 16 not measured, assumed worst).  The
# first H100 run delivered TFLOP/s ~ 1350 / (instructions per HMMA) (PERF_NOTES #20).
ISSUE_COST = {(128, 64): 1.0, (64, 64): 1.35, (128, 32): 1.4, (64, 32): 1.75, (128, 16): 2.0}


def applies(p):
    return p.dtype in ("float32", "float16")


def config_ok(p, cfg):
    return cfg.tensor_core and not (cfg.async_copy and p.dtype != "float32")  # copies move float32 words


def check_config(cfg, precision):
    if not cfg.tensor_core:
        raise ValueError(f"config: {NAME} needs a tensor-core TileConfig (WM, WN > 0), got {cfg}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS} for {NAME}, got {precision!r}")
    if cfg.wgmma and not (precision == "tf32" or precision == "fp16" and cfg.tma):
        raise ValueError(f"config: wgmma=1 computes in TF32 (fp16 with tma=1 or 2, on float16 arrays), got "
                         f"precision={precision!r} ({cfg})")
    if cfg.tma and cfg.BK != {"tf32": 32, "fp16": 64}.get(precision):  # a 128-byte row of the operands
        raise ValueError(f"config: tma={cfg.tma} needs BK 32 at tf32 or BK 64 at fp16, got precision={precision!r} "
                         f"({cfg})")
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
    (ks_deconv.ks_view): the zero-insertion view spends (s-1)/s of its MMAs per strided dim on zeros."""
    if ks_deconv.applies(p):
        return ks_deconv.ks_view(p, cfg)
    return implicit_gemm.VIEWS[p.direction](p, cfg)


def build(p, cfg: TileConfig, precision="tf32"):
    """(ConvProblem, TileConfig with WM, WN, precision) -> Kernel."""
    check_config(cfg, precision)
    view = gemm_view(p, cfg)
    k = tiled_gemm(f"conv_{p.direction}_{precision}", view, cfg, precision)
    return k.__class__(k.name, k.params, k.locals, k.body, k.grid, k.threads,
                       {**k.meta, "problem": p.key(), "template": NAME})


def default_config(p, backend, precision="tf32") -> TileConfig:
    """The CPU default (BK 16 for the 16-bit MMAs), or the CUDA tile with the least padded work per SM (narrow tiles for GEMMs with
    few columns); backward-weight splits its long reduction until the grid fills two waves (float32 outputs only)."""
    if backend != "cuda":
        return CPU_TC_DEFAULT if precision == "tf32" else CPU_TC16_DEFAULT
    from . import gemm_shape
    M, N, K, G = gemm_shape(p)

    def cost(t):
        blocks = _cdiv(M, t[0]) * _cdiv(N, t[1]) * G
        return _cdiv(blocks, SM_COUNT) * t[0] * t[1] * (1.0 if t[0] * t[1] >= 128 * 64 else 1.25)
    bm, bn, wm, wn = min(CUDA_TC_TILES, key=cost)
    split = 1
    # a float16 output takes no atomic adds, so no split-K: its backward-weight tile is picked by waves as above
    # (few blocks for a long reduction: slower than the float32 path, never wrong)
    if p.direction == "bwd_weight" and p.dtype != "float16":
        # split-K supplies the blocks here, so the tile is picked by padded work x issue cost per MMA
        # (PERF_NOTES #21), not by waves
        bm, bn, wm, wn = min(CUDA_TC_TILES, key=lambda t: _cdiv(M, t[0]) * t[0] * _cdiv(N, t[1]) * t[1]
                             * ISSUE_COST[t[:2]])
        blocks = _cdiv(M, bm) * _cdiv(N, bn) * G
        split = max(1, min(64, _cdiv(K, CUDA_TC_DEFAULT.BK) // 8, _cdiv(2 * SM_COUNT, blocks)))
    return TileConfig(bm, bn, CUDA_TC_DEFAULT.BK, split_k=split, stages=2, WM=wm, WN=wn, swizzle=1)
