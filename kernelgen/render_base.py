"""Shared printing for the renderers: IR expressions and statements -> Python source text.

A target renderer subclasses SourcePrinter and supplies what differs: the header, how loops of
each binding are executed, how block-local buffers are declared, and how register buffers are
indexed.
"""
from __future__ import annotations

from .ir import (STORAGE_DTYPES, Assign, AsyncCommit, AsyncCopy, AsyncProxyFence, AsyncWait, Barrier, BinOp, Call, Comment,
                 Const, For, If, Kernel, Load, MbarrierExpect, MbarrierInit, MbarrierWait, Mma, Pipeline, Select,
                 TensorCopy,
                 WarpgroupCommit, WarpgroupFence, WarpgroupMma, WarpgroupWait,
                 Store, Var, VectorLoad, compute_dtype)

_PY_OPS = {"and": "and", "or": "or"}
MATH_FNS = {"min": "min", "max": "max", "exp": "math.exp", "tanh": "math.tanh", "sqrt": "math.sqrt",
            "log": "math.log", "erf": "math.erf",
            # operand rounding (cvt.rna.tf32 / cvt.rn.f16 / cvt.rn.bf16): kernelgen.cuda_mma / kernelgen.cpu_round
            "tf32": "tf32", "fp16": "fp16", "bf16": "bf16"}
ROUNDINGS = ("tf32", "fp16", "bf16")


