"""Sk-dilated (templates/sk_dilated.py) against the float64 reference, all three directions.

CPU backend over 1D/2D/3D with dilation 2-3, stride, groups and padding (trimmed forward when the
config fits, core unit-step view otherwise); one simulator case; the CUDA source for the trimmed
form.  Outputs are NaN-poisoned before every launch.  ConvV2 and KS-deconv: test_conv_v2.py and
test_ks_deconv.py.
"""
from __future__ import annotations

import numpy as np
import pytest

import kernelgen
from kernelgen import reference as ref
from kernelgen.problem import make_problem
from kernelgen.templates.config import TileConfig

CASES = [((4, 9, 8), (3, 3, 8), dict(padding=2, dilation=2)),
         ((2, 7, 6, 4), (4, 3, 2, 2), dict(padding=(1, 2), dilation=(2, 3), stride=(1, 2), groups=2)),
         ((2, 5, 6, 5, 2), (3, 2, 2, 2, 2), dict(padding=1, dilation=2))]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
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
