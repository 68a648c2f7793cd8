"""The kernel IR: plain frozen dataclasses, nothing here knows about numba or CUDA.

A kernel is a tree of statements over buffers.  Three buffer scopes mirror the GPU memory
hierarchy: `global` (kernel arguments), `shared` (one tile per block) and `register` (private
to each thread, persisting across the phases of a block).  Loops carry a binding that says how a
target executes them:

    grid    - one iteration per block (CUDA blockIdx; CPU: the parallel outer loop)
    thread  - one iteration per thread of the block, extent == block size, or the first `extent`
              threads (a Pipeline's consumers) (CUDA threadIdx.x; CPU: a plain loop).  A block body is
              a sequence of thread phases separated by Barriers; scalars (Assign) live within one
              phase, register buffers across phases.
    serial  - an ordinary loop run by every thread
    unroll  - a loop the `unroll` pass expands into straight-line code

Expressions are small trees; Python operators on them build new trees so templates read like
the algorithm (`m0 + row`, `(ih >= 0) & (ih < H)`).  They and Stmt, the statements' base, are defined in
kernelgen/ir_base.py; the asynchronous statements (cp.async copies, warpgroup MMAs, TMA tensor copies,
mbarriers and the producer/consumer Pipeline) in kernelgen/ir_async.py, which builds on ir_base too.  Both are
re-exported here: every IR class is importable from kernelgen.ir.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Tuple

# the expressions and Stmt (kernelgen/ir_base.py) and the asynchronous statements (kernelgen/ir_async.py) are
# part of the IR: re-exported, so `from kernelgen.ir import ...` names every IR class
from kernelgen.ir_async import (AsyncCommit, AsyncCopy, AsyncProxyFence, AsyncWait, MbarrierExpect,  # noqa: F401
                                MbarrierInit, MbarrierWait, Pipeline, TensorCopy, TensorMap, WarpgroupCommit,
                                WarpgroupFence, WarpgroupMma, WarpgroupWait)
from kernelgen.ir_base import (BinOp, Call, Const, Expr, Load, Select, Stmt, Var, all_of, as_expr,  # noqa: F401
                               maximum, minimum, select)


@dataclass(frozen=True)
class Assign(Stmt):
    """Bind a scalar (or rebind it, for accumulators)."""
    var: str
    value: Expr


@dataclass(frozen=True)
class Store(Stmt):
    buf: str
    index: Tuple[Expr, ...]
    value: Expr
    accumulate: bool = False  # buf[index] += value
    # also buf[index + 1] = pair (a plain store of one flat index): two neighbours written at once, one 4-byte
    # store of a float16 pair on CUDA
    pair: Expr | None = None

    def __post_init__(self):
        if self.pair is not None and (self.accumulate or len(self.index) != 1):
            raise ValueError(f"Store {self.buf}: a pair is a plain store at one flat index")


@dataclass(frozen=True)
class For(Stmt):
    var: str
    extent: int | Expr
    body: Tuple[Stmt, ...]
    binding: str = "serial"  # grid | thread | serial | unroll
    axis: int = 0            # grid axis for binding == "grid"
    start: int | Expr = 0


@dataclass(frozen=True)
class If(Stmt):
    cond: Expr
    body: Tuple[Stmt, ...]
    orelse: Tuple[Stmt, ...] = ()


@dataclass(frozen=True)
class Barrier(Stmt):
    pass


@dataclass(frozen=True)
class Comment(Stmt):
    text: str


# (shape, dtype) -> fragment elements per lane (accumulator, A, B)
MMA_SHAPES = {("m16n8k8", "tf32"): (4, 4, 2), ("m16n8k16", "fp16"): (4, 8, 4), ("m16n8k16", "bf16"): (4, 8, 4)}


@dataclass(frozen=True)
class Mma(Stmt):
    """Warp-level matrix multiply-accumulate on one tile: D[16 x 8] += A[16 x K] @ B[K x 8].

    A warp-collective statement: all 32 lanes of a warp execute it together, each contributing the
    fragment elements it holds and receiving its own four accumulator elements.  `acc` (4 locations,
    read and written), `a` and `b` are register-buffer elements (Loads; after register scalarisation,
    Vars) in the PTX ISA's m16n8k8 fragment layout (kernelgen/mma_layout.py): with g = lane // 4 and
    t = lane % 4,

        a[r] = A[g + 8 * (r % 2), t + 4 * (r // 2)]      b[r] = B[t + 4 * r, g]
        acc[r] = D[g + 8 * (r // 2), 2 * t + r % 2]

    shape "m16n8k8", dtype "tf32": K = 8, 4 A and 2 B values; operands are used as TF32 (rounded to
    nearest, ties away, to 10 mantissa bits; a template normally rounds them once when staging,
    Call("tf32", ...), which makes this exact).
    shape "m16n8k16", dtype "fp16" / "bf16": K = 16 as two consecutive 8-deep steps, each in the m16n8k8
    layout above: a = step 0's 4 values then step 1's 4, b = step 0's 2 then step 1's 2 (targets map
    them onto the 16-bit MMA's own register layout, mma_layout.pack16); operands are used as fp16 /
    bf16 (round to nearest even; Call("fp16"/"bf16", ...) when staging makes that exact).
    Products are accumulated in float32.  Every lane of the warp must reach the statement, and the
    fragments of all lanes must be written before it (targets that run the lanes of a warp one after
    another, the CPU, need the fragment stores in an earlier thread phase than the Mma).
    """
    acc: Tuple[Expr, ...]
    a: Tuple[Expr, ...]
    b: Tuple[Expr, ...]
    shape: str = "m16n8k8"
    dtype: str = "tf32"

    def __post_init__(self):
        counts = MMA_SHAPES.get((self.shape, self.dtype))
        if counts is None:
            raise ValueError(f"Mma: shape/dtype must be one of {sorted(MMA_SHAPES)}, got "
                             f"{self.shape!r}/{self.dtype!r}")
        if (len(self.acc), len(self.a), len(self.b)) != counts:
            raise ValueError(f"Mma {self.shape} {self.dtype}: expected {counts[0]} accumulator, {counts[1]} A and "
                             f"{counts[2]} B fragment elements")


@dataclass(frozen=True)
class VectorLoad(Stmt):
    """dst[i] = buf[index + i] for i < len(dst) when cond holds, else 0: consecutive elements of a global
    buffer read as one memory transaction where the target has one (CUDA: a 16-byte load when the address
    is 16-byte aligned, which the kernel tests, since a caller's array may start anywhere).  `dst` are
    register-buffer elements (Loads; Vars after register scalarisation), written.  The template promises
    that the elements share `cond` and that `index` is a multiple of len(dst).  From a storage-only buffer
    (float16) the dst receive float32 values, like a Load."""
    dst: Tuple[Expr, ...]
    buf: str
    index: Expr
    cond: Expr


BINDINGS = ("grid", "thread", "serial", "unroll")
SCOPES = ("global", "shared", "register")
# Storage-only dtypes -> the dtype their values are computed in.  A global buffer may store float16
# (inputs and outputs of half-precision convolutions), but a Load of it is the element's value as float32
# (exact) and a Store into it rounds its float32 value once, to nearest even (overflow to inf); shared and
# register buffers hold computed values, so they never have a storage-only dtype.
STORAGE_DTYPES = {"float16": "float32", "bfloat16": "float32"}  # bfloat16: uint16 bit patterns in NumPy / numba


def compute_dtype(dtype):
    """The dtype values of a `dtype` buffer are computed in (itself, unless storage-only)."""
    return STORAGE_DTYPES.get(dtype, dtype)


@dataclass(frozen=True)
class Buffer:
    name: str
    shape: Tuple[int, ...]
    dtype: str = "float32"
    scope: str = "global"
    role: str = "in"  # for globals: in | out | inout

    def __post_init__(self):
        # shared float16 tiles hold what TMA copies land for fp16 warpgroup MMAs; registers compute
        if self.dtype in STORAGE_DTYPES and self.scope == "register":
            raise ValueError(f"buffer {self.name!r}: {self.dtype} is a storage dtype of global and shared buffers; "
                             f"a {self.scope} buffer holds {compute_dtype(self.dtype)}")

    @property
    def size(self):
        n = 1
        for s in self.shape:
            n *= s
        return n

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        return Load(self.name, tuple(as_expr(i) for i in index))

    def store(self, index, value, accumulate=False):
        index = index if isinstance(index, tuple) else (index,)
        return Store(self.name, tuple(as_expr(i) for i in index), as_expr(value), accumulate)


@dataclass(frozen=True)
class Kernel:
    """One kernel: global parameters, block-local buffers, a body, launch geometry, metadata."""
    name: str
    params: Tuple[Buffer, ...]
    locals: Tuple[Buffer, ...]
    body: Tuple[Stmt, ...]
    grid: Tuple[int, ...]
    threads: int
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def buffer(self, name):
        for b in self.params + self.locals:
            if b.name == name:
                return b
        raise KeyError(name)

