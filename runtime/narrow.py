"""Rounding a float32 workspace into the caller's float16 or bfloat16 output, after a kernel that could only
accumulate in float32 (split 16-bit backward-weight: no 16-bit atomic adds).  Launcher.widened uses it."""
from __future__ import annotations

import threading

import numpy as np

from kernelgen.runtime.driver import _FastLaunch, configure
from kernelgen.storage import narrow_bits

NARROW_THREADS = 256
NARROW_GRID = 1056  # as elementwise.ROUND_GRID: 8 blocks per SM of an H100, striding over any size

_kernels = {}  # bfloat16? -> its dispatcher
_kernel_lock = threading.Lock()
_fast = {}  # bfloat16? -> narrow_step's launch (usable by the thread that made it)


def _narrow_body(src, dst):
    # module-level, reading this module's `cuda`, so that the simulator can swap it for its fake one; numba
    # stores a float32 into a float16 array with fptrunc (round to nearest even)
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    step = cuda.gridDim.x * cuda.blockDim.x
    while i < dst.size:
        dst[i] = src[i]
        i += step


def _narrow_bf16_body(src, dst):
    # dst: bfloat16 bit patterns (uint16), rounded to nearest even by cvt.rn.bf16.f32
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    step = cuda.gridDim.x * cuda.blockDim.x
    while i < dst.size:
        dst[i] = bf16_narrow(src[i])
        i += step


def _dispatcher(bfloat16=False):
    global cuda, bf16_narrow
    with _kernel_lock:  # one dispatcher for every thread
        if bfloat16 not in _kernels:
            from numba import cuda

            from kernelgen.cuda_memory import bf16_narrow
            _kernels[bfloat16] = cuda.jit(_narrow_bf16_body if bfloat16 else _narrow_body)
    return _kernels[bfloat16]


def narrow_device(src, dst, stream=None, bfloat16=False):
    """dst[:] = src rounded to dst's dtype, both 1D device arrays of one size (src float32, dst float16, or
    bfloat16 bit patterns where `bfloat16`)."""
    if src.size != dst.size:
        raise ValueError(f"dst: {dst.size} elements, the workspace has {src.size}")
    grid = max(1, min(NARROW_GRID, -(-dst.size // NARROW_THREADS)))
    configure(_dispatcher(bfloat16), grid, NARROW_THREADS, stream or 0)(src, dst)


def narrow_step(src, dst, n, stream_handle=0, bfloat16=False):
    """narrow_device on raw device addresses of n elements (src float32, dst float16 or bfloat16) as a driver step,
    launched without numba's dispatcher: a launch program runs it after every split 16-bit backward-weight kernel
    (runtime/program.py)."""
    return _narrow_launch(bfloat16).step([(src, n, 4), (dst, n, 2)], 4, stream_handle)


def _narrow_launch(bfloat16):
    fast = _fast.get(bfloat16)
    if fast is None or not fast.usable():
        from numba import cuda
        kernel = _dispatcher(bfloat16)
        configure(kernel, 1, NARROW_THREADS)(cuda.device_array(1, np.float32),
                                             cuda.device_array(1, np.uint16 if bfloat16 else np.float16))
        fast = _fast[bfloat16] = _FastLaunch(kernel, NARROW_GRID, NARROW_THREADS, 2)  # (its one overload, compiled)
    return fast


def narrow_host(src, dst, bfloat16=False):
    """The CPU backend's narrow_device: dst[:] = src, rounded to nearest even (dst: bfloat16 bits where
    `bfloat16`)."""
    if bfloat16:
        np.copyto(dst.view(np.uint16), narrow_bits(src).reshape(dst.shape))
    else:
        np.copyto(dst, src, casting="same_kind")
