"""The TMA k-loop of the tiled-GEMM schedule (TileConfig.tma=1, with wgmma=1): slices arrive by tensor copies.

Per stage s of S, a shared mbarrier full[s] counts the bytes of the two TensorCopy statements that fill it: an
im2col box of BM pixels x BK channels of x (one filter tap, padding as zeros) and a tiled box of BN filters x BK
of their k, BK = 128 bytes of elements (32 float32, 64 float16).  Both land in the 128-byte swizzled layout that
the warpgroup MMAs read (warpgroup_mma.py): float32 from copies of x and w already rounded to TF32
(TensorMap.rounding: wgmma truncates what it reads), float16 as stored.  Thread 0 issues
every copy; per slice kt:

    all threads   wait for full[kt % S] (phase kt // S)
    barrier       everyone's MMAs of slice kt - 1 - slack are done (waited for)
    thread 0      refills the stage of slice kt - 1 - slack with slice kt - 1 - slack + S
    warpgroups    the MMAs of slice kt, waited for down to `slack` batches in flight

slack = 1 from 3 stages on (wgmma.wait_group 1, CUTLASS's habit): a slice's MMAs run on through the next slice's
wait and barrier, and a stage is refilled one slice later, when every warpgroup has waited for the MMAs that read
it; with 2 stages slack = 0.  S slices are in flight from the start, S - 1 - slack after.  On the CPU the copies
happen when issued and the waits are no-ops (render_cpu), so the same IR runs there.

tma=2 (warp specialisation, tma_specialised_pipeline): the same copies and MMAs as an ir.Pipeline.  A producer warp
beside the NT compute threads refills each stage as soon as every compute thread has released it (an `empty`
mbarrier per stage, NT arrivals), and the compute threads never meet the producer, nor each other: no thread
waits for a copy it could have issued earlier.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kernelgen import settings

from ..ir import (Barrier, Buffer, Const, For, If, MbarrierExpect, MbarrierInit, MbarrierWait, Pipeline, TensorCopy,
                  TensorMap, Var, all_of, as_expr)

ROW = 32  # words of a 128-byte swizzled row: BK = 32 float32


def swizzled_row(dtype):
    """Elements of a 128-byte swizzled row, the BK of a TMA tile: 32 float32 (TF32), 64 float16 / bfloat16."""
    return {"float32": 32, "float16": 64, "bfloat16": 64}[dtype]


@dataclass(frozen=True)
class TmaOperands:
    """A view's operands as TMA boxes: the two tensor maps, and a_box(kt, part) / b_box(kt, part) -> (coords,
    offsets) of box `part` of slice kt (an Expr) of A / of B.  a_parts / b_parts: boxes per slice (an MN-major
    operand: one per 64 columns, TileConfig.a_mn / b_mn), box j landing j boxes' elements into the stage."""
    a: TensorMap
    b: TensorMap
    a_box: Callable
    b_box: Callable
    a_parts: int = 1
    b_parts: int = 1
    # a slice past the reduction's end reads zeros in one operand's boxes (backward-weight's dy), so a split-K's last
    # split may run past it; elsewhere such a box reads real elements at a tap the filter does not have
    zeros_past_end: bool = False

    def params(self):
        """The maps as kernel parameters (the launcher derives them from the arrays they describe)."""
        return tuple(Buffer(m.name, (16,), "uint64") for m in (self.a, self.b))


def _issue(ops: TmaOperands, cfg, As, Bs, kt, stage):
    """One thread's statements that fill `stage` with slice kt: announce the bytes on full[stage], copy the boxes."""
    stage = as_expr(stage)

    def copies(dst, tmap, box, parts):
        elements = 1
        for extent in tmap.box:
            elements *= extent
        return tuple(TensorCopy(dst.name, (stage, Const(j * elements)), tmap, *box(kt, j), "full", stage)
                     for j in range(parts))
    return (MbarrierExpect("full", stage, 128 * (cfg.BM + cfg.BN)),  # BM + BN rows of 128 bytes
            *copies(As, ops.a, ops.a_box, ops.a_parts), *copies(Bs, ops.b, ops.b_box, ops.b_parts))


