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
_SPECIAL = 0x7F800000  # exponent bits all set: inf or NaN, which cvt.rna.tf32.f32 does not round


def _round_tf32_body(src, dst):
    # uint32 views: + half a TF32 unit in the last place, then drop the 13 low bits (ties away from zero)
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < src.size:
        b = src[i]
        if b & 0x7F800000 == 0x7F800000:
            dst[i] = 0x7FFFFFFF if b & 0x7FFFFF else b  # NaN as the canonical NaN, inf as itself
        else:
            dst[i] = (b + 0x1000) & 0xFFFFE000


def round_tf32_device(src, dst, stream=None):
    """dst[:] = src rounded to TF32 (what cvt.rna.tf32.f32 gives), both 1D float32 device arrays of one size: the
    operands of a TMA-fed tensor-core kernel, which reads them as they are (ir_async.TensorMap.rounding)."""
    global _round_kernel, cuda
    from numba import cuda
    if _round_kernel is None:
        _round_kernel = cuda.jit(_round_tf32_body)
    n = src.size
    launch = _round_kernel[(n + 255) // 256, 256] if stream is None else _round_kernel[(n + 255) // 256, 256, stream]
    launch(src.view(np.uint32), dst.view(np.uint32))


def round_tf32_host(a):
    """A copy of the float32 NumPy array `a` rounded as round_tf32_device rounds (the CPU backend's operands)."""
    b = np.ascontiguousarray(a, np.float32).view(np.uint32)
    rounded = (b + np.uint32(0x1000)) & np.uint32(0xFFFFE000)
    special = b & np.uint32(_SPECIAL) == _SPECIAL
    kept = np.where(b & np.uint32(0x7FFFFF), np.uint32(0x7FFFFFFF), b)
    return np.where(special, kept, rounded).view(np.float32)
