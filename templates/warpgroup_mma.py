"""The warpgroup-MMA inner product of the tiled-GEMM schedule (TileConfig.wgmma=1): sm_90's wgmma.

The block's threads form warpgroups of 4 warps (128 threads); warpgroup (wgm, wgn) owns the WM x WN sub-tile
at (wgm * WM, wgn * WN) of the block tile and computes it as WM / 64 strips of 64 x WN, one ir.WarpgroupMma
per strip and 8-deep k step.  Both operands are read by the tensor cores straight from shared memory, so
there are no fragment loads and no register shuffles, which is what held the warp-level mma.sync kernels at
about a quarter of the tensor cores' issue rate (PERF_NOTES #31/#32).  The MMA truncates float32 operands to
TF32, so the schedule rounds each landed word in shared memory first (tiled_gemm's round_landed: truncation
alone measured past the issue's 1e-3 on random data), or reads copies rounded before the kernel (TMA).
fp16 (TMA only): float16 arrays land as stored, 64 to a 128-byte row, and each MMA is 16 deep.

Shared layout (both operands, per stage): rows (m of A, n of B) along k in core matrices of 8 rows x 4 words
(16 bytes per row, 128 contiguous bytes):  word(line, k) = ((line // 8) * BK / 4 + k // 4) * 36 + (line % 8) * 4
+ k % 4,  i.e. core matrices adjacent along k are 36 words apart (the descriptor's leading offset; 4 words of
padding, CORE_STRIDE) and along rows 9 BK words (its stride offset).  A 16-byte chunk (line, k .. k + 3) is 4 consecutive words, so the
k-contiguous operands arrive as one 16-byte asynchronous copy per chunk, and 8 lanes writing the chunks of 8
consecutive lines fill 128 contiguous bytes (no bank conflicts).
"""
from __future__ import annotations

from dataclasses import replace

from ..ir import (Assign, Buffer, Const, For, If, Var, WarpgroupCommit, WarpgroupFence, WarpgroupMma, WarpgroupWait,
                  all_of, as_expr)
from kernelgen.ir_async import WGMMA_K
from kernelgen.storage import HALF_DTYPES, stored_exactly

WARPGROUP = 128


# Words from one core matrix to the next along k: 32 (its 128 bytes) + 4 of padding.  A 16-byte asynchronous
# copy writes shared memory per global request, i.e. the 4 or 8 chunks of one operand row (one line of x or w)
# land together: 128 bytes apart they would all hit banks 0-3 (an 8-way conflict, measured: 6 shared wavefronts
# per copy instead of 1); 144 bytes apart they fall on distinct banks.  The descriptor's offsets take any
# multiple of 16 bytes, and each core matrix stays 128 contiguous bytes.
CORE_STRIDE = 36


