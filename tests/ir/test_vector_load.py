"""ir.VectorLoad: four consecutive global elements under one predicate, on every target.

A hand-built kernel copies x into y four elements per thread, odd threads reading under a false
predicate (zeros expected); the CPU renderer prints it element by element, the CUDA renderer as
kernelgen.cuda_memory.load4 (one 16-byte load where the array is 16-byte aligned, four 4-byte loads
where it is not: the GPU test passes an array that starts one element into an allocation); float16 buffers of
2, 4 or 8 elements as load2h / load4h / load8h (one 4-, 8- or 16-byte load widened to float32, 2-byte loads where
unaligned).
"""
from __future__ import annotations

import numpy as np
import pytest

from kernelgen.render_cpu import render_cpu
from kernelgen.render_cuda import render_cuda
from harness import poisoned
from vector_copy import THREADS, copy_kernel, module


def expected(x, width=4):
    want = x.copy().reshape(THREADS, width)
    want[1::2] = 0.0
    return want.reshape(-1)


WIDE = [("float32", 4, "load4"), ("float16", 2, "load2h"), ("float16", 4, "load4h"), ("float16", 8, "load8h")]


def test_vector_load_renders_and_runs_on_the_cpu(rng):
    src = render_cpu(copy_kernel(), cache=False)
    assert "load4" not in src
    x = rng.standard_normal(4 * THREADS).astype(np.float32)
    y = poisoned(x.shape)
    module(src)["vector_copy"](x, y)
    np.testing.assert_array_equal(y, expected(x))


def test_cuda_rendering_calls_load4():
    src = render_cuda(copy_kernel(), cache=False)
    assert "from kernelgen.cuda_memory import load4, load4_aligned" in src
    assert "r_0, r_1, r_2, r_3 = load4(x, " in src  # KERNEL_ANY_ALIGNMENT: the tested form
    assert "r_0, r_1, r_2, r_3 = load4_aligned(x, " in src and "KERNEL_ANY_ALIGNMENT = vector_copy_any_alignment" in src


@pytest.mark.parametrize("dtype, width, fn", WIDE[1:])
def test_cuda_rendering_of_float16_vectors(dtype, width, fn):
    src = render_cuda(copy_kernel(dtype, width=width), cache=False)
    assert f"= {fn}(x, " in src and f"= {fn}_aligned(x, " in src


def _run_cuda(rng, offset, route="launcher", dtype="float32", width=4):
    """The vector copy on `offset`-shifted input.  route "launcher": through runtime.launch.Launcher, which
    runs KERNEL (specialised for 16-byte aligned arrays) or, for an unaligned array, KERNEL_ANY_ALIGNMENT;
    "any": KERNEL_ANY_ALIGNMENT directly; "aligned": KERNEL directly (aligned arrays only)."""
    from types import SimpleNamespace

    from numba import cuda

    from kernelgen.runtime.launch import Launcher
    ns = module(render_cuda(copy_kernel(dtype, width=width), cache=False))
    x = rng.standard_normal(width * THREADS + offset).astype(dtype)
    xd = cuda.to_device(x)[offset:]  # offset 1: an element-aligned view, not 16-byte aligned
    yd = cuda.to_device(poisoned(width * THREADS, np.dtype(dtype)))
    if route == "launcher":
        Launcher.from_module(SimpleNamespace(**ns), "cuda")({"x": xd, "y": yd})
    else:
        ns["KERNEL_ANY_ALIGNMENT" if route == "any" else "KERNEL"][1, THREADS](xd, yd)
    return yd.copy_to_host(), expected(x[offset:], width)


@pytest.mark.sim
@pytest.mark.parametrize("dtype, width, fn", WIDE)
def test_vector_load_in_the_simulator(dtype, width, fn, rng):
    got, want = _run_cuda(rng, 0, dtype=dtype, width=width)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, width, fn", WIDE)
@pytest.mark.parametrize("offset", [0, 1, 2, 3])
@pytest.mark.parametrize("route", ["launcher", "any", "aligned"])
def test_vector_load_on_the_gpu_any_alignment(offset, route, dtype, width, fn, rng):
    if route == "aligned" and offset:
        pytest.skip("KERNEL assumes 16-byte aligned arrays (the launcher never gives it others)")
    got, want = _run_cuda(rng, offset, route, dtype, width)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
