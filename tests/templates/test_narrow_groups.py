"""Narrow groups on the direct template (issue 28: C / groups = Cg in 2..8, ResNeXt's 4 and 8 channels a group)
against the float64 reference.

Every direction on fresh random data into NaN-poisoned outputs: on the CPU backend over a hypothesis strategy of
shapes (1D / 2D, strides, padding, dilation, 2..8 channels and 1..8 filters a group, group counts that leave ragged
channel blocks, bias and relu) and of configs (block shapes, VC, group_split, window in shared memory or not,
backward-weight's split_k); tiny cases in the CUDA simulator.  Bad configs are refused before anything is built.
The planner takes the template where its cost model says so.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kernelgen
from kernelgen import reference
from kernelgen.problem import make_problem
from kernelgen.target import target_for
from kernelgen.templates import depthwise
from kernelgen.templates.depthwise_config import DepthwiseConfig
from kernelgen.templates.depthwise_geometry import MAX_FILTER_WORDS, geometry, over_limits, unmet
from test_depthwise import check

DIRECTIONS = ("fwd", "bwd_data", "bwd_weight")


def narrow_problem(direction, x_shape, groups, kg, filt, kw, bias=False, activation=None, dtype="float32"):
    C = x_shape[-1]
    fwd = direction == "fwd"
    return make_problem(direction, x_shape, (groups * kg, *filt, C // groups), groups=groups, dtype=dtype,
                        has_bias=bias and fwd, activation=activation if fwd else None, **kw)


@st.composite
def cases(draw, direction):
    ndim = draw(st.sampled_from((1, 2, 2)))
    # (groups >= 2: an ungrouped convolution is a GEMM, whatever its channels)
    cg, kg, groups = draw(st.integers(2, 8)), draw(st.sampled_from((1, 2, 4, 8))), draw(st.integers(2, 5))
    N = draw(st.integers(1, 2))
    filt = tuple(draw(st.sampled_from((1, 2, 3))) for _ in range(ndim))
    stride = tuple(draw(st.sampled_from((1, 1, 2, 3))) for _ in range(ndim))
    dilation = tuple(draw(st.sampled_from((1, 1, 2))) for _ in range(ndim))
    padding = tuple(draw(st.integers(0, 2)) for _ in range(ndim))
    sizes = tuple(draw(st.integers(max(1, d * (f - 1) + 1 - 2 * p), 8)) for f, d, p in zip(filt, dilation, padding))
    kw = dict(stride=stride, padding=padding, dilation=dilation)
    bias, activation = draw(st.booleans()), draw(st.sampled_from((None, "relu")))
    dtype = draw(st.sampled_from(("float32", "float32", "float64")))
    problem = narrow_problem(direction, (N, *sizes, groups * cg), groups, kg, filt, kw, bias, activation, dtype)
    outs = cg if direction == "bwd_data" else kg
    gs = draw(st.sampled_from([d for d in range(1, outs + 1) if outs % d == 0]))
    halo = draw(st.integers(0, 1))
    config = DepthwiseConfig(TC=gs * draw(st.integers(1, 2)), TW=draw(st.integers(1, 3)), TH=draw(st.integers(1, 2)),
                             VC=draw(st.sampled_from((1, 2, 4))), PW=draw(st.integers(1, 3)),
                             PH=draw(st.integers(1, 2)), halo=halo, smem_pad=halo * draw(st.integers(0, 1)),
                             group_split=gs, split_k=draw(st.sampled_from((1, 2, 3))) if direction == "bwd_weight" else 1)
    return problem, kw, config


@pytest.mark.parametrize("direction", DIRECTIONS)
@settings(max_examples=2, deadline=None)  # (2 a direction, fresh shapes every run, as test_depthwise: CI time)
@given(data=st.data())
def test_cpu_random_shapes(direction, data):
    problem, kw, config = data.draw(cases(direction))
    why = unmet(problem, config)
    if why:  # (over the filter-register limit, or more splits than tiles): refused, never run
        with pytest.raises(ValueError, match=re.escape(why[0])):
            depthwise.build(problem, config)
        return
    check(problem, kw, config, "cpu", np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1))))


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("channels, stride", [(128, 1), (256, 2)])
def test_cpu_default_on_resnext_groups(direction, channels, stride, rng):
    """ResNeXt-50 32x4d's grouped 3x3 layers (4 and 8 channels a group), on a small map: the CPU default."""
    kw = dict(stride=stride, padding=1)
    p = narrow_problem(direction, (1, 7, 6, channels), 32, channels // 32, (3, 3), kw, bias=True, activation="relu")
    config = depthwise.VARIANT.default_config(p, target_for("cpu"))
    assert depthwise.VARIANT.accepts(p, config)
    check(p, kw, config, "cpu", rng)


def test_cpu_reduced_precision(rng):
    kw = dict(padding=1)
    p = narrow_problem("fwd", (2, 5, 6, 12), 3, 4, (3, 3), kw, bias=True)
    check(p, kw, DepthwiseConfig(TC=4, TW=2, TH=2, VC=1, PW=2, PH=1, halo=1, group_split=2), "cpu", rng, "bf16")


def test_cpu_float16_split_backward_weight(rng):
    """float16 tensors, split blocks: the splits add into the float32 workspace, rounded into dw once."""
    kw = dict(padding=1, stride=2)
    p = narrow_problem("bwd_weight", (2, 7, 6, 16), 4, 4, (3, 3), kw, dtype="float16")
    config = DepthwiseConfig(TC=4, TW=2, TH=2, VC=1, PW=2, PH=1, halo=1, group_split=2, split_k=3)
    check(p, kw, config, "cpu", rng, "fp16")


@pytest.mark.sim
@pytest.mark.parametrize("direction, config", [
    ("fwd", DepthwiseConfig(4, 2, 2, 1, 2, 1, 1, 1, group_split=2)),
    ("bwd_data", DepthwiseConfig(4, 2, 2, 2, 2, 1, 0, group_split=4)),
    ("bwd_weight", DepthwiseConfig(4, 2, 2, 1, 2, 1, 1, 1, group_split=2, split_k=2))])
def test_simulator(direction, config, rng):
    kw = dict(stride=2, padding=1)
    p = narrow_problem(direction, (1, 5, 6, 12), 3, 4, (3, 3), kw, bias=True, activation="relu")
    check(p, kw, config, "cuda", rng)


# --- what applies, what is refused --------------------------------------------------------------------------------

def test_applies_in_every_direction_to_narrow_groups_only():
    v = depthwise.VARIANT
    for direction in DIRECTIONS:
        assert v.applies(narrow_problem(direction, (1, 8, 8, 128), 32, 4, (3, 3), {}), "fp32")
        assert v.applies(narrow_problem(direction, (1, 8, 8, 256), 32, 8, (3, 3), {}), "fp32")
    assert not v.applies(narrow_problem("fwd", (1, 8, 8, 512), 32, 16, (3, 3), {}), "fp32")  # 16 a group
    assert not v.applies(narrow_problem("fwd", (1, 8, 8, 32), 2, 16, (3, 3), {}), "fp32")  # 16 filters a group
    assert not v.applies(narrow_problem("fwd", (1, 12, 12, 64), 8, 8, (7, 7), {}), "fp32")  # 49 x 8 words a thread
    assert not v.applies(make_problem("fwd", (1, 8, 8, 16), (16, 3, 3, 16)), "fp32")  # dense


@pytest.mark.parametrize("config, match", [
    (DepthwiseConfig(TC=4, VC=1, group_split=3), "group_split must divide TC"),
    (DepthwiseConfig(TC=6, VC=1, group_split=3), "group_split dividing a group's 4 outputs"),
    (DepthwiseConfig(TC=4, VC=2, group_split=1), "filter words"),  # 9 taps x 2 groups x 4 x 4
    (DepthwiseConfig(TC=4, VC=4, group_split=2, split_k=2), "split_k=1 outside backward-weight")])
def test_bad_configs_refused_before_building(config, match):
    p = narrow_problem("fwd", (1, 8, 8, 16), 4, 4, (3, 3), dict(padding=1))
    assert not depthwise.VARIANT.accepts(p, config)
    with pytest.raises(ValueError, match=match):
        depthwise.build(p, config)
    with pytest.raises(ValueError, match="group_split=1 for depthwise"):
        depthwise.build(make_problem("fwd", (1, 8, 8, 16), (16, 3, 3, 1), groups=16),
                        DepthwiseConfig(TC=4, group_split=2))
    with pytest.raises(ValueError, match="narrow groups"):  # the kind the template does not compute
        depthwise.build(narrow_problem("bwd_weight", (1, 8, 8, 64), 4, 16, (3, 3), {}), DepthwiseConfig())


def test_config_round_trips_with_group_split():
    config = DepthwiseConfig(8, 4, 4, 1, 2, 1, 1, 0, 1, 4)
    assert str(config).endswith("_GS4") and DepthwiseConfig.parse(str(config)) == config
    assert DepthwiseConfig.from_dict(config.as_dict()) == config and config.block_groups == 2


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("channels, stride", [(128, 1), (256, 2)])
def test_cuda_default_and_space_on_resnext(direction, channels, stride):
    """The issue's layers (batch 32, 56x56): the default and the tuner's space build, fit the target and keep
    each thread's filter within MAX_FILTER_WORDS; the space tries every group split that fits."""
    p = narrow_problem(direction, (32, 56, 56, channels), 32, channels // 32, (3, 3), dict(stride=stride, padding=1))
    target = target_for("cuda")
    default = depthwise.VARIANT.default_config(p, target)
    space = depthwise.VARIANT.config_space(p, target, keep=40)
    assert default in depthwise.candidate_configs(p, target) and len(space) == 40
    # 4 a group: splits 2 and 4 fit a thread's filter registers; 8 a group: only 8 (at 4, 9 x 2 x 8 = 144 words)
    assert {c.group_split for c in space} == ({2, 4} if channels == 128 else {8})
    for config in [default] + space:
        g = geometry(p, config)
        assert depthwise.VARIANT.accepts(p, config) and not over_limits(g) and g.filter_words <= MAX_FILTER_WORDS


def test_planner_takes_the_cost_models_verdict():
    """Without a config the planner runs narrow groups on the direct template where its cost model is below the
    GEMM variants' (explain says why), else on a GEMM variant, in every direction."""
    target = target_for("cuda")
    for channels, stride in ((128, 1), (256, 2)):
        x, w = np.zeros((32, 56, 56, channels), np.float32), np.zeros((channels, 3, 3, channels // 32), np.float32)
        p = narrow_problem("fwd", x.shape, 32, channels // 32, (3, 3), dict(stride=stride, padding=1))
        plan = kernelgen.explain(kernelgen.conv, x, w, stride=stride, padding=1, groups=32, backend="cuda")
        faster, _, _ = depthwise.narrow_groups_verdict(p, target)
        assert (plan.variant == depthwise.NAME) == faster
        if faster:
            assert "narrow groups" in plan.reason and "GEMM variants'" in plan.reason
        dy = np.zeros(p.y_shape, np.float32)
        bw = kernelgen.explain(kernelgen.conv_backward_weight, x, dy, w.shape, stride=stride, padding=1, groups=32,
                               backend="cuda")
        p_bw = narrow_problem("bwd_weight", x.shape, 32, channels // 32, (3, 3), dict(stride=stride, padding=1))
        assert (bw.variant == depthwise.NAME) == depthwise.narrow_groups_verdict(p_bw, target)[0]
    small = narrow_problem("fwd", (32, 56, 56, 128), 32, 4, (3, 3), dict(padding=1))
    assert depthwise.narrow_groups_verdict(small, target)[0]  # ResNeXt's 4-channel layer: the direct template


def test_a_narrow_group_no_cuda_block_fits_goes_to_the_gemm(rng):
    """A 3-D narrow-group problem (3 channels and 5 filters a group of a 3x2x3 filter) that no direct CUDA block
    fits: the planner's verdict is the GEMM variants' (it raised 'no CUDA block fits' from the API, a hypothesis
    find), and the result matches float64 in every direction."""
    x = rng.standard_normal((1, 3, 2, 3, 6))
    w = rng.standard_normal((10, 3, 2, 3, 3))
    p = narrow_problem("bwd_weight", x.shape, 2, 5, (3, 2, 3), {}, dtype="float64")
    assert depthwise.cuda_default_config(p, target_for("cuda")) is None
    assert not depthwise.narrow_groups_verdict(p, target_for("cuda"))[0]
    y = kernelgen.conv(x, w, groups=2, backend="cpu")
    assert np.abs(y - reference.conv_forward(x, w, groups=2)).max() <= 1e-12 * np.abs(y).max()
    dy = rng.standard_normal(y.shape)
    dx = kernelgen.conv_backward_data(dy, w, x.shape, groups=2, backend="cpu")
    assert np.abs(dx - reference.conv_backward_data(dy, w, x.shape, groups=2)).max() <= 1e-12 * np.abs(dx).max()
    assert kernelgen.explain(kernelgen.conv_backward_weight, x, dy, w.shape, groups=2, backend="cpu").variant \
        != depthwise.NAME
    dw = kernelgen.conv_backward_weight(x, dy, w.shape, groups=2, backend="cpu")
    assert np.abs(dw - reference.conv_backward_weight(x, dy, w.shape, groups=2)).max() <= 1e-12 * np.abs(dw).max()


def test_api_runs_narrow_groups_on_the_cpu(rng):
    """kernelgen.conv and conv_backward_data on a narrow-group layer the planner gives the direct template, and
    conv_backward_weight on it by name."""
    x = rng.standard_normal((4, 16, 16, 64)).astype(np.float32)
    w = rng.standard_normal((64, 3, 3, 4)).astype(np.float32)
    kw = dict(padding=1, groups=16, backend="cpu")
    ref = dict(padding=1, groups=16)
    assert kernelgen.explain(kernelgen.conv, x, w, **kw).variant == depthwise.NAME
    y = kernelgen.conv(x, w, **kw)
    want = reference.conv_forward(x.astype(np.float64), w.astype(np.float64), **ref)
    assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max()
    dy = rng.standard_normal(y.shape).astype(np.float32)
    assert kernelgen.explain(kernelgen.conv_backward_data, dy, w, x.shape, **kw).variant == depthwise.NAME
    dx = kernelgen.conv_backward_data(dy, w, x.shape, **kw)
    want = reference.conv_backward_data(dy.astype(np.float64), w.astype(np.float64), x.shape, **ref)
    assert np.abs(dx - want).max() <= 1e-5 * np.abs(want).max()
    # (backward-weight: the CPU's cost model keeps the GEMM here; the template asked for by name)
    assert kernelgen.explain(kernelgen.conv_backward_weight, x, dy, w.shape, algo=depthwise.NAME,
                             **kw).variant == depthwise.NAME
    dw = kernelgen.conv_backward_weight(x, dy, w.shape, algo=depthwise.NAME, **kw)
    want = reference.conv_backward_weight(x.astype(np.float64), dy.astype(np.float64), w.shape, **ref)
    assert np.abs(dw - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, precision", [("float32", "fp32"), ("float16", "fp16"), ("float32", "tf32")])
@pytest.mark.parametrize("channels, stride", [(128, 1), (256, 2)])
def test_gpu_backward_weight_on_resnext_groups(dtype, precision, channels, stride, rng):
    """ResNeXt-50 32x4d's grouped 3x3 layers' backward-weight (4 and 8 channels a group) on the GPU, with the CUDA
    default (split blocks: atomic adds, float16 through the float32 workspace)."""
    kw = dict(stride=stride, padding=1)
    p = narrow_problem("bwd_weight", (8, 28, 28, channels), 32, channels // 32, (3, 3), kw, dtype=dtype)
    config = depthwise.VARIANT.default_config(p, target_for("cuda"), precision)
    assert config.split_k > 1
    check(p, kw, config, "cuda", rng, precision)
