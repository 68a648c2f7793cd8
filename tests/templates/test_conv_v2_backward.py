"""ConvV2 backward (templates/conv_v2.py): stride-1 backward-data with trimmed taps, backward-weight
with a trimmed output range per tap (one tap per grid-z slice), against the float64 reference.

CPU backend over 1D/2D/3D, dilation, groups, padding 0 up to larger than the filter (taps, or whole
tap GEMMs, with nothing inside dy / x: an empty reduction must still store zeros), explicit configs
drawn to hit both reduction decodes of backward-weight (N % BK == 0 or not); the CUDA rendering in
the simulator on tiny shapes; realistic shapes on a GPU.  Outputs are NaN-poisoned before every
launch.  Forward: test_conv_v2.py.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kernelgen
from kernelgen import reference as ref
from kernelgen.api import make_plan
from kernelgen.problem import make_problem
from kernelgen.templates import candidates, conv_v2, default_config
from kernelgen.templates.config import TileConfig


def _divisors(n, most):
    return [d for d in range(1, most + 1) if n % d == 0]


@st.composite
def problems(draw, direction):
    nd = draw(st.integers(1, 3))
    filt = [draw(st.integers(1, 4)) for _ in range(nd)]
    pad = [draw(st.integers(0, f + 1)) for f in filt]
    dil = [draw(st.integers(1, 2)) for _ in range(nd)]
    if direction == "bwd_data":
        stride = [1] * nd
        if all(d * (f - 1) <= p for f, p, d in zip(filt, pad, dil)):  # nothing to trim: make one dim trim
            filt[0], pad[0] = max(filt[0], 2), min(pad[0], dil[0] * (max(filt[0], 2) - 1) - 1)
    else:
        stride = [draw(st.integers(1, 2)) for _ in range(nd)]
        if max(pad) == 0:
            pad[0] = 1
    lows = [max(1, d * (f - 1) + 1 - 2 * p) for f, p, d in zip(filt, pad, dil)]
    size = tuple(draw(st.integers(lo, max(lo, 7 if nd < 3 else 4))) for lo in lows)
    groups = draw(st.sampled_from([1, 2]))
    c, k = groups * draw(st.integers(1, 4)), groups * draw(st.sampled_from([2, 4]))
    n = draw(st.integers(1, 4))
    kw = dict(stride=tuple(stride), padding=tuple(pad), dilation=tuple(dil), groups=groups)
    return (n,) + size + (c,), (k,) + tuple(filt) + (c // groups,), kw


@st.composite
def configs(draw, p):
    """A small schedule conv_v2 accepts (None: the default one)."""
    if draw(st.booleans()):
        return None
    bm = draw(st.sampled_from(_divisors(p.N, 4) if p.direction == "bwd_data" else [1, 2, 4]))
    bk = draw(st.sampled_from(_divisors(p.Kg, 4) if p.direction == "bwd_data" else [1, 2, 3, 4]))
    return TileConfig(bm, draw(st.sampled_from([2, 4, 8])), bk, 2 if bm % 2 == 0 else 1, 2)


@settings(max_examples=4)  # (CI time)
@given(case=problems("bwd_data"), dtype=st.sampled_from(["float32", "float64"]), data=st.data())
def test_conv_v2_bwd_data_cpu_matches_reference(case, dtype, data, assert_close, run_poisoned):
    rng = np.random.default_rng()
    x_shape, w_shape, kw = case
    p = make_problem("bwd_data", x_shape, w_shape, dtype=dtype, **kw)
    assert conv_v2.applies(p)
    cfg = data.draw(configs(p))
    w, dy = rng.standard_normal(w_shape).astype(dtype), rng.standard_normal(p.y_shape).astype(dtype)
    plan, dx = run_poisoned(p, {"dy": dy, "w": w}, "cpu", algo="conv_v2", config=cfg)
    assert plan.variant == "conv_v2"
    assert_close(dx, ref.conv_backward_data(dy, w, x_shape, **kw), dtype)


@settings(max_examples=4)  # (CI time)
@given(case=problems("bwd_weight"), dtype=st.sampled_from(["float32", "float64"]), data=st.data())
def test_conv_v2_bwd_weight_cpu_matches_reference(case, dtype, data, assert_close, run_poisoned):
    rng = np.random.default_rng()
    x_shape, w_shape, kw = case
    p = make_problem("bwd_weight", x_shape, w_shape, dtype=dtype, **kw)
    cfg = data.draw(configs(p))
    x, dy = rng.standard_normal(x_shape).astype(dtype), rng.standard_normal(p.y_shape).astype(dtype)
    plan, dw = run_poisoned(p, {"x": x, "dy": dy}, "cpu", algo="conv_v2", config=cfg)
    assert plan.variant == "conv_v2"
    assert_close(dw, ref.conv_backward_weight(x, dy, w_shape, **kw), dtype)


def test_conv_v2_backward_through_the_api(rng, assert_close):
    x = rng.standard_normal((3, 5, 6, 4)).astype("float32")
    w = rng.standard_normal((6, 3, 3, 4)).astype("float32")
    dy = rng.standard_normal((3, 5, 6, 6)).astype("float32")
    got = kernelgen.conv_backward_data(dy, w, x.shape, padding=1, backend="cpu", algo="conv_v2")
    assert_close(got, ref.conv_backward_data(dy, w, x.shape, padding=1))
    got = kernelgen.conv_backward_weight(x, dy, w.shape, padding=1, backend="cpu", algo="conv_v2")
    assert_close(got, ref.conv_backward_weight(x, dy, w.shape, padding=1))


def test_conv_v2_backward_applicability_and_never_automatic():
    p = make_problem("bwd_data", (2, 6, 6, 4), (4, 3, 3, 4), padding=1)
    assert conv_v2.applies(p) and conv_v2.applies(p.with_direction("bwd_weight"))
    assert not conv_v2.applies(make_problem("bwd_data", (2, 6, 6, 4), (4, 3, 3, 4), padding=1, stride=2))
    assert not conv_v2.applies(make_problem("bwd_data", (2, 6, 6, 4), (4, 3, 3, 4), padding=2))  # all inside dy
    assert conv_v2.applies(make_problem("bwd_data", (2, 6, 6, 4), (4, 3, 3, 4), padding=1, dilation=2))
    assert not conv_v2.applies(make_problem("bwd_weight", (2, 6, 6, 4), (4, 3, 3, 4)))  # no padding
    for q in (p, p.with_direction("bwd_weight")):
        assert candidates(q)[0].name != "conv_v2"
        assert make_plan(q, "cpu").variant != "conv_v2"


def test_conv_v2_backward_rejects_bad_input():
    dy, w = np.ones((2, 4, 4, 4), np.float32), np.ones((4, 3, 3, 4), np.float32)
    with pytest.raises(ValueError, match="algo"):
        kernelgen.conv_backward_data(dy, w, (2, 8, 8, 4), stride=2, padding=1, backend="cpu", algo="conv_v2")
    with pytest.raises(ValueError, match="algo"):
        kernelgen.conv_backward_weight(np.ones((2, 4, 4, 4), np.float32), np.ones((2, 2, 2, 4), np.float32),
                                       (4, 3, 3, 4), backend="cpu", algo="conv_v2")  # no padding: nothing to trim
    p = make_problem("bwd_data", (6, 4, 4, 8), (6, 3, 3, 8), padding=1)
    with pytest.raises(ValueError, match="N % BM"):
        make_plan(p, "cpu", algo="conv_v2", config=TileConfig(4, 8, 2, 2, 2)).render()
    with pytest.raises(ValueError, match="K/groups % BK"):
        make_plan(p, "cpu", algo="conv_v2", config=TileConfig(2, 8, 4, 2, 2)).render()
    with pytest.raises(ValueError, match="split_k"):
        conv_v2.build(p.with_direction("bwd_weight"), TileConfig(2, 8, 4, 2, 2, split_k=2))


@pytest.mark.parametrize("direction", ["bwd_data", "bwd_weight"])
def test_conv_v2_backward_default_configs_and_cuda_source(direction):
    """Every problem the variant applies to gets a CPU schedule; the CUDA loads carry no bounds tests."""
    for n, c in [(1, 3), (5, 6), (32, 64)]:
        p = make_problem(direction, (n, 7, 7, c), (8, 3, 3, c), padding=1)
        assert conv_v2.config_ok(p, default_config(p, "cpu", conv_v2.VARIANT))
    p = make_problem(direction, (32, 8, 8, 64), (64, 3, 3, 64), padding=1)
    assert conv_v2.config_ok(p, default_config(p, "cuda", conv_v2.VARIANT))
    src = make_plan(p, "cuda", algo="conv_v2").render()
    assert f"def conv_{direction}_v2(" in src
    assert ">= 0" not in src and "cuda.local.array" not in src


SIM_CASES = [("bwd_data", (2, 6, 4), (4, 3, 4), dict(padding=0)),
             ("bwd_data", (2, 4, 3, 4), (4, 3, 2, 2), dict(padding=(1, 0), dilation=(1, 2), groups=2)),
             ("bwd_weight", (2, 5, 4), (3, 3, 4), dict(padding=4, stride=2)),
             ("bwd_weight", (3, 4, 3, 2), (2, 3, 2, 2), dict(padding=1, dilation=(2, 1)))]


@pytest.mark.sim
@pytest.mark.parametrize("direction, x_shape, w_shape, kw", SIM_CASES)
def test_conv_v2_backward_simulator(direction, x_shape, w_shape, kw, rng, assert_close, run_direction):
    p = make_problem(direction, x_shape, w_shape, **kw)
    cfg = TileConfig(2, 4, 2, 2, 2)  # N % BK != 0 at N = 3: the per-element decode of backward-weight
    _, got, want = run_direction(p, kw, "cuda", algo="conv_v2", config=cfg, rng=rng)
    assert_close(got, want)


GPU_CASES = {"3x3_pad1": ((32, 14, 14, 64), (64, 3, 3, 64), dict(padding=1)),
             "grouped_dilated": ((32, 15, 17, 32), (48, 3, 3, 8), dict(padding=2, dilation=2, groups=4)),
             "1d_full": ((64, 129, 24), (40, 5, 24), dict(padding=0)),
             "3d": ((32, 6, 10, 10, 16), (24, 3, 3, 3, 16), dict(padding=1))}


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["bwd_data", "bwd_weight"])
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_conv_v2_backward_gpu(name, direction, rng, assert_close, run_direction):
    x_shape, w_shape, kw = GPU_CASES[name]
    p = make_problem(direction, x_shape, w_shape, **kw)
    if not conv_v2.applies(p):
        pytest.skip(f"conv_v2 has nothing to trim on {p.key()}")
    _, got, want = run_direction(p, kw, "cuda", algo="conv_v2", rng=rng)
    assert_close(got, want, "float32", f"{direction} {name}", tol=2e-5)
