"""Render lowered IR as a numba CPU kernel module: blocks become a parallel loop, threads a plain loop.

A block runs on one CPU thread: its thread phases run one after another, which is exactly what
the barriers between them promise, so barriers print as nothing.  Register buffers gain a leading
thread dimension so each simulated thread keeps its own copy across phases.
"""
from __future__ import annotations

import numpy as np

from .ir import STORAGE_DTYPES, Const, Kernel, Load
from .mma_layout import WARP
from .passes import _strides, lower
from .render_base import SourcePrinter, launch_constants


class CpuPrinter(SourcePrinter):
    def __init__(self, kernel: Kernel, serial: bool = False):
        super().__init__(kernel)
        self.tma_helpers = set()  # what the module imports from kernelgen.cpu_tma
        self.serial = serial  # the blocks run one after another (render_cpu(parallel=False)): an atomic add is +=

    def index(self, buf, index):
        idx = super().index(buf, index)
        if self.scopes.get(buf) == "register":
            if self.thread_var is None:
                raise ValueError(f"register buffer {buf!r} used outside a thread loop")
            return f"{self.thread_var}, {idx}"
        return idx

    def mma(self, s, depth):
        """The warp MMA as plain loops: lane `tid` gathers the A and B elements its four outputs need
        from the fragment registers of the other lanes of its warp (kernelgen/mma_layout.py), which
        an earlier thread phase filled, and accumulates the products of the rounded operands in float32
        (exact products: 11 + 11 significant bits at most).  m16n8k16 is two m16n8k8 steps, s = 0, 1,
        whose fragments follow each other in a and b (ir.Mma)."""
        for e in s.acc + s.a + s.b:
            if not (isinstance(e, Load) and self.scopes.get(e.buf) == "register"):
                raise ValueError(f"CPU Mma: fragment elements must be register-buffer elements, got {e!r}")
        tid, rnd, steps = self.thread_var, s.dtype, len(s.b) // 2
        frag = lambda e, lane: f"{e.buf}[_wb + {lane}, {super(CpuPrinter, self).index(e.buf, e.index)}]"
        if steps == 1:
            self.emit(depth, "# warp MMA m16n8k8 tf32, emulated per lane: A[row, k] is lane (row % 8) * 4 + k % 4's "
                             "a[row // 8 + 2 * (k // 4)], B[k, n] lane n * 4 + k % 4's b[k // 4]")
        else:
            self.emit(depth, f"# warp MMA {s.shape} {s.dtype}, emulated per lane: A[row, k] of 8-deep step s is lane "
                             "(row % 8) * 4 + k % 4's a[4 s + row // 8 + 2 * (k // 4)], B[k, n] lane n * 4 + k % 4's "
                             "b[2 s + k // 4]")
        self.emit(depth, f"_wb = {tid} - {tid} % {WARP}")
        self.emit(depth, f"_g = ({tid} % {WARP}) // 4")
        self.emit(depth, f"_t = {tid} % 4")
        for r, acc in enumerate(s.acc):  # acc[r] = D[g + 8 * (r // 2), 2 * t + r % 2]
            h, col = r // 2, f"(2 * _t + {r % 2})"
            self.emit(depth, "_s = float32(0.0)")
            self.emit(depth, "for _k in range(4):")
            for st in range(steps):
                for half in range(2):  # k = _k + 4 * half
                    self.emit(depth + 1, f"_s += {rnd}({frag(s.a[4 * st + h + 2 * half], '_g * 4 + _k')}) * "
                                         f"{rnd}({frag(s.b[2 * st + half], col + ' * 4 + _k')})")
            self.emit(depth, f"{acc.buf}[{self.index(acc.buf, acc.index)}] += _s")

    def warpgroup_mma(self, s, depth):
        """The warpgroup MMA per thread (kernelgen.cpu_round.wgmma_tf32): each thread reads the operands of its
        own accumulators from shared memory, which earlier thread phases filled."""
        first = s.acc[0]
        shape = self.kernel.buffer(first.buf).shape if isinstance(first, Load) else ()
        flat = lambda e: sum(i.value * st for i, st in zip(e.index, _strides(shape)))
        ok = all(isinstance(e, Load) and e.buf == first.buf and self.scopes.get(e.buf) == "register"
                 and all(isinstance(i, Const) for i in e.index) for e in s.acc)
        if not ok or [flat(e) for e in s.acc] != list(range(flat(first), flat(first) + len(s.acc))):
            raise ValueError("CPU WarpgroupMma: the accumulators must be consecutive elements of one register buffer")
        # the thread's registers as one flat row: the helper indexes them from the first accumulator on
        row = f"{first.buf}[{self.thread_var}]" + (f".reshape({int(np.prod(shape))})" if len(shape) > 1 else "")
        fn = {"tf32": "wgmma_tf32", "fp16": "wgmma_f16", "bf16": "wgmma_bf16"}[s.kind]
        self.helpers.add(fn)
        (ai,), (bi,) = s.a_index, s.b_index
        tid = self.thread_var
        # an MN-major B's strides, and an MN-major A's after them (wgmma_f16)
        mn = "".join(f", {v}" for v in (s.b_mn or ((0, 0) if s.a_mn else ())) + s.a_mn)
        self.emit(depth, f"{fn}({row}, {flat(first)}, {s.a}, {self.expr(ai)}, {s.b}, "
                         f"{self.expr(bi)}, {s.n}, {s.lbo}, {s.sbo}, {tid}, {s.swizzle}{mn})")

    def tensor_copy(self, s, depth):
        """The box, copied now (kernelgen.cpu_tma): the thread phases after the MbarrierWait read it."""
        m, (di,) = s.tmap, s.dst_index
        if not self.kernel.buffer(m.source).dtype == self.kernel.buffer(s.dst).dtype == m.dtype:
            raise ValueError(f"TensorCopy {m.source} -> {s.dst}: the copy moves {m.dtype} elements into {m.dtype}")
        args = [s.dst, self.expr(di), m.source]
        if m.mode == "tiled" and len(m.dims) == 2:
            fn, geometry = "tma_tiled_2d", [*m.dims, m.strides[0] // m.itemsize, *m.box]
        elif m.mode == "tiled" and len(m.dims) == 4:
            fn, geometry = "tma_tiled_4d", [*m.dims, *(st // m.itemsize for st in m.strides), *m.box]
        elif m.mode == "im2col" and len(m.dims) in (4, 5):
            fn = f"tma_im2col_{len(m.dims)}d"
            geometry = [*m.dims, *m.lower, *m.upper, *m.box, *(m.traversal or (1,) * len(m.lower))]
        else:
            raise ValueError(f"TensorCopy {m.name}: the CPU copies 2-D and 4-D tiled and 4-D and 5-D im2col boxes, "
                             f"got {m.mode} {m.dims}")
        self.tma_helpers.add(fn)
        coords = [self.expr(e) for e in s.coords + s.offsets]
        self.emit(depth, f"{fn}({', '.join(args + [str(g) for g in geometry] + coords)}, {int(m.swizzle == 128)})")

    # float16 and bfloat16 buffers arrive as their uint16 bit patterns (numba's CPU target has neither type):
    # kernelgen.cpu_round decodes and encodes them
    def widen(self, text, dtype):
        fn = {"float16": "f16_bits_to_f32", "bfloat16": "bf16_bits_to_f32"}[dtype]
        self.helpers.add(fn)
        return f"{fn}({text})"

    def narrow(self, text, dtype):
        fn = {"float16": "f32_to_f16_bits", "bfloat16": "f32_to_bf16_bits"}[dtype]
        self.helpers.add(fn)
        return f"{fn}({text})"

    def thread_loop(self, s, depth):
        self.emit(depth, f"for {s.var} in range({s.extent}):")
        self.stmts(s.body, depth + 1)

    def atomic_add(self, s, depth):
        # blocks of a parallel prange run concurrently: a plain += there would be a silent race.  Serial blocks (a
        # test checking a split-K kernel's arithmetic on the CPU) add in turn.
        if not self.serial:
            raise ValueError("the CPU target has no atomic stores: use split_k=1 for CPU configs")
        at = self.index(s.buf, s.index)
        self.emit(depth, f"{s.buf}[{at}] += {self.expr(s.value)}")

    def barrier(self, depth):
        self.emit(depth, "# barrier: the thread phases above ran to completion")

    def render(self) -> str:
        k = self.kernel
        grid_loops, block = self.split_grid()
        args = ", ".join(b.name for b in k.params)
        total = 1
        for g in grid_loops:
            total *= g.extent
        self.emit(0, "@njit(parallel=_PARALLEL, cache=_CACHE)")
        self.emit(0, f"def {k.name}({args}):")
        self.docstring(1)
        self.emit(1, f"for _block in prange({total}):")
        rest = "_block"
        for g in grid_loops:
            self.emit(2, f"{g.var} = {rest} % {g.extent}")
            rest = f"({rest} // {g.extent})"
        for b in k.locals:
            shape = (k.threads,) + b.shape if b.scope == "register" else b.shape
            # 16-bit floats as their bit patterns, as arrays.cpu_kernel_arg passes them
            self.emit(2, f"{b.name} = np.empty({shape}, np.{'uint16' if b.dtype in STORAGE_DTYPES else b.dtype})")
        self.stmts(block, 2)
        return "\n".join(self.lines) + "\n" + launch_constants(k)


HEADER = """\
# Generated by kernelgen (CPU target). Do not edit: regenerate with kernelgen.explain(...).
import math
import numpy as np
from numba import njit, prange, float32, float64, int32
{helpers}_CACHE = {cache}
_PARALLEL = {parallel}

"""


# numba's parallel=True costs seconds of compile time; only worth it when there is real work
PARALLEL_MIN_BLOCKS = 4
PARALLEL_MIN_WORK = 1 << 21


def render_cpu(kernel: Kernel, *, cache: bool = True, parallel: bool | None = None) -> str:
    """Lower a kernel for the CPU and print it as a module defining `kernel.name`."""
    if parallel is None:
        blocks = 1
        for g in kernel.grid:
            blocks *= g
        # (a kernel that adds into a zeroed output - split-K, col2im - runs its blocks in turn: no atomics here)
        parallel = blocks >= PARALLEL_MIN_BLOCKS and kernel.meta.get("work", 0) >= PARALLEL_MIN_WORK and \
            not kernel.meta.get("zero_output")
    lowered = lower(kernel, "cpu")
    printer = CpuPrinter(lowered, serial=not parallel)
    body = printer.render()
    helpers = f"from kernelgen.cpu_round import {', '.join(sorted(printer.helpers))}\n" if printer.helpers else ""
    if printer.tma_helpers:
        helpers += f"from kernelgen.cpu_tma import {', '.join(sorted(printer.tma_helpers))}\n"
    return HEADER.format(cache=cache, parallel=parallel, helpers=helpers) + body
