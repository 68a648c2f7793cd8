"""TMA tensor maps (runtime/tensor_map.py) and the TMA/mbarrier intrinsics (kernelgen/_cuda_tma_intrinsics.py).

Bad arguments are refused on the host, naming the argument, before the driver is asked (runs anywhere).  On
an sm_90 GPU one im2col copy (a filter tap of an implicit-GEMM A tile, padding included) and one tiled copy,
unswizzled and 128-byte swizzled, land in shared memory where NumPy says they should.
"""
from __future__ import annotations

import numpy as np
import pytest

from kernelgen.runtime.tensor_map import channels_last, copy_kernel, encode_im2col, encode_tiled, unswizzle128

DIMS, STRIDES = channels_last((2, 6, 10, 32))  # x[N=2, H=6, W=10, C=32]


@pytest.mark.parametrize("call, match", [
    (lambda: encode_tiled(256, np.float64, (32, 8), (128,), (32, 8)), "dtype: expected float32 or float16"),
    (lambda: encode_tiled(256, np.float32, (32, 8), (128,), (32, 8), swizzle=16), "swizzle: expected one of"),
    (lambda: encode_tiled(260, np.float32, (32, 8), (128,), (32, 8)), "address: the tensor must start 16-byte"),
    (lambda: encode_tiled(256, np.float32, (30, 8), (120,), (32, 8)), "strides: expected 1 byte strides"),
    (lambda: encode_tiled(256, np.float32, (32, 8), (128,), (32, 300)), "box: expected 2 sizes in 1..256"),
    (lambda: encode_tiled(256, np.float32, (32, 8), (128,), (6, 8)), "box: the inner box must be a multiple"),
    (lambda: encode_tiled(256, np.float32, (64, 8), (256,), (64, 8), swizzle=128), "at most the swizzle span"),
    (lambda: encode_im2col(256, np.float32, (32, 8), (128,), (-1, -1), (-1, -1), 32, 64), "dims: expected (C, W, H, N)"),
    (lambda: encode_im2col(256, np.float32, DIMS, STRIDES, (-200, 0), (0, 0), 32, 64), "lower, upper: a 4-D im2col"),
    (lambda: encode_im2col(256, np.float32, DIMS, STRIDES, (-1, -1), (-1, -1), 32, 2048), "channels, pixels"),
])
def test_bad_arguments_are_refused_before_the_driver(call, match):
    with pytest.raises((ValueError, TypeError), match=match.replace("(", r"\(").replace(")", r"\)")):
        call()


def test_a_missing_driver_is_named(monkeypatch):
    import ctypes

    def no_driver(name):
        raise OSError(f"{name}: cannot open shared object file")
    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    with pytest.raises(RuntimeError, match="CUDA driver \\(libcuda.so.1\\)"):
        encode_tiled(256, np.float32, (32, 8), (128,), (32, 8))


def test_channels_last_dims_and_strides():
    assert DIMS == (32, 10, 6, 2) and STRIDES == (32 * 4, 10 * 32 * 4, 6 * 10 * 32 * 4)


def test_unswizzle128_undoes_the_128_byte_swizzle(rng):
    tile = rng.standard_normal((16, 32)).astype(np.float32)
    swizzled = np.empty_like(tile)
    for r in range(16):  # 16-byte chunk j of row r lands at chunk j ^ (r % 8)
        for j in range(8):
            swizzled[r, 4 * (j ^ (r % 8)):4 * (j ^ (r % 8)) + 4] = tile[r, 4 * j:4 * j + 4]
    assert not np.array_equal(swizzled, tile)
    np.testing.assert_array_equal(unswizzle128(swizzled.ravel()), tile)


@pytest.mark.gpu
@pytest.mark.parametrize("swizzle", [None, 128])
def test_gpu_im2col_and_tiled_copies(swizzle, rng):
    from numba import cuda

    N, H, W, C, R, pad = 2, 6, 10, 32, 3, 1
    x = rng.standard_normal((N, H, W, C)).astype(np.float32)
    w2d = rng.standard_normal((40, 3 * 3 * C)).astype(np.float32)
    x_dev, w_dev = cuda.to_device(x.ravel()), cuda.to_device(w2d.ravel())
    xmap = encode_im2col(x_dev.device_ctypes_pointer.value, np.float32, DIMS, STRIDES, (-pad, -pad),
                         (pad - (R - 1), pad - (R - 1)), 32, 64, swizzle=swizzle)
    wmap = encode_tiled(w_dev.device_ctypes_pointer.value, np.float32, (w2d.shape[1], w2d.shape[0]),
                        (w2d.shape[1] * 4,), (32, 16), swizzle=swizzle)
    copy = copy_kernel()
    for m0, (r, s), kb, nb in ((0, (0, 2), 0, 0), (50, (2, 1), 64, 32)):  # the second crosses into image 1
        n, ho, wo = m0 // (H * W), (m0 % (H * W)) // W, m0 % W
        coords = np.array([0, wo - pad, ho - pad, n, s, r, kb, nb], np.int32)
        out = cuda.to_device(np.full(80 * 32, np.nan, np.float32))
        copy[1, 128, 0, 80 * 32 * 4](cuda.to_device(xmap), cuda.to_device(wmap), out, cuda.to_device(coords),
                                     64 * 32, 16 * 32)
        got = out.copy_to_host().reshape(80, 32)
        a, b = (unswizzle128(got[:64]), unswizzle128(got[64:])) if swizzle else (got[:64], got[64:])
        want = np.zeros((64, 32), np.float32)
        for p in range(64):  # the column walks output pixels; each reads input (h + r, w + s) of its base
            m = m0 + p
            hi, wi = (m % (H * W)) // W - pad + r, m % W - pad + s
            if m < N * H * W and 0 <= hi < H and 0 <= wi < W:
                want[p] = x[m // (H * W), hi, wi]
        np.testing.assert_array_equal(a, want)
        want_b = np.zeros((16, 32), np.float32)  # rows past the 40 filters arrive as zeros
        rows = w2d[nb:nb + 16, kb:kb + 32]
        want_b[:len(rows)] = rows
        np.testing.assert_array_equal(b, want_b)
