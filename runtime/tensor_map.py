"""TMA tensor maps (sm_90): the 128-byte descriptors that cp.async.bulk.tensor copies read, encoded on the host
by the CUDA driver (cuTensorMapEncodeTiled / cuTensorMapEncodeIm2col, through ctypes: numba exposes neither)
and handed to a kernel in global memory as a device array (kernelgen/_cuda_tma_intrinsics.py).

Dimensions, box sizes and coordinates are innermost first, as the driver takes them: a channels-last
activation x[N, H, W, C] is the 4-D tensor (C, W, H, N).
"""
from __future__ import annotations

import ctypes

import numpy as np

from kernelgen.runtime.driver import libcuda

# CUtensorMapDataType, CUtensorMapSwizzle (cuda.h)
# (by dtype name: bfloat16 arrays are uint16 bit patterns to NumPy)
DATA_TYPES = {"float16": 6, "float32": 7, "bfloat16": 9}
SWIZZLE = {None: 0, 32: 1, 64: 2, 128: 3}
_L2_PROMOTION_128B = 2


def _driver():
    try:
        return libcuda()
    except OSError as e:
        raise RuntimeError("TMA tensor maps need the CUDA driver (libcuda.so.1), which is not installed here") from e


def _check(cu, result, what):
    if result:
        name = ctypes.c_char_p()
        cu.cuGetErrorName(result, ctypes.byref(name))
        raise ValueError(f"{what}: the driver refused the tensor map ({(name.value or b'?').decode()}, {result})")


def _common(address, dtype, dims, strides, swizzle, traversal=()):
    """Validated (data type, dims, byte strides of dims 1.., element strides) arrays for the driver; traversal:
    an im2col walk's step per spatial dim (the element strides of dims 1 .. rank - 2; the others 1)."""
    dtype = dtype if dtype == "bfloat16" else np.dtype(dtype).name
    if dtype not in DATA_TYPES:
        raise TypeError(f"dtype: expected float32, float16 or bfloat16, got {dtype}")
    if swizzle not in SWIZZLE:
        raise ValueError(f"swizzle: expected one of None, 32, 64, 128 (bytes), got {swizzle!r}")
    if address % 16:
        raise ValueError(f"address: the tensor must start 16-byte aligned, got {address:#x}")
    if len(strides) != len(dims) - 1 or any(s % 16 for s in strides):
        raise ValueError(f"strides: expected {len(dims) - 1} byte strides (dims 1..), multiples of 16, got {strides}")
    rank = len(dims)
    steps = (1, *traversal, 1) if traversal else (1,) * rank
    if len(steps) != rank or not all(1 <= t <= 8 for t in steps):
        raise ValueError(f"traversal: expected {rank - 2} steps in 1..8 (the spatial dims), got {traversal}")
    return (DATA_TYPES[dtype], rank, (ctypes.c_uint64 * rank)(*dims), (ctypes.c_uint64 * (rank - 1))(*strides),
            (ctypes.c_uint32 * rank)(*steps))


def _map_buffer() -> np.ndarray:
    """16 zeroed uint64 words at a 64-byte aligned address: CUtensorMap is declared alignas(64)."""
    raw = np.zeros(16 + 8, np.uint64)
    skip = (-raw.ctypes.data % 64) // 8
    return raw[skip:skip + 16]


def encode_tiled(address, dtype, dims, strides, box, *, swizzle=None) -> np.ndarray:
    """The tensor map of a `box` (elements per dim) tiling of the tensor at device `address`; returned as 16
    uint64 words for the kernel's global memory.  Out-of-bounds elements of a box arrive as zeros."""
    dt, rank, gdim, gstride, estride = _common(address, dtype, dims, strides, swizzle)
    if len(box) != rank or not all(1 <= b <= 256 for b in box):
        raise ValueError(f"box: expected {rank} sizes in 1..256, got {box}")
    itemsize = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
    if box[0] * itemsize % 16 or (swizzle and box[0] * itemsize > swizzle):
        raise ValueError(f"box: the inner box must be a multiple of 16 bytes and at most the swizzle span, got {box[0]}")
    out = _map_buffer()
    cu = _driver()
    _check(cu, cu.cuTensorMapEncodeTiled(
        out.ctypes.data_as(ctypes.c_void_p), dt, rank, ctypes.c_void_p(address), gdim, gstride,
        (ctypes.c_uint32 * rank)(*box), estride, 0, SWIZZLE[swizzle], _L2_PROMOTION_128B, 0), "encode_tiled")
    return out


# the driver's range of an im2col map's corners per rank (cuTensorMapEncodeIm2col): 4-D -128..127, 5-D -16..15
IM2COL_CORNER = {4: 128, 5: 16}