class SourcePrinter:
    indent_unit = "    "

    def __init__(self, kernel: Kernel):
        self.kernel = kernel
        # the type of float constants and zero fills: the arithmetic's, float32 for float16 storage
        self.float_type = compute_dtype(kernel.params[0].dtype) if kernel.params else "float32"
        # buffers that store a narrower float than they compute in: loads widen, stores narrow
        self.stored_narrow = {b.name: b.dtype for b in kernel.params + kernel.locals if b.dtype in STORAGE_DTYPES}
        self.lines: list[str] = []
        self.scopes = {b.name: b.scope for b in kernel.params + kernel.locals}
        self.thread_var = None  # innermost enclosing thread-loop variable
        self.helpers = set()  # tensor-core helpers the module must import (filled while printing)

    # --- expressions -------------------------------------------------------------------------
    def expr(self, e) -> str:
        if isinstance(e, Const):
            v = e.value
            if isinstance(v, bool):
                return "True" if v else "False"
            if isinstance(v, float):
                return f"{self.float_type}({v!r})"
            return str(v)
        if isinstance(e, Var):
            return e.name
        if isinstance(e, BinOp):
            op = _PY_OPS.get(e.op, e.op)
            return f"({self.expr(e.a)} {op} {self.expr(e.b)})"
        if isinstance(e, Call):
            if e.fn in ROUNDINGS:
                self.helpers.add(e.fn)
            return f"{MATH_FNS[e.fn]}({', '.join(self.expr(a) for a in e.args)})"
        if isinstance(e, Select):
            return f"({self.expr(e.a)} if {self.expr(e.cond)} else {self.expr(e.b)})"
        if isinstance(e, Load):
            return self.load(e.buf, self.index(e.buf, e.index))
        raise TypeError(f"cannot render {e!r}")

    def load(self, buf, index_text) -> str:
        text = f"{buf}[{index_text}]"
        return self.widen(text, self.stored_narrow[buf]) if buf in self.stored_narrow else text

    def widen(self, text, dtype) -> str:
        """A float16 / bfloat16 element (its text) as the float32 value it holds (ir.STORAGE_DTYPES)."""
        raise TypeError(f"{type(self).__name__} cannot read {dtype} buffers")

    def narrow(self, text, dtype) -> str:
        """A float32 value (its text) as what a float16 / bfloat16 buffer stores: rounded to nearest even."""
        raise TypeError(f"{type(self).__name__} cannot write {dtype} buffers")

    def stored(self, buf, text) -> str:
        """The value `text` as buffer `buf` stores it (narrowed where its dtype is storage-only)."""
        return self.narrow(text, self.stored_narrow[buf]) if buf in self.stored_narrow else text

    def index(self, buf, index) -> str:
        return ", ".join(self.expr(i) for i in index)

    # --- statements ----------------------------------------------------------------------------
    def emit(self, depth, text):
        self.lines.append(self.indent_unit * depth + text)

    def stmts(self, stmts, depth):
        for s in stmts:
            self.stmt(s, depth)
        if all(isinstance(s, Comment) for s in stmts):  # a body that folding emptied (comments only)
            self.emit(depth, "pass")

    def stmt(self, s, depth):
        if isinstance(s, Assign):
            self.emit(depth, f"{s.var} = {self.expr(s.value)}")
        elif isinstance(s, Store) and s.accumulate == "atomic":
            if s.buf in self.stored_narrow:  # partial sums rounded to fp16 one by one would lose the point
                raise ValueError(f"{s.buf} stores {self.stored_narrow[s.buf]}: split-K (atomic adds into it) needs a float32 output")
            self.atomic_add(s, depth)
        elif isinstance(s, Store) and s.pair is not None:
            self.pair_store(s, depth)
        elif isinstance(s, Store) and s.buf in self.stored_narrow:  # computed in float32, rounded once
            at = self.index(s.buf, s.index)
            value = f"{self.load(s.buf, at)} + {self.expr(s.value)}" if s.accumulate else self.expr(s.value)
            self.emit(depth, f"{s.buf}[{at}] = {self.stored(s.buf, value)}")
        elif isinstance(s, Store):
            op = "+=" if s.accumulate else "="
            self.emit(depth, f"{s.buf}[{self.index(s.buf, s.index)}] {op} {self.expr(s.value)}")
        elif isinstance(s, If):
            self.emit(depth, f"if {self.expr(s.cond)}:")
            self.stmts(s.body, depth + 1)
            if s.orelse:
                self.emit(depth, "else:")
                self.stmts(s.orelse, depth + 1)
        elif isinstance(s, For):
            self.loop(s, depth)
        elif isinstance(s, Barrier):
            self.barrier(depth)
        elif isinstance(s, Comment):
            self.emit(depth, f"# {s.text}")
        elif isinstance(s, Mma):
            self.helpers.add(s.dtype)  # the operands' rounding (the CPU emulation applies it)
            self.mma(s, depth)
        elif isinstance(s, VectorLoad):
            self.vector_load(s, depth)
        elif isinstance(s, AsyncCopy):
            self.async_copy(s, depth)
        elif isinstance(s, (AsyncCommit, AsyncWait)):
            self.async_fence(s, depth)
        elif isinstance(s, WarpgroupMma):
            self.warpgroup_mma(s, depth)
        elif isinstance(s, (WarpgroupFence, WarpgroupCommit, WarpgroupWait, AsyncProxyFence)):
            self.warpgroup_sync(s, depth)
        elif isinstance(s, TensorCopy):
            self.tensor_copy(s, depth)
        elif isinstance(s, (MbarrierInit, MbarrierExpect, MbarrierWait)):
            self.mbarrier(s, depth)
        elif isinstance(s, Pipeline):
            self.pipeline(s, depth)
        else:
            raise TypeError(f"cannot render {s!r}")

    def mma(self, s, depth):
        raise TypeError(f"{type(self).__name__} cannot render a warp-level Mma")

    def pair_store(self, s, depth):
        """Store.pair: the two neighbours as two stores (targets with a wider store override this)."""
        (i,) = s.index
        for at, value in ((self.expr(i), s.value), (f"{self.expr(i)} + 1", s.pair)):
            text = self.expr(value)
            self.emit(depth, f"{s.buf}[{at}] = {self.stored(s.buf, text)}")

    def warpgroup_mma(self, s, depth):
        raise TypeError(f"{type(self).__name__} cannot render a WarpgroupMma")

    def warpgroup_sync(self, s, depth):
        """Warpgroup MMAs finish when issued on targets that emulate them: fences and waits do nothing."""
        self.emit(depth, f"pass  # {type(s).__name__}: warpgroup MMAs are synchronous on this target")

    def tensor_copy(self, s, depth):
        raise TypeError(f"{type(self).__name__} cannot render a TensorCopy")

    def mbarrier(self, s, depth):
        """Tensor copies land when issued on targets that copy synchronously: mbarriers have nothing to count."""
        self.emit(depth, f"pass  # {type(s).__name__}: copies are synchronous on this target")

    def extent(self, n):
        """A loop's trip count: an int, or an int Expr."""
        return str(n) if isinstance(n, int) else self.expr(n)

    def pipeline(self, s, depth):
        """Copies land when issued on targets that copy synchronously: each slice is produced, then consumed."""
        self.emit(depth, f"for {s.var} in range({self.extent(s.count)}):  # pipeline: produce a slice, then consume it")
        self.stmt(Assign(s.stage, Var(s.var) % s.stages), depth + 1)
        self.stmts(s.produce, depth + 1)
        self.stmts(s.consume, depth + 1)
        if s.finish:
            self.stmts(s.finish, depth)

    def vector_load(self, s, depth):
        """Element by element (targets with a wide load override this)."""
        self.emit(depth, f"if {self.expr(s.cond)}:")
        for i, d in enumerate(s.dst):
            at = self.index(s.buf, (s.index + i if i else s.index,))  # the target's index form (CUDA: 32-bit)
            self.emit(depth + 1, f"{self.expr(d)} = {self.load(s.buf, at)}")
        self.emit(depth, "else:")
        for d in s.dst:
            self.emit(depth + 1, f"{self.expr(d)} = {self.float_type}(0.0)")

    def async_copy(self, s, depth):
        """A plain copy, finished when the statement is (targets with a copy engine override this)."""
        if s.src in self.stored_narrow:
            raise ValueError(f"AsyncCopy: {s.src} stores {self.stored_narrow[s.src]}; an asynchronous copy moves bytes, it cannot widen")
        (di,), (si,) = s.dst_index, s.src_index
        self.emit(depth, f"if {self.expr(s.cond)}:")
        for i in range(s.width):
            self.emit(depth + 1, f"{s.dst}[{self.index(s.dst, (di + i if i else di,))}] = "
                                 f"{s.src}[{self.index(s.src, (si + i if i else si,))}]")
        self.emit(depth, "else:")
        for i in range(s.width):
            self.emit(depth + 1, f"{s.dst}[{self.index(s.dst, (di + i if i else di,))}] = {self.float_type}(0.0)")

    def async_fence(self, s, depth):
        """Copies finish when issued here: commit and wait have nothing to do."""
        self.emit(depth, f"pass  # {type(s).__name__}{f'({s.pending})' if isinstance(s, AsyncWait) else ''}: "
                         "copies are synchronous on this target")

    def serial_loop(self, s, depth):
        start = self.expr(s.start) if not isinstance(s.start, int) else str(s.start)
        ext = self.extent(s.extent)
        rng = f"range({ext})" if start == "0" else f"range({start}, {start} + {ext})"
        self.emit(depth, f"for {s.var} in {rng}:")
        self.stmts(s.body, depth + 1)

    def loop(self, s, depth):
        if s.binding in ("serial", "unroll"):
            self.serial_loop(s, depth)
        elif s.binding == "thread":
            outer, self.thread_var = self.thread_var, s.var
            self.thread_loop(s, depth)
            self.thread_var = outer
        else:
            raise ValueError(f"{type(self).__name__}: unexpected {s.binding} loop {s.var!r} inside a block")

    # --- structure -------------------------------------------------------------------------------
    def split_grid(self):
        """The kernel body must open with perfectly nested grid loops: return them and the block body."""
        loops, body = [], self.kernel.body
        while len(body) == 1 and isinstance(body[0], For) and body[0].binding == "grid":
            loops.append(body[0])
            body = body[0].body
        return loops, body

    def docstring(self, depth):
        meta = self.kernel.meta
        self.emit(depth, '"""' + meta.get("doc", self.kernel.name))
        for k in ("problem", "template", "config"):
            if k in meta:
                self.emit(depth, f"{k}: {meta[k]}")
        self.emit(depth, '"""')


def launch_constants(kernel: Kernel) -> str:
    """Module-level facts the runtime needs to launch the kernel without rebuilding its IR."""
    params = tuple(b.name for b in kernel.params)
    outs = tuple(b.name for b in kernel.params if b.role != "in")
    out = (f"\nKERNEL = {kernel.name}\nPARAMS = {params!r}\nOUTPUTS = {outs!r}\n"
           f"GRID = {tuple(kernel.grid)!r}\nTHREADS = {kernel.threads}\n"
           f"ZERO_OUTPUT = {bool(kernel.meta.get('zero_output'))}\n")
    maps = kernel.meta.get("tensor_maps")
    if maps:  # the launcher derives these parameters from the TensorMap fields, as tuples
        specs = tuple((m.name, m.source, m.mode, m.dims, m.strides, m.box, m.lower, m.upper, m.swizzle, m.rounding,
                      m.flip, m.dtype, m.traversal)
                      for m in maps)
        out += f"TENSOR_MAPS = {specs!r}\n"
    if any(b.dtype == "bfloat16" for b in kernel.params):  # its 16-bit arrays are bfloat16 bits, not float16
        out += "BFLOAT16 = True\n"
    return out
