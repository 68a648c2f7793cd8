"""Small elementwise device kernels the API needs around the generated ones."""
from __future__ import annotations

import numpy as np

_bias_kernel = None


def _add_channel_bias_body(y, bias, channels):
    # module-level so the simulator can swap this module's `cuda` global for its fake one
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < y.size:
        y[i] += bias[i % channels]


def add_channel_bias(y, bias, stream=None):
    """y[..., c] += bias[c] in place, for a C-contiguous channels-last device array y."""
    global _bias_kernel, cuda
    from numba import cuda

    from kernelgen.arrays import to_device_view
    if _bias_kernel is None:
        _bias_kernel = cuda.jit(_add_channel_bias_body)
    d = to_device_view(y, "y")
    flat = d.reshape(d.size)
    b = to_device_view(bias, "bias")
    grid = (flat.size + 255) // 256
    launch = _bias_kernel[grid, 256] if stream is None else _bias_kernel[grid, 256, stream]
    launch(flat, b, b.size)


_round_kernel = None
_round_fast = None
ROUND_GRID, ROUND_THREADS = 1056, 256  # 8 blocks per SM of an H100, striding over any size


def _round_tf32_body(src, dst):
    # uint32 views: + half a TF32 unit in the last place, then drop the 13 low bits (ties away from zero)
    for i in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, src.size, cuda.gridDim.x * cuda.blockDim.x):
        b = src[i]
        if b & 0x7F800000 == 0x7F800000:
            dst[i] = 0x7FFFFFFF if b & 0x7FFFFF else b  # NaN as the canonical NaN, inf as itself
        else:
            dst[i] = (b + 0x1000) & 0xFFFFE000


def _round_dispatcher():
    global _round_kernel, cuda
    from numba import cuda
    if _round_kernel is None:
        _round_kernel = cuda.jit(_round_tf32_body)
    return _round_kernel


def round_tf32_device(src, dst, stream=None):
    """dst[:] = src rounded to TF32 (what cvt.rna.tf32.f32 gives), both 1D float32 device arrays of one size: the
    operands of a TMA-fed tensor-core kernel, which reads them as they are (ir_async.TensorMap.rounding)."""
    kernel = _round_dispatcher()
    launch = kernel[ROUND_GRID, ROUND_THREADS] if stream is None else kernel[ROUND_GRID, ROUND_THREADS, stream]
    launch(src.view(np.uint32), dst.view(np.uint32))


def round_tf32_pointers(src, dst, n, stream_handle=0):
    """round_tf32_device on raw device addresses of n float32 words, launched without numba's dispatcher (the
    Launcher's fast route: this runs before every TMA kernel)."""
    global _round_fast
    from .launch import _FastLaunch
    if _round_fast is None or not _round_fast.usable():
        from numba import cuda
        kernel, scratch = _round_dispatcher(), cuda.device_array(1, np.uint32)
        kernel[1, ROUND_THREADS](scratch, scratch)  # compiles its one overload
        _round_fast = _FastLaunch(kernel, ROUND_GRID, ROUND_THREADS, 2)
    _round_fast([(src, n), (dst, n)], 4, stream_handle)


def round_tf32_host(a):
    """A copy of the float32 NumPy array `a` rounded as round_tf32_device rounds (the CPU backend's operands)."""
    b = np.ascontiguousarray(a, np.float32).view(np.uint32)
    rounded = (b + np.uint32(0x1000)) & np.uint32(0xFFFFE000)
    special = b & np.uint32(0x7F800000) == 0x7F800000  # inf or NaN, which cvt.rna.tf32.f32 does not round
    kept = np.where(b & np.uint32(0x7FFFFF), np.uint32(0x7FFFFFFF), b)
    return np.where(special, kept, rounded).view(np.float32)
