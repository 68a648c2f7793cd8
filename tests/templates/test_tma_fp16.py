"""fp16 warpgroup MMAs fed by TMA (TileConfig.tma with precision="fp16" on float16 arrays): the operands land as
stored, 64 to a 128-byte swizzled row (BK 64), and each ir.WarpgroupMma of kind "fp16" is 16 deep.

On the CPU backend the copies happen when issued and the MMAs are emulated per thread (kernelgen.cpu_round.wgmma_f16);
the simulator checks the launcher's flipped float16 filter copy; the GPU tests
(tests/templates/test_tensor_core_gpu.py) run the same kernels on the H100.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from harness import norm_err, poisoned, random_array, rel_err


def fp16_tma_config(**kw):
    from kernelgen.templates.config import TileConfig
    return TileConfig(**{"BK": 64, "WM": 64, "wgmma": 1, "tma": 1, **kw})


def fp16_inputs(rng, *shapes):
    return [random_array(rng, s, np.float16) for s in shapes]


def close_to_float64(got, want):
    """fp16 operands are exact, products exact in float32, float32 sums, one rounding to float16 at the store:
    within a few float16 units of the largest output."""
    assert np.isfinite(got.astype(np.float64)).all()
    assert rel_err(got, want) <= 2e-3
    assert norm_err(got, want) <= 1e-3


FWD_CASES = [((2, 5, 7, 64), (40, 3, 3, 64), dict(padding=1), dict(BM=64, BN=40, WN=40, stages=2)),
             ((1, 6, 6, 128), (16, 3, 1, 128), dict(padding=(2, 0), dilation=(2, 1)),
              dict(BM=128, BN=16, WN=16, stages=3)),
             ((1, 4, 5, 64), (24, 1, 1, 64), {}, dict(BM=64, BN=24, WN=24, stages=2, tma=2)),
             ((2, 9, 11, 64), (40, 3, 3, 64), dict(padding=1, stride=2), dict(BM=64, BN=40, WN=40, stages=2)),
             ((1, 8, 10, 64), (24, 1, 1, 64), dict(stride=(2, 3)), dict(BM=64, BN=24, WN=24, stages=2, tma=2))]


@pytest.mark.parametrize("x_shape, w_shape, kw, tile", FWD_CASES)
def test_cpu_fp16_tma_forward(x_shape, w_shape, kw, tile, rng):
    """Ragged M and N, 1-2 warpgroups, two slices per tap (C = 128), dilation, asymmetric padding, tma=2, strides
    (the im2col walk's traversal steps)."""
    from kernelgen import reference as ref
    from kernelgen.api import get_launcher, make_plan
    from kernelgen.problem import make_problem
    x, w = fp16_inputs(rng, x_shape, w_shape)
    p = make_problem("fwd", x_shape, w_shape, dtype="float16", **kw)
    launcher = get_launcher(make_plan(p, "cpu", config=fp16_tma_config(**tile), precision="fp16"))
    assert [(m[0], m[9], m[11]) for m in launcher.tensor_maps] == [("x_map", "", "float16"), ("w_map", "", "float16")]
    y = poisoned(int(np.prod(p.y_shape)), np.float16)
    launcher({"x": x.ravel(), "w": w.ravel(), "y": y})
    close_to_float64(y.reshape(p.y_shape), ref.conv_forward(x.astype(np.float64), w.astype(np.float64), **kw))


def test_cpu_fp16_tma_forward_bias_relu_pairs(rng):
    """The epilogue writes a thread's two neighbouring channels as one Store with a pair (ir.Store.pair; CUDA: one
    4-byte store), each with its own channel's bias, then ReLU."""
    from kernelgen import reference as ref
    from kernelgen.api import get_launcher, make_plan
    from kernelgen.ir_walk import walk_stmts
    from kernelgen.ir import Store
    from kernelgen.problem import make_problem
    x, w, bias = fp16_inputs(rng, (2, 5, 7, 64), (40, 3, 3, 64), (40,))
    p = make_problem("fwd", x.shape, w.shape, dtype="float16", padding=1, has_bias=True, activation="relu")
    plan = make_plan(p, "cpu", config=fp16_tma_config(BM=64, BN=40, WN=40, stages=2), precision="fp16")
    assert all(s.pair is not None for s in walk_stmts(plan.kernel_ir().body) if isinstance(s, Store) and s.buf == "y")
    y = poisoned(int(np.prod(p.y_shape)), np.float16)
    get_launcher(plan)({"x": x.ravel(), "w": w.ravel(), "bias": bias, "y": y})
    want = np.maximum(ref.conv_forward(x.astype(np.float64), w.astype(np.float64), padding=1) + bias, 0.0)
    close_to_float64(y.reshape(p.y_shape), want)


@pytest.mark.parametrize("x_shape, w_shape, kw, tile", [
    ((2, 5, 6, 24), (64, 3, 3, 24), dict(padding=1), dict(BM=64, BN=24, WN=24, stages=2)),
    ((1, 6, 5, 16), (64, 3, 3, 16), dict(padding=2, dilation=2), dict(BM=64, BN=16, WN=16, stages=2, tma=2)),
    ((2, 8, 6, 24), (64, 3, 3, 24), dict(padding=1, stride=2), dict(BM=64, BN=24, WN=24, stages=2)),
    ((1, 7, 9, 16), (64, 3, 3, 16), dict(padding=1, stride=2), dict(BM=64, BN=16, WN=16, stages=2, tma=2)),
    ((2, 8, 8, 40), (128, 1, 1, 40), dict(stride=2), dict(BM=64, BN=40, WN=40, stages=3))])
def test_cpu_fp16_tma_backward_data(x_shape, w_shape, kw, tile, rng):
    """A stride-1 backward-data: the forward convolution of dy with the launcher's flipped float16 copy of w
    (no rounding: fp16 operands are exact); strided, KS-deconv's classes on the same flipped copy (ks_deconv.ks_tma:
    a 7 x 9 dx has classes of 4 x 5, 4 x 4, 3 x 5 and 3 x 4 positions; 3 x 3 at stride 2, sub-filters of 2 x 2 down to
    1 x 1 taps); the caller's w is left as it was."""
    from kernelgen import reference as ref
    from kernelgen.api import get_launcher, make_plan
    from kernelgen.problem import make_problem
    (w,) = fp16_inputs(rng, w_shape)
    p = make_problem("bwd_data", x_shape, w_shape, dtype="float16", **kw)
    (dy,) = fp16_inputs(rng, p.y_shape)
    launcher = get_launcher(make_plan(p, "cpu", config=fp16_tma_config(**tile), precision="fp16"))
    assert [(m[0], m[10]) for m in launcher.tensor_maps] == [
        ("dy_map", ()), ("w_map", (w_shape[0], w_shape[1] * w_shape[2], w_shape[3]))]
    dx = poisoned(int(np.prod(x_shape)), np.float16)
    w_flat = w.ravel().copy()
    launcher({"dy": dy.ravel(), "w": w_flat, "dx": dx})
    close_to_float64(dx.reshape(x_shape), ref.conv_backward_data(dy.astype(np.float64), w.astype(np.float64),
                                                                  x_shape, **kw))
    assert np.array_equal(w_flat.view(np.uint16), w.ravel().view(np.uint16))


@st.composite
def strided_tma_cases(draw):
    """A strided 2-D convolution whose fp16 TMA boxes build: stride 1-3 per dim (one above 1), filter 1-5, padding
    below the filter, sizes that leave partial windows and classes of unequal size (or none: a 1x1 at stride 2),
    the reduction's channels 64 or 128, the GEMM's columns 3..40 (ragged tiles; C = 3 as the stem's)."""
    stride = [draw(st.integers(1, 3)) for _ in range(2)]
    assume(max(stride) > 1)
    filt = [draw(st.integers(1, 5)) for _ in range(2)]
    pad = [draw(st.integers(0, f - 1)) for f in filt]
    size = [draw(st.integers(max(1, f - 2 * p), max(1, f - 2 * p) + 7)) for f, p in zip(filt, pad)]
    direction = draw(st.sampled_from(["fwd", "bwd_data"]))
    reduced, columns = draw(st.sampled_from([64, 128])), draw(st.sampled_from([3, 8, 24, 40]))
    c, k = (reduced, columns) if direction == "fwd" else (columns, reduced)
    bn = -(-columns // 8) * 8
    tile = dict(BM=64, BN=bn, WN=bn, stages=draw(st.integers(2, 3)), tma=draw(st.sampled_from([1, 2])))
    kw = dict(stride=tuple(stride), padding=tuple(pad))
    return direction, (draw(st.integers(1, 2)), *size, c), (k, *filt, c), kw, tile


@settings(max_examples=2)  # (CI time: ~12 s an example on the CPU)
@given(case=strided_tma_cases())
def test_cpu_fp16_tma_strided_matches_float64(case):
    """Strided convolutions on TMA, both ways: forward (the im2col walk's traversal steps) and backward-data
    (KS-deconv's classes, each over its own sub-filter), fresh float16 data, a poisoned output."""
    from kernelgen import reference as ref
    from kernelgen.api import get_launcher, make_plan
    from kernelgen.problem import make_problem
    direction, x_shape, w_shape, kw, tile = case
    rng = np.random.default_rng(abs(hash(str(case))) % 2 ** 32)
    p = make_problem(direction, x_shape, w_shape, dtype="float16", **kw)
    x, w, dy = fp16_inputs(rng, x_shape, w_shape, p.y_shape)
    launcher = get_launcher(make_plan(p, "cpu", config=fp16_tma_config(**tile), precision="fp16"))
    out = poisoned(int(np.prod(p.output_shape)), np.float16)
    f64 = lambda a: a.astype(np.float64)
    if direction == "fwd":
        launcher({"x": x.ravel(), "w": w.ravel(), "y": out})
        want = ref.conv_forward(f64(x), f64(w), **kw)
    else:
        launcher({"dy": dy.ravel(), "w": w.ravel(), "dx": out})
        want = ref.conv_backward_data(f64(dy), f64(w), x_shape, **kw)
    close_to_float64(out.reshape(p.output_shape), want)


B_MN_CASES = [((2, 5, 6, 64), (64, 3, 3, 64), dict(padding=1), dict(BM=64, BN=64, WN=64, stages=2)),
              pytest.param((1, 6, 5, 128), (64, 3, 3, 128), dict(padding=2, dilation=2),
                           dict(BM=64, BN=128, WN=64, stages=3, tma=2), marks=pytest.mark.slow),  # (CI time: tma=2
              # and two column boxes run in the strided case below)
              ((1, 7, 9, 72), (64, 3, 3, 72), dict(padding=1, stride=2), dict(BM=64, BN=128, WN=128, stages=2, tma=2)),
              ((2, 8, 8, 40), (128, 1, 1, 40), dict(stride=2), dict(BM=64, BN=64, WN=64, stages=3))]


@pytest.mark.parametrize("x_shape, w_shape, kw, tile", B_MN_CASES)
def test_cpu_fp16_tma_backward_data_reads_w_as_stored(x_shape, w_shape, kw, tile, rng):
    """TileConfig.b_mn: backward-data's B boxes from w as stored (no flipped copy: the map reads the caller's
    array), 64 columns a box, read MN-major by the (emulated) wgmma; stride 1 and KS-deconv's classes, C ragged
    against the tile (a multiple of 8: the map's rows are 16-byte multiples)."""
    from kernelgen import reference as ref
    from kernelgen.api import get_launcher, make_plan
    from kernelgen.problem import make_problem
    (w,) = fp16_inputs(rng, w_shape)
    p = make_problem("bwd_data", x_shape, w_shape, dtype="float16", **kw)
    (dy,) = fp16_inputs(rng, p.y_shape)
    launcher = get_launcher(make_plan(p, "cpu", config=fp16_tma_config(**tile, b_mn=1), precision="fp16"))
    assert [(m[0], m[1], m[2], m[10]) for m in launcher.tensor_maps] == [("dy_map", "dy", "im2col", ()),
                                                                         ("w_map", "w", "tiled", ())]
    dx = poisoned(int(np.prod(x_shape)), np.float16)
    launcher({"dy": dy.ravel(), "w": w.ravel(), "dx": dx})
    close_to_float64(dx.reshape(x_shape), ref.conv_backward_data(dy.astype(np.float64), w.astype(np.float64),
                                                                  x_shape, **kw))


def test_fp16_b_mn_module_and_refusals():
    """The CUDA module: the MN-major fp16 wgmma, B's descriptor offsets as render_cuda.MN_MAJOR_OFFSETS says (the
    64-column blocks BK rows of 128 bytes apart, 8-row groups 1024 bytes), one B copy per 64 columns; refused for
    the forward (its w is K-major already) and for tiles not a multiple of 64 wide."""
    from kernelgen.api import make_plan
    from kernelgen.problem import make_problem
    from kernelgen.render_cuda import MN_MAJOR_OFFSETS, render_cuda
    p = make_problem("bwd_data", (4, 16, 16, 128), (64, 3, 3, 128), padding=1, dtype="float16")
    src = render_cuda(make_plan(p, "cuda", config=fp16_tma_config(BM=128, BN=128, WN=128, stages=6, tma=2, b_mn=1),
                                precision="fp16").kernel_ir(), cache=False)
    offsets = {"n_block": 8192, "k_group": 1024}
    assert f"{offsets[MN_MAJOR_OFFSETS[0]]}, {offsets[MN_MAJOR_OFFSETS[1]]}))" in src
    assert "wgmma_f16_m64n128k16_bmn((" in src and src.count("tma_load_4d(Bs, ") == 2
    fwd = make_problem("fwd", (4, 16, 16, 128), (64, 3, 3, 128), padding=1, dtype="float16")
    with pytest.raises(ValueError, match="b_mn=1 reads a backward-data filter as stored"):
        make_plan(fwd, "cpu", config=fp16_tma_config(BM=64, BN=64, WN=64, stages=2, b_mn=1),
                  precision="fp16").kernel_ir()
    with pytest.raises(ValueError, match="b_mn=1 needs tma=1 or 2, BK 64 .fp16. and BN, WN multiples of 64"):
        fp16_tma_config(BM=64, BN=40, WN=40, stages=2, b_mn=1).validate()
    for kw in ({}, dict(stride=2)):  # the map's rows of 12 channels: 24 bytes
        odd = make_problem("bwd_data", (2, 8, 8, 12), (64, 3, 3, 12), padding=1, dtype="float16", **kw)
        with pytest.raises(ValueError, match="rows of C channels must be a multiple of 16 bytes .* got C=12"):
            make_plan(odd, "cpu", config=fp16_tma_config(BM=64, BN=64, WN=64, stages=2, b_mn=1),
                      precision="fp16").kernel_ir()


def test_fp16_tma_module_reads_float16_tiles():
    """The CUDA module: float16 shared tiles, 16-deep fp16 warpgroup MMAs with byte offsets of 2-byte elements,
    float16 maps that read the caller's arrays (no rounding copy)."""
    from kernelgen.api import make_plan
    from kernelgen.problem import make_problem
    from kernelgen.render_cuda import render_cuda
    p = make_problem("fwd", (2, 6, 10, 64), (64, 3, 3, 64), padding=1, dtype="float16")
    src = render_cuda(make_plan(p, "cuda", config=fp16_tma_config(BM=128, BN=64, WN=64, stages=4), precision="fp16")
                      .kernel_ir(), cache=False)
    assert "wgmma_f16_m64n64k16(" in src and "wgmma_tf32" not in src
    assert "float16, alignment=1024)" in src
    assert ", 1024)" in src  # the descriptors' stride offset: 8 rows of 128 bytes
    maps = src.split("TENSOR_MAPS = ")[1].splitlines()[0]
    assert maps.count("'float16'") == 2 and "'tf32'" not in maps


@pytest.mark.parametrize("dtype, precision, kw, tile, match", [
    ("float16", "fp16", {}, dict(BK=32), "needs BK 32 at tf32 or BK 64 at fp16"),
    ("float32", "tf32", {}, dict(BK=64), "needs BK 32 at tf32 or BK 64 at fp16"),
    ("float32", "fp16", {}, {}, "fp16 / bf16 on float16 / bfloat16 arrays with tma=1"),
    ("float16", "fp16", dict(channels=32), {}, "channels a multiple of 64 .of the reduction, float16."),
])
def test_fp16_tma_configs_it_cannot_build_are_refused(dtype, precision, kw, tile, match):
    from kernelgen.api import make_plan
    from kernelgen.problem import make_problem
    c = kw.get("channels", 64)
    p = make_problem("fwd", (2, 6, 10, c), (40, 3, 3, c), padding=1, dtype=dtype)
    with pytest.raises(ValueError, match=match):
        make_plan(p, "cpu", config=fp16_tma_config(BM=64, BN=40, WN=40, stages=2, **tile),
                  precision=precision).kernel_ir()


@pytest.mark.sim
def test_flip16_device_matches_the_host(rng):
    """The launcher's float16 backward-data filter for TMA: (K, T, C) -> (C, T, K), taps reversed, bits unchanged
    (NaN and -0 included); partial 32 x 32 tiles at both edges."""
    from numba import cuda

    from kernelgen.runtime.elementwise import flip16_device, flip_host
    K, T, C = 33, 2, 34
    a = rng.standard_normal(K * T * C).astype(np.float16)
    a[:4] = [np.nan, -0.0, np.inf, 6e-8]
    want = flip_host(a, (K, T, C))
    assert want.reshape(C, T, K)[5, 0, 7] == a.reshape(K, T, C)[7, T - 1, 5]
    out = cuda.to_device(np.full(a.size, 5.0, np.float16))
    flip16_device(cuda.to_device(a), out, (K, T, C))
    assert np.array_equal(out.copy_to_host().view(np.uint16), want.view(np.uint16))


def test_untuned_fp16_on_sm_90_takes_the_tma_tile(monkeypatch):
    """fp16 without a tuned entry on an sm_90 GPU: implicit_gemm_tc.UNTUNED_TMA_TILE_FP16 (backward-data reading w as
    stored where its rows allow); mma.sync's default where that tile does not apply (C = 3: no im2col map forward, a GEMM
    of 3 columns backward), on other GPUs, and for TF32; a tuned entry still wins."""
    from kernelgen import api, planner
    from kernelgen.problem import make_problem
    from kernelgen.templates import implicit_gemm_tc
    from kernelgen.target import KNOWN_TARGETS
    from kernelgen.templates.config import TileConfig
    monkeypatch.setattr(planner, "gpu_present", lambda: True)
    monkeypatch.setattr(planner, "tuned_tensor_core_config", lambda p, prec: None)
    monkeypatch.setattr(planner, "target_for", lambda backend: KNOWN_TARGETS["h100"])
    monkeypatch.setattr(planner, "model_device", lambda: None)  # no performance model either (it comes first)
    plan = lambda d, x, w, prec="fp16", **kw: api.make_plan(
        make_problem(d, x, w, dtype="float16" if prec == "fp16" else "float32", **kw), "cuda", precision=prec)
    tile = TileConfig(128, 64, 64, WM=64, WN=64, stages=8, wgmma=1, tma=2)
    assert plan("fwd", (32, 28, 28, 128), (128, 3, 3, 128), padding=1).config == tile
    assert plan("bwd_data", (32, 28, 28, 128), (128, 3, 3, 128), padding=1, stride=2).config == replace(tile, b_mn=1)
    stem = make_problem("fwd", (32, 224, 224, 3), (64, 7, 7, 3), padding=3, stride=2, dtype="float16")
    assert api.make_plan(stem, "cuda", precision="fp16").config == implicit_gemm_tc.default_config(stem, "cuda", "fp16")
    stem_dx = make_problem("bwd_data", (32, 224, 224, 3), (64, 7, 7, 3), padding=3, stride=2, dtype="float16")
    plan_dx = api.make_plan(stem_dx, "cuda", precision="fp16")  # C = 3: the col2im rule comes first (no tune timed
    assert plan_dx.decided_by == "col2im" and not plan_dx.config.tma  # a col2im tile on it)
    assert not plan("fwd", (32, 28, 28, 128), (128, 3, 3, 128), "tf32", padding=1).config.tma
    tuned = TileConfig(128, 128, 64, WM=64, WN=128, stages=6, wgmma=1, tma=1)
    monkeypatch.setattr(planner, "tuned_tensor_core_config", lambda p, prec: tuned)
    assert plan("fwd", (32, 28, 28, 128), (128, 3, 3, 128), padding=1).config == tuned
    monkeypatch.setattr(planner, "tuned_tensor_core_config", lambda p, prec: None)
    monkeypatch.setattr(planner, "target_for", lambda backend: KNOWN_TARGETS["a100"])
    assert not plan("fwd", (32, 28, 28, 128), (128, 3, 3, 128), padding=1).config.tma


# --- the same kernels on the H100 -----------------------------------------------------------------------------

FP16_TMA_GPU_CONFIGS = [fp16_tma_config(BM=128, BN=64, WN=64, stages=4),
                        # 8 stages: the strided backward-data's classes of 8, 4, 4 and 2 slices all end in the
                        # remainder's tested slices (measured wrong on the H100 before they drained, 4.05e-02)
                        fp16_tma_config(BM=128, BN=64, WN=64, stages=8),
                        fp16_tma_config(BM=128, BN=128, WN=128, stages=6),
                        fp16_tma_config(BM=256, BN=128, WM=128, WN=128, stages=4, tma=2),
                        fp16_tma_config(BM=64, BN=128, WN=128, stages=2, tma=2),
                        fp16_tma_config(BM=128, BN=128, WN=128, stages=6, tma=2)]
FP16_TMA_SHAPES = {"fwd": [((4, 16, 16, 64), (64, 3, 3, 64), dict(padding=1)),
                           ((3, 13, 11, 128), (40, 3, 3, 128), dict(padding=2, dilation=2)),
                           ((2, 9, 7, 192), (24, 1, 1, 192), {}),
                           # strided: the im2col map's traversal steps
                           ((2, 17, 15, 64), (40, 3, 3, 64), dict(padding=1, stride=2)),
                           ((2, 10, 12, 64), (24, 1, 1, 64), dict(stride=2))],
                   # backward-data reduces over K (a multiple of 64)
                   "bwd_data": [((4, 16, 16, 64), (64, 3, 3, 64), dict(padding=1)),
                                ((3, 13, 11, 24), (64, 3, 3, 24), dict(padding=2, dilation=2)),
                                ((2, 9, 7, 40), (128, 1, 1, 40), {}),
                                # strided: KS-deconv's classes (uneven in size and taps; 1x1: all but one empty)
                                ((2, 14, 13, 40), (128, 3, 3, 40), dict(padding=1, stride=2)),
                                ((2, 10, 12, 24), (64, 1, 1, 24), dict(stride=2))]}


def gpu_fp16_calls(direction, shape, config, rng, calls=1):
    """`calls` calls of one launcher on fresh float16 data, outputs poisoned: each result against the float64
    reference of the same float16 values; the caller's inputs are left as they were."""
    from numba import cuda

    from kernelgen import reference as ref
    from kernelgen.api import get_launcher, make_plan
    from kernelgen.problem import make_problem
    x_shape, w_shape, kw = shape
    p = make_problem(direction, x_shape, w_shape, dtype="float16", **kw)
    launcher = get_launcher(make_plan(p, "cuda", config=config, precision="fp16"))
    for call in range(calls):
        x, w, dy = fp16_inputs(rng, x_shape, w_shape, p.y_shape)
        inputs = {"x": x, "w": w} if direction == "fwd" else {"dy": dy, "w": w}
        args = {k: cuda.to_device(v.ravel()) for k, v in inputs.items()}
        out = cuda.to_device(poisoned(int(np.prod(p.output_shape)), np.float16))
        launcher({**args, launcher.outputs[0]: out})
        f64 = lambda a: a.astype(np.float64)
        want = (ref.conv_forward(f64(x), f64(w), **kw) if direction == "fwd" else
                ref.conv_backward_data(f64(dy), f64(w), x_shape, **kw))
        close_to_float64(out.copy_to_host().reshape(p.output_shape), want)
        for k, v in inputs.items():
            assert np.array_equal(args[k].copy_to_host().view(np.uint16), v.ravel().view(np.uint16))
    return launcher


@pytest.mark.gpu
@pytest.mark.parametrize("config", [fp16_tma_config(BM=128, BN=64, WN=64, stages=4, b_mn=1),
                                    fp16_tma_config(BM=128, BN=128, WN=128, stages=6, tma=2, b_mn=1)], ids=str)
def test_gpu_fp16_tma_b_mn(config, rng):
    """Backward-data reading w as stored, B MN-major (TileConfig.b_mn): the descriptor reading that
    scripts/wgmma_check.py --parts mn-major probes, on every backward-data shape."""
    for shape in FP16_TMA_SHAPES["bwd_data"]:  # C of 24 and 40 as well: columns past C read as zeros, not stored
        gpu_fp16_calls("bwd_data", shape, config, rng)


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["fwd", "bwd_data"])
@pytest.mark.parametrize("config", FP16_TMA_GPU_CONFIGS, ids=str)
def test_gpu_fp16_tma(config, direction, rng):
    """The fp16 wgmma (m64nNk16) reading TMA's float16 boxes: descriptors, swizzle and accumulator layout are the
    hardware's; backward-data reads the launcher's flipped float16 filter."""
    from kernelgen.tuning.bench import kernel_resources
    # the 288-thread tile (two 64 x 128 warpgroups of 128 accumulators, and a producer warp) runs capped at 224
    # registers (its launch bounds) and spills a few words: measured 16-48 bytes on the H100
    spill = 64 if config.threads > 256 else 0
    for shape in FP16_TMA_SHAPES[direction]:
        launcher = gpu_fp16_calls(direction, shape, config, rng)
        assert kernel_resources(launcher, launcher.threads).get("local_bytes") <= spill


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["fwd", "bwd_data"])
def test_gpu_untuned_fp16_calls_take_the_tma_tile(direction, rng, monkeypatch):
    """A call no tune has seen (the tuned databases off) and no model answers (its link off: it comes first, and its
    pick may be a TMA tile where this one is not) runs untuned_tma_config on the H100, right on every TMA shape;
    backward-data reads w as stored (no flipped copy) where that config says so."""
    from kernelgen.problem import make_problem
    from kernelgen.templates.implicit_gemm_tc import untuned_tma_config
    monkeypatch.setenv("KERNELGEN_NO_TUNED", "1")
    monkeypatch.setenv("KERNELGEN_MODEL", "off")
    shapes = [(s, untuned_tma_config(make_problem(direction, *s[:2], dtype="float16", **s[2]), "fp16"))
              for s in FP16_TMA_SHAPES[direction]]
    assert sum(config is not None for _, config in shapes) >= 3  # the others: GEMMs of 24 columns
    for shape, config in shapes:
        launcher = gpu_fp16_calls(direction, shape, None, rng)
        assert bool(launcher.tensor_maps) == (config is not None)
        assert bool(launcher._copied_sources) == (direction == "bwd_data" and config is not None and not config.b_mn)


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["fwd", "bwd_data"])
def test_gpu_fp16_tma_calls_after_the_first(direction, rng):
    """From the second call on, the fast route (the flip kernel on raw addresses for backward-data, maps of the
    caller's own arrays for forward, re-encoded when an address changes)."""
    launcher = gpu_fp16_calls(direction, FP16_TMA_SHAPES[direction][0], FP16_TMA_GPU_CONFIGS[0], rng, calls=3)
    assert launcher.fast
