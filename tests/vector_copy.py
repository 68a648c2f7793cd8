"""The hand-built vector-copy kernel shared by test_vector_load.py (ir.VectorLoad on every target) and
test_fp16_storage.py (the same kernel over float16 buffers): y = x (or scale * x), four consecutive elements
per thread through one VectorLoad, odd threads' loads predicated off (zeros).  It lives here, beside
conftest.py, because the two test files sit in different area folders (tests/ir, tests/templates)."""
from __future__ import annotations

from kernelgen.ir import Buffer, For, Kernel, Var, VectorLoad

THREADS = 8


def copy_kernel(dtype="float32", scale=None, name="vector_copy", width=4):
    """y = x (or scale * x), `width` elements per thread through one VectorLoad; odd threads' loads are
    predicated off (zeros)."""
    x, y = Buffer("x", (width * THREADS,), dtype), Buffer("y", (width * THREADS,), dtype, role="out")
    r = Buffer("r", (width,), scope="register")
    tid = Var("tid")
    phase = (VectorLoad(tuple(r[i] for i in range(width)), "x", tid * width, (tid % 2).eq(0)),
             *[y.store(tid * width + i, r[i] if scale is None else r[i] * scale) for i in range(width)])
    body = (For("b", 1, (For("tid", THREADS, phase, "thread"),), "grid"),)
    return Kernel(name, (x, y), (r,), body, (1,), THREADS)


def module(src):
    """The rendered source `src` executed: its namespace (kernel name -> function)."""
    ns = {}
    exec(compile(src, "<vector_copy>", "exec"), ns)
    return ns
