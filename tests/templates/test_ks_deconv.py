"""KS-deconv (templates/ks_deconv.py): stride > 1 backward-data and deconv without inserted zeros.

CPU backend broadly (hypothesis over 1D/2D/3D, strides 2-3, filters not divisible by the stride,
padding larger than the filter, groups, float32 and float64), the CUDA rendering in the simulator
on tiny shapes, all with NaN-poisoned outputs against the float64 reference.  KS-deconv-V2 (the
opt-in trimmed form, the ks_deconv_trim setting) the same way, with schedules it accepts.
"""
from __future__ import annotations

import contextlib
import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kernelgen
from kernelgen import reference as ref
from kernelgen import settings as kg_settings
from kernelgen.api import make_plan
from kernelgen.problem import make_problem
from kernelgen.templates import candidates, ks_deconv
from kernelgen.templates.config import TileConfig

SMALL = TileConfig(BM=16, BN=8, BK=4, TM=2, TN=2)
# `(e % 2) == 0` in the CUDA source, with or without the renderer's 32-bit index helpers
STRIDE_TEST = re.compile(r"(% 2\)|mod32\(\w+, 2\)) == 0")


@st.composite
def strided_problems(draw):
    nd = draw(st.integers(1, 3))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    if max(stride) == 1:
        stride = (2,) + stride[1:]
    filt = tuple(draw(st.integers(1, 5)) for _ in range(nd))
    pad = tuple(draw(st.integers(0, f + 1)) for f in filt)
    size = tuple(draw(st.integers(max(1, f - 2 * p), 9 if nd < 3 else 5)) for f, p in zip(filt, pad))
    groups = draw(st.sampled_from([1, 2]))
    c, k = groups * draw(st.integers(1, 3)), groups * draw(st.integers(1, 3))
    n = draw(st.integers(1, 2))
    return (n,) + size + (c,), (k,) + filt + (c // groups,), dict(stride=stride, padding=pad, groups=groups)


@settings(max_examples=4)  # (CI time)
@given(case=strided_problems(), dtype=st.sampled_from(["float32", "float64"]))
def test_ks_deconv_cpu_matches_reference(case, dtype, assert_close, run_poisoned):
    rng = np.random.default_rng()  # fresh data per example
    x_shape, w_shape, kw = case
    p = make_problem("bwd_data", x_shape, w_shape, dtype=dtype, **kw)
    w = rng.standard_normal(w_shape).astype(dtype)
    dy = rng.standard_normal(p.y_shape).astype(dtype)
    # groups == C > 1 is depthwise, which the planner gives its own template: ask for KS-deconv there
    plan, dx = run_poisoned(p, {"dy": dy, "w": w}, "cpu", algo="ks_deconv" if p.groups == p.C > 1 else None)
    assert plan.variant == "ks_deconv"
    assert_close(dx, ref.conv_backward_data(dy, w, x_shape, **kw), dtype)


def test_ks_deconv_is_the_automatic_choice_only_where_it_applies():
    strided = make_problem("bwd_data", (2, 8, 8, 4), (4, 3, 3, 4), stride=2, padding=1)
    assert candidates(strided)[0].name == "ks_deconv"
    assert candidates(strided.with_direction("fwd"))[0].name != "ks_deconv"
    unit = make_problem("bwd_data", (2, 8, 8, 4), (4, 3, 3, 4), padding=1)
    dilated = make_problem("bwd_data", (2, 9, 9, 4), (4, 3, 3, 4), stride=2, dilation=2, padding=2)
    assert all(v.name != "ks_deconv" for v in candidates(unit) + candidates(dilated))


def test_ks_deconv_reads_no_inserted_zeros():
    """The point of KS-deconv: no `% stride` test in the reduction, unlike the zero-insertion form."""
    x = np.zeros((2, 8, 8, 4), np.float32)
    w = np.zeros((4, 3, 3, 4), np.float32)
    dy = np.zeros((2, 4, 4, 4), np.float32)
    ks = kernelgen.explain(kernelgen.conv_backward_data, dy, w, x.shape, stride=2, padding=1, backend="cuda")
    zi = kernelgen.explain(kernelgen.conv_backward_data, dy, w, x.shape, stride=2, padding=1, backend="cuda",
                           algo="implicit_gemm")
    assert ks.variant == "ks_deconv" and not STRIDE_TEST.search(ks.source)
    assert STRIDE_TEST.search(zi.source)
    assert "cuda.local.array" not in ks.source


@pytest.mark.parametrize("kw", [dict(stride=2, padding=1, output_padding=1), dict(stride=3, padding=2, output_padding=2),
                                dict(stride=(2, 1), padding=(0, 1), output_padding=(1, 0), groups=2)])
def test_deconv_uses_ks_and_matches_reference(kw, rng, assert_close):
    x = rng.standard_normal((2, 4, 5, 4)).astype("float32")
    w = rng.standard_normal((4, 3, 3, 3)).astype("float32")
    b = rng.standard_normal(3 * kw.get("groups", 1)).astype("float32")
    assert_close(kernelgen.deconv(x, w, b, backend="cpu", **kw), ref.deconv(x, w, b, **kw))


@pytest.mark.sim
@pytest.mark.parametrize("case", [((2, 7, 8, 4), (6, 3, 3, 4), dict(padding=1, stride=2)),
                                  ((1, 9, 5, 6), (4, 5, 4, 3), dict(padding=(2, 1), stride=(3, 2), groups=2)),
                                  ((1, 5, 6, 4, 2), (2, 3, 2, 3, 2), dict(padding=(1, 0, 1), stride=(2, 1, 2)))])
def test_ks_deconv_simulator(case, rng, assert_close, run_poisoned):
    x_shape, w_shape, kw = case
    p = make_problem("bwd_data", x_shape, w_shape, **kw)
    w = rng.standard_normal(w_shape).astype("float32")
    dy = rng.standard_normal(p.y_shape).astype("float32")
    plan, dx = run_poisoned(p, {"dy": dy, "w": w}, "cuda", config=SMALL)
    assert plan.variant == "ks_deconv"
    assert_close(dx, ref.conv_backward_data(dy, w, x_shape, **kw))


@contextlib.contextmanager
def trimming(on=True):
    """The ks_deconv_trim setting for the block (hypothesis tests cannot use a function-scoped fixture)."""
    with kg_settings.scope(ks_deconv_trim=on):
        yield


@settings(max_examples=3)  # (CI time)
@given(case=strided_problems(), dtype=st.sampled_from(["float32", "float64"]), data=st.data())
def test_ks_deconv_v2_cpu_matches_reference(case, dtype, data, assert_close, run_poisoned):
    rng = np.random.default_rng()
    x_shape, w_shape, kw = case
    p = make_problem("bwd_data", x_shape, w_shape, dtype=dtype, **kw)
    bm = data.draw(st.sampled_from([d for d in (1, 2) if p.N % d == 0]))
    bk = data.draw(st.sampled_from([d for d in (1, 2, 3) if p.Kg % d == 0]))
    cfg = TileConfig(bm, data.draw(st.sampled_from([2, 4])), bk, bm, 2)
    w, dy = rng.standard_normal(w_shape).astype(dtype), rng.standard_normal(p.y_shape).astype(dtype)
    with trimming():
        assert make_plan(p, "cpu", config=cfg).kernel_ir().meta["trimmed"]
        plan, dx = run_poisoned(p, {"dy": dy, "w": w}, "cpu", config=cfg)
    assert plan.variant == "ks_deconv"
    assert_close(dx, ref.conv_backward_data(dy, w, x_shape, **kw), dtype)


def test_ks_deconv_v2_is_opt_in_and_reads_only_real_taps():
    p = make_problem("bwd_data", (32, 8, 8, 16), (16, 3, 3, 16), stride=2, padding=1)
    cfg = TileConfig(32, 64, 8, 4, 4)
    assert not kg_settings.get("ks_deconv_trim") and not make_plan(p, "cuda", config=cfg).kernel_ir().meta["trimmed"]
    plain_key = make_plan(p, "cuda", config=cfg).key()
    with trimming():
        plan = make_plan(p, "cuda", config=cfg)
        assert plan.key() != plain_key  # a cached predicated kernel is never reused for the trimmed one
        src = plan.render()
        assert "def conv_bwd_data_ks_v2(" in src
        assert ">= 0" not in src and not STRIDE_TEST.search(src) and "cuda.local.array" not in src
        assert not make_plan(p, "cuda", config=TileConfig(32, 64, 8, 4, 4, split_k=2)).kernel_ir().meta["trimmed"]
    with pytest.raises(ValueError, match="N % BM"):
        ks_deconv.ks_v2_view(p, TileConfig(64, 64, 8, 4, 4))


@pytest.mark.sim
@pytest.mark.parametrize("case", [((2, 7, 6, 2), (4, 3, 3, 2), dict(padding=1, stride=2)),
                                  ((1, 8, 4), (4, 4, 2), dict(padding=3, stride=3, groups=2))])
def test_ks_deconv_v2_simulator(case, rng, assert_close, run_poisoned):
    x_shape, w_shape, kw = case
    p = make_problem("bwd_data", x_shape, w_shape, **kw)
    w = rng.standard_normal(w_shape).astype("float32")
    dy = rng.standard_normal(p.y_shape).astype("float32")
    cfg = TileConfig(x_shape[0], 4, 2, 1, 2)
    with trimming():
        plan, dx = run_poisoned(p, {"dy": dy, "w": w}, "cuda", config=cfg)
        assert plan.kernel_ir().meta["trimmed"]
    assert_close(dx, ref.conv_backward_data(dy, w, x_shape, **kw))
