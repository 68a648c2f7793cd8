"""ConvV2 (templates/conv_v2.py): forward with filter trimming, against the float64 reference.

CPU backend over 1D/2D/3D, stride, dilation, groups, padding up to larger than the filter (whole
windows in the padding: the block's reduction is empty and only the bias remains); the CUDA
rendering in the simulator on tiny shapes.  Outputs are NaN-poisoned before every launch.
Backward-data and backward-weight: test_conv_v2_backward.py.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kernelgen
from kernelgen import reference as ref
from kernelgen.api import make_plan
from kernelgen.problem import make_problem
from kernelgen.templates.config import TileConfig


@st.composite
def padded_problems(draw):
    nd = draw(st.integers(1, 3))
    filt = tuple(draw(st.integers(1, 4)) for _ in range(nd))
    pad = tuple(draw(st.integers(0, f + 1)) for f in filt)
    if max(pad) == 0:
        pad = (1,) + pad[1:]
    dil = tuple(draw(st.integers(1, 2)) for _ in range(nd))
    stride = tuple(draw(st.integers(1, 2)) for _ in range(nd))
    lows = [max(1, d * (f - 1) + 1 - 2 * p) for f, p, d in zip(filt, pad, dil)]
    size = tuple(draw(st.integers(lo, max(lo, 7 if nd < 3 else 4))) for lo in lows)
    groups = draw(st.sampled_from([1, 2]))
    c, k = groups * draw(st.sampled_from([2, 4])), groups * draw(st.integers(1, 3))
    n = draw(st.sampled_from([1, 2, 4]))
    return (n,) + size + (c,), (k,) + filt + (c // groups,), dict(stride=stride, padding=pad, dilation=dil,
                                                                   groups=groups)


@settings(max_examples=4)  # (CI time)
@given(case=padded_problems(), dtype=st.sampled_from(["float32", "float64"]))
def test_conv_v2_cpu_matches_reference(case, dtype, assert_close, run_poisoned):
    rng = np.random.default_rng()
    x_shape, w_shape, kw = case
    p = make_problem("fwd", x_shape, w_shape, dtype=dtype, has_bias=True, **kw)
    x, w = rng.standard_normal(x_shape).astype(dtype), rng.standard_normal(w_shape).astype(dtype)
    b = rng.standard_normal(p.K).astype(dtype)
    _, y = run_poisoned(p, {"x": x, "w": w, "bias": b}, "cpu", algo="conv_v2")
    assert_close(y, ref.conv_forward(x, w, b, **kw), dtype)


def test_conv_v2_through_the_api_and_its_source(rng, assert_close):
    x = rng.standard_normal((4, 5, 5, 8)).astype("float32")
    w = rng.standard_normal((6, 3, 3, 8)).astype("float32")
    assert_close(kernelgen.conv(x, w, padding=1, backend="cpu", algo="conv_v2"), ref.conv_forward(x, w, padding=1))
    src = kernelgen.explain(kernelgen.conv, np.zeros((128, 4, 4, 64), np.float32),
                            np.zeros((64, 3, 3, 64), np.float32), padding=1, backend="cuda", algo="conv_v2").source
    assert ">= 0" not in src  # no bounds tests on the loads: the trimmed window is all in bounds
    assert "cuda.local.array" not in src


def test_conv_v2_rejects_configs_it_cannot_run():
    p = make_problem("fwd", (6, 4, 4, 8), (4, 3, 3, 8), padding=1)
    with pytest.raises(ValueError, match="N % BM"):
        make_plan(p, "cpu", algo="conv_v2", config=TileConfig(4, 8, 8, 2, 2)).render()


@pytest.mark.sim
@pytest.mark.parametrize("case", [((4, 4, 4, 8), (6, 3, 3, 8), dict(padding=1)),
                                  ((4, 7, 5, 8), (6, 3, 2, 4), dict(padding=(2, 1), stride=(2, 1), groups=2)),
                                  ((2, 6, 4), (3, 5, 4), dict(padding=4, dilation=2))])
def test_conv_v2_simulator(case, rng, assert_close, run_poisoned):
    x_shape, w_shape, kw = case
    p = make_problem("fwd", x_shape, w_shape, has_bias=True, **kw)
    x, w = rng.standard_normal(x_shape).astype("float32"), rng.standard_normal(w_shape).astype("float32")
    b = rng.standard_normal(p.K).astype("float32")
    cfg = TileConfig(x_shape[0], 8, 4, 2, 2)
    _, y = run_poisoned(p, {"x": x, "w": w, "bias": b}, "cuda", algo="conv_v2", config=cfg)
    assert_close(y, ref.conv_forward(x, w, b, **kw))