# fp16 kernels measured wrong (0.1-0.3 relative) on the H100 where a k-loop of 3+ rounds carried wgmma batches in
# flight across its back edge (PERF_NOTES #43); TF32 did not.  The setting tma_drain_each_round=False (a code
# setting: part of every kernel's key) reproduces that schedule.


def _when(cond, stmts):
    """stmts, under `cond` unless it is the Python True of a length known when the kernel is built."""
    return tuple(stmts) if cond is True else (If(cond, tuple(stmts)),)


def tma_pipeline(ops: TmaOperands, cfg, nkt, wmma, As, Bs, NT: int, tid):
    """(prologue statements for the thread phase before the first barrier, k-loop statements, extra locals).
    nkt: the slices, an int, or an int Expr of the block's position (KS-deconv's classes: a sub-filter's taps)."""
    S = cfg.stages
    fixed = isinstance(nkt, int)
    first = tid.eq(0)
    issue = lambda kt, stage: _issue(ops, cfg, As, Bs, kt, stage)

    slack = 1 if S >= 3 else 0

    def one_slice(kt, stage, parity, pending=slack):
        back = 1 + slack  # the slice whose stage is free now: kt - back
        nxt = kt + (S - back)
        refill = all_of([first, kt >= back, nxt < nkt])
        return (For("tid", NT, (MbarrierWait("full", stage, parity),), "thread"),
                Barrier(),
                For("tid", NT, (If(refill, issue(nxt, (stage + S - back) % S)),), "thread"),
                *wmma.compute(tid, NT, As, Bs, stage, pending=pending))

    prologue = [If(first, tuple(MbarrierInit("full", s, 1) for s in range(S))
                   + tuple(st for s in range(min(S, nkt) if fixed else S)
                           for st in _when(True if fixed else Const(s) < nkt, issue(Const(s), s))))]
    kp = Var("kp")
    # no MMA batch in flight across the loop's back edge (tma_drain_each_round, PERF_NOTES #43): the round's last
    # slice waits for all of its MMAs
    drain = settings.get("tma_drain_each_round")
    last = lambda r: 0 if drain and r == S - 1 else slack
    kloop = [For("kp", nkt // S, sum((one_slice(kp * S + r, r, kp % 2, last(r)) for r in range(S)), ()), "serial")]
    if fixed:
        kloop += [st for r in range(nkt % S) for st in one_slice(Const((nkt // S) * S + r), r, Const((nkt // S) % 2))]
    else:  # the remainder's slices, each under its own test and waited for inside it: an MMA batch still in flight
        # where the branches meet came out wrong on the H100 (r18_c128_s2's classes at 8 stages, 4.05e-02), as
        # batches across a loop's back edge did (#43)
        kloop += [st for r in range(S - 1)
                  for st in _when(Const(r) < nkt % S, one_slice((nkt // S) * S + r, r, (nkt // S) % 2, 0))]
    kloop += wmma.wait_all(NT) if slack else []
    return prologue, kloop, (Buffer("full", (S,), "int64", "shared"),)


def tma_specialised_pipeline(ops: TmaOperands, cfg, nkt: int, wmma, As, Bs, NT: int, tid):
    """tma=2: as tma_pipeline, with a producer warp (ir.Pipeline); NT counts the compute threads only.  The MMAs
    of a slice run on while the next one is waited for (lag 1: a stage is released one slice after its MMAs were
    issued, once wgmma.wait_group 1 has seen them done)."""
    S, stage = cfg.stages, Var("stage")
    prologue = [If(tid.eq(0), tuple(MbarrierInit("full", s, 1) for s in range(S))
                   + tuple(MbarrierInit("empty", s, NT) for s in range(S)))]
    consume = tuple(wmma.compute(tid, NT, As, Bs, stage, pending=1))
    # the consumers wait for their last MMAs inside the pipeline (ir.Pipeline.finish: ptxas would serialise them)
    kloop = [Pipeline("kt", nkt, S, "full", "empty", NT, _issue(ops, cfg, As, Bs, Var("kt"), stage), consume, lag=1,
                      finish=tuple(wmma.wait_all(NT)))]
    return prologue, kloop, (Buffer("full", (S,), "int64", "shared"), Buffer("empty", (S,), "int64", "shared"))
