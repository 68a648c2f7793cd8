"""The IR's asynchronous statements (re-exported by kernelgen.ir): copies that land later (cp.async), warpgroup
MMAs that finish later (wgmma), tensor copies counted on mbarriers (TMA), and the producer/consumer Pipeline that
ties them together.  Targets without such hardware run them synchronously (render_base's defaults), which is what
their comments call "the CPU".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from kernelgen.ir_base import Expr, Stmt, as_expr


@dataclass(frozen=True)
class AsyncCopy(Stmt):
    """dst[dst_index + i] = src[src_index + i] for i < width when cond holds, else 0, copied without
    passing through the issuing thread's registers (CUDA: cp.async, global -> shared).  dst is a shared
    buffer, src a global one; width is 1 or 4, and for 4 the template promises that both indices are
    multiples of 4 and that the elements share `cond`.  The copy completes asynchronously: the issuing
    thread may rely on dst only after an AsyncWait that covers the copy's group (AsyncCommit closes a group),
    other threads only after a Barrier that follows that wait.  src is not read where cond fails."""
    dst: str
    dst_index: Tuple[Expr, ...]
    src: str
    src_index: Tuple[Expr, ...]
    cond: Expr
    width: int = 1

    def __post_init__(self):
        if self.width not in (1, 4):
            raise ValueError(f"AsyncCopy: width must be 1 or 4, got {self.width}")


@dataclass(frozen=True)
class AsyncCommit(Stmt):
    """Close the issuing thread's group of AsyncCopy statements issued since the previous commit (possibly
    none: an empty group, which keeps the group count of every pipeline iteration the same)."""


@dataclass(frozen=True)
class AsyncWait(Stmt):
    """Wait until at most `pending` of the issuing thread's committed groups are still in flight."""
    pending: int


@dataclass(frozen=True)
class WarpgroupMma(Stmt):
    """Warpgroup matrix multiply-accumulate, D[64 x n] += A[64 x 8] @ B[8 x n] in TF32, both operands read
    from shared memory (CUDA: sm_90a wgmma.mma_async).  A warpgroup-collective statement: the 4 consecutive
    warps of threads 128 q .. 128 q + 127 execute it together.  With w = (thread % 128) // 32, g = lane // 4,
    t = lane % 4, the n / 2 accumulators `acc` (register-buffer elements, read and written) are

        acc[4 j + r] = D[16 w + g + 8 (r // 2), 8 j + 2 t + r % 2]      (mma.sync's m16n8 layout along n)

    Operand tiles are stored K-major in 8-row x 4-word core matrices (128 contiguous bytes): element (row, k)
    of A is word  a_index + (row // 8) sbo + (k // 4) lbo + (row % 8) 4 + k % 4  of shared buffer `a`, B's
    (column, k) likewise in `b`; a_index and b_index are multiples of 4.  Operands are used as TF32 by
    truncation (their low 13 bits ignored), products accumulated in float32.
    Asynchronous: a batch of these follows a WarpgroupFence and ends with a WarpgroupCommit; the accumulators
    may be read only after a WarpgroupWait that covers the batch.  Shared memory written by the threads
    (stores, AsyncCopy) is read correctly only after an AsyncProxyFence by the writers and then a Barrier."""
    acc: Tuple[Expr, ...]
    a: str
    a_index: Tuple[Expr, ...]
    b: str
    b_index: Tuple[Expr, ...]
    n: int
    lbo: int  # words between core matrices adjacent along k
    sbo: int  # words between core matrices adjacent along rows (m for A, n for B)
    # 128: the 128-byte swizzled layout instead (what TensorCopy writes): (row, k) at element  index + (row // 8)
    # sbo + (row % 8) R + k (R = 128 bytes of elements) with its 16-byte chunk (bits 4-6 of the byte address)
    # XORed with row % 8 (bits 7-9); the tile starts 1024-byte aligned and index moves along k within the
    # 128-byte rows; lbo unused
    swizzle: int = 0
    # "tf32": k 8 of float32 buffers (A[64 x 8] above); "fp16" / "bf16": k 16 of float16 / bfloat16 buffers
    # (A[64 x 16], exact operands, 128-byte swizzle only); indices and offsets count the buffers' elements
    kind: str = "tf32"
    # (n block, k group) strides in elements: B MN-major instead (fp16 / bf16 only), element (col, k) at  b_index +
    # (col // 64) n_block + (k // 8) k_group + (k % 8) 64 + col % 64  (rows of 64 n along k, 128 bytes, swizzled
    # as above with k % 8 for the row): w as stored, read without a transposed copy.  Which descriptor offset
    # carries which stride on the H100 is scripts/wgmma_check.py's mn-major probe (render_cuda.MN_MAJOR_OFFSETS)
    b_mn: Tuple[int, ...] = ()
    # (m block, k group) strides: A MN-major likewise (backward-weight's dy: k_out contiguous), element (row, k) at
    # a_index + (row // 64) m_block + (k // 8) k_group + (k % 8) 64 + row % 64; its descriptor as b_mn's
    a_mn: Tuple[int, ...] = ()

    def __post_init__(self):
        for name, mn in (("a_mn", self.a_mn), ("b_mn", self.b_mn)):
            if mn and (self.kind == "tf32" or len(mn) != 2):
                raise ValueError(f"WarpgroupMma: {name} is fp16's / bf16's (block, k group) strides of an MN-major "
                                 f"operand, got {mn} with kind {self.kind!r}")
        if self.n % 8 or not 8 <= self.n <= 256 or len(self.acc) != self.n // 2:
            raise ValueError(f"WarpgroupMma: n must be a multiple of 8 in 8..256 with n / 2 accumulators, got "
                             f"n={self.n} and {len(self.acc)}")
        if self.kind not in WGMMA_K or self.kind != "tf32" and self.swizzle != 128:
            raise ValueError(f"WarpgroupMma: kind tf32, fp16 or bf16 (16-bit with swizzle 128), got {self.kind!r}, "
                             f"swizzle {self.swizzle}")

    @property
    def k(self):
        return WGMMA_K[self.kind]


