"""32-bit index arithmetic in the CUDA renderer (kernelgen/cuda_index.py).

What the renderer may prove is checked here on the source; that the proofs hold on real data is
checked by every simulator test (the stand-ins raise on overflow or a negative "non-negative"
value); that the GPU results are right, by the gpu tests.  Where NVRTC is installed, the PTX is
compiled and its integer instruction count compared with the 64-bit rendering.
"""
from __future__ import annotations

import re

import pytest

from kernelgen.api import make_plan
from kernelgen.ir import Assign, BinOp, Buffer, Const, For, Kernel, Load, Store, Var
from kernelgen.problem import make_problem
from kernelgen.render_cuda import index32_safe, render_cuda


def _src(problem, index32, algo=None):
    return render_cuda(make_plan(problem, "cuda", algo).kernel_ir(), cache=False, index32=index32)


def test_index32_source_uses_intrinsics_everywhere_an_int_is_computed():
    p = make_problem("fwd", (4, 9, 9, 16), (32, 3, 3, 16), padding=1, stride=2)
    src = _src(p, True)
    assert "from kernelgen.cuda_index import" in src
    assert "uidx(" in src and "udiv32(" in src
    body = src.split('"""', 2)[2]
    assert not re.search(r"\S // \S|\S % \S", body), "a Python floor division / modulo on ints is left"
    assert "uidx(" not in _src(p, False) and "cuda_index" not in _src(p, False)


def _kernel(value_expr):
    x = Buffer("x", (64,))
    y = Buffer("y", (64,), role="out")
    body = (For("i", 8, (Assign("v", value_expr), Store("y", (Var("i"),), Load("x", (BinOp("%", Var("v"), Const(64)),)))),
                binding="thread"),)
    return Kernel("k", (x, y), (), body, (1,), 8)


def test_signed_values_keep_floor_semantics():
    # i - 3 may be negative: its modulo must keep Python's floor semantics (mod32, not umod32)
    src = render_cuda(_kernel(BinOp("-", Var("i"), Const(3))), cache=False, index32=True)
    assert "mod32(v, 64)" in src and "umod32(v" not in src
    src = render_cuda(_kernel(BinOp("+", Var("i"), Const(3))), cache=False, index32=True)
    assert "umod32(v, 64)" in src


def test_huge_tensors_keep_64_bit_indices():
    small = make_plan(make_problem("fwd", (4, 9, 9, 16), (32, 3, 3, 16)), "cuda").kernel_ir()
    big = make_plan(make_problem("fwd", (1024, 256, 256, 32), (32, 1, 1, 32)), "cuda").kernel_ir()
    assert index32_safe(small) and not index32_safe(big)
    assert "uidx(" not in render_cuda(big, cache=False)


def test_index32_ptx_has_fewer_integer_instructions():
    from numba import cuda
    try:
        from numba.cuda.cudadrv import nvrtc
        nvrtc.get_supported_ccs()
    except Exception as e:  # no NVRTC on this machine: the GPU run measures it instead
        pytest.skip(f"NVRTC not available: {type(e).__name__}")
    import importlib.util
    import tempfile
    from numba import float32
    p = make_problem("fwd", (32, 28, 28, 128), (128, 3, 3, 128), padding=1)
    counts = {}
    for i32 in (False, True):
        path = tempfile.mktemp(suffix=".py")
        open(path, "w").write(_src(p, i32))
        spec = importlib.util.spec_from_file_location(f"kg_i32_{i32}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        ptx, _ = cuda.compile_ptx(mod.KERNEL.py_func, tuple(float32[::1] for _ in mod.PARAMS), cc=(9, 0))
        counts[i32] = len(re.findall(r"^\s*(?:@%p\d+\s+)?(?:add|sub|mul|mad|shl|shr|and|or|xor|div|rem|cvt|selp)\.(?:s|u|b|lo|hi|wide)",
                                     ptx, re.M))
    assert counts[True] < 0.6 * counts[False], counts
