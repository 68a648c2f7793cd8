"""TMA tensor maps (runtime/tensor_map.py) and the TMA/mbarrier intrinsics (kernelgen/_cuda_tma_intrinsics.py).

Bad arguments are refused on the host, naming the argument, before the driver is asked (runs anywhere).  One
im2col copy (a filter tap of an implicit-GEMM A tile, padding included) and one tiled copy, unswizzled and
128-byte swizzled, land in shared memory where NumPy says they should: written in the IR (ir.TensorCopy and
the mbarrier statements) on the CPU backend everywhere, and on an sm_90 GPU both from the IR and through the
intrinsics directly.
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


# --- the copies: one im2col box (64 pixels x 32 channels of x at a filter tap) and one tiled box (16 rows x 32
# words of a 40 x 288 matrix), unswizzled and 128-byte swizzled ------------------------------------------------

N, H, W, C, R, PAD = 2, 6, 10, 32, 3, 1
CASES = ((0, (0, 2), 0, 0), (50, (2, 1), 64, 32))  # (m0, tap, kb, nb); the second crosses into image 1


def operands(rng):
    return (rng.standard_normal((N, H, W, C)).astype(np.float32),
            rng.standard_normal((40, 3 * 3 * C)).astype(np.float32))


def coords(m0, tap, kb, nb):
    """(c, w, h, n, dw, dh, kb, nb): the im2col copy's base pixel is output pixel m0's window corner."""
    n, ho, wo = m0 // (H * W), (m0 % (H * W)) // W, m0 % W
    r, s = tap
    return np.array([0, wo - PAD, ho - PAD, n, s, r, kb, nb], np.int32)


def expected(x, w2d, m0, tap, kb, nb):
    """The 80 x 32 words the two copies bring: pixel rows (zeros in the padding), then filter rows (zeros
    past the 40th)."""
    want = np.zeros((80, 32), np.float32)
    for p in range(64):  # the column walks output pixels; each reads input (h + r, w + s) of its base
        m = m0 + p
        hi, wi = (m % (H * W)) // W - PAD + tap[0], m % W - PAD + tap[1]
        if m < N * H * W and 0 <= hi < H and 0 <= wi < W:
            want[p] = x[m // (H * W), hi, wi]
    rows = w2d[nb:nb + 16, kb:kb + 32]
    want[64:64 + len(rows)] = rows
    return want


def landed(out, swizzle):
    got = np.asarray(out).reshape(80, 32)
    return np.concatenate([unswizzle128(got[:64]), unswizzle128(got[64:])]) if swizzle else got


def copy_ir(swizzle):
    """The two copies as an IR kernel: thread 0 initialises the mbarrier, announces the bytes and issues both
    copies; after the barrier's phase 0 every thread writes its share of the 80 x 32 shared words to out."""
    from kernelgen.ir import Barrier, Buffer, For, If, Kernel, MbarrierExpect, MbarrierInit, MbarrierWait, \
        TensorCopy, TensorMap, Var
    sw = swizzle or 0
    xmap = TensorMap("x_map", "x", "im2col", DIMS, STRIDES, (32, 64), (-PAD, -PAD), (PAD - (R - 1),) * 2, sw)
    wmap = TensorMap("w_map", "w", "tiled", (3 * 3 * C, 40), (3 * 3 * C * 4,), (32, 16), swizzle=sw)
    c, out = Buffer("c", (8,), "int32"), Buffer("out", (80 * 32,), role="out")
    sm = Buffer("sm", (80 * 32,), scope="shared")
    tid = Var("tid")
    issue = (MbarrierExpect("bar", 0, 80 * 32 * 4),
             TensorCopy("sm", (0,), xmap, tuple(c[i] for i in range(4)), (c[4], c[5]), "bar", 0),
             TensorCopy("sm", (64 * 32,), wmap, (c[6], c[7]), (), "bar", 0))
    body = (For("tid", 128, (If(tid.eq(0), (MbarrierInit("bar", 0, 1),)),), "thread"), Barrier(),
            For("tid", 128, (If(tid.eq(0), issue),), "thread"),
            For("tid", 128, (MbarrierWait("bar", 0, 0),) + tuple(out.store(tid + 128 * e, sm[tid + 128 * e])
                                                                   for e in range(20)), "thread"))
    params = (Buffer("x", (N * H * W * C,)), Buffer("x_map", (16,), "uint64"), Buffer("w", (40 * 3 * 3 * C,)),
              Buffer("w_map", (16,), "uint64"), c, out)
    return Kernel("tma_copy", params, (sm, Buffer("bar", (1,), "int64", "shared")),
                  (For("b", 1, body, "grid"),), (1,), 128)