WGMMA_K = {"tf32": 8, "fp16": 16, "bf16": 16}  # the reduction depth of one WarpgroupMma per kind


@dataclass(frozen=True)
class WarpgroupFence(Stmt):
    """Before a batch of WarpgroupMma: orders the thread's earlier accesses to the accumulators before it."""


@dataclass(frozen=True)
class WarpgroupCommit(Stmt):
    """Closes the batch of WarpgroupMma issued since the last commit."""


@dataclass(frozen=True)
class WarpgroupWait(Stmt):
    """Waits until at most `pending` committed batches are in flight; `acc` (the accumulators the batches
    write) are valid afterwards."""
    pending: int
    acc: Tuple[Expr, ...]


@dataclass(frozen=True)
class AsyncProxyFence(Stmt):
    """Makes the thread's shared-memory writes (stores and landed AsyncCopy) visible to WarpgroupMma operand
    reads; a Barrier after it extends that to every thread's writes."""


@dataclass(frozen=True)
class TensorMap:
    """What a TensorCopy reads: a box of the global buffer `source` (CUDA: a TMA tensor map, which the launcher
    encodes from the caller's array and passes as the uint64 parameter `name`).  Dims, byte strides (of dims
    1..) and boxes are innermost first.  mode "tiled": boxes of `box` elements; "im2col": `box` = (channels,
    pixels) of a channels-last (C, W, H, N) tensor, the pixels walking the base positions [lower, (W, H) - 1 +
    upper] w, then h, then n, `traversal` apart per dim (a strided convolution's window corners; () = 1).
    swizzle 0 or 128 (bytes): where a box's 128-byte rows land (TensorCopy).
    rounding "tf32": the map (and the kernel's `source` parameter) reads a copy of the caller's array rounded to
    TF32 (cvt.rna) that the launcher makes before the kernel runs: wgmma truncates what it reads, and rounding the
    landed tiles in shared memory costs the compute threads more than their MMAs take (PERF_NOTES #38).
    flip (K, T, C): `source` is a (K, T, C) filter and the map reads a copy written as (C, T, K) with the T taps
    reversed, the filter of the forward convolution that a stride-1 backward-data is (the launcher writes it, and
    rounds it with rounding: TMA boxes need the reduction's k contiguous).  dtype float16 / bfloat16: fp16 / bf16
    operands, exact as stored, 64 to a swizzled row."""
    name: str
    source: str
    mode: str
    dims: Tuple[int, ...]
    strides: Tuple[int, ...]
    box: Tuple[int, ...]
    lower: Tuple[int, ...] = ()
    upper: Tuple[int, ...] = ()
    swizzle: int = 0
    rounding: str = ""
    flip: Tuple[int, ...] = ()
    dtype: str = "float32"  # the source's elements: float32, or float16 / bfloat16 (16-bit operands, never rounded)
    traversal: Tuple[int, ...] = ()  # im2col: the walk's step per spatial dim (w, h), a convolution's stride; () = 1

    def __post_init__(self):
        if self.mode not in ("tiled", "im2col") or self.swizzle not in (0, 128) or self.rounding not in ("", "tf32"):
            raise ValueError(f"TensorMap {self.name}: mode tiled|im2col, swizzle 0|128 and rounding ''|'tf32', got "
                             f"{self.mode}, {self.swizzle}, {self.rounding!r}")
        if self.dtype not in MAP_ITEMSIZE or self.rounding and self.dtype != "float32":
            raise ValueError(f"TensorMap {self.name}: dtype float32, float16 or bfloat16 (rounding float32 only), got "
                             f"{self.dtype} with rounding {self.rounding!r}")
        if any(st % 16 for st in self.strides):  # the driver's rule (cuTensorMapEncode*): checked where the IR is built
            raise ValueError(f"TensorMap {self.name}: byte strides must be multiples of 16, got {self.strides} (dims "
                             f"{self.dims})")
        if self.traversal and (self.mode != "im2col" or len(self.traversal) != len(self.lower)
                               or not all(1 <= t <= 8 for t in self.traversal)):
            raise ValueError(f"TensorMap {self.name}: traversal is an im2col map's step per spatial dim, 1..8 each, "
                             f"got {self.traversal} ({self.mode}, {len(self.lower)} spatial dims)")
        if self.flip and len(self.flip) != 3:
            raise ValueError(f"TensorMap {self.name}: flip is (K, T, C), got {self.flip}")
        if self.swizzle and self.box[0] != self.row:  # the swizzled layout is one of 128-byte rows
            raise ValueError(f"TensorMap {self.name}: swizzle 128 needs box[0] = {self.row} {self.dtype} (128 "
                             f"bytes), got {self.box}")

    @property
    def itemsize(self):
        return MAP_ITEMSIZE[self.dtype]

    @property
    def row(self):
        """Elements of a 128-byte swizzled row."""
        return 128 // self.itemsize

    @property
    def copied(self):
        """Does the map read a copy the launcher makes (rounded, or flipped) rather than the caller's array?"""
        return bool(self.rounding or self.flip)


