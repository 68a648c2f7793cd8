"""Render lowered IR as a numba.cuda kernel module (source text)."""
from __future__ import annotations

from kernelgen.fresh_names import fresh_names

from . import settings
from .ir import (Assign, AsyncCopy, AsyncProxyFence, AsyncWait, BinOp, Call, Const, For, Kernel, MbarrierExpect,
                 MbarrierInit, Pipeline, Select, TensorCopy, Var, WarpgroupCommit, WarpgroupFence, WarpgroupMma, WarpgroupWait)
from .ir_walk import walk_stmts
from .passes import lower
from .render_base import SourcePrinter, launch_constants
from .target import STATIC_SHARED_BYTES, Target

_AXES = "xyz"
# an MN-major B operand's descriptor (ir.WarpgroupMma.b_mn): which stride goes in the leading and which in the stride
# byte offset.  Measured on the H100 (`scripts/wgmma_check.py --parts mn-major`, BENCHMARKS.md 2026-11-25): the
# 64-column block stride leads, the 8-row group stride (1024 B) strides; the swapped reading is 0.92 wrong
MN_MAJOR_OFFSETS = ("n_block", "k_group")
_INT_OPS = {"+": "add32", "-": "sub32", "*": "mul32", "//": "floordiv32", "%": "mod32"}  # kernelgen.cuda_index


def index32_enabled() -> bool:
    """32-bit index math (kernelgen/cuda_index.py) unless the setting index32 is off (KERNELGEN_INDEX32=0).
    In the simulator the intrinsics are checked Python stand-ins, so simulator tests verify the renderer's proofs."""
    return settings.get("index32")


def index32_safe(kernel: Kernel) -> bool:
    """Every global buffer small enough that no offset or intermediate of one overflows int32."""
    return all(b.size < 2 ** 30 for b in kernel.params)


