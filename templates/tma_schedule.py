"""The TMA k-loop of the tiled-GEMM schedule (TileConfig.tma=1, with wgmma=1): slices arrive by tensor copies.

Per stage s of S, a shared mbarrier full[s] counts the bytes of the two TensorCopy statements that fill it: an
im2col box of BM pixels x 32 channels of x (one filter tap, padding as zeros) and a tiled box of BN filters x 32
of their k.  Both land in the 128-byte swizzled layout that the warpgroup MMAs read (warpgroup_mma.py).  Thread 0
issues every copy; per slice kt:

    all threads   wait for full[kt % S] (phase kt // S), round their share of the stage to TF32 in place
                  (wgmma would truncate it), fence it for the async proxy
    barrier       everyone's rounding is done, and everyone's MMAs of slice kt - 1 (waited for) are too
    thread 0      refills the stage of slice kt - 1 - slack with slice kt - 1 - slack + S
    warpgroups    the MMAs of slice kt, waited for down to `slack` batches in flight

slack = 1 from 3 stages on (wgmma.wait_group 1, CUTLASS's habit): a slice's MMAs run on through the next slice's
wait, rounding and barrier, and a stage is refilled one slice later, when every warpgroup has waited for the
MMAs that read it; with 2 stages slack = 0.  S slices are in flight from the start, S - 1 - slack after.  On the
CPU the copies happen when issued and the waits are no-ops (render_cpu), so the same IR runs there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..ir import (AsyncProxyFence, Barrier, Buffer, Call, Const, For, If, MbarrierExpect, MbarrierInit, MbarrierWait,
                  TensorCopy, TensorMap, Var, all_of)

ROW = 32  # words of a 128-byte swizzled row: BK = 32 float32


@dataclass(frozen=True)
class TmaOperands:
    """A view's operands as TMA boxes: the two tensor maps, and per slice kt (an Expr) the coordinates of A's box
    (coords, offsets) and of B's box (coords)."""
    a: TensorMap
    b: TensorMap
    a_box: Callable
    b_box: Callable

    def params(self):
        """The maps as kernel parameters (the launcher derives them from the arrays they describe)."""
        return tuple(Buffer(m.name, (16,), "uint64") for m in (self.a, self.b))


def tma_pipeline(ops: TmaOperands, cfg, nkt: int, wmma, As, Bs, NT: int, tid):
    """(prologue statements for the thread phase before the first barrier, k-loop statements, extra locals)."""
    S, a_words, b_words = cfg.stages, cfg.BM * ROW, cfg.BN * ROW
    first = tid.eq(0)

    def issue(kt, stage):
        coords, offsets = ops.a_box(kt)
        return (MbarrierExpect("full", stage, 4 * (a_words + b_words)),
                TensorCopy(As.name, (Const(stage), Const(0)), ops.a, coords, offsets, "full", stage),
                TensorCopy(Bs.name, (Const(stage), Const(0)), ops.b, ops.b_box(kt), (), "full", stage))

    def round_stage(stage):
        out = []
        for buf, words in ((As, a_words), (Bs, b_words)):
            chunks = words // 4
            for i in range(-(-chunks // NT)):
                q = tid + i * NT
                st = tuple(buf.store((Const(stage), q * 4 + w), Call("tf32", (buf[Const(stage), q * 4 + w],)))
                           for w in range(4))
                out += list(st) if chunks % NT == 0 else [If(q < chunks, st)]
        return out

    slack = 1 if S >= 3 else 0

    def one_slice(kt, stage, parity):
        back = 1 + slack  # the slice whose stage is free now: kt - back
        nxt = kt + (S - back)
        refill = all_of([first, kt >= back, nxt < nkt])
        return (For("tid", NT, (MbarrierWait("full", stage, parity), *round_stage(stage), AsyncProxyFence()),
                    "thread"),
                Barrier(),
                For("tid", NT, (If(refill, issue(nxt, (stage + S - back) % S)),), "thread"),
                *wmma.compute(tid, NT, As, Bs, stage, pending=slack))

    prologue = [If(first, tuple(MbarrierInit("full", s, 1) for s in range(S))
                   + tuple(st for s in range(min(S, nkt)) for st in issue(Const(s), s)))]
    kp = Var("kp")
    kloop = [For("kp", nkt // S, sum((one_slice(kp * S + r, r, kp % 2) for r in range(S)), ()), "serial")]
    kloop += [st for r in range(nkt % S) for st in one_slice(Const((nkt // S) * S + r), r, Const((nkt // S) % 2))]
    kloop += wmma.wait_all(NT) if slack else []
    return prologue, kloop, (Buffer("full", (S,), "int64", "shared"),)
