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


_flip_kernel = None
_flip_fast = {}
FLIP_THREADS = 256  # 8 warps: a 32 x 32 tile of (k, c), 4 rows per warp


def _round_flip_body(src, dst, K, T, C):
    # one block per (32 c, 32 k, tap): read src[k, t, :] along c, write dst[c, T - 1 - t, :] along k, through a
    # padded shared tile so that both sides are whole 128-byte lines
    tile = cuda.shared.array((32, 33), np.uint32)
    lane, row = cuda.threadIdx.x % 32, cuda.threadIdx.x // 32
    c0, k0, t = cuda.blockIdx.x * 32, cuda.blockIdx.y * 32, cuda.blockIdx.z
    for j in range(row, 32, 8):
        k, c = k0 + j, c0 + lane
        if k < K and c < C:
            b = src[(k * T + t) * C + c]
            if b & 0x7F800000 == 0x7F800000:
                tile[j, lane] = 0x7FFFFFFF if b & 0x7FFFFF else b
            else:
                tile[j, lane] = (b + 0x1000) & 0xFFFFE000
    cuda.syncthreads()
    for j in range(row, 32, 8):
        c, k = c0 + j, k0 + lane
        if c < C and k < K:
            dst[(c * T + (T - 1 - t)) * K + k] = tile[lane, j]


def _flip_dispatcher():
    global _flip_kernel, cuda
    from numba import cuda
    if _flip_kernel is None:
        _flip_kernel = cuda.jit(_round_flip_body)
    return _flip_kernel


def _flip_grid(K, T, C):
    return (-(-C // 32), -(-K // 32), T)


def round_tf32_flipped_device(src, dst, flip, stream=None):
    """dst (C, T, K) = src (K, T, C) with the taps reversed, rounded as round_tf32_device rounds (flip = (K, T,
    C); 1D float32 device arrays): a stride-1 backward-data's filter as the forward convolution it is reads it
    (ir_async.TensorMap.flip)."""
    kernel = _flip_dispatcher()
    grid = _flip_grid(*flip)
    launch = kernel[grid, FLIP_THREADS] if stream is None else kernel[grid, FLIP_THREADS, stream]
    launch(src.view(np.uint32), dst.view(np.uint32), *flip)


def round_tf32_flipped_pointers(src, dst, flip, stream_handle=0):
    """round_tf32_flipped_device on raw device addresses, launched without numba's dispatcher."""
    from .launch import _FastLaunch
    fast = _flip_fast.get(flip)
    if fast is None or not fast.usable():
        from numba import cuda
        kernel, scratch = _flip_dispatcher(), cuda.device_array(1, np.uint32)
        kernel[(1, 1, 1), FLIP_THREADS](scratch, scratch, 0, 1, 0)  # compiles its one overload (nothing to do)
        fast = _flip_fast[flip] = _FastLaunch(kernel, _flip_grid(*flip), FLIP_THREADS, 2, scalars=3)
    n = flip[0] * flip[1] * flip[2]
    fast([(src, n), (dst, n)], 4, stream_handle, scalars=flip)


def round_tf32_flipped_host(a, flip):
    """round_tf32_host of the (K, T, C) filter `a` written as (C, T, K), taps reversed (the CPU backend's copy)."""
    K, T, C = flip
    a = np.asarray(a)
    return round_tf32_host(a.reshape(K, T, C)[:, ::-1, :].transpose(2, 1, 0)).reshape(a.shape)  # a's shape, flat order


def round_tf32_host(a):
    """A copy of the float32 NumPy array `a` rounded as round_tf32_device rounds (the CPU backend's operands)."""
    b = np.ascontiguousarray(a, np.float32).view(np.uint32)
    rounded = (b + np.uint32(0x1000)) & np.uint32(0xFFFFE000)
    special = b & np.uint32(0x7F800000) == 0x7F800000  # inf or NaN, which cvt.rna.tf32.f32 does not round
    kept = np.where(b & np.uint32(0x7FFFFF), np.uint32(0x7FFFFFFF), b)
    return np.where(special, kept, rounded).view(np.float32)