class CudaPrinter(SourcePrinter):
    def __init__(self, kernel: Kernel, index32: bool = False, aligned: bool = False, name: str | None = None,
                 static_shared: int = STATIC_SHARED_BYTES):
        """aligned: every array argument starts 16-byte aligned (the launcher checks; see render_cuda), so
        16-byte loads and copies need no run-time alignment test and no 4-byte fallback.  name: the function's
        name (default: the kernel's).  static_shared: the most bytes of static shared arrays a block may have
        (Target.static_shared_per_block); past it the tiles become one dynamic array."""
        super().__init__(kernel)
        self.static_shared = static_shared
        self.index32 = index32
        self.aligned = aligned
        self.name = name or kernel.name
        self.int_vars = set()
        self.nonneg_vars = set()  # ints proven >= 0 (grid, thread and loop indices, sums of those...)
        self.memory_helpers = set()  # what the module imports from kernelgen.cuda_memory
        self.wgmma_helpers = set()  # ... and from kernelgen.cuda_wgmma
        self.tma_helpers = set()  # ... and from kernelgen.cuda_tma
        self.consumers = 0  # inside a Pipeline's consumer side: its thread count (Barrier syncs those only)
        # kernels with a Pipeline branch on the thread's warpgroup, read warp-uniformly (see render)
        self.specialised = any(isinstance(s, Pipeline) for s in walk_stmts(kernel.body))

    def is_int(self, e) -> bool:
        if isinstance(e, Const):
            return isinstance(e.value, int) and not isinstance(e.value, bool)
        if isinstance(e, Var):
            return e.name in self.int_vars
        if isinstance(e, BinOp):
            return e.op in _INT_OPS and self.is_int(e.a) and self.is_int(e.b)
        if isinstance(e, Call):
            return e.fn in ("min", "max") and all(self.is_int(a) for a in e.args)
        if isinstance(e, Select):
            return self.is_int(e.a) and self.is_int(e.b)
        return False

    def nonneg(self, e) -> bool:
        if isinstance(e, Const):
            return self.is_int(e) and e.value >= 0
        if isinstance(e, Var):
            return e.name in self.nonneg_vars
        if isinstance(e, BinOp) and e.op in ("+", "*", "//", "%"):
            return self.nonneg(e.a) and self.nonneg(e.b)
        if isinstance(e, Call) and e.fn in ("min", "max"):
            return all(self.nonneg(a) for a in e.args) if e.fn == "min" else any(self.nonneg(a) for a in e.args)
        if isinstance(e, Select):
            return self.nonneg(e.a) and self.nonneg(e.b)
        return False

    def expr(self, e) -> str:
        if self.index32 and isinstance(e, BinOp) and e.op in _INT_OPS and self.is_int(e):
            fn = _INT_OPS[e.op]
            if e.op in ("//", "%") and self.nonneg(e.a) and isinstance(e.b, Const) and e.b.value > 0:
                fn = "udiv32" if e.op == "//" else "umod32"
            return f"{fn}({self.expr(e.a)}, {self.expr(e.b)})"
        return super().expr(e)

    def index(self, buf, index) -> str:
        if not self.index32:
            return super().index(buf, index)
        return ", ".join(f"uidx({self.expr(i)})" if self.is_int(i) else self.expr(i) for i in index)

    def stmt(self, s, depth):
        if isinstance(s, Assign) and self.is_int(s.value):
            self.int_vars.add(s.var)
            (self.nonneg_vars.add if self.nonneg(s.value) else self.nonneg_vars.discard)(s.var)
        elif isinstance(s, For):
            self.int_vars.add(s.var)
            start = s.start if not isinstance(s.start, int) else Const(s.start)
            if self.nonneg(start):
                self.nonneg_vars.add(s.var)
        super().stmt(s, depth)

    def mma(self, s, depth):
        # one mma.sync per statement: the four accumulator scalars are rebound from its result tuple
        acc = ", ".join(self.expr(e) for e in s.acc)
        ops = ", ".join(self.expr(e) for e in s.acc + s.a + s.b)
        fn = MMA_INTRINSICS[s.shape, s.dtype]
        self.helpers.add(fn)
        self.emit(depth, f"{acc} = {fn}({ops})")

    # float16 buffers are numba float16 arrays: an explicit float32() is cvt.f32.f16 (exact), and numba casts a
    # float32 stored into a float16 array with fptrunc, i.e. cvt.rn.f16.f32 (nearest even, overflow to inf).
    # bfloat16 buffers are uint16 arrays of bit patterns (kernelgen.cuda_memory.bf16_widen / bf16_narrow).
    def widen(self, text, dtype):
        if dtype == "bfloat16":
            self.memory_helpers.add("bf16_widen")
            return f"bf16_widen({text})"
        return f"float32({text})"

    def narrow(self, text, dtype):
        if dtype == "bfloat16":
            self.memory_helpers.add("bf16_narrow")
            return f"bf16_narrow({text})"
        return text

    def vector_load(self, s, depth):
        dtype = self.kernel.buffer(s.buf).dtype
        if dtype == "float32" and len(s.dst) == 4:
            fn = "load4"
        elif dtype == "float16" and len(s.dst) in (2, 4, 8):  # 4, 8 or 16 bytes of float16, widened
            fn = f"load{len(s.dst)}h"
        else:
            return super().vector_load(s, depth)
        fn += "_aligned" if self.aligned else ""
        self.memory_helpers.add(fn)
        dst = ", ".join(self.expr(d) for d in s.dst)
        self.emit(depth, f"{dst} = {fn}({s.buf}, {self.expr(s.index)}, {self.expr(s.cond)})")

    def async_copy(self, s, depth):
        if self.kernel.buffer(s.src).dtype != "float32" or self.kernel.buffer(s.dst).dtype != "float32":
            raise ValueError(f"AsyncCopy {s.src} -> {s.dst}: the CUDA copies move float32 words only")
        fn = ("copy_async16" if self.aligned else "copy_async4") if s.width == 4 else "copy_async"
        self.memory_helpers.add(fn)
        (di,), (si,) = s.dst_index, s.src_index
        self.emit(depth, f"{fn}({s.dst}, {self.expr(di)}, {s.src}, {self.expr(si)}, {self.expr(s.cond)})")

    def async_fence(self, s, depth):
        fn = "copy_async_wait" if isinstance(s, AsyncWait) else "copy_async_commit"
        self.memory_helpers.add(fn)
        self.emit(depth, f"{fn}({s.pending})" if isinstance(s, AsyncWait) else f"{fn}()")

    def pair_store(self, s, depth):
        fn = {"float16": "store_pair16", "bfloat16": "store_pair_bf16"}.get(self.kernel.buffer(s.buf).dtype)
        if fn is None:
            return super().pair_store(s, depth)
        self.memory_helpers.add(fn)  # one 4-byte store where the pair is 4-byte aligned
        (i,) = s.index
        self.emit(depth, f"{fn}({s.buf}, {self.expr(i)}, {self.expr(s.value)}, {self.expr(s.pair)})")

    def warpgroup_mma(self, s, depth):
        fn = {"tf32": f"wgmma_tf32_m64n{s.n}k8", "fp16": f"wgmma_f16_m64n{s.n}k16",
              "bf16": f"wgmma_bf16_m64n{s.n}k16"}[s.kind] + ("_amn" if s.a_mn else "") + ("_bmn" if s.b_mn else "")
        desc = "smem_desc_sw128" if s.swizzle else "smem_desc"
        self.wgmma_helpers |= {fn, desc}
        acc = ", ".join(self.expr(e) for e in s.acc)
        (ai,), (bi,) = s.a_index, s.b_index
        # descriptors take byte offsets; the IR counts the buffers' elements
        e = _BYTES[self.kernel.buffer(s.a).dtype]
        # an MN-major operand: its (block, k group) strides in the offsets MN_MAJOR_OFFSETS names
        mn_major = lambda mn: tuple(e * dict(zip(("n_block", "k_group"), mn))[f] for f in MN_MAJOR_OFFSETS)
        a_offsets = mn_major(s.a_mn) if s.a_mn else (e * s.lbo, e * s.sbo)
        b_offsets = mn_major(s.b_mn) if s.b_mn else (e * s.lbo, e * s.sbo)
        self.emit(depth, f"{acc} = {fn}(({acc},), {desc}({s.a}, {self.expr(ai)}, {a_offsets[0]}, {a_offsets[1]}), "
                         f"{desc}({s.b}, {self.expr(bi)}, {b_offsets[0]}, {b_offsets[1]}))")

    def warpgroup_sync(self, s, depth):
        if isinstance(s, WarpgroupWait):
            self.wgmma_helpers.add("wgmma_wait")
            acc = ", ".join(self.expr(e) for e in s.acc)
            self.emit(depth, f"{acc} = wgmma_wait(({acc},), {s.pending})")
            return
        fn = {WarpgroupFence: "wgmma_fence", WarpgroupCommit: "wgmma_commit", AsyncProxyFence: "async_proxy_fence"}[
            type(s)]
        self.wgmma_helpers.add(fn)
        self.emit(depth, f"{fn}()")

    def tensor_copy(self, s, depth):
        m, (di,) = s.tmap, s.dst_index
        fn = {("tiled", 2): "tma_load_2d", ("tiled", 4): "tma_load_4d", ("im2col", 4): "tma_load_im2col_4d",
              ("im2col", 5): "tma_load_im2col_5d"}.get((m.mode, len(m.dims)))
        if fn is None:
            raise ValueError(f"TensorCopy {m.name}: 2-D and 4-D tiled and 4-D and 5-D im2col boxes are rendered, "
                             f"got {m.mode} {m.dims}")
        self.tma_helpers.add(fn)
        where = ", ".join(self.expr(e) for e in s.coords + s.offsets)
        self.emit(depth, f"{fn}({s.dst}, {self.expr(di)}, {m.name}, {where}, {s.bar}, {self.expr(s.bar_index)})")

    def mbarrier(self, s, depth):
        at = f"{s.bar}, {self.expr(s.index)}"
        if isinstance(s, MbarrierInit):
            self.tma_helpers |= {"mbarrier_init", "mbarrier_init_fence"}
            self.emit(depth, f"mbarrier_init({at}, {s.count})")
            self.emit(depth, "mbarrier_init_fence()")
        elif isinstance(s, MbarrierExpect):
            self.tma_helpers.add("mbarrier_expect_tx")
            self.emit(depth, f"mbarrier_expect_tx({at}, {s.nbytes})")
        else:
            self.tma_helpers.add("mbarrier_try_wait")
            self.emit(depth, f"while mbarrier_try_wait({at}, {self.expr(s.parity)}) == 0:")
            self.emit(depth + 1, "pass")

    def thread_loop(self, s, depth):
        # every thread runs the phase once: the loop disappears (a phase of fewer threads than the block's, e.g.
        # a pipeline's consumers outside the pipeline, is guarded; inside it only consumers get here)
        self.emit(depth, f"{s.var} = cuda.threadIdx.x")
        if s.extent < self.kernel.threads and not self.consumers:
            whole = self.specialised and s.extent % 128 == 0  # whole warpgroups: a uniform branch (see render)
            self.emit(depth, f"if {'_wg' if whole else s.var} < {s.extent // 128 if whole else s.extent}:")
            self.stmts(s.body, depth + 1)
        else:
            self.stmts(s.body, depth)

    def pipeline(self, s, depth):
        """Warp specialisation (ir.Pipeline): the producer warp's first thread refills stages as the consumers
        release them, the consumers wait for each stage to fill, consume it and release an earlier one."""
        self.tma_helpers |= {"mbarrier_try_wait", "mbarrier_arrive"}
        kt, S = Var(s.var), s.stages
        self.int_vars.add(s.var)  # the stage is an Assign of it: stmt() tracks that one
        self.nonneg_vars.add(s.var)

        def wait(bar, parity, at):
            self.emit(at, f"while mbarrier_try_wait({bar}, {s.stage}, {self.expr(parity)}) == 0:")
            self.emit(at + 1, "pass")

        if s.consumers % 128:
            raise ValueError(f"Pipeline: the consumers must be whole warpgroups (their MMAs are), got {s.consumers}")
        self.emit(depth, f"if _wg >= {s.consumers // 128}:  # the producer warp")
        self.emit(depth + 1, f"if cuda.threadIdx.x == {s.consumers}:")
        self.emit(depth + 2, f"for {s.var} in range({self.extent(s.count)}):")
        self.stmt(Assign(s.stage, kt % S), depth + 3)
        self.emit(depth + 3, f"if {s.var} >= {S}:  # the consumers released slice {s.var} - {S}: the stage is free")
        wait(s.empty, (kt // S + 1) % 2, depth + 4)
        self.stmts(s.produce, depth + 3)
        self.emit(depth, "else:  # the consumers")
        self.emit(depth + 1, f"for {s.var} in range({self.extent(s.count)}):")
        self.stmt(Assign(s.stage, kt % S), depth + 2)
        wait(s.full, (kt // S) % 2, depth + 2)
        outer, self.consumers = self.consumers, s.consumers
        self.stmts(s.consume, depth + 2)
        if s.lag:
            self.emit(depth + 2, f"if {s.var} >= {s.lag}:  # slice {s.var} - {s.lag}'s MMAs are done: free its stage")
            self.emit(depth + 3, f"mbarrier_arrive({s.empty}, {self.expr((kt + (S - s.lag)) % S)})")
        else:
            self.emit(depth + 2, f"mbarrier_arrive({s.empty}, {s.stage})")
        if s.finish:
            self.stmts(s.finish, depth + 1)
        self.consumers = outer

    def atomic_add(self, s, depth):  # (SourcePrinter.stmt refused a float16 buffer)
        self.emit(depth, f"cuda.atomic.add({s.buf}, {self.index(s.buf, s.index)}, {self.expr(s.value)})")

    def barrier(self, depth):
        if self.consumers:  # the producer warp is elsewhere: barrier 1 counts the consumers only
            self.tma_helpers.add("named_barrier")
            self.emit(depth, f"named_barrier(1, {self.consumers})")
        else:
            self.emit(depth, "cuda.syncthreads()")

    def render(self) -> str:
        """The kernel function; self.dynamic: its bytes of dynamic shared memory (0: static arrays only)."""
        k = self.kernel
        grid_loops, block = self.split_grid()
        args = ", ".join(b.name for b in k.params)
        bounds = k.meta.get("launch_bounds")  # (threads, min blocks per SM): ptxas caps registers at 64K / product
        if bounds:
            self.emit(0, f"LAUNCH_BOUNDS = {tuple(bounds)!r}")
            self.emit(0, "@cuda.jit(cache=_CACHE, **jit_launch_bounds(LAUNCH_BOUNDS))")
        else:
            self.emit(0, "@cuda.jit(cache=_CACHE)")
        self.emit(0, f"def {self.name}({args}):")
        self.docstring(1)
        for g in grid_loops:
            self.int_vars.add(g.var)
            self.nonneg_vars.add(g.var)
            self.emit(1, f"{g.var} = cuda.blockIdx.{_AXES[g.axis]}")
        if self.specialised:
            # the thread's warpgroup, broadcast from lane 0 so that ptxas knows it is warp-uniform (CUTLASS's
            # canonical_warp_group_idx): branches on it are uniform, and warpgroup MMAs inside them are not
            # serialised (ptxas C7518, "wgmma ... serialized due to ... divergent path")
            self.emit(1, "_wg = cuda.shfl_sync(0xFFFFFFFF, cuda.threadIdx.x // 128, 0)")
        # 16-byte asynchronous copies need 16-byte aligned shared rows (numba aligns to the element size), tensor
        # copies 128-byte aligned ones (1024 for the 128-byte swizzle, whose pattern follows the address)
        align = {s.dst: 16 for s in walk_stmts(k.body) if isinstance(s, AsyncCopy) and s.width == 4}
        align |= {b: 16 for s in walk_stmts(k.body) if isinstance(s, WarpgroupMma) for b in (s.a, s.b)}  # descriptors
        for s in walk_stmts(k.body):
            if isinstance(s, TensorCopy):
                align[s.dst] = max(align.get(s.dst, 0), 1024 if s.tmap.swizzle else 128)
        shared = [b for b in k.locals if b.scope == "shared"]
        tiles = max({b.dtype for b in shared}, key=lambda d: sum(b.size for b in shared if b.dtype == d), default=None)
        pooled = [b for b in shared if b.dtype == tiles]
        dynamic = 0
        if sum(b.size * _BYTES[b.dtype] for b in shared) > self.static_shared:
            # past 48 KiB a block's shared memory must be dynamic (the launcher opts in): one extern array, each
            # buffer of its dtype a slice of it at an aligned offset (others, e.g. int64 mbarriers, stay static)
            base = max([16] + [align.get(b.name, 16) for b in pooled])
            self.emit(1, f"_smem = cuda.shared.array(0, {_NUMBA_TYPE.get(pooled[0].dtype, pooled[0].dtype)}, "
                         f"alignment={base})")
            for b in pooled:
                step = align.get(b.name, 16)
                dynamic = -(-dynamic // step) * step
                at = dynamic // _BYTES[b.dtype]
                self.emit(1, f"{b.name} = _smem[{at}:{at + b.size}]")
                dynamic += b.size * _BYTES[b.dtype]
            dynamic = -(-dynamic // 16) * 16
        for b in k.locals:
            if dynamic and b in pooled:
                continue
            kind = "shared" if b.scope == "shared" else "local"
            at = f", alignment={align[b.name]}" if b.name in align else ""
            self.emit(1, f"{b.name} = cuda.{kind}.array({b.shape}, {_NUMBA_TYPE.get(b.dtype, b.dtype)}{at})")
        self.stmts(block, 1)
        self.dynamic = dynamic
        return "\n".join(self.lines) + "\n"


# kernelgen.cuda_memory helpers that assume 16-byte alignment
ALIGNED_HELPERS = {"load4_aligned", "load2h_aligned", "load4h_aligned", "load8h_aligned", "copy_async16"}
_NUMBA_TYPE = {"bfloat16": "uint16"}  # numba has no bfloat16: its tiles hold the bit patterns
_BYTES = {"float32": 4, "float64": 8, "int32": 4, "int64": 8, "uint64": 8, "float16": 2, "bfloat16": 2}

HEADER = """\
# Generated by kernelgen (CUDA target). Do not edit: regenerate with kernelgen.explain(...).
import math
from numba import cuda, float32, float64, int32, int64
{index32}{mma}_CACHE = {cache}

"""
MMA_INTRINSICS = {("m16n8k8", "tf32"): "mma_m16n8k8_tf32", ("m16n8k16", "fp16"): "mma_m16n8k16_f16",
                  ("m16n8k16", "bf16"): "mma_m16n8k16_bf16"}  # kernelgen.cuda_mma
_INDEX32_IMPORT = "from kernelgen.cuda_index import add32, sub32, mul32, floordiv32, mod32, udiv32, umod32, uidx\n"


def render_cuda(kernel: Kernel, *, cache: bool = True, index32: bool | None = None,
                target: Target | None = None, fresh: bool = True) -> str:
    """Lower a kernel for CUDA and print it as a module defining `kernel.name`.  index32: 32-bit
    index arithmetic (default: index32_enabled(), where index32_safe for the kernel).  target: the device's limits
    (default: those of every CUDA GPU).  fresh: straight-line re-assignments get fresh names (kernelgen.fresh_names:
    the same PTX, ~14 % less numba compile time); False prints the IR's names, for scripts/compile_time.py's
    comparison."""
    static_shared = STATIC_SHARED_BYTES if target is None else target.static_shared_per_block
    lowered = lower(kernel, "cuda")
    if index32 is None:
        index32 = index32_enabled() and index32_safe(lowered)
    # Specialised on alignment, as Triton specialises on 16-byte divisibility: KERNEL assumes every array starts
    # 16-byte aligned (one 16-byte load or copy per vector, no test, no predicated-off 4-byte fallback in the
    # load/store queue); a module whose kernel has 16-byte accesses also defines KERNEL_ANY_ALIGNMENT, which
    # tests each array and falls back, and which the launcher runs (compiling it on first use) when a caller's
    # array is not aligned (a slice starting one float in, say).
    printer = CudaPrinter(lowered, index32, aligned=True, static_shared=static_shared)
    body = printer.render()
    printers = [printer]
    constants = launch_constants(lowered)
    if printer.memory_helpers & ALIGNED_HELPERS:
        anywhere = CudaPrinter(lowered, index32, name=f"{lowered.name}_any_alignment", static_shared=static_shared)
        body += "\n\n" + anywhere.render()
        printers.append(anywhere)
        constants += f"KERNEL_ANY_ALIGNMENT = {anywhere.name}\n"
    if fresh:  # (after printing: the printers' own bookkeeping, such as int_vars, reads the IR's names)
        body = fresh_names(body)
    if printer.dynamic:
        constants += f"DYNAMIC_SHARED = {printer.dynamic}\n"
    if lowered.meta.get("batch_grid"):  # fewer blocks along a grid axis run fewer images: Launcher.on_images
        constants += f"BATCH_GRID = {tuple(lowered.meta['batch_grid'])!r}\n"
    helpers = lambda attr: sorted(set().union(*(getattr(p, attr) for p in printers)))
    mma = f"from kernelgen.cuda_mma import {', '.join(helpers('helpers'))}\n" if printer.helpers else ""
    if lowered.meta.get("launch_bounds"):
        mma += "from kernelgen.cuda_mma import jit_launch_bounds\n"
    if printer.wgmma_helpers:
        mma += f"from kernelgen.cuda_wgmma import {', '.join(helpers('wgmma_helpers'))}\n"
    if printer.memory_helpers:
        mma += f"from kernelgen.cuda_memory import {', '.join(helpers('memory_helpers'))}\n"
    if printer.tma_helpers:
        mma += f"from kernelgen.cuda_tma import {', '.join(helpers('tma_helpers'))}\n"
    if any(b.dtype == "float16" for b in lowered.locals):  # fp16 TMA tiles (numba exports no float16 itself)
        mma += "from numba.core.types import float16\n"
    if any(b.dtype == "bfloat16" for b in lowered.locals):  # bf16 TMA tiles, as bit patterns
        mma += "from numba import uint16\n"
    return HEADER.format(cache=cache, index32=_INDEX32_IMPORT if index32 else "", mma=mma) + body + constants