MAP_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class TensorCopy(Stmt):
    """dst[dst_index ..] = the box of `tmap` at `coords` (innermost first; im2col: channel c and base pixel
    (w, h, n), each pixel read at (h + offsets[1], w + offsets[0])), zeros outside the tensor.  The box lands as
    rows of box[0] words; with swizzle 128 the 16-byte chunk j of row r lands at chunk j ^ (r % 8) (dst_index
    then 1024-byte aligned).  Issued by one thread; it lands asynchronously and counts its bytes on mbarrier
    bar[bar_index], whose MbarrierWait makes dst readable (CUDA: cp.async.bulk.tensor)."""
    dst: str
    dst_index: Tuple[Expr, ...]
    tmap: TensorMap
    coords: Tuple[Expr, ...]
    offsets: Tuple[Expr, ...]
    bar: str
    bar_index: Expr

    def __post_init__(self):
        for f in ("dst_index", "coords", "offsets"):
            object.__setattr__(self, f, tuple(as_expr(e) for e in getattr(self, f)))
        _exprs(self, "bar_index")


def _exprs(stmt, *fields):
    for f in fields:
        object.__setattr__(stmt, f, as_expr(getattr(stmt, f)))


@dataclass(frozen=True)
class MbarrierInit(Stmt):
    """Shared int64 bar[index] becomes a barrier expecting `count` arrivals a phase; a Barrier must follow
    before other threads use it."""
    bar: str
    index: Expr
    count: int

    def __post_init__(self):
        _exprs(self, "index")


@dataclass(frozen=True)
class MbarrierExpect(Stmt):
    """One arrival on bar[index] that also announces `nbytes` of TensorCopy still to land this phase."""
    bar: str
    index: Expr
    nbytes: int

    def __post_init__(self):
        _exprs(self, "index")


@dataclass(frozen=True)
class MbarrierWait(Stmt):
    """Wait until the phase of bar[index] with this parity (0, 1, 0, .. for its 1st, 2nd, 3rd .. phase) completed."""
    bar: str
    index: Expr
    parity: Expr

    def __post_init__(self):
        _exprs(self, "index", "parity")


@dataclass(frozen=True)
class Pipeline(Stmt):
    """A k-loop of `count` slices through `stages` shared stages, written as its two sides: `produce` fills the stage
    of slice Var(var), Var(stage) = var % stages (TensorCopy and MbarrierExpect on full[stage], issued by one
    thread), `consume` reads it (thread phases of the block's first `consumers` threads; a Barrier in it waits for
    those threads only).  Each stage has two shared mbarriers, which the template initialises before the loop:
    full[s] (1 arrival, the producer's MbarrierExpect, plus the bytes it announces) and empty[s] (`consumers`
    arrivals).  After consuming slice kt the consumers release the stage of slice kt - lag (lag > 0: their warpgroup
    MMAs of the last `lag` slices may still read theirs, WarpgroupWait(lag) in `consume`).

    CUDA (warp specialisation): threads >= consumers form the producer warp, whose first thread runs
    `for kt: wait until empty[stage] completed the phase that released slice kt - stages (kt >= stages); produce`;
    the consumers run `for kt: wait for full[stage]'s phase kt // stages; consume; arrive on empty[(kt - lag) %
    stages] (kt >= lag)`, then `finish` (e.g. the wait for their last MMAs: inside the consumers' branch, where ptxas
    keeps the MMAs asynchronous; after the branch it serialises them, C7518).  Other targets run `for kt: produce;
    consume`, then `finish` (their copies land when issued)."""
    var: str
    count: object  # int, or an int Expr of block-uniform values (a per-block reduction length)
    stages: int
    full: str
    empty: str
    consumers: int
    produce: Tuple[Stmt, ...]
    consume: Tuple[Stmt, ...]
    lag: int = 0
    stage: str = "stage"
    finish: Tuple[Stmt, ...] = ()

    def __post_init__(self):
        if not 0 <= self.lag < self.stages or self.consumers % 32:
            raise ValueError(f"Pipeline: needs 0 <= lag < stages and whole warps of consumers, got lag={self.lag}, "
                             f"stages={self.stages}, consumers={self.consumers}")
