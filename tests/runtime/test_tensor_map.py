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
from harness import poisoned

DIMS, STRIDES = channels_last((2, 6, 10, 32))  # x[N=2, H=6, W=10, C=32]


@pytest.mark.parametrize("call, match", [
    (lambda: encode_tiled(256, np.float64, (32, 8), (128,), (32, 8)), "dtype: expected float32, float16 or bfloat16"),
    (lambda: encode_tiled(256, np.float32, (32, 8), (128,), (32, 8), swizzle=16), "swizzle: expected one of"),
    (lambda: encode_tiled(260, np.float32, (32, 8), (128,), (32, 8)), "address: the tensor must start 16-byte"),
    (lambda: encode_tiled(256, np.float32, (30, 8), (120,), (32, 8)), "strides: expected 1 byte strides"),
    (lambda: encode_tiled(256, np.float32, (32, 8), (128,), (32, 300)), "box: expected 2 sizes in 1..256"),
    (lambda: encode_tiled(256, np.float32, (32, 8), (128,), (6, 8)), "box: the inner box must be a multiple"),
    (lambda: encode_tiled(256, np.float32, (64, 8), (256,), (64, 8), swizzle=128), "at most the swizzle span"),
    (lambda: encode_im2col(256, np.float32, (32, 8), (128,), (-1, -1), (-1, -1), 32, 64), "dims: expected (C, W, H, N)"),
    (lambda: encode_im2col(256, np.float32, DIMS, STRIDES, (-200, 0), (0, 0), 32, 64), "lower, upper: a 4-D im2col"),
    (lambda: encode_im2col(256, np.float32, DIMS, STRIDES, (-1, -1), (-1, -1), 32, 2048), "channels, pixels"),
    (lambda: encode_im2col(256, np.float32, DIMS, STRIDES, (-1, -1), (-1, -1), 32, 64, traversal=(9, 1)),
     "traversal: expected 2 steps in 1..8"),
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
        out = poisoned(80 * 32)
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
            out = cuda.to_device(poisoned(80 * 32))
            c = cuda.to_device(coords(*case))
            if run == "intrinsics":
                copy_kernel()[1, 128, 0, 80 * 32 * 4](xmap, wmap, out, c, 64 * 32, 16 * 32)
            else:
                ir_kernel[1, 128](x_dev, xmap, w_dev, wmap, c, out)
            np.testing.assert_array_equal(landed(out.copy_to_host(), swizzle), expected(x, w2d, *case), err_msg=run)


# --- TileConfig.tma=1: the forward implicit GEMM fed by TensorCopy, emulated on the CPU ---------------------

TMA_CPU_CASES = [((2, 6, 10, 32), (40, 3, 3, 32), dict(padding=1), dict(BM=64, BN=32, WN=32, stages=2)),
                 ((1, 7, 9, 64), (24, 3, 3, 64), dict(padding=2, dilation=2), dict(BM=64, BN=16, WN=16, stages=3)),
                 pytest.param((2, 5, 5, 32), (16, 1, 1, 32), {}, dict(BM=64, BN=16, WN=16, stages=2),
                              marks=pytest.mark.slow),  # (a 1x1: case 6 at stride 2 runs it in CI)
                 ((1, 6, 6, 32), (32, 5, 3, 32), dict(padding=(2, 0)), dict(BM=128, BN=32, WN=32, stages=4)),
                 # strided: the im2col walk's traversal steps (odd sizes: the last window of a row is partial)
                 pytest.param((2, 9, 11, 32), (24, 3, 3, 32), dict(padding=1, stride=2),
                              dict(BM=64, BN=24, WN=24, stages=2), marks=pytest.mark.slow),  # (case 5 strides in CI)
                 ((1, 12, 13, 32), (16, 3, 3, 32), dict(padding=2, dilation=2, stride=(3, 2)),
                  dict(BM=64, BN=16, WN=16, stages=3)),
                 ((2, 8, 10, 64), (16, 1, 1, 64), dict(stride=2), dict(BM=64, BN=16, WN=16, stages=2))]


def tma_config(**kw):
    from kernelgen.templates.config import TileConfig
    return TileConfig(**{"BK": 32, "WM": 64, "wgmma": 1, "tma": 1, **kw})


# tma=2 (a producer warp, ir.Pipeline) on the CPU runs the pipeline's sequential lowering: one and two warpgroups
@pytest.mark.parametrize("x_shape, w_shape, kw, tile", TMA_CPU_CASES + [
    pytest.param(*case[:3], {**case[3], "tma": 2}, id=f"tma2-{i}") for i, case in enumerate(TMA_CPU_CASES[::3])])
def test_cpu_tma_forward(x_shape, w_shape, kw, tile, rng):
    """The TMA schedule on the CPU backend (copies when issued, wgmma emulated per thread, truncating): ragged M
    and N, 1..2 warpgroups, 2..4 stages, dilation, asymmetric padding and strides.  Equal to the float64 GEMM of
    TF32-rounded operands to float32 accuracy, because the threads round each landed stage."""
    from kernelgen import reference as ref
    from kernelgen.api import get_launcher, make_plan
    from kernelgen.mma_layout import tf32_round
    from kernelgen.problem import make_problem
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal(w_shape).astype(np.float32)
    p = make_problem("fwd", x_shape, w_shape, **kw)
    launcher = get_launcher(make_plan(p, "cpu", config=tma_config(**tile), precision="tf32"))
    assert [m[0] for m in launcher.tensor_maps] == ["x_map", "w_map"]
    y = poisoned(int(np.prod(p.y_shape)))
    launcher({"x": x.ravel(), "w": w.ravel(), "y": y})
    y = y.reshape(p.y_shape).astype(np.float64)
    rounded = ref.conv_forward(tf32_round(x).astype(np.float64), tf32_round(w).astype(np.float64), **kw)
    exact = ref.conv_forward(x.astype(np.float64), w.astype(np.float64), **kw)
    assert np.abs(y - rounded).max() <= 1e-5 * np.abs(rounded).max()
    assert np.abs(y - exact).max() <= 1e-3 * np.abs(exact).max()


TMA_BWD_CPU_CASES = [((2, 6, 10, 24), (64, 3, 3, 24), dict(padding=1), dict(BM=64, BN=24, WN=24, stages=2)),
                     ((1, 7, 9, 16), (32, 3, 3, 16), dict(padding=2, dilation=2), dict(BM=64, BN=16, WN=16, stages=3)),
                     ((1, 6, 6, 8), (32, 5, 3, 8), dict(padding=(2, 1)), dict(BM=64, BN=8, WN=8, stages=2, tma=2)),
                     # strided: KS-deconv's classes (ks_deconv.ks_tma), one with fewer positions and taps than another
                     ((2, 8, 6, 24), (64, 3, 3, 24), dict(padding=1, stride=2), dict(BM=64, BN=24, WN=24, stages=2)),
                     ((1, 9, 10, 8), (32, 5, 4, 8), dict(padding=(2, 1), stride=(3, 2)),
                      dict(BM=64, BN=8, WN=8, stages=3, tma=2))]


@pytest.mark.parametrize("x_shape, w_shape, kw, tile", TMA_BWD_CPU_CASES)
def test_cpu_tma_backward_data(x_shape, w_shape, kw, tile, rng):
    check_cpu_tma_backward_data(x_shape, w_shape, kw, tile, rng)


@pytest.mark.parametrize("tile", [dict(BM=64, BN=24, WN=24, stages=2), dict(BM=64, BN=24, WN=24, stages=3, tma=2)])
def test_cpu_tma_strided_backward_data_untrimmed(tile, monkeypatch, rng):
    """With split-K (CUDA only) KS-deconv's TMA classes all run the largest sub-filter, the taps a class lacks
    read as TMA's zeros (a tap coordinate below 0): the same schedule here, where every block has one length."""
    from kernelgen.templates import ks_deconv
    monkeypatch.setattr(ks_deconv, "_tma_trims", lambda cfg: False)
    check_cpu_tma_backward_data((2, 7, 9, 24), (64, 3, 3, 24), dict(padding=1, stride=2), tile, rng)


def check_cpu_tma_backward_data(x_shape, w_shape, kw, tile, rng):
    """A stride-1 backward-data through the TMA boxes: the forward convolution of dy with the launcher's rounded
    copy of w transposed and flipped (TensorMap.flip), equal to the float64 backward-data of the TF32-rounded
    operands to float32 accuracy; the caller's w is left as it was."""
    from kernelgen import reference as ref
    from kernelgen.api import get_launcher, make_plan
    from kernelgen.mma_layout import tf32_round
    from kernelgen.problem import make_problem
    w = rng.standard_normal(w_shape).astype(np.float32)
    p = make_problem("bwd_data", x_shape, w_shape, **kw)
    dy = rng.standard_normal(p.y_shape).astype(np.float32)
    launcher = get_launcher(make_plan(p, "cpu", config=tma_config(**tile), precision="tf32"))
    assert [(m[0], m[1], m[10]) for m in launcher.tensor_maps] == [
        ("dy_map", "dy", ()), ("w_map", "w", (w_shape[0], w_shape[1] * w_shape[2], w_shape[3]))]
    dx = poisoned(int(np.prod(x_shape)))
    w_flat = w.ravel().copy()
    launcher({"dy": dy.ravel(), "w": w_flat, "dx": dx})
    dx = dx.reshape(x_shape).astype(np.float64)
    rounded = ref.conv_backward_data(tf32_round(dy).astype(np.float64), tf32_round(w).astype(np.float64), x_shape,
                                     **kw)
    assert np.abs(dx - rounded).max() <= 1e-5 * np.abs(rounded).max()
    assert np.array_equal(w_flat, w.ravel())


def test_tma_module_names_its_maps():
    from kernelgen.api import make_plan
    from kernelgen.problem import make_problem
    from kernelgen.render_cuda import render_cuda
    p = make_problem("fwd", (2, 6, 10, 32), (40, 3, 3, 32), padding=1)
    src = render_cuda(make_plan(p, "cuda", config=tma_config(BM=64, BN=32, WN=32, stages=2), precision="tf32")
                      .kernel_ir(), cache=False)
    assert "PARAMS = ('x', 'w', 'y', 'x_map', 'w_map')" in src
    assert "TENSOR_MAPS = (('x_map', 'x', 'im2col', (32, 10, 6, 2), (128, 1280, 7680), (32, 64), (-1, -1), (-1, -1), " \
           "128, 'tf32', (), 'float32', ()), ('w_map', 'w', 'tiled', (288, 40), (1152,), (32, 32), (), (), 128, 'tf32', " \
           "(), 'float32', ()))" in src
    assert "smem_desc_sw128(As, " in src and "copy_async" not in src and "KERNEL_ANY_ALIGNMENT" not in src
    # a strided forward: the map walks the window corners 2 apart (its traversal steps), from 2 wo - pad
    p = make_problem("fwd", (2, 9, 11, 32), (40, 3, 3, 32), padding=1, stride=2)
    src = render_cuda(make_plan(p, "cuda", config=tma_config(BM=64, BN=32, WN=32, stages=2), precision="tf32")
                      .kernel_ir(), cache=False)
    assert "(32, 64), (-1, -1), (-1, -1), 128, 'tf32', (), 'float32', (2, 2)), ('w_map'" in src


def test_tma_split_k_module():
    """split_k with TMA boxes: each split starts its boxes at its own first slice (bz selects it), adds into the
    zeroed output with atomics; a split that does not divide the slices is refused (a box past the last tap would
    read real pixels)."""
    from kernelgen.api import make_plan
    from kernelgen.problem import make_problem
    from kernelgen.render_cuda import render_cuda
    p = make_problem("fwd", (2, 6, 10, 64), (40, 3, 3, 64), padding=1)  # 18 slices
    src = render_cuda(make_plan(p, "cuda", config=tma_config(BM=64, BN=32, WN=32, stages=2, split_k=3),
                                precision="tf32").kernel_ir(), cache=False)
    assert "ZERO_OUTPUT = True" in src and "cuda.atomic.add(y, " in src
    assert "GRID = (2, 2, 3)" in src
    for tma in (1, 2):
        with pytest.raises(ValueError, match="split_k to divide the 18 slices"):
            make_plan(p, "cuda", config=tma_config(BM=64, BN=32, WN=32, stages=2, split_k=4, tma=tma),
                      precision="tf32").kernel_ir()


def test_warp_specialised_module():
    """tma=2 for CUDA: a producer warp beside two consumer warpgroups, branching on the warp-uniform warpgroup
    index; the consumers never meet (the operands land rounded), and wait for their last MMAs inside their branch
    (after it, ptxas serialises every warpgroup MMA: C7518, seen in the local sm_90a compile)."""
    from kernelgen.api import make_plan
    from kernelgen.problem import make_problem
    from kernelgen.render_cuda import render_cuda
    p = make_problem("fwd", (2, 6, 10, 32), (40, 3, 3, 32), padding=1)
    cfg = tma_config(BM=128, BN=32, WN=32, stages=3, tma=2)
    assert (str(cfg), cfg.threads, type(cfg).parse(str(cfg))) == ("BM128_BN32_BK32_WM64_WN32_S3_WG_TMA2", 288, cfg)
    src = render_cuda(make_plan(p, "cuda", config=cfg, precision="tf32").kernel_ir(), cache=False)
    lines = src.splitlines()
    assert "THREADS = 288" in lines and "    _wg = cuda.shfl_sync(0xFFFFFFFF, cuda.threadIdx.x // 128, 0)" in lines
    at = lines.index("    if _wg >= 2:  # the producer warp")
    assert lines[at + 1:at + 4] == ["        if cuda.threadIdx.x == 256:", "            for kt in range(9):",
                                    "                stage = umod32(kt, 3)"]
    consumers = lines.index("    else:  # the consumers")
    assert lines[consumers + 1] == "        for kt in range(9):"
    assert "            while mbarrier_try_wait(full, stage, umod32(udiv32(kt, 3), 2)) == 0:" in lines
    assert "                mbarrier_arrive(empty, umod32(add32(kt, 2), 3))" in lines
    last_wait = max(i for i, line in enumerate(lines) if "= wgmma_wait(" in line)
    assert lines[last_wait].startswith("        acc_") and lines[last_wait].endswith(", 0)")  # in the branch
    assert src.count("cuda.syncthreads()") == 1 and "named_barrier" not in src and " tf32(" not in src
    assert "mbarrier_init(empty, 2, 256)" in src and "mbarrier_init(full, 2, 1)" in src


def test_a_barrier_among_the_consumers_is_a_named_barrier():
    """Inside a Pipeline's consume, Barrier() joins the consumers alone (bar.sync 1, N): the producer warp never
    reaches it, so __syncthreads there would hang."""
    from kernelgen.ir import Barrier, Buffer, Const, For, Kernel, Pipeline, Var
    from kernelgen.render_cuda import render_cuda
    out, tid = Buffer("out", (128,), role="out"), Var("tid")
    consume = (For("tid", 128, (out.store(tid, Const(1.0)),), "thread"), Barrier())
    pipe = Pipeline("kt", 4, 2, "full", "empty", 128, (), consume)
    shared = tuple(Buffer(name, (2,), "int64", "shared") for name in ("full", "empty"))
    src = render_cuda(Kernel("k", (out,), shared, (For("b", 1, (pipe,), "grid"),), (1,), 160), cache=False)
    assert "named_barrier(1, 128)" in src and "syncthreads" not in src


def test_pipeline_checks_its_shape():
    from kernelgen.ir import Pipeline
    with pytest.raises(ValueError, match="lag < stages"):
        Pipeline("kt", 4, 2, "full", "empty", 128, (), (), lag=2)
    with pytest.raises(ValueError, match="whole warps of consumers"):
        Pipeline("kt", 4, 2, "full", "empty", 100, (), ())


@pytest.mark.parametrize("direction, x_shape, w_shape, kw, tile, match", [
    # (float32 backward-weight: its boxes are MN-major, which only the 16-bit wgmma reads)
    ("bwd_weight", (2, 6, 10, 32), (64, 3, 3, 32), dict(padding=1), {}, "tma=1 needs float16 or bfloat16 arrays"),
    ("bwd_data", (2, 6, 10, 32), (64, 3, 3, 16), dict(padding=1, stride=2, groups=2), {}, "tma=1 needs groups=1"),
    ("bwd_data", (2, 6, 10, 32), (40, 3, 3, 32), dict(padding=1, stride=2), {}, "channels a multiple of 32"),
    ("bwd_data", (2, 6, 10, 32), (40, 3, 3, 32), dict(padding=1), {}, "channels a multiple of 32 .of the reduction"),
    ("fwd", (2, 6, 10, 32), (40, 3, 3, 32), dict(stride=9), {}, "tma=1 needs stride 1 to 8"),
    ("fwd", (2, 6, 10, 16), (40, 3, 3, 16), {}, {}, "tma=1 needs channels a multiple of 32"),
    ("fwd", (2, 6, 10, 32), (40, 3, 3, 32), {}, dict(BK=16), "BK in .8, 16, 32. .tma: 32 or 64."),
    ("fwd", (2, 6, 10, 32), (40, 3, 3, 32), {}, dict(async_copy=1), "tma=1 needs wgmma=1, async_copy=0"),
])
def test_tma_configs_it_cannot_build_are_refused(direction, x_shape, w_shape, kw, tile, match):
    from kernelgen.api import make_plan
    from kernelgen.problem import make_problem
    p = make_problem(direction, x_shape, w_shape, **kw)
    with pytest.raises(ValueError, match=match):
        make_plan(p, "cpu", config=tma_config(BM=64, BN=32, WN=32, stages=2, **tile), precision="tf32").kernel_ir()


def tf32_edge_cases(rng):
    """Random floats of every magnitude, exact ties of TF32's last place, and inf, NaN, zeros, subnormals, FLT_MAX."""
    bits = rng.integers(0, 2 ** 32, 200, dtype=np.uint64).astype(np.uint32)
    ties = (bits & np.uint32(0xFFFFE000)) | np.uint32(0x1000)
    special = np.float32([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-40, -3e-39, np.finfo(np.float32).max, 1.0, -2.5])
    return np.concatenate([bits.view(np.float32), ties.view(np.float32), special])


def test_round_tf32_host_rounds_as_cvt_rna(rng):
    from kernelgen.cpu_round import tf32
    from kernelgen.runtime.elementwise import round_tf32_host
    a = tf32_edge_cases(rng)
    got = round_tf32_host(a)
    finite = np.isfinite(a) & (np.abs(a) >= np.finfo(np.float32).tiny)  # (cpu_round keeps subnormals' bits apart)
    want = np.array([tf32(v) for v in a[finite]], np.float32)
    assert np.array_equal(got[finite].view(np.uint32), want.view(np.uint32))
    assert np.array_equal(np.isnan(got), np.isnan(a)) and np.array_equal(got[np.isinf(a)], a[np.isinf(a)])
    assert not (got[~np.isnan(got)].view(np.uint32) & np.uint32(0x1FFF)).any()  # what wgmma would drop is 0
    assert a is not got and not np.shares_memory(a, got)


@pytest.mark.sim
def test_round_tf32_device_matches_the_host(rng):
    from numba import cuda

    from kernelgen.runtime.elementwise import round_tf32_device, round_tf32_host
    a = tf32_edge_cases(rng)[-40:]  # ties and the special values, in one simulated block
    out = cuda.to_device(np.full(a.size, 5.0, np.float32))
    round_tf32_device(cuda.to_device(a), out)
    got, want = out.copy_to_host(), round_tf32_host(a)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_round_tf32_flipped_device_matches_the_host(rng):
    """The launcher's copy of a backward-data filter for TMA: (K, T, C) -> (C, T, K) with the taps reversed and
    every word rounded; partial 32 x 32 tiles at both edges (simulated: 8 blocks of 256 threads)."""
    from numba import cuda

    from kernelgen.runtime.elementwise import round_tf32_flipped_device, round_tf32_flipped_host, round_tf32_host
    K, T, C = 33, 2, 34
    a = rng.standard_normal(K * T * C).astype(np.float32)
    a[:10] = tf32_edge_cases(rng)[-10:]
    want = round_tf32_flipped_host(a, (K, T, C))
    assert np.array_equal(want.reshape(C, T, K)[5, 0, 7].view(np.uint32),
                          round_tf32_host(a.reshape(K, T, C)[7, T - 1, 5:6])[0].view(np.uint32))
    out = cuda.to_device(np.full(a.size, 5.0, np.float32))
    round_tf32_flipped_device(cuda.to_device(a), out, (K, T, C))
    assert np.array_equal(out.copy_to_host().view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("flip", [(), (33, 2, 34)], ids=["plain", "flipped"])
def test_round_tf32_pair_device_matches_the_host(flip, rng):
    """The launcher's one launch for both operands of a TMA kernel: a rounded as it is, b rounded (and flipped
    for a backward-data filter), each as its own kernel would."""
    from numba import cuda

    from kernelgen.runtime.elementwise import round_tf32_flipped_host, round_tf32_host, round_tf32_pair_device
    a = np.concatenate([tf32_edge_cases(rng)[-10:], rng.standard_normal(27).astype(np.float32)])
    b = rng.standard_normal(int(np.prod(flip)) if flip else 50).astype(np.float32)
    a_out, b_out = (cuda.to_device(np.full(v.size, 5.0, np.float32)) for v in (a, b))
    round_tf32_pair_device(cuda.to_device(a), a_out, cuda.to_device(b), b_out, flip)
    assert np.array_equal(a_out.copy_to_host().view(np.uint32), round_tf32_host(a).view(np.uint32))
    want = round_tf32_flipped_host(b, flip) if flip else round_tf32_host(b)
    assert np.array_equal(b_out.copy_to_host().view(np.uint32), want.view(np.uint32))
