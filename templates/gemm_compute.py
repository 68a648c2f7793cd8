"""The inner product of the tiled-GEMM schedule, one of three kinds (TileConfig.compute):

* "fp32_tile": each thread owns a TM x TN register tile of outputs and accumulates outer products of a column of
  A and a row of B per k step (Fp32Tile, here);
* "warp_mma": warps of m16n8k8 TF32 / m16n8k16 fp16, bf16 MMAs on WM x WN sub-tiles (warp_mma.WarpMma);
* "warpgroup_mma": warpgroups of sm_90 wgmma reading both operands from shared memory
  (warpgroup_mma.WarpgroupGemm).

All three offer the same parts: zero() (the accumulators), compute(tid, NT, As, Bs, stage) (thread phases adding
one BK slice), epilogue(tid, view, m0, n0, g, split) (guarded stores of the outputs through the view) and locals.
Each kind's rules on the config sit here, beside make_compute; its rules on the precision sit in its class.
"""
from __future__ import annotations

from kernelgen.ir import Assign, Buffer, Const, For, If, Var, all_of
from kernelgen.templates.warp_mma import WarpMma
from kernelgen.templates.warpgroup_mma import WarpgroupGemm


def check_fp32_tile(cfg):
    """The fp32 register tile's rule (TileConfig.validate): threads own whole TM x TN tiles of the block tile."""
    if cfg.BM % cfg.TM or cfg.BN % cfg.TN:
        raise ValueError(f"TileConfig: BM/BN must be multiples of TM/TN, got {cfg}")


def check_mma_tile(cfg):
    """The tensor-core tiles' rule (any of WM, WN set): whole m16n8 MMA tiles per warp, 8-deep k steps, whole
    warp (or warpgroup) tiles per block."""
    if cfg.WM <= 0 or cfg.WN <= 0 or cfg.WM % 16 or cfg.WN % 8 or cfg.BK % 8 or cfg.BM % cfg.WM or cfg.BN % cfg.WN:
        raise ValueError(f"TileConfig: a tensor-core tile needs WM % 16 == 0, WN % 8 == 0, BK % 8 == 0 "
                         f"and BM, BN multiples of WM, WN; got {cfg}")


def check_warpgroup(cfg):
    """The warpgroup MMAs' rules (wgmma=1): 64-row strips, at most 256 columns per MMA, operands that arrive in
    shared memory asynchronously (cp.async into core matrices, or TMA into 128-byte swizzled rows; neither has a
    rotated or padded row), BK a whole number of 16-byte chunks (128-byte rows under TMA)."""
    if cfg.wgmma and (not cfg.tensor_core or cfg.WM % 64 or cfg.WN > 256 or not (cfg.async_copy or cfg.tma)
                      or cfg.swizzle or cfg.smem_pad or cfg.BK not in ((32, 64) if cfg.tma else (8, 16, 32))):
        raise ValueError(f"TileConfig: wgmma needs WM a multiple of 64, WN <= 256, async_copy=1 or tma=1, "
                         f"swizzle=0, smem_pad=0 and BK in (8, 16, 32) (tma: 32 or 64); got {cfg}")


class Fp32Tile:
    """The fp32 register tile: thread (ty, tx) owns outputs ty*TM.. x tx*TN.. of the block tile; per k step it
    loads TM words of A and TN of B from the k-major shared tiles into registers and adds their outer product.
    Its thread phases touch only the thread's own registers, so a pipeline may fuse them with staging
    (products())."""

    def __init__(self, cfg, dtype):
        TM, TN = cfg.TM, cfg.TN
        self.cfg = cfg
        self.acc = Buffer("acc", (TM, TN), dtype, "register")
        self.a_frag = Buffer("a_frag", (TM,), dtype, "register")
        self.b_frag = Buffer("b_frag", (TN,), dtype, "register")
        self.locals = (self.acc, self.a_frag, self.b_frag)

    def coords(self, tid):
        """The thread's (ty, tx) as scalars."""
        per_row = self.cfg.BN // self.cfg.TN
        return [Assign("ty", tid // per_row), Assign("tx", tid % per_row)]

    def zero(self):
        return [self.acc.store((i, j), Const(0.0)) for i in range(self.cfg.TM) for j in range(self.cfg.TN)]

    def products(self, As, Bs, stage):
        """Statements inside a thread phase (after coords()): acc += As[stage] x Bs[stage] over one BK slice."""
        TM, TN = self.cfg.TM, self.cfg.TN
        ty, tx, kk = Var("ty"), Var("tx"), Var("kk")
        return [For("kk", self.cfg.BK, tuple(
            [self.a_frag.store(i, As[stage, kk, ty * TM + i]) for i in range(TM)]
            + [self.b_frag.store(j, Bs[stage, kk, tx * TN + j]) for j in range(TN)]
            + [self.acc.store((i, j), self.a_frag[i] * self.b_frag[j], accumulate=True)
               for i in range(TM) for j in range(TN)]), "unroll")]

    def compute(self, tid, NT_threads, As, Bs, stage):
        """One thread phase adding slice `stage`."""
        return [For("tid", NT_threads, tuple(self.coords(tid) + self.products(As, Bs, stage)), "thread")]

    def epilogue(self, tid, view, m0, n0, g, split):
        """Guarded stores through the view, one per register of the tile."""
        cfg = self.cfg
        ty, tx = Var("ty"), Var("tx")
        out = self.coords(tid)
        for i in range(cfg.TM):
            for j in range(cfg.TN):
                m, n = m0 + ty * cfg.TM + i, n0 + tx * cfg.TN + j
                guard = all_of(([m < view.M] if view.M % cfg.BM else []) + ([n < view.N] if view.N % cfg.BN else []))
                out.append(If(guard, tuple(view.store(m, n, g, self.acc[i, j], split))))
        return out


def make_compute(cfg, dtype, precision, storage):
    """The inner product cfg.compute names.  dtype: the accumulators'; precision: the tensor cores' operand format
    (fp32 tiles ignore it); storage: the operands' arrays.  Asynchronous copies bypass the staging registers, so
    warp MMAs fed by them round operands where fragments are loaded."""
    if cfg.compute == "warpgroup_mma":
        return WarpgroupGemm(cfg, dtype, precision, storage)
    if cfg.compute == "warp_mma":
        return WarpMma(cfg, dtype, precision, round_fragments=bool(cfg.async_copy))
    return Fp32Tile(cfg, dtype)
