"""Winograd backward-weight (templates/winograd_wgrad.py, algo="winograd_wgrad") against the float64 reference.

The CPU backend over a hypothesis strategy of shapes (1-D / 2-D / 3-D, filter widths 2-7, padding, dilation, groups,
state counts, register tiles, float32 and float64) into NaN-poisoned outputs; split-K in the CUDA simulator (the
blocks add into the zeroed dw); the CUDA default on a GPU.  It is opt-in: never an automatic candidate.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings as hsettings
from hypothesis import strategies as st

from dataclasses import replace
from unittest import mock

from kernelgen import planner, settings
from kernelgen.api import make_plan
from kernelgen.problem import make_problem
from kernelgen.target import KNOWN_TARGETS, target_for
from kernelgen.templates import OPT_IN_VARIANTS, candidates, get_variant, winograd_wgrad
from kernelgen.templates.config import TileConfig
from kernelgen.tuning import tuner
from harness import assert_close, run_direction

TOL = 1e-4  # float32 through the transforms (the forward Winograd's bound); float64: the dtype's own


def check(p, kw, config, backend, rng):
    plan, got, want = run_direction(p, {**kw, "groups": p.groups}, backend, winograd_wgrad.NAME, config, rng)
    assert plan.variant == winograd_wgrad.NAME
    assert_close(got, want, p.dtype, f"{p.key()} {config} {backend}", tol=TOL if p.dtype == "float32" else None)


@st.composite
def cases(draw):
    ndim = draw(st.sampled_from((1, 2, 2, 3)))
    width = draw(st.integers(2, 7))  # (7: 8 states, two dy items a tile)
    filt = tuple(draw(st.integers(1, 3)) for _ in range(ndim - 1)) + (width,)
    dilation = tuple(draw(st.sampled_from((1, 1, 2, 3))) for _ in range(ndim))
    padding = tuple(draw(st.integers(0, d * (f - 1))) for f, d in zip(filt, dilation))
    span = [d * (f - 1) + 1 - 2 * pd for f, d, pd in zip(filt, dilation, padding)]  # the least size with an output
    sizes = tuple(draw(st.integers(max(1, lo), max(lo, 8 if ndim < 3 else 5))) for lo in span[:-1])
    sizes += (draw(st.integers(max(1, span[-1]), max(span[-1], 19))),)
    groups, cg, kg = draw(st.sampled_from((1, 1, 2))), draw(st.integers(1, 6)), draw(st.integers(1, 9))
    kw = dict(padding=padding, dilation=dilation, groups=groups)
    p = make_problem("bwd_weight", (draw(st.integers(1, 2)), *sizes, groups * cg), (groups * kg, *filt, cg),
                     dtype=draw(st.sampled_from(("float32", "float32", "float64"))), **kw)
    states = draw(st.sampled_from([a for a in (4, 8) if a - width + 1 >= 2]))  # (16: slow CPU compiles)
    config = TileConfig(BM=draw(st.sampled_from((4, 8))), BN=draw(st.sampled_from((4, 8))),
                        BK=draw(st.sampled_from((2, 4))), TM=2, TN=draw(st.sampled_from((1, 2))), states=states,
                        smem_pad=draw(st.sampled_from((0, 1))))
    return p, kw, config


@hsettings(max_examples=3, deadline=None)  # (a 5-8 s CPU compile each: CI time)
@given(data=st.data())
def test_cpu_random_shapes(data):
    p, kw, config = data.draw(cases())
    check(p, kw, config, "cpu", np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1))))


@pytest.mark.parametrize("x_shape, w_shape, kw", [
    ((2, 10, 14, 8), (8, 3, 3, 8), dict(padding=1)),        # VGG's 3x3, a ragged last width tile
    ((1, 4, 5, 9, 3), (4, 3, 3, 3, 3), dict(padding=1)),    # C3D's 3x3x3
    ((2, 23, 6), (5, 7, 6), dict(padding=3)),                # a 1-D 7-tap layer
    ((1, 13, 17, 4), (4, 3, 3, 4), dict(padding=4, dilation=4)),  # DeepLab's dilated 3x3
])
def test_cpu_network_shapes(x_shape, w_shape, kw, rng):
    p = make_problem("bwd_weight", x_shape, w_shape, **kw)
    check(p, kw, get_variant(winograd_wgrad.NAME).default_config(p, target_for("cpu")), "cpu", rng)


@pytest.mark.sim
@pytest.mark.parametrize("config", [TileConfig(BM=4, BN=4, BK=4, TM=2, TN=2, states=4, split_k=3),
                                    TileConfig(BM=8, BN=4, BK=2, TM=2, TN=1, states=8, split_k=2, smem_pad=1)],
                         ids=str)
def test_simulator_split(config, rng):
    kw = dict(padding=1)
    check(make_problem("bwd_weight", (1, 5, 9, 3), (5, 3, 3, 3), **kw), kw, config, "cuda", rng)


@pytest.mark.gpu
@pytest.mark.parametrize("x_shape, w_shape", [((8, 56, 56, 64), (64, 3, 3, 64)), ((16, 14, 14, 256), (256, 3, 3, 256))])
def test_gpu_default(x_shape, w_shape, rng):
    kw = dict(padding=1)
    p = make_problem("bwd_weight", x_shape, w_shape, **kw)
    check(p, kw, None, "cuda", rng)


def _gpu_plan(problem, tried=None):
    """make_plan as on a GPU with the H100 database and model (offline: gpu_present patched, model "on"); `tried`
    patches what the tune of exactly this problem timed (database.measured)."""
    with settings.scope(model="on"), mock.patch.object(planner, "gpu_present", lambda: True):
        if tried is None:
            return planner.make_plan(problem, "cuda")
        with mock.patch.object(planner._tuned_db(), "measured", lambda *a, **k: tried):
            return planner.make_plan(problem, "cuda")


@pytest.mark.parametrize("x_shape, w_shape, kw, taken", [
    ((8, 28, 28, 256), (512, 3, 3, 256), dict(padding=1), True),          # VGG conv4_1
    ((2, 33, 33, 512), (512, 3, 3, 512), dict(padding=4, dilation=4), True),  # DeepLab: dilated, any width
    ((16, 400, 250), (250, 7, 250), dict(padding=3), True),                # wav2letter, 1-D
    ((16, 400, 64), (64, 9, 64), dict(padding=4), False),                  # 9 wide: 16 states, no default tile
    ((8, 224, 224, 3), (64, 3, 3, 3), dict(padding=1), False),             # a first layer: 3 channels
    ((32, 7, 7, 512), (512, 3, 3, 512), dict(padding=1), False),           # width 7: 7 of 12 columns filled
    ((32, 56, 56, 128), (128, 3, 3, 4), dict(padding=1, groups=32), False),  # 4 channels a group
    ((8, 28, 28, 64), (64, 3, 3, 64), dict(padding=1, stride=2), False)])  # strided
def test_planner_rule(x_shape, w_shape, kw, taken):
    p = make_problem("bwd_weight", x_shape, w_shape, **kw)
    plan = _gpu_plan(p)
    assert (plan.decided_by == "winograd backward-weight") == taken and (plan.variant == winograd_wgrad.NAME) == taken
    if taken:
        assert plan.config == get_variant(winograd_wgrad.NAME).default_config(p, plan.target)
        assert "with the roles of filter and data exchanged" in plan.reason
        timed = [("implicit_gemm", TileConfig()), (winograd_wgrad.NAME, plan.config)]  # a tune timed it: the chain
        assert _gpu_plan(p, tried=timed).decided_by != "winograd backward-weight"
    assert make_plan(p, "cpu").variant != winograd_wgrad.NAME
    assert make_plan(replace(p, dtype="float64"), "cpu").variant != winograd_wgrad.NAME


def test_a_tune_times_it_where_the_rule_takes_it():
    """tuner.candidates adds the template's states and splits where the planner's rule would take it, so a tune's
    entry weighs it (and the rule then leaves the problem to that entry); nowhere else."""
    h100 = KNOWN_TARGETS["h100"]
    vgg = make_problem("bwd_weight", (8, 28, 28, 256), (512, 3, 3, 256), padding=1)
    pairs = tuner.candidates(vgg, keep=4, target=h100)
    ours = [c for v, c in pairs if v == winograd_wgrad.NAME]
    assert ours and any(v != winograd_wgrad.NAME for v, _ in pairs)
    assert len({c.states for c in ours}) > 1 and all(get_variant(winograd_wgrad.NAME).accepts(vgg, c) for c in ours)
    first = make_problem("bwd_weight", (8, 224, 224, 3), (64, 3, 3, 3), padding=1)
    assert not any(v == winograd_wgrad.NAME for v, _ in tuner.candidates(first, keep=4, target=h100))
    assert not any(v == winograd_wgrad.NAME for v, _ in tuner.candidates(vgg, ("implicit_gemm",), keep=4, target=h100))


def test_opt_in_only():
    p = make_problem("bwd_weight", (8, 28, 28, 64), (64, 3, 3, 64), padding=1)
    v = get_variant(winograd_wgrad.NAME)
    assert winograd_wgrad.NAME in OPT_IN_VARIANTS and v.applies(p)
    assert winograd_wgrad.NAME not in [c.name for c in candidates(p)]
    assert make_plan(p, "cpu").variant != winograd_wgrad.NAME
    cuda = v.default_config(p, KNOWN_TARGETS["h100"])
    assert cuda.split_k > 1 and v.accepts(p, cuda) and v.config_space(p, KNOWN_TARGETS["h100"])


@pytest.mark.parametrize("change, what", [(dict(stride=2), "stride 1"), (dict(stride=(1, 2)), "stride 1")])
def test_refused_problems(change, what):
    p = make_problem("bwd_weight", (1, 9, 9, 4), (4, 3, 3, 4), padding=1, **change)
    assert not get_variant(winograd_wgrad.NAME).applies(p)
    with pytest.raises(ValueError, match=what):
        winograd_wgrad.build(p, TileConfig(BM=4, BN=4, BK=4, TM=2, TN=2))


def test_refused_configs():
    p = make_problem("bwd_weight", (1, 9, 9, 4), (4, 3, 3, 4), padding=1)
    for bad in (dict(stages=2), dict(state_groups=2), dict(states=16, BM=64, BN=64, BK=16, TM=8, TN=8)):
        cfg = TileConfig(**{**dict(BM=4, BN=4, BK=4, TM=2, TN=2), **bad})
        assert not get_variant(winograd_wgrad.NAME).accepts(p, cfg)
    with pytest.raises(ValueError, match="algo"):
        make_plan(make_problem("fwd", (1, 9, 9, 4), (4, 3, 3, 4)), "cpu", winograd_wgrad.NAME)


def test_a_neighbour_s_winner_transfers_only_where_the_rule_would_take_it(monkeypatch):
    """The nearest tuned entry's Winograd backward-weight winner reaches a problem only where winograd_wgrad.suits
    it; elsewhere the neighbour's fastest other candidate."""
    from kernelgen.tuning import database
    near = make_problem("bwd_weight", (32, 28, 28, 16), (16, 3, 3, 16), padding=1)
    ours = get_variant(winograd_wgrad.NAME).default_config(near, KNOWN_TARGETS["h100"])
    gemm = TileConfig(BM=64, BN=64, BK=8, TM=4, TN=4, split_k=4)
    entry = {"variant": winograd_wgrad.NAME, "config": ours.as_dict(), "ms": 0.1, "problem": near.__dict__,
             "tried": [{"variant": winograd_wgrad.NAME, "config": str(ours), "ms": 0.1},
                       {"variant": "implicit_gemm", "config": str(gemm), "ms": 0.2}]}
    monkeypatch.setattr(database, "entries_for", lambda device: {near.key(): entry})
    wide = make_problem("bwd_weight", (32, 28, 28, 20), (20, 3, 3, 20), padding=1)     # 20 channels: the rule's
    narrow = make_problem("bwd_weight", (32, 28, 28, 14), (14, 3, 3, 14), padding=1)   # 14: not
    assert winograd_wgrad.suits(wide) and not winograd_wgrad.suits(narrow)
    assert database.resolve(wide, "any")[:3] == (winograd_wgrad.NAME, ours, "nearest")
    assert database.resolve(narrow, "any")[:3] == ("implicit_gemm", gemm, "nearest")
