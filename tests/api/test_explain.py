"""kernelgen.explain: problem, variant, config and the generated source of a call, without running it."""
from __future__ import annotations

import numpy as np
import pytest

import kernelgen
from kernelgen import api
from kernelgen.api import get_launcher
from kernelgen.runtime.cache import KERNELS
from kernelgen.templates import VARIANTS
from kernelgen.templates.config import TileConfig

rng = np.random.default_rng()
X, W = rng.standard_normal((2, 7, 9, 6)).astype("float32"), rng.standard_normal((10, 3, 3, 3)).astype("float32")
B = rng.standard_normal(10).astype("float32")
KW = dict(stride=(2, 1), padding=1, groups=2)
DY = rng.standard_normal((2, 4, 9, 10)).astype("float32")

CALLS = {
    "conv": (kernelgen.conv, (X, W, B), "fwd", "def conv_fwd("),
    "conv_backward_data": (kernelgen.conv_backward_data, (DY, W, X.shape), "bwd_data", "def conv_bwd_data("),
    "conv_backward_weight": (kernelgen.conv_backward_weight, (X, DY, W.shape), "bwd_weight", "def conv_bwd_weight("),
    # deconv of DY-shaped x with a (C_in=10, 3, 3, 3) weight is the backward-data above
    "deconv": (kernelgen.deconv, (DY, W), "bwd_data", "def conv_bwd_data("),
}


@pytest.fixture
def cache_untouched():
    before = (dict(KERNELS.stats.__dict__), len(KERNELS._memory))
    yield
    assert (dict(KERNELS.stats.__dict__), len(KERNELS._memory)) == before, "explain compiled or fetched a kernel"


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
@pytest.mark.parametrize("name", list(CALLS))
def test_explain_each_op(name, backend, cache_untouched):
    op, args, direction, signature = CALLS[name]
    for target in (op, name):  # the function or its name
        e = kernelgen.explain(target, *args, backend=backend, **KW)
        assert e.problem.direction == direction and e.problem.groups == 2 and e.problem.stride[1:] == (2, 1)
        assert e.backend == backend and e.variant in VARIANTS and isinstance(e.config, TileConfig)
        assert e.problem.key() in e.source
        if e.variant == "implicit_gemm":
            assert signature in e.source
        assert ("@cuda.jit" in e.source) == (backend == "cuda") and ("@njit" in e.source) == (backend == "cpu")
        compile(e.source, "<explain>", "exec")
        text = str(e)
        assert e.problem.key() in text and str(e.config) in text and e.source in text
    if backend == "cuda":
        assert "cuda.local.array" not in e.source, "register tiles must be scalars, not local arrays"


def test_explain_bias_is_in_the_problem(cache_untouched):
    with_bias = kernelgen.explain("conv", X, W, B, backend="cpu", **KW)
    without = kernelgen.explain("conv", X, W, backend="cpu", **KW)
    assert with_bias.problem.has_bias and not without.problem.has_bias
    assert "bias[" in with_bias.source and "bias" not in without.source.split("def conv_fwd(")[1].split(")")[0]


def test_explain_validates_and_never_replaces_the_runner(cache_untouched):
    real = api._run
    with pytest.raises(ValueError, match="stride must be >= 1"):
        kernelgen.explain("conv", X, W, **{**KW, "stride": 0})
    assert api._run is real
    with pytest.raises(ValueError, match="op must be one of"):
        kernelgen.explain("convolve", X, W)
    with pytest.raises(ValueError, match="op must be one of"):
        kernelgen.explain(np.add, X, W)


def test_explained_source_is_what_runs():
    """The source explain shows is the module the cache compiles and the call runs."""
    e = kernelgen.explain("conv", X, W, B, backend="cpu", **KW)
    launcher = get_launcher(api.make_plan(e.problem, "cpu"))
    with open(launcher.source_path) as f:
        header, body = f.read().split("\n", 1)
    assert header.startswith("# kernelgen-cache") and body == e.source


def test_explain_says_which_link_decided(monkeypatch, cache_untouched):
    """explain() reports the planner's link (Plan.decided_by) and its reason: the model (planned as on an H100 with
    the shipped model), the cost-model default (the CPU backend, or the model off).  (The public ops take no
    config=; its link is tested through make_plan in tests/tuning/test_perf_model.py.)"""
    from kernelgen import planner, settings
    from kernelgen.target import KNOWN_TARGETS
    x = rng.standard_normal((3, 11, 11, 40)).astype("float32")  # batch 3, 40 channels: no tuned problem is near
    w = rng.standard_normal((24, 3, 3, 40)).astype("float32")
    cpu = kernelgen.explain("conv", x, w, padding=1, backend="cpu")
    assert cpu.decided_by == "default" and "cpu backend" in cpu.reason
    assert "decided : default" in str(cpu) and f"reason  : {cpu.reason}" in str(cpu)
    monkeypatch.setattr(planner, "gpu_present", lambda: True)
    monkeypatch.setattr(planner, "target_for", lambda backend: KNOWN_TARGETS["h100"])
    monkeypatch.setattr(planner, "tuned_device", lambda: KNOWN_TARGETS["h100"].device_name)
    api.clear_caches()
    try:
        modelled = kernelgen.explain("conv", x, w, padding=1, backend="cuda")
        assert modelled.decided_by == "model" and "performance model" in str(modelled)
        with settings.scope(model="off"):
            api.clear_caches()
            assert kernelgen.explain("conv", x, w, padding=1, backend="cuda").decided_by == "default"
    finally:
        api.clear_caches()
