"""kernelgen.precompile and Module.precompile (issue 27), on the CPU backend: the kernels of a set of calls (of a
training step) compiled in worker processes into the disk cache; this process and a fresh one then load them -
the kernel cache's stats show no render, numba's show no compile - and compute correctly (float64 reference,
outputs poisoned with NaN)."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kernelgen
from kernelgen import api, nn, settings
from kernelgen.nn import functional as F
from kernelgen.nn.precompile_step import trace_plans
from kernelgen.nn.tensor import Tensor
from kernelgen.precompile import plan_calls, precompile, recording
from kernelgen.runtime.cache import KERNELS
from harness import random_array

KW = dict(padding=1, backend="cpu")
X, W, DY = (1, 5, 4, 3), (2, 3, 3, 3), (1, 5, 4, 2)  # shapes no other test compiles


def _calls():
    x, w, dy = np.zeros(X, np.float32), np.zeros(W, np.float32), np.zeros(DY, np.float32)
    return [(kernelgen.conv, (x, w), KW), ("conv_backward_data", (dy, w, X), KW),
            (kernelgen.conv_backward_weight, (x, dy, W), KW)]


def _numba_compiles(launchers) -> int:
    return sum(sum(launcher.kernel.stats.cache_misses.values()) for launcher in launchers)


FRESH_PROCESS = textwrap.dedent("""
    import json, numpy as np, kernelgen
    from kernelgen import api, reference as ref
    from kernelgen.runtime.cache import KERNELS
    rng = np.random.default_rng()
    x, w, dy = (rng.standard_normal(s).astype(np.float32) for s in ({X}, {W}, {DY}))
    kw = dict(padding=1, backend="cpu")
    err = []
    for op, args, want, shape in (
            (kernelgen.conv, (x, w), ref.conv_forward(x, w, padding=(1, 1)), {DY}),
            (kernelgen.conv_backward_data, (dy, w, {X}), ref.conv_backward_data(dy, w, {X}, padding=(1, 1)), {X}),
            (kernelgen.conv_backward_weight, (x, dy, {W}), ref.conv_backward_weight(x, dy, {W}, padding=(1, 1)),
             {W})):
        out = np.full(shape, np.nan, np.float32)
        op(*args, out=out, **kw)
        err.append(float(np.abs(out - want).max() / np.abs(want).max()))
    launchers = [p.launcher for p in api._PREPARED.values()]
    print(json.dumps({{"err": err, "stats": KERNELS.stats.__dict__,
                      "numba_compiles": sum(sum(l.kernel.stats.cache_misses.values()) for l in launchers),
                      "numba_cache_hits": sum(sum(l.kernel.stats.cache_hits.values()) for l in launchers)}}))
""").format(X=X, W=W, DY=DY)


def test_precompile_fills_the_disk_cache_and_a_fresh_process_compiles_nothing(tmp_path):
    with settings.scope(cache_dir=str(tmp_path)):
        report = precompile(_calls(), workers=2)
        assert report.errors == [] and (report.kernels, report.cached, report.compiled) == (3, 0, 3)
        assert report.workers == 2  # (two kernels in the pool, one here)
        assert len(list(tmp_path.glob("kg_*.py"))) == 3 and len(list(tmp_path.glob("__pycache__/kg_*.nbi"))) == 3
        again = precompile(_calls())
        assert (again.kernels, again.cached, again.compiled, again.workers) == (3, 3, 0, 0)
    env = {**os.environ, "KERNELGEN_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", FRESH_PROCESS], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert max(result["err"]) <= 1e-5, result
    assert result["stats"]["misses"] == 0 and result["stats"]["disk_hits"] == 3, result
    assert result["numba_compiles"] == 0 and result["numba_cache_hits"] == 3, result
    assert not done.stderr.strip(), done.stderr[-2000:]  # no numba warning or message reaches the user


def test_bad_calls_are_refused_by_index_before_any_work(tmp_path):
    x, w = np.zeros(X, np.float32), np.zeros(W, np.float32)
    with settings.scope(cache_dir=str(tmp_path)):
        with pytest.raises(ValueError, match=r"calls\[1\]: stride must be >= 1"):
            precompile([(kernelgen.conv, (x, w), KW), (kernelgen.conv, (x, w), {**KW, "stride": 0})])
        with pytest.raises(ValueError, match=r"calls\[0\]: op must be one of"):
            precompile([("convolve", (x, w), KW)])
        with pytest.raises(TypeError, match=r"calls\[0\]: w must have dtype float32"):
            precompile([("conv", (x, w.astype(np.int32)), KW)])
        with pytest.raises(TypeError, match=r"calls\[0\] must be \(op, args\)"):
            precompile([kernelgen.conv])
        with pytest.raises(ValueError, match="workers must be None or an int >= 0"):
            precompile(_calls(), workers=-1)
    assert not list(tmp_path.iterdir())


def test_recording_plans_without_running(rng):
    """Inside recording(): each call planned (validated), a zero output of its shape returned, nothing compiled."""
    x, w = random_array(rng, (1, 3, 7, 2)), random_array(rng, (3, 1, 3, 2))
    before = dict(KERNELS.stats.__dict__)
    with recording() as plans:
        y = kernelgen.conv(x, w, **KW)
        with pytest.raises(ValueError, match="stride"):
            kernelgen.conv(x, w, stride=0, **KW)
    assert y.shape == (1, 5, 7, 3) and not y.any()  # (a 1x3 filter, padding 1: two more rows)
    assert len(plans) == 1 and plans[0].problem.x_shape == x.shape
    assert KERNELS.stats.__dict__ == before
    assert plan_calls([(kernelgen.conv, (x, w), KW)])[0].key() == plans[0].key()


def _small_net():
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Conv2d(4, 5, 3, padding=1, stride=2), nn.GlobalAvgPool(), nn.Linear(5, 3))


def test_model_precompile_compiles_a_training_step_and_leaves_the_model_as_it_was(tmp_path):
    model = _small_net()
    state = {k: v.copy() for k, v in model.state_dict().items()}
    with settings.scope(cache_dir=str(tmp_path)):
        report = model.precompile((2, 6, 7, 3), workers=2)
        # conv 1: forward and backward-weight (its input needs no gradient); conv 2: all three
        assert report.errors == [] and report.kernels == 5 and report.compiled + report.cached == 5
        assert all(np.array_equal(state[k], v) for k, v in model.state_dict().items())
        assert all(p.grad is None for p in model.parameters())
        launchers = [api.get_launcher(plan) for plan in trace_plans(model, (2, 6, 7, 3))]
        misses, compiles = KERNELS.stats.misses, _numba_compiles(launchers)
        x = Tensor(np.random.default_rng(0).standard_normal((2, 6, 7, 3)).astype(np.float32))
        loss = F.cross_entropy(model(x), np.array([0, 2]))
        loss.backward()
        assert KERNELS.stats.misses == misses  # the step rendered nothing
        assert _numba_compiles(launchers) == compiles  # and numba compiled nothing
    assert np.isfinite(float(loss.data)) and all(np.isfinite(p.grad).all() for p in model.parameters())


def test_model_precompile_refuses_a_bad_shape():
    with pytest.raises(ValueError, match="input_shape must be a tuple of positive ints"):
        _small_net().precompile((2, 0, 7, 3))
    with pytest.raises(TypeError, match="dtype"):
        _small_net().precompile((2, 6, 7, 3), dtype="not a dtype")


def test_demo_compiles_its_kernels_beforehand_and_passes(tmp_path):
    """`python -m kernelgen demo` from an empty cache: its three kernels precompiled, checked against float64,
    nothing on stderr; run again, they all come from the disk cache."""
    env = {**os.environ, "KERNELGEN_CACHE_DIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "kernelgen", "demo", "--backend", "cpu", "--size", "1,4,5,2,3"]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0 and "OK: all passes match" in first.stdout, first.stdout + first.stderr[-2000:]
    assert "kernels: 3, 0 from the disk cache, 3 compiled" in first.stdout and not first.stderr.strip()
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "kernels: 3, 3 from the disk cache, 0 compiled" in again.stdout, again.stdout


def _no_pool():
    """pool_on_demand's stand-in where the compile pool is stood in for too: shown each plan, starts nothing."""
    return contextlib.nullcontext(SimpleNamespace(see=lambda plan: None, pool=None))