def core_word(line, q, w, BK):
    """Word of (line, k = 4 q + w) of a BK-deep operand tile in the core-matrix layout."""
    return ((line // 8) * (BK // 4) + q) * CORE_STRIDE + (line % 8) * 4 + w


def tile_words(lines, BK):
    """Shared words of one stage of a lines x BK operand tile in the core-matrix layout."""
    return (lines // 8) * (BK // 4) * CORE_STRIDE


class WarpgroupGemm:
    def __init__(self, cfg, dtype, precision="tf32", storage="float32"):
        """dtype: the accumulators'; storage: the operands' arrays.  TF32 reads float32 tiles; fp16 / bf16 read
        float16 / bfloat16 tiles as they were stored, which only TMA lands unconverted (tma=1/2)."""
        half = stored_exactly(storage, precision)
        if not ((precision, storage) == ("tf32", "float32") or half and cfg.tma):
            raise ValueError(f"config: wgmma=1 computes TF32 on float32 arrays, or fp16 / bf16 on float16 / bfloat16 "
                             f"arrays with tma=1 or 2; got precision={precision!r} on {storage} ({cfg})")
        self.kind, self.depth = precision, WGMMA_K[precision]
        self.cfg = cfg
        self.MT = cfg.WM // 64  # 64-row strips per warpgroup
        self.groups_n = cfg.BN // cfg.WN
        self.acc = Buffer("acc", (self.MT, cfg.WN // 8, 4), dtype, "register")
        self.locals = (self.acc,)

    def coords(self, tid):
        """The thread's warpgroup position in the block tile, its warp in the warpgroup, and its lane's
        (group, thread-in-group)."""
        lane = Var("lane")
        return [Assign("wgi", tid // WARPGROUP), Assign("wgm", Var("wgi") // self.groups_n),
                Assign("wgn", Var("wgi") % self.groups_n), Assign("wq", (tid % WARPGROUP) // 32),
                Assign("lane", tid % 32), Assign("lg", lane // 4), Assign("lt", lane % 4)]

    def strip(self, i):
        """The accumulators of 64-row strip i, in the WarpgroupMma order acc[4 j + r]."""
        return tuple(self.acc[i, j, r] for j in range(self.cfg.WN // 8) for r in range(4))

    def zero(self):
        return [self.acc.store((i, j, r), Const(0.0))
                for i in range(self.MT) for j in range(self.cfg.WN // 8) for r in range(4)]

    def compute(self, tid, NT_threads, As, Bs, stage, pending=0):
        """One thread phase: acc += As[stage] x Bs[stage] for this warpgroup's sub-tile (one BK slice), as one
        batch of warpgroup MMAs, waited for before the phase ends down to `pending` batches in flight (0: the
        next slice's copies may overwrite any stage after the barrier that follows; 1: the previous slice's
        batch is done, this one may still run: wait_all() before the accumulators are read)."""
        cfg, BK = self.cfg, self.cfg.BK
        wgm, wgn = Var("wgm"), Var("wgn")
        mmas = []
        d = self.depth
        for ks in range(BK // d):  # k steps outer: the strips' independent accumulators interleave
            for i in range(self.MT):
                if cfg.tma:  # 128-byte swizzled rows of BK elements (TMA's layout): a k step moves the start d of them
                    a_first, b_first = (wgm * cfg.WM + 64 * i) * BK + d * ks, wgn * cfg.WN * BK + d * ks
                    # lbo: unused by the swizzled K-major layout; 16 bytes (encoded 1), as CUTLASS sets it
                    layout = dict(lbo=BK // 8, sbo=8 * BK, swizzle=128, kind=self.kind)
                    if cfg.b_mn:  # B MN-major: BK rows of 64 columns per 64-column block, a k step d rows on
                        b_first = (wgn * cfg.WN // 64) * BK * 64 + d * ks * 64
                        layout["b_mn"] = (BK * 64, 8 * 64)
                    if cfg.a_mn:  # A MN-major likewise: strip i is the 64-row block wgm * WM / 64 + i
                        a_first = (wgm * (cfg.WM // 64) + i) * BK * 64 + d * ks * 64
                        layout["a_mn"] = (BK * 64, 8 * 64)
                else:
                    a_first = core_word(wgm * cfg.WM + 64 * i, 2 * ks, 0, BK)
                    b_first = core_word(wgn * cfg.WN, 2 * ks, 0, BK)
                    layout = dict(lbo=CORE_STRIDE, sbo=(BK // 4) * CORE_STRIDE)
                mmas.append(WarpgroupMma(self.strip(i), As.name, (as_expr(stage), a_first), Bs.name,
                                         (as_expr(stage), b_first), cfg.WN, **layout))
        return [For("tid", NT_threads, tuple(self.coords(tid) + [WarpgroupFence()] + mmas
                                             + [WarpgroupCommit(), WarpgroupWait(pending, self.every())]), "thread")]

    def every(self):
        return tuple(a for i in range(self.MT) for a in self.strip(i))

    def wait_all(self, NT_threads):
        """A thread phase that waits for every batch still in flight (after compute(..., pending=1))."""
        return [For("tid", NT_threads, (WarpgroupWait(0, self.every()),), "thread")]

    def epilogue(self, tid, view, m0, n0, g_, split):
        """Guarded stores through the view: acc[i, j, r] is row 64 i + 16 wq + g + 8 (r // 2), column
        8 j + 2 t + r % 2 of the warpgroup's sub-tile."""
        cfg = self.cfg
        wgm, wgn, wq, g, t = Var("wgm"), Var("wgn"), Var("wq"), Var("lg"), Var("lt")
        out = self.coords(tid)
        # 16-bit outputs: a thread's two columns 2t, 2t + 1 as one 4-byte store (half the store instructions)
        paired = view.pairs and view.dtype in HALF_DTYPES and split is None and view.N % 2 == 0
        for i in range(self.MT):
            for j in range(cfg.WN // 8):
                for r in range(0, 4, 2 if paired else 1):
                    m = m0 + wgm * cfg.WM + (64 * i + 8 * (r // 2)) + wq * 16 + g
                    n = n0 + wgn * cfg.WN + (8 * j + r % 2) + t * 2
                    guard = all_of(([m < view.M] if view.M % cfg.BM else []) + ([n < view.N] if view.N % cfg.BN else []))
                    stores = view.store(m, n, g_, self.acc[i, j, r], split)
                    if paired:  # n even and N even: n + 1 < N wherever n < N
                        (first,), (second,) = stores, view.store(m, n + 1, g_, self.acc[i, j, r + 1], split)
                        stores = [_paired(first, second)]
                    out.append(If(guard, tuple(stores)))
        return out


def _paired(first, second):
    """One Store of first's element and second's (the next channel: ir.Store.pair), inside first's guard where the
    view guards its store (KS-deconv's class sizes: the same test for both channels of a position)."""
    if isinstance(first, If):
        (a,), (b,) = first.body, second.body
        return replace(first, body=(_paired(a, b),))
    return replace(first, pair=second.value)
