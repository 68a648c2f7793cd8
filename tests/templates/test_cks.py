"""Sk-dilated (templates/sk_dilated.py) against the float64 reference, all three directions.

CPU backend over 1D/2D/3D with dilation 2-3, stride, groups and padding (the trimmed ConvV2 form
when it applies and the config fits - forward, stride-1 backward-data, backward-weight - the core
unit-step view otherwise, both checked); simulator cases; the CUDA source for the trimmed forms.  Outputs are NaN-poisoned before every launch.  ConvV2 and KS-deconv: test_conv_v2.py and
test_ks_deconv.py.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kernelgen
from kernelgen import reference as ref
from kernelgen.api import make_plan
from kernelgen.problem import make_problem
from kernelgen.templates import conv_v2
from kernelgen.templates.config import TileConfig

CASES = [((4, 9, 8), (3, 3, 8), dict(padding=2, dilation=2)),
         ((2, 7, 6, 4), (4, 3, 2, 2), dict(padding=(1, 2), dilation=(2, 3), stride=(1, 2), groups=2)),
         ((2, 5, 6, 5, 2), (3, 2, 2, 2, 2), dict(padding=1, dilation=2))]


@pytest.mark.parametrize("dtype", ["float32", pytest.param("float64", marks=pytest.mark.slow)])  # (float64: the
# random-problem tests of test_conv_cpu.py run it in CI)
@pytest.mark.parametrize("case", CASES)
def test_sk_dilated_cpu_all_directions(case, dtype, assert_close, run_poisoned):
    rng = np.random.default_rng()
    x_shape, w_shape, kw = case
    x, w = rng.standard_normal(x_shape).astype(dtype), rng.standard_normal(w_shape).astype(dtype)
    p = make_problem("fwd", x_shape, w_shape, dtype=dtype, **kw)
    _, y = run_poisoned(p, {"x": x, "w": w}, "cpu", algo="sk_dilated")
    assert_close(y, ref.conv_forward(x, w, **kw), dtype)
    dy = rng.standard_normal(y.shape).astype(dtype)
    pd = make_problem("bwd_data", x_shape, w_shape, dtype=dtype, **kw)
    _, dx = run_poisoned(pd, {"dy": dy, "w": w}, "cpu", algo="sk_dilated")
    assert_close(dx, ref.conv_backward_data(dy, w, x_shape, **kw), dtype)
    pw = make_problem("bwd_weight", x_shape, w_shape, dtype=dtype, **kw)
    _, dw = run_poisoned(pw, {"x": x, "dy": dy}, "cpu", algo="sk_dilated")
    assert_close(dw, ref.conv_backward_weight(x, dy, w_shape, **kw), dtype)


def test_sk_dilated_applies_only_to_dilated_problems():
    with pytest.raises(ValueError, match="sk_dilated"):
        kernelgen.conv(np.ones((2, 6, 4), np.float32), np.ones((3, 3, 4), np.float32), padding=1,
                       backend="cpu", algo="sk_dilated")


def test_sk_dilated_cuda_source_is_trimmed():
    x, w = np.zeros((32, 8, 8, 64), np.float32), np.zeros((64, 3, 3, 64), np.float32)
    src = kernelgen.explain(kernelgen.conv, x, w, padding=2, dilation=2, backend="cuda", algo="sk_dilated").source
    assert "def conv_fwd_sk_v2(" in src  # the trimmed (V2) form, not the core view
    assert ">= 0" not in src and "cuda.local.array" not in src


@pytest.mark.sim
def test_sk_dilated_simulator(rng, assert_close, run_poisoned):
    x_shape, w_shape, kw = (2, 6, 4), (3, 3, 4), dict(padding=2, dilation=2)
    p = make_problem("fwd", x_shape, w_shape, has_bias=True, **kw)
    x, w = rng.standard_normal(x_shape).astype("float32"), rng.standard_normal(w_shape).astype("float32")
    b = rng.standard_normal(3).astype("float32")
    _, y = run_poisoned(p, {"x": x, "w": w, "bias": b}, "cuda", algo="sk_dilated", config=TileConfig(2, 8, 4, 2, 2))
    assert_close(y, ref.conv_forward(x, w, b, **kw))


def _v2_config(p):
    """The largest small schedule ConvV2 accepts for p (block rows = images, BK | channels per slice)."""
    reduce_ch = p.Cg if p.direction == "fwd" else p.Kg
    bk = max(d for d in (1, 2, 3, 4) if reduce_ch % d == 0)
    bm = p.N if p.direction != "bwd_weight" else 2
    return TileConfig(bm, 4, bk, 2 if bm % 2 == 0 else 1, 2)


@st.composite
def dilated_problems(draw):
    nd = draw(st.integers(1, 3))
    filt = [draw(st.integers(1, 3)) for _ in range(nd)]
    dil = [draw(st.integers(2, 3)) for _ in range(nd)]
    pad = [draw(st.integers(0, d * f)) for f, d in zip(filt, dil)]  # up to past the dilated filter
    stride = [draw(st.integers(1, 2)) for _ in range(nd)]
    lows = [max(1, d * (f - 1) + 1 - 2 * p) for f, p, d in zip(filt, pad, dil)]
    size = tuple(draw(st.integers(lo, lo + (4 if nd < 3 else 2))) for lo in lows)
    groups = draw(st.sampled_from([1, 2]))
    c, k = groups * draw(st.integers(1, 3)), groups * draw(st.integers(1, 4))
    kw = dict(stride=tuple(stride), padding=tuple(pad), dilation=tuple(dil), groups=groups)
    return (draw(st.integers(1, 3)),) + size + (c,), (k,) + tuple(filt) + (c // groups,), kw


@settings(max_examples=3)  # (CI time)
@given(case=dilated_problems(), direction=st.sampled_from(["fwd", "bwd_data", "bwd_weight"]),
       dtype=st.sampled_from(["float32", "float64"]))
def test_sk_dilated_v2_cpu_matches_reference(case, direction, dtype, assert_close, run_direction):
    """With a schedule ConvV2 accepts, every direction it covers runs trimmed; the rest the core view."""
    x_shape, w_shape, kw = case
    p = make_problem(direction, x_shape, w_shape, dtype=dtype, **kw)
    cfg = _v2_config(p)
    plan, got, want = run_direction(p, kw, "cpu", algo="sk_dilated", config=cfg)
    assert plan.kernel_ir().meta["trimmed"] == conv_v2.applies(p)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("direction", ["bwd_data", "bwd_weight"])
def test_sk_dilated_cuda_backward_source_is_trimmed(direction):
    p = make_problem(direction, (32, 8, 8, 64), (64, 3, 3, 64), padding=1, dilation=2)
    src = make_plan(p, "cuda", algo="sk_dilated", config=TileConfig(32, 64, 8, 4, 4)).render()
    assert f"def conv_{direction}_sk_v2(" in src
    assert ">= 0" not in src and "cuda.local.array" not in src
    strided = make_problem("bwd_data", (32, 8, 8, 64), (64, 3, 3, 64), padding=2, stride=2, dilation=2)
    src = make_plan(strided, "cuda", algo="sk_dilated", config=TileConfig(32, 64, 8, 4, 4)).render()
    assert "def conv_bwd_data_sk(" in src  # strided backward-data: the core view


@pytest.mark.sim
@pytest.mark.parametrize("direction", ["bwd_data", "bwd_weight"])
def test_sk_dilated_backward_simulator(direction, rng, assert_close, run_direction):
    p, kw = make_problem(direction, (2, 7, 4), (4, 3, 4), padding=1, dilation=2), dict(padding=1, dilation=2)
    plan, got, want = run_direction(p, kw, "cuda", algo="sk_dilated", config=TileConfig(2, 4, 2, 2, 2), rng=rng)
    assert plan.kernel_ir().meta["trimmed"]
    assert_close(got, want)
