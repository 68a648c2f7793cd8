"""Backward-data with the col2im in the GEMM's epilogue (TileConfig.col2im, implicit_gemm.col2im_view) against the
float64 reference.

On the CPU backend over a hypothesis strategy of shapes (1-D / 2-D / 3-D, strides, padding, dilation, 1-4 channels
a group, groups, filters ragged against BK) and fp32 tiles, into NaN-poisoned outputs (the kernel adds into a dx the
launcher zeroes first); the tensor-core tiles at TF32 and fp16 (float16 dx through the float32 workspace); tiny cases
in the CUDA simulator; larger ones on a GPU.  Configs that cannot build are refused before anything runs, and the
planner's rule takes it for narrow backward-data on the GPU unless a tune measured the problem.
"""
from __future__ import annotations

from dataclasses import replace
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings as hsettings
from hypothesis import strategies as st

from kernelgen import planner, settings
from kernelgen.tuning import tuner
from kernelgen.api import get_launcher, make_plan
from kernelgen.problem import make_problem
from kernelgen.render_cuda import render_cuda
from kernelgen.templates import implicit_gemm
from kernelgen.target import KNOWN_TARGETS
from kernelgen.templates.config import CPU_TC16_DEFAULT, CPU_TC_DEFAULT, CUDA_TC_DEFAULT, TileConfig
from harness import assert_close as check_close, direction_inputs, launch_poisoned, tolerance

SMALL = TileConfig(BM=16, BN=16, BK=8, TM=2, TN=2, col2im=1)


def run(problem, kw, config, backend, rng, precision="fp32"):
    """Fresh inputs, the col2im kernel run into a NaN-poisoned dx, checked against float64; returns the plan."""
    inputs, want = direction_inputs(problem, kw, rng)
    plan = make_plan(problem, backend, None if precision != "fp32" else "implicit_gemm", config, precision)
    got = launch_poisoned(get_launcher(plan), problem, inputs, backend)
    tol = tolerance(problem.dtype, precision)
    check_close(got, want, problem.dtype, f"{problem.key()} {config} {backend} {precision}", tol=tol)
    return plan


@st.composite
def cases(draw):
    ndim = draw(st.sampled_from((1, 2, 2, 3)))
    cg, kg, groups = draw(st.integers(1, 4)), draw(st.integers(1, 20)), draw(st.sampled_from((1, 1, 2)))
    filt = tuple(draw(st.sampled_from((1, 2, 3, 4) if ndim < 3 else (1, 2, 3))) for _ in range(ndim))
    stride = tuple(draw(st.sampled_from((1, 2, 2, 3))) for _ in range(ndim))
    dilation = tuple(draw(st.sampled_from((1, 1, 2))) for _ in range(ndim))
    padding = tuple(draw(st.integers(0, 2)) for _ in range(ndim))
    sizes = tuple(draw(st.integers(max(1, d * (f - 1) + 1 - 2 * p), 9 if ndim < 3 else 5))
                  for f, d, p in zip(filt, dilation, padding))
    kw = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    dtype = draw(st.sampled_from(("float32", "float32", "float64")))
    p = make_problem("bwd_data", (draw(st.integers(1, 2)), *sizes, groups * cg), (groups * kg, *filt, cg),
                     dtype=dtype, **kw)
    config = TileConfig(BM=draw(st.sampled_from((8, 16))), BN=draw(st.sampled_from((8, 16))), BK=4,
                        TM=2, TN=draw(st.sampled_from((1, 2))), stages=draw(st.sampled_from((1, 2))), col2im=1)
    return p, kw, config


@hsettings(max_examples=3, deadline=None)
@given(data=st.data())
def test_cpu_random_shapes(data):
    p, kw, config = data.draw(cases())
    run(p, kw, config, "cpu", np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1))))


@pytest.mark.parametrize("name, x_shape, w_shape, kw", [
    ("stem 7x7 s2", (2, 14, 14, 3), (16, 7, 7, 3), dict(stride=2, padding=3)),
    ("transposed 4x4 s2 (dcgan's last)", (2, 12, 12, 3), (20, 4, 4, 3), dict(stride=2, padding=1)),
    ("3-D 3x3x3", (1, 4, 6, 6, 3), (16, 3, 3, 3, 3), dict(padding=1)),
    ("1x7x7 folded (R(2+1)D's stem)", (1, 3, 10, 10, 3), (16, 1, 7, 7, 3), dict(stride=(1, 2, 2), padding=(0, 3, 3))),
])
def test_cpu_network_shapes(name, x_shape, w_shape, kw, rng):
    run(make_problem("bwd_data", x_shape, w_shape, **kw), kw, SMALL, "cpu", rng)