def module(src):
    ns = {}
    exec(compile(src, "<tma_copy>", "exec"), ns)
    return ns


@pytest.mark.parametrize("swizzle", [None, 128])
def test_tensor_copy_ir_runs_on_the_cpu(swizzle, rng):
    """ir.TensorCopy on the CPU backend (kernelgen.cpu_tma): the copies land synchronously, mbarriers are
    no-ops, the words are where the GPU puts them."""
    from kernelgen.render_cpu import render_cpu
    src = render_cpu(copy_ir(swizzle), cache=False)
    assert "tma_im2col_4d(sm, 0, x, 32, 10, 6, 2, -1, -1, -1, -1, 32, 64, " in src and "tma_tiled_2d(sm, 2048, w, " in src
    x, w2d = operands(rng)
    placeholder = np.zeros(16, np.uint64)  # the CPU reads x and w themselves
    for case in CASES:
        out = np.full(80 * 32, np.nan, np.float32)
        module(src)["tma_copy"](x.ravel(), placeholder, w2d.ravel(), placeholder, coords(*case), out)
        np.testing.assert_array_equal(landed(out, swizzle), expected(x, w2d, *case))


def test_tensor_copy_ir_renders_for_cuda():
    from kernelgen.render_cuda import render_cuda
    src = render_cuda(copy_ir(128), cache=False)
    assert "from kernelgen.cuda_tma import mbarrier_expect_tx, mbarrier_init, mbarrier_init_fence, " \
           "mbarrier_try_wait, tma_load_2d, tma_load_im2col_4d\n" in src
    assert "sm = cuda.shared.array((2560,), float32, alignment=1024)" in src  # the swizzle follows the address
    assert "bar = cuda.shared.array((1,), int64)" in src
    assert "tma_load_im2col_4d(sm, 0, x_map, c[uidx(0)], c[uidx(1)], c[uidx(2)], c[uidx(3)], c[uidx(4)], c[uidx(5)], bar, 0)" in src
    assert "tma_load_2d(sm, 2048, w_map, c[uidx(6)], c[uidx(7)], bar, 0)" in src
    assert "mbarrier_init(bar, 0, 1)\n" in src and "while mbarrier_try_wait(bar, 0, 0) == 0:" in src
    assert "alignment=128)" in render_cuda(copy_ir(None), cache=False)


def _gpu_maps(x_dev, w_dev, w2d, swizzle):
    from numba import cuda
    xmap = encode_im2col(x_dev.device_ctypes_pointer.value, np.float32, DIMS, STRIDES, (-PAD, -PAD),
                         (PAD - (R - 1), PAD - (R - 1)), 32, 64, swizzle=swizzle)
    wmap = encode_tiled(w_dev.device_ctypes_pointer.value, np.float32, (w2d.shape[1], w2d.shape[0]),
                        (w2d.shape[1] * 4,), (32, 16), swizzle=swizzle)
    return cuda.to_device(xmap), cuda.to_device(wmap)


@pytest.mark.gpu
@pytest.mark.parametrize("swizzle", [None, 128])
def test_gpu_im2col_and_tiled_copies(swizzle, rng):
    """The intrinsics directly (runtime.tensor_map.copy_kernel) and the IR kernel rendered for CUDA."""
    from kernelgen.render_cuda import render_cuda
    from numba import cuda
    x, w2d = operands(rng)
    x_dev, w_dev = cuda.to_device(x.ravel()), cuda.to_device(w2d.ravel())
    xmap, wmap = _gpu_maps(x_dev, w_dev, w2d, swizzle)
    ir_kernel = module(render_cuda(copy_ir(swizzle), cache=False))["KERNEL"]
    for case in CASES:
        for run in ("intrinsics", "ir"):
            out = cuda.to_device(np.full(80 * 32, np.nan, np.float32))
            c = cuda.to_device(coords(*case))
            if run == "intrinsics":
                copy_kernel()[1, 128, 0, 80 * 32 * 4](xmap, wmap, out, c, 64 * 32, 16 * 32)
            else:
                ir_kernel[1, 128](x_dev, xmap, w_dev, wmap, c, out)
            np.testing.assert_array_equal(landed(out.copy_to_host(), swizzle), expected(x, w2d, *case), err_msg=run)