@pytest.mark.sim
def test_a_cuda_model_s_first_call_on_a_new_input_precompiles_its_step(monkeypatch, rng):
    """auto_precompile: the outermost module's first call on each new (shape, dtype, mode) traces a step and hands
    its plans to the compile pool - forward and backward in training, forward only in eval - and never again for
    the same input; inner modules never trace; the setting turns it off.  (The simulator compiles nothing, so
    there the pool is stood in for.)"""
    from kernelgen.nn import precompile_step
    batches = []
    monkeypatch.setattr(precompile_step, "_compiles_for_real", lambda: True)
    monkeypatch.setattr(precompile_step, "compile_plans", lambda plans, pool=None: batches.append(plans))
    monkeypatch.setattr(precompile_step, "pool_on_demand", _no_pool)
    model = _small_net().to("cuda")
    x = Tensor(random_array(rng, (4, 6, 7, 3))).to("cuda")
    model(x)
    model(x)
    # conv 1: forward and backward-weight; conv 2 and the Linear (a 1x1 convolution on the device): all three
    assert [len(b) for b in batches] == [8]
    with settings.scope(batch_fallback=False):  # a smaller batch compiles its own kernels first
        model(Tensor(random_array(rng, (2, 6, 7, 3))).to("cuda"))
    assert [b[0].problem.N for b in batches] == [4, 2]
    # with it, a smaller batch runs on the larger batch's kernels while its own compile in the background
    model(Tensor(random_array(rng, (3, 6, 7, 3))).to("cuda"))
    assert len(batches) == 2
    model.eval()
    model(x)
    assert [len(b) for b in batches] == [8, 8, 3]  # eval: the forward's three
    with settings.scope(auto_precompile=False):
        model(Tensor(random_array(rng, (5, 6, 7, 3))).to("cuda"))
    assert len(batches) == 3


@pytest.mark.sim
def test_the_first_call_s_trace_leaves_dropout_masks_as_they_would_be(monkeypatch, rng):
    """The trace draws dropout seeds from the layers' generators and puts their states back: the step computes
    what it computes with auto_precompile off."""
    from kernelgen.nn import precompile_step
    monkeypatch.setattr(precompile_step, "_compiles_for_real", lambda: True)
    monkeypatch.setattr(precompile_step, "compile_plans", lambda plans, pool=None: None)
    monkeypatch.setattr(precompile_step, "pool_on_demand", _no_pool)
    x = random_array(rng, (2, 6, 7, 3))
    outputs = []
    for auto in (True, False):
        model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, rng=0), nn.Dropout(0.5, rng=7)).to("cuda")
        with settings.scope(auto_precompile=auto):
            outputs.append(model(Tensor(x).to("cuda")).numpy())
    assert np.array_equal(outputs[0], outputs[1])