@pytest.mark.parametrize("precision, dtype, base", [("tf32", "float32", CPU_TC_DEFAULT),
                                                     ("fp16", "float16", CPU_TC16_DEFAULT)])
def test_cpu_tensor_core_tiles(precision, dtype, base, rng):
    """The warp-MMA tiles through the same view; float16 dx adds into the launcher's float32 workspace."""
    kw = dict(stride=2, padding=1)
    p = make_problem("bwd_data", (2, 10, 10, 3), (32, 4, 4, 3), dtype=dtype, **kw)
    plan = run(p, kw, replace(base, col2im=1), "cpu", rng, precision)
    assert get_launcher(plan).widened == (("dx",) if dtype == "float16" else ())


@pytest.mark.parametrize("dtype, precision, base", [("float32", "fp32", SMALL), ("float16", "fp16", CPU_TC16_DEFAULT)])
@pytest.mark.parametrize("w_shape", [(24, 1, 1, 16), (8, 2, 2, 16)])
def test_cpu_taps_that_never_meet_store(dtype, precision, base, w_shape, rng):
    """A strided 1x1 (ResNet's downsample) or 2x2 at stride 2: each dx element gets one product or none, so the
    epilogue stores (no atomics, float16 dx without the workspace) into the zeroed dx."""
    kw = dict(stride=2)
    p = make_problem("bwd_data", (2, 10, 9, 16), w_shape, dtype=dtype, **kw)
    plan = run(p, kw, replace(base, col2im=1), "cpu", rng, precision)
    launcher = get_launcher(plan)
    assert launcher.zero_output and launcher.widened == ()
    cuda = render_cuda(plan.kernel_ir(), target=KNOWN_TARGETS["h100"])
    assert "cuda.atomic" not in cuda and "cuda.atomic" in render_cuda(make_plan(
        make_problem("bwd_data", (2, 10, 9, 16), (8, 3, 3, 16), stride=2, padding=1), "cpu", "implicit_gemm",
        SMALL).kernel_ir(), target=KNOWN_TARGETS["h100"])  # (overlapping taps add)


@pytest.mark.sim  # (fp32 tiles only: the simulator has no mma.sync)
@pytest.mark.parametrize("x_shape, w_shape, kw", [((1, 6, 5, 3), (8, 3, 3, 3), dict(stride=2, padding=1)),
                                                  ((1, 9, 2), (6, 4, 2), dict(stride=3, padding=2, dilation=2)),
                                                  ((1, 7, 6, 4), (6, 1, 1, 4), dict(stride=2))])
def test_simulator(x_shape, w_shape, kw, rng):
    config = TileConfig(BM=16, BN=8, BK=4, TM=2, TN=2, col2im=1)
    run(make_problem("bwd_data", x_shape, w_shape, **kw), kw, config, "cuda", rng)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, precision", [("float32", "fp32"), ("float32", "tf32"), ("float16", "fp16")])
@pytest.mark.parametrize("x_shape, w_shape, kw", [
    ((4, 64, 64, 3), (64, 7, 7, 3), dict(stride=2, padding=3)),
    ((8, 64, 64, 3), (64, 4, 4, 3), dict(stride=2, padding=1)),
    ((2, 8, 28, 28, 3), (64, 3, 3, 3, 3), dict(padding=1)),
    ((8, 28, 28, 64), (128, 1, 1, 64), dict(stride=2))])
def test_gpu_planned(dtype, precision, x_shape, w_shape, kw, rng):
    """The planner's own col2im tile on the GPU (the rule: no tune has measured these problems)."""
    if precision == "fp16" and kw.get("stride") == 2 and w_shape[1] == 1:
        pytest.skip("a strided 1x1 at fp16 takes its stride classes' TMA tile")
    p = make_problem("bwd_data", x_shape, w_shape, dtype=dtype, **kw)
    inputs, want = direction_inputs(p, kw, rng)
    plan = make_plan(p, "cuda", None, None, precision)
    assert plan.decided_by == "col2im" and plan.config.col2im
    got = launch_poisoned(get_launcher(plan), p, inputs, "cuda")
    check_close(got, want, dtype, f"{p.key()} {plan.config} {precision}", tol=tolerance(dtype, precision))


# --- what is refused, what the planner takes --------------------------------------------------------------------

@pytest.mark.parametrize("direction", ["fwd", "bwd_weight"])
def test_refused_outside_backward_data(direction):
    p = make_problem(direction, (1, 6, 6, 3), (8, 3, 3, 3), padding=1)
    assert not implicit_gemm.VARIANT.accepts(p, SMALL)
    with pytest.raises(ValueError, match="col2im=1 needs a backward-data problem"):
        get_launcher(make_plan(p, "cpu", "implicit_gemm", SMALL))


