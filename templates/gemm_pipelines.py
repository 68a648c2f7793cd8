"""The k-loops of the tiled-GEMM schedule, one per pipeline kind (TileConfig.pipeline), each with its rules beside it:

* "single_stage": stage a slice (global -> registers -> shared), barrier, compute, barrier;
* "register_double_buffer" (stages=2): the global loads of slice kt + 1 are issued into staging registers before the
  products of slice kt and stored to the other stage after them: load latency hides behind math;
* "cp_async" / "cp_async_wgmma" (async_copy=1): CUTLASS's multistage, `stages - 1` slices in flight by cp.async
  (the warpgroup MMAs' words rounded to TF32 as they land);
* "tma" / "tma_warp_specialised" (tma=1 / 2): tensor copies that one thread (or a producer warp) issues
  (tma_schedule.py).

Each kind is a PipelineKind: check_config(cfg), the config's rules (TileConfig.validate calls it); requires(s),
what it needs of the GEMM view (tiled_gemm calls it once the schedule context s exists); main_loop(s) -> MainLoop.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from kernelgen.ir import AsyncCommit, AsyncProxyFence, AsyncWait, Barrier, Comment, For, If, Var
from kernelgen.templates.gemm_staging import commit, fetch, issue, round_landed
from kernelgen.templates.tma_schedule import tma_pipeline, tma_specialised_pipeline


@dataclass(frozen=True)
class MainLoop:
    """A pipeline's statements: `prologue` ends the first thread phase (prefetches, barrier set-up), `kloop` runs
    the slices; extra shared `locals`, kernel `params` and the tensor maps the launcher encodes (`maps`)."""
    kloop: tuple
    prologue: tuple = ()
    locals: tuple = ()
    params: tuple = ()
    maps: tuple = ()


@dataclass(frozen=True)
class PipelineKind:
    name: str
    check_config: Callable  # (TileConfig) -> None, or ValueError naming the rule
    requires: Callable      # (GemmSchedule) -> None, or ValueError naming what the view lacks
    main_loop: Callable     # (GemmSchedule) -> MainLoop


# --- rules shared by the kinds ------------------------------------------------------------------------------------

def check_b_mn(cfg):
    """B read MN-major (b_mn=1) exists only as TMA boxes of 64 columns of 128 bytes of fp16; A read MN-major (a_mn=1,
    backward-weight) likewise, with B MN-major too (its rows: 64 of the 64-row strips a warpgroup MMA takes)."""
    if cfg.b_mn not in (0, 1) or cfg.b_mn and (not cfg.tma or cfg.BK != 64 or cfg.BN % 64 or cfg.WN % 64):
        raise ValueError(f"TileConfig: b_mn=1 needs tma=1 or 2, BK 64 (fp16) and BN, WN multiples of 64; got {cfg}")
    if cfg.a_mn not in (0, 1) or cfg.a_mn and not cfg.b_mn:
        raise ValueError(f"TileConfig: a_mn=1 (backward-weight's A MN-major) needs b_mn=1; got {cfg}")


def require_fixed_reduction(s):
    """A per-block reduction length (GemmView.k_tiles) is a loop bound only: no split of it, and no prefetch of a
    next slice the block may not have (except TMA's, which tests each slice against the length)."""
    cfg = s.cfg
    if s.view.k_tiles is not None and (cfg.split_k > 1 or cfg.stages > 1 and not cfg.tma):
        raise ValueError(f"TileConfig: a per-block reduction needs split_k=1 and stages=1 (or tma), got {cfg}")


def _when_in_range(s, kt, body):
    """body, under kt < nkt where the last split has fewer slices."""
    return (If(kt < s.nkt, body),) if s.ragged else body


# --- single stage and register double buffer ----------------------------------------------------------------------

def check_register_config(cfg):
    check_b_mn(cfg)
    if cfg.stages not in (1, 2):
        raise ValueError(f"TileConfig: stages must be 1 or 2 (up to 4 with async_copy=1), got {cfg.stages}")


def single_stage(s):
    kt, NT, tid = Var("kt"), s.NT, s.tid
    body = (For("tid", NT, tuple([Comment("stage A and B: global -> shared")] + fetch(s, kt) + commit(s, 0)), "thread"),
            Barrier(), *s.compute.compute(tid, NT, s.As, s.Bs, 0), Barrier())
    return MainLoop([For("kt", s.k_extent, _when_in_range(s, kt, body), "serial", start=s.k_lo)])


def register_double_buffer(s):
    """One barrier per slice: slice j computes from stage j % 2 while slice j + 1 fills the other.  The loop is
    unrolled by two so that every shared-memory address has a constant stage offset."""
    NT, tid, k_lo, k_end, k_extent = s.NT, s.tid, s.k_lo, s.k_end, s.k_extent

    def one_slice(kt, stage):
        nxt = kt + 1
        prefetch = [Comment("prefetch the next slice into registers"), If(nxt < k_end, tuple(fetch(s, nxt)))]
        store = If(nxt < k_end, tuple(commit(s, 1 - stage)))
        if s.cfg.compute == "fp32_tile":  # the thread's own registers only: one thread phase
            body = (For("tid", NT, tuple(s.compute.coords(tid) + prefetch + s.compute.products(s.As, s.Bs, stage)
                                         + [store]), "thread"), Barrier())
        else:  # the MMA steps are thread phases of their own; staging registers carry across them
            body = (For("tid", NT, tuple(prefetch), "thread"), *s.compute.compute(tid, NT, s.As, s.Bs, stage),
                    For("tid", NT, (store,), "thread"), Barrier())
        return _when_in_range(s, kt, body)

    kp = Var("kp")
    kloop = [For("kp", k_extent // 2, one_slice(k_lo + kp * 2, 0) + one_slice(k_lo + kp * 2 + 1, 1), "serial")]
    if k_extent % 2:
        kloop += list(one_slice(k_lo + (k_extent - 1), 0))
    prefetch = [Comment("first slice: global -> shared")] + fetch(s, k_lo) + commit(s, 0)
    return MainLoop(kloop, prologue=tuple([If(k_lo < s.nkt, tuple(prefetch))] if s.ragged else prefetch))


# --- cp.async multistage ------------------------------------------------------------------------------------------

def check_cp_async_config(cfg):
    """16-byte copies land in the swizzled rows (swizzle=1) or the warpgroups' core matrices; stages: at least one
    slice in flight while one is computed."""
    check_b_mn(cfg)
    if cfg.swizzle != 1 and not cfg.wgmma or not 2 <= cfg.stages <= (8 if cfg.wgmma else 4):
        raise ValueError(f"TileConfig: async_copy needs a tensor-core tile with swizzle=1 and stages 2..4 (or "
                         f"wgmma=1 and stages 2..8), got {cfg}")


def require_float32_copies(name, view, cfg):
    """cp.async moves float32 words as they are stored (checked before any schedule part is built)."""
    if cfg.async_copy and view.dtype != "float32":
        raise ValueError(f"config: async_copy copies float32 words into float32 shared tiles; {name} stores "
                         f"{view.dtype} (use async_copy=0), got {cfg}")


def cp_async(s):
    """S-stage pipeline (CUTLASS's multistage): S - 1 slices are in flight while one is computed.  Per slice: wait
    until this thread's copies of slice kt have landed, one barrier (everyone's have landed, and everyone has
    finished computing slice kt - 1, whose stage the next copies overwrite), issue slice kt + S - 1, compute slice
    kt.  Every iteration commits a group, empty past the end, so that "all but the S - 2 newest groups" is always
    slice kt.  Unrolled by S: every stage index is a constant."""
    S, NT, tid, k_lo, k_end, k_extent = s.cfg.stages, s.NT, s.tid, s.k_lo, s.k_end, s.k_extent
    wg = s.cfg.compute == "warpgroup_mma"

    def one_slice(kt, stage):
        nxt = kt + (S - 1)
        # warpgroup MMAs read shared memory through the async proxy: each thread rounds its landed copies to TF32
        # and fences them
        landed = (AsyncWait(S - 2), *round_landed(s, stage), AsyncProxyFence()) if wg else (AsyncWait(S - 2),)
        body = (For("tid", NT, landed, "thread"), Barrier(),
                For("tid", NT, (Comment(f"copy slice + {S - 1} into stage {(stage + S - 1) % S}"),
                                If(nxt < k_end, tuple(issue(s, nxt, (stage + S - 1) % S))), AsyncCommit()), "thread"),
                *s.compute.compute(tid, NT, s.As, s.Bs, stage))
        return _when_in_range(s, kt, body)

    kp = Var("kp")
    kloop = [For("kp", k_extent // S, sum((one_slice(k_lo + kp * S + r, r) for r in range(S)), ()), "serial")]
    kloop += [st for r in range(k_extent % S) for st in one_slice(k_lo + (k_extent // S) * S + r, r)]
    kloop += [For("tid", NT, (AsyncWait(0),), "thread")]  # nothing is in flight when the block ends
    prefetch = [Comment(f"the first {S - 1} slices: global -> shared, asynchronously")]
    for s_ in range(S - 1):
        prefetch += [If(k_lo + s_ < k_end, tuple(issue(s, k_lo + s_, s_))), AsyncCommit()]
    return MainLoop(kloop, prologue=tuple(prefetch))


# --- TMA ----------------------------------------------------------------------------------------------------------

def check_tma_config(cfg):
    """Tensor copies land 128-byte swizzled rows that only the warpgroup MMAs read (so BK is one row: 32 float32 or
    64 float16), counted on an mbarrier per stage (2..8 of them)."""
    if not cfg.wgmma or cfg.async_copy or cfg.BK not in (32, 64) or not 2 <= cfg.stages <= 8:
        raise ValueError(f"TileConfig: tma={cfg.tma} needs wgmma=1, async_copy=0, BK 32 (float32) or 64 "
                         f"(float16) and stages 2..8; got {cfg}")
    check_b_mn(cfg)


def require_tma_view(s):
    """The view must describe its operands as TMA boxes (tma() checks the split against them)."""
    require_fixed_reduction(s)
    if s.view.tma is None:
        raise ValueError(f"config: tma={s.cfg.tma} needs a GEMM view whose operands are TMA boxes (implicit-GEMM "
                         f"forward, backward-data or 16-bit backward-weight); {s.name} has none, got {s.cfg}")
    if s.cfg.a_mn and not s.view.tma_a_mn:
        raise ValueError(f"config: a_mn=1 reads backward-weight's dy MN-major; {s.name} reads its A K-major, got "
                         f"{s.cfg}")


def tma(s):
    """The view's boxes (each split copies its own run of slices; the schedule counts from 0), through
    tma_schedule's k-loop: one issuing thread (tma=1), or a producer warp (tma=2).  split-K must split the slices
    evenly unless the boxes read zeros past the reduction's end (TmaOperands.zeros_past_end)."""
    ops = s.view.tma(s.cfg, s.ctx)
    if s.nkt % s.cfg.split_k and not ops.zeros_past_end:  # a box past the last slice would read real pixels at a
        # tap the filter does not have
        raise ValueError(f"config: tma={s.cfg.tma} needs split_k to divide the {s.nkt} slices of {s.cfg.BK}, got "
                         f"{s.cfg}")
    if s.cfg.split_k > 1:
        ops = replace(ops, a_box=lambda kt, part, box=ops.a_box: box(s.k_lo + kt, part),
                      b_box=lambda kt, part, box=ops.b_box: box(s.k_lo + kt, part))
    schedule = tma_specialised_pipeline if s.cfg.tma == 2 else tma_pipeline
    prologue, kloop, locals_ = schedule(ops, s.cfg, s.k_extent, s.compute, s.As, s.Bs, s.NT, s.tid)
    return MainLoop(tuple(kloop), tuple(prologue), tuple(locals_), ops.params(), (ops.a, ops.b))


PIPELINES = {kind.name: kind for kind in (
    PipelineKind("single_stage", check_register_config, require_fixed_reduction, single_stage),
    PipelineKind("register_double_buffer", check_register_config, require_fixed_reduction, register_double_buffer),
    PipelineKind("cp_async", check_cp_async_config, require_fixed_reduction, cp_async),
    PipelineKind("cp_async_wgmma", check_cp_async_config, require_fixed_reduction, cp_async),
    PipelineKind("tma", check_tma_config, require_tma_view, tma),
    PipelineKind("tma_warp_specialised", check_tma_config, require_tma_view, tma),
)}
