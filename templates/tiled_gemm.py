"""The tiled-GEMM schedule shared by every GEMM-shaped variant.

A variant supplies a GemmView (what C[m, n] = sum_k A[m, k] * B[k, n] means for its problem:
how to gather an A or B element and where C goes); the schedule decides how it runs: block
tiles staged through shared memory, per-thread register tiles or warp(group) MMAs, per-thread index
invariants hoisted into registers before the reduction loop.  TVM's compute/schedule split.

The schedule is built from parts, each with the rules of its modes beside it (TileConfig.validate dispatches to
them): gemm_schedule (the frozen context every part reads), gemm_layout (operand layout and addressing in shared
memory), gemm_staging (global -> registers -> shared, cp.async), gemm_compute (fp32 register tile, warp MMA or
warpgroup MMA, and their epilogues) and gemm_pipelines (one k-loop per TileConfig.pipeline; TMA's in
tma_schedule).  tiled_gemm() checks, builds the context, and assembles the kernel.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from kernelgen.ir import Barrier, For, Kernel
from kernelgen.target import KNOWN_TARGETS, Target
from kernelgen.templates.config import TileConfig
from kernelgen.templates.gemm_layout import shared_bytes
from kernelgen.templates.gemm_pipelines import PIPELINES, require_float32_copies
from kernelgen.templates.gemm_schedule import BlockContext, GemmSchedule, _cdiv, make_schedule
from kernelgen.templates.gemm_staging import invariants, staging_registers

__all__ = ["BlockContext", "GemmView", "Operand", "_cdiv", "shared_bytes", "shared_limit", "tiled_gemm"]


@dataclass
class Operand:
    """How to gather one GEMM operand tile element.

    fast:      which tile axis is contiguous in memory ("k", or "mn" = the operand's m or n axis);
               threads walk it fastest so global loads coalesce.
    invariant: line index (m for A, n for B) -> {name: int Expr}, computed once per thread.
    element:   (inv: {name: Expr}, kk: Expr, k_tile: Expr, k_col: Expr) -> (predicate, value Expr).
    """
    fast: str
    invariant: Callable
    element: Callable
    context: bool = False  # element() also gets a BlockContext (variants that need the block's position)
    # element(kk) for kk % 4 == 0 is a Load whose index is a multiple of 4, and kk .. kk + 3 are the next
    # addresses under the same predicate (one tap, one bounds test): read as one VectorLoad
    vector: bool = False


@dataclass
class GemmView:
    M: int
    N: int
    K: int
    groups: int          # independent GEMMs, one per grid-z slice
    a: Operand
    b: Operand
    store: Callable      # (m, n, g, value, split) -> list of statements; split: the split-K index or None
    params: tuple        # global Buffers, in kernel-argument order
    dtype: str = "float32"
    doc: str = ""
    meta: dict = field(default_factory=dict)
    k_tiles: Callable | None = None  # (BlockContext) -> Expr: a per-block count of BK slices (ConvV2)
    # (cfg, BlockContext) -> tma_schedule.TmaOperands: the operands as TMA boxes (TileConfig.tma); raises ValueError
    # naming what the problem lacks
    tma: Callable | None = None
    tma_a_mn: bool = False  # its TMA A boxes are MN-major (backward-weight's dy: TileConfig.a_mn); else K-major
    # store(m, n + 1) writes the element after store(m, n)'s (a channels-last output, n its channel), so an
    # epilogue may write the two as one Store with a pair
    pairs: bool = False
    # where the batch is the outermost index of an axis: ("M", items per image) - image n owns rows n * items ..
    # (n + 1) * items - 1 and no other row reads it - or ("K", items per image) for the reduction (backward-weight);
    # None where images interleave (ConvV2) or the view does not say.  batch_grid reads it.
    batch: tuple | None = None


def shared_limit(cfg, target: Target = KNOWN_TARGETS["h100"]):
    """Bytes of shared memory a block of this config may use on the target: its static shared arrays' limit (48 KiB),
    or, for the warpgroup-MMA tiles (sm_90 only: the H100's figures by default), its opt-in limit of dynamic shared
    memory (227 KiB; render_cuda switches to a dynamic array past the static limit and the launcher opts the kernel
    in)."""
    return target.optin_shared_per_block if cfg.wgmma else target.static_shared_per_block


def tiled_gemm(name: str, view: GemmView, cfg: TileConfig, precision: str = "tf32") -> Kernel:
    """precision: the tensor-core operand format ("tf32", "fp16", "bf16"); fp32 configs ignore it."""
    cfg.validate()
    if cfg.state_groups != 1:
        raise ValueError(f"config: state_groups is a Winograd schedule field; {name} needs 1, got {cfg}")
    if cfg.col2im and not view.meta.get("col2im"):
        raise ValueError(f"config: col2im=1 is the implicit GEMM's backward-data view (implicit_gemm.col2im_view); "
                         f"{name} has none, got {cfg}")
    require_float32_copies(name, view, cfg)
    limit, need = shared_limit(cfg), shared_bytes(cfg)
    if need > limit:
        raise ValueError(f"config: {cfg.stages} stages of {cfg.BM + cfg.BN} x {cfg.BK} float32 need {need} bytes of "
                         f"shared memory, over the {limit} a block may have; got {cfg}")
    s = make_schedule(name, view, cfg, precision)
    pipeline = PIPELINES[cfg.pipeline]
    pipeline.requires(s)
    return _kernel(s, pipeline.main_loop(s))


def batch_grid(s: GemmSchedule) -> tuple:
    """(grid axis, items per image, items per block along it) where fewer blocks along that axis compute the same
    convolution on fewer images (runtime.launch.Launcher.on_images; () where they do not):
    - ("M", items): the blocks along x are BM rows each, and a block reads only its own rows' images;
    - ("K", items): split-K blocks along z (one GEMM: z is the split) each add k_extent whole BK slices of the
      reduction, and a split reads only its own slices' images (a ragged last split is never among fewer blocks).
    The images past the last block are never read, whatever N the kernel was built for.  Not with TMA boxes (their
    tensor maps hold N) or a reduction whose length is per block (ConvV2)."""
    view, cfg = s.view, s.cfg
    if view.batch is None or view.k_tiles is not None:
        return ()
    axis, per_image = view.batch
    if axis == "M":
        return (0, per_image, cfg.BM)
    if axis == "K" and cfg.split_k > 1 and view.groups == 1:
        return (2, per_image, s.k_extent * cfg.BK)
    return ()


def _kernel(s: GemmSchedule, loop) -> Kernel:
    """The block: invariants and zeroed accumulators (and the pipeline's prologue) in one thread phase, the k-loop,
    the epilogue's stores; over a grid of M / BM x N / BN x groups * split_k blocks."""
    view, cfg, NT = s.view, s.cfg, s.NT
    prologue = invariants(s) + s.compute.zero() + list(loop.prologue)
    epilogue = s.compute.epilogue(s.tid, view, s.m0, s.n0, s.g, s.split)
    block = tuple([For("tid", NT, tuple(prologue), "thread"), Barrier()] + list(loop.kloop)
                  + [For("tid", NT, tuple(epilogue), "thread")])
    SK = cfg.split_k
    grid = (_cdiv(view.M, cfg.BM), _cdiv(view.N, cfg.BN), view.groups * SK)
    body = (For("bm", grid[0], (For("bn", grid[1], (For("bz", grid[2], block, "grid", axis=2),), "grid", axis=1),),
                "grid", axis=0),)
    locals_ = (s.As, s.Bs) + s.compute.locals + staging_registers(s) + tuple(s.inv_a.values()) \
        + tuple(s.inv_b.values()) + loop.locals
    meta = {"doc": view.doc, "config": str(cfg), "zero_output": SK > 1,
            "precision": s.precision if cfg.tensor_core else "fp32",
            "work": view.M * view.N * view.K * view.groups, **view.meta}
    if loop.maps:  # the launcher encodes these from the arrays they name (render_base.launch_constants)
        meta["tensor_maps"] = loop.maps
    elif batch := batch_grid(s):  # (render_cuda writes it as BATCH_GRID)
        meta["batch_grid"] = batch
    if cfg.min_blocks or cfg.tma:  # CUDA launch bounds (render_cuda): (threads per block, min blocks per SM);
        # a TMA tile's block must launch whatever ptxas allocates (288 threads: at most 224 registers each)
        meta["launch_bounds"] = (cfg.threads, max(1, cfg.min_blocks))
    return Kernel(s.name, tuple(view.params) + loop.params, locals_, body, grid, cfg.threads, meta)