def test_refused_by_other_variants_and_modes():
    p = make_problem("bwd_data", (1, 6, 6, 3), (8, 3, 3, 3), stride=2, padding=1)
    with pytest.raises(ValueError, match="col2im=1 is the implicit GEMM's backward-data view"):
        get_launcher(make_plan(p, "cpu", "ks_deconv", SMALL))
    for bad in (dict(split_k=2), dict(col2im=2)):
        with pytest.raises(ValueError, match="col2im must be 0 or 1"):
            replace(SMALL, **bad).validate()


def test_config_string_round_trip():
    assert str(SMALL) == "BM16_BN16_BK8_TM2_TN2_C2I" and TileConfig.parse(str(SMALL)) == SMALL
    assert "col2im" not in TileConfig().as_dict() and SMALL.as_dict()["col2im"] == 1


def _gpu_plan(problem, precision, measured=None):
    """make_plan as on a GPU with the H100 database and model (offline: gpu_present patched, model "on"); `measured`
    patches what the tune of exactly this problem timed (database.measured)."""
    with settings.scope(model="on"), mock.patch.object(planner, "gpu_present", lambda: True):
        if measured is None:
            return planner.make_plan(problem, "cuda", None, None, precision)
        with mock.patch.object(planner._tuned_db(), "measured", lambda *a, **k: measured):
            return planner.make_plan(problem, "cuda", None, None, precision)


@pytest.mark.parametrize("precision, dtype", [("fp32", "float32"), ("tf32", "float32"), ("fp16", "float16")])
def test_planner_rule(precision, dtype):
    stem = make_problem("bwd_data", (16, 224, 224, 3), (64, 7, 7, 3), stride=2, padding=3, dtype=dtype)
    plan = _gpu_plan(stem, precision)
    assert plan.decided_by == "col2im" and plan.config.col2im and not plan.config.tma and plan.config.split_k == 1
    assert "147 columns" in plan.reason and plan.precision == precision
    other = ("ks_deconv", TileConfig()) if precision == "fp32" else ("implicit_gemm_tc", CUDA_TC_DEFAULT)
    assert _gpu_plan(stem, precision, measured=[other]).decided_by == "col2im"  # a tune that timed no col2im tile
    timed = [other, (plan.variant, plan.config)]
    assert _gpu_plan(stem, precision, measured=timed).decided_by != "col2im"  # a tune weighed col2im: it decides
    wide = make_problem("bwd_data", (16, 56, 56, 64), (64, 3, 3, 64), padding=1, dtype=dtype)
    assert _gpu_plan(wide, precision).decided_by != "col2im"
    downsample = make_problem("bwd_data", (64, 56, 56, 256), (512, 1, 1, 256), stride=2, dtype=dtype)  # ResNet-50's
    plan = _gpu_plan(downsample, precision)
    own = _gpu_plan(downsample, precision, measured=[("implicit_gemm", TileConfig(col2im=1))])  # the chain's plan
    if own.config.tma:  # (fp16's stride classes on TMA: measured faster than the col2im tile)
        assert plan.decided_by != "col2im"
    else:
        assert plan.decided_by == "col2im" and plan.config.col2im and "taps never meet" in plan.reason
    overlapping = make_problem("bwd_data", (16, 56, 56, 64), (128, 3, 3, 64), stride=2, padding=1, dtype=dtype)
    assert _gpu_plan(overlapping, precision).decided_by != "col2im"
    with mock.patch.object(planner, "gpu_present", lambda: False):
        assert planner.make_plan(stem, "cpu", None, None, precision).decided_by != "col2im"


def test_a_tune_times_col2im_tiles_beside_the_other_variants():
    """A tune's entry weighs the col2im tiles against the stride classes' (tuner.col2im_candidates), so the rule's
    "unless a tune measured it" compares the two; a wide backward-data gets none."""
    target = KNOWN_TARGETS["h100"]
    stem = make_problem("bwd_data", (16, 224, 224, 3), (64, 7, 7, 3), stride=2, padding=3)
    pairs = tuner.candidates(stem, keep=4, target=target)
    folded = [c for v, c in pairs if c.col2im]
    assert folded and all(v == "implicit_gemm" for v, c in pairs if c.col2im)
    assert any(v == "ks_deconv" for v, _ in pairs)
    assert all(c.split_k == 1 and not c.tma for c in folded)
    half = replace(stem, dtype="float16")
    assert any(c.col2im and not c.tma for _, c in tuner.tc_candidates(half, "fp16", keep=4, target=target))
    wide = make_problem("bwd_data", (16, 56, 56, 64), (64, 3, 3, 64), padding=1)
    assert not any(c.col2im for _, c in tuner.candidates(wide, keep=4, target=target))