def encode_im2col(address, dtype, dims, strides, lower, upper, channels, pixels, *, swizzle=None,
                  traversal=()) -> np.ndarray:
    """The im2col tensor map of a channels-last tensor dims = (C, W, H, N), or (C, W, H, D, N) for a 3-D
    convolution: a copy brings `pixels` pixels x `channels` channels, the pixels walking the bounding box of base
    positions [lower, (W, H[, D]) - 1 + upper] (per spatial dim, innermost first; for a convolution lower =
    -padding, upper = padding - (R - 1) dilation), `traversal` apart per spatial dim (a convolution's stride; () =
    1).  Returned as 16 uint64 words."""
    dt, rank, gdim, gstride, estride = _common(address, dtype, dims, strides, swizzle, traversal)
    if rank not in IM2COL_CORNER or len(lower) != rank - 2 or len(upper) != rank - 2:
        raise ValueError(f"dims: expected (C, W, H, N) or (C, W, H, D, N) with a lower and an upper corner per "
                         f"spatial dim, got {dims}, {lower}, {upper}")
    bound = IM2COL_CORNER[rank]
    if not all(-bound <= v < bound for v in (*lower, *upper)):
        raise ValueError(f"lower, upper: a {rank}-D im2col corner must lie in {-bound}..{bound - 1}, got {lower}, "
                         f"{upper}")
    if not (1 <= channels <= 256 and 1 <= pixels <= 1024):
        raise ValueError(f"channels, pixels: expected 1..256 and 1..1024, got {channels}, {pixels}")
    out = _map_buffer()
    cu = _driver()
    corners = ctypes.c_int * (rank - 2)
    _check(cu, cu.cuTensorMapEncodeIm2col(
        out.ctypes.data_as(ctypes.c_void_p), dt, rank, ctypes.c_void_p(address), gdim, gstride,
        corners(*lower), corners(*upper), ctypes.c_uint32(channels), ctypes.c_uint32(pixels),
        estride, 0, SWIZZLE[swizzle], _L2_PROMOTION_128B, 0), "encode_im2col")
    return out


def channels_last(x_shape, itemsize=4):
    """(dims, strides) of a contiguous x[N, H, W, C] as the driver takes them: (C, W, H, N) and the byte
    strides of W, H, N."""
    N, H, W, C = x_shape
    return (C, W, H, N), (C * itemsize, W * C * itemsize, H * W * C * itemsize)


def unswizzle128(tile):
    """A rows x 32-word tile as a 128-byte swizzled copy wrote it (16-byte chunk j of row r at chunk
    j ^ (r % 8), the tile starting 1024-byte aligned), back in row-major order."""
    t = np.asarray(tile).reshape(-1, 8, 4)
    out = np.empty_like(t)
    for r in range(len(t)):
        out[r, np.arange(8) ^ (r % 8)] = t[r]
    return out.reshape(-1, 32)


def copy_kernel():
    """A one-block kernel that checks a pair of maps on the GPU: copy(xmap, wmap, out, c, a_words, b_words)
    issues one im2col copy at c[0:6] = (c, w, h, n, dw, dh) into shared words [0, a_words) (a multiple of 256:
    swizzled tiles start 1024-byte aligned) and one tiled copy at c[6:8] after it, waits on one mbarrier, and
    writes the a_words + b_words shared words to out.  Launch with (a_words + b_words) * 4 bytes of dynamic
    shared memory."""
    # imported here, not at the top: this GPU check alone needs numba.cuda (slow to import, absent without
    # numba-cuda) and the TMA intrinsics, which import it; encoding maps needs neither
    from numba import cuda, float32, int64

    from kernelgen._cuda_tma_intrinsics import (mbarrier_expect_tx, mbarrier_init, mbarrier_init_fence,
                                                mbarrier_try_wait, tma_load_2d, tma_load_im2col_4d)

    @cuda.jit
    def copy(xmap, wmap, out, c, a_words, b_words):
        sm = cuda.shared.array(0, float32, alignment=1024)
        bar = cuda.shared.array(1, int64)
        t = cuda.threadIdx.x
        if t == 0:
            mbarrier_init(bar, 0, 1)
            mbarrier_init_fence()
        cuda.syncthreads()
        if t == 0:
            mbarrier_expect_tx(bar, 0, (a_words + b_words) * 4)
            tma_load_im2col_4d(sm, 0, xmap, c[0], c[1], c[2], c[3], c[4], c[5], bar, 0)
            tma_load_2d(sm, a_words, wmap, c[6], c[7], bar, 0)
        spins = 0  # bounded: a bad map gives wrong words, not a hung GPU
        while mbarrier_try_wait(bar, 0, 0) == 0 and spins < 4194304:
            spins += 1
        for e in range(t, a_words + b_words, cuda.blockDim.x):
            out[e] = sm[e]
    return copy
