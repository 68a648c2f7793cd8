"""Rounding a float32 workspace into the caller's float16 output, after a kernel that could only accumulate in
float32 (split float16 backward-weight: no 16-bit atomic adds).  Launcher.widened uses it."""
from __future__ import annotations

import threading

import numpy as np

from kernelgen.runtime.driver import _FastLaunch, configure

NARROW_THREADS = 256
NARROW_GRID = 1056  # as elementwise.ROUND_GRID: 8 blocks per SM of an H100, striding over any size

_kernel = None
_kernel_lock = threading.Lock()
_fast = None  # narrow_pointers' launch (usable by the thread that made it)


def _narrow_body(src, dst):
    # module-level, reading this module's `cuda`, so that the simulator can swap it for its fake one; numba
    # stores a float32 into a float16 array with fptrunc (round to nearest even)
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    step = cuda.gridDim.x * cuda.blockDim.x
    while i < dst.size:
        dst[i] = src[i]
        i += step


def _dispatcher():
    global _kernel, cuda
    with _kernel_lock:  # one dispatcher for every thread
        if _kernel is None:
            from numba import cuda
            _kernel = cuda.jit(_narrow_body)
    return _kernel


def narrow_device(src, dst, stream=None):
    """dst[:] = src rounded to dst's dtype, both 1D device arrays of one size (src float32, dst float16)."""
    if src.size != dst.size:
        raise ValueError(f"dst: {dst.size} elements, the workspace has {src.size}")
    grid = max(1, min(NARROW_GRID, -(-dst.size // NARROW_THREADS)))
    configure(_dispatcher(), grid, NARROW_THREADS, stream or 0)(src, dst)


def narrow_pointers(src, dst, n, stream_handle=0):
    """narrow_device on raw device addresses of n elements (src float32, dst float16), without numba's dispatcher:
    the Launcher's fast route runs it after every split float16 backward-weight kernel."""
    global _fast
    fast = _fast
    if fast is None or not fast.usable():
        from numba import cuda
        kernel = _dispatcher()
        configure(kernel, 1, NARROW_THREADS)(cuda.device_array(1, np.float32), cuda.device_array(1, np.float16))
        fast = _fast = _FastLaunch(kernel, NARROW_GRID, NARROW_THREADS, 2)  # (its one overload, compiled above)
    fast([(src, n, 4), (dst, n, 2)], 4, stream_handle)


def narrow_host(src, dst):
    """The CPU backend's narrow_device: dst[:] = src, rounded to nearest even."""
    np.copyto(dst, src, casting="same_kind")
