"""Regression tests for what a new user broke in the public API (the reliability issue), each against a float64
reference on fresh random data: threads, lists, torch CPU tensors, validation of cached calls, settings in
the kernel key, empty problems, padding modes, read-only arrays and a machine without a GPU."""
from __future__ import annotations

import dataclasses
import re
import threading
from pathlib import Path

import numpy as np
import pytest

import kernelgen
from kernelgen import api, settings
from kernelgen import reference as ref
from kernelgen.planner import make_plan
from kernelgen.problem import make_problem
from harness import poisoned


def _case(rng, n=2, hw=6, c=3, k=4, r=3):
    return (rng.standard_normal((n, hw, hw, c)).astype(np.float32),
            rng.standard_normal((k, r, r, c)).astype(np.float32))


def test_explain_and_conv_in_two_threads_never_lose_a_result(rng, assert_close):
    """explain() used to swap the module's runner for a capturing one: a conv in another thread then returned None."""
    x, w = _case(rng)
    want = ref.conv_forward(x, w, padding=(1, 1))
    kernelgen.conv(x, w, padding=1, backend="cpu")  # compiled before the race
    stop, errors = threading.Event(), []

    def explainer():
        try:
            while not stop.is_set():
                kernelgen.explain(kernelgen.conv, x, w, padding=1, backend="cpu")
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)
    t = threading.Thread(target=explainer)
    t.start()
    try:
        for _ in range(300):
            got = kernelgen.conv(x, w, padding=1, backend="cpu")
            assert got is not None
            assert_close(got, want)
    finally:
        stop.set()
        t.join()
    assert not errors


def test_python_lists_are_keyed_by_shape_never_by_id(rng, assert_close):
    """A freed list's id() is reused: a call on a new list of another shape returned the old list's result."""
    w = rng.standard_normal((4, 3, 3, 3))
    big, small = rng.standard_normal((2, 7, 7, 3)), rng.standard_normal((1, 5, 5, 3))
    for x in (big, small, big, small):
        got = kernelgen.conv(x.tolist(), w.tolist(), padding=1, backend="cpu")
        assert got.shape == (x.shape[0], x.shape[1], x.shape[2], 4)
        assert_close(got, ref.conv_forward(x, w, padding=(1, 1)), "float64")


@pytest.mark.parametrize("value, name, exc", [
    (1.0, "stride", TypeError), (True, "stride", TypeError), ((1, 1.0), "stride", ValueError),
    (True, "groups", TypeError), (1.0, "groups", TypeError), (1.0, "padding", TypeError),
    (True, "dilation", TypeError), (np.float32(1), "padding", TypeError)])
def test_cached_calls_still_validate_new_values(rng, value, name, exc):
    """After one call with an int, a float or bool equal to it (same hash) used to hit the memo and pass."""
    x, w = _case(rng)
    kernelgen.conv(x, w, **{name: 1}, backend="cpu")
    with pytest.raises(exc, match=name):
        kernelgen.conv(x, w, **{name: value}, backend="cpu")


def test_every_code_setting_enters_the_kernel_key():
    """A code-changing switch left out of the key let a kernel rendered under one value be reused under another."""
    plan = make_plan(make_problem("fwd", (2, 8, 8, 16), (16, 3, 3, 16), padding=1), "cpu")
    base = plan.key()
    flipped = {"index32": False, "winograd_16_states": True, "winograd_states": (4, 8), "ks_deconv_trim": True,
               "tma_drain_each_round": False, "target": "a100"}
    assert set(flipped) == {s.name for s in settings.CODE_SETTINGS}
    for name, value in flipped.items():
        with settings.scope(**{name: value}):
            assert plan.key() != base, name
    assert plan.key() == base


def test_drain_setting_changes_the_tma_source_and_the_key():
    """The switch a probe script flipped: it changes the rendered TMA k-loop, so the key must change with it."""
    from kernelgen.templates.implicit_gemm_tc import untuned_tma_config
    p = make_problem("fwd", (2, 8, 8, 256), (64, 3, 3, 256), padding=1, dtype="float16")  # 36 k-slices: rounds
    config = dataclasses.replace(untuned_tma_config(p, "fp16"), tma=1)  # the pipeline without a producer warp
    plan = make_plan(p, "cuda", config=config, precision="fp16")
    src, key = plan.render(), plan.key()
    with settings.scope(tma_drain_each_round=False):
        assert plan.render() != src
        assert plan.key() != key


def test_settings_scope_is_per_thread():
    seen = {}
    with settings.scope(index32=False):
        t = threading.Thread(target=lambda: seen.setdefault("other", settings.get("index32")))
        t.start()
        t.join()
        assert settings.get("index32") is False
    assert seen["other"] is True and settings.get("index32") is True


def test_settings_validate_names_values_and_environment(monkeypatch):
    with pytest.raises(ValueError, match="unknown kernelgen setting 'index_32'"):
        settings.get("index_32")
    with pytest.raises(TypeError, match="setting index32"):
        with settings.scope(index32=2):
            pass
    with pytest.raises(ValueError, match="setting winograd_states"):
        settings.set("winograd_states", (4, 5))
    monkeypatch.setenv("KERNELGEN_INDEX32", "maybe")
    with pytest.raises(ValueError, match="KERNELGEN_INDEX32"):
        settings.get("index32")
    monkeypatch.setenv("KERNELGEN_INDEX32", "0")
    assert settings.get("index32") is False


def test_set_precision_is_a_setting_and_scopes_per_thread(rng, assert_close):
    assert kernelgen.get_precision() == "fp32"
    with settings.scope(precision="tf32"):
        assert kernelgen.get_precision() == "tf32"
    old = kernelgen.set_precision("bf16")
    try:
        assert old == "fp32" and settings.get("precision") == "bf16"
    finally:
        kernelgen.set_precision(old)
    with pytest.raises(ValueError, match="precision must be one of"):
        kernelgen.set_precision("fp8")


# --- torch CPU tensors ------------------------------------------------------------------------------

def test_torch_cpu_tensors_run_on_the_cpu_backend(rng, assert_close):
    torch = pytest.importorskip("torch")
    x, w = _case(rng)
    for backend in (None, "cpu"):
        got = kernelgen.conv(torch.from_numpy(x), torch.from_numpy(w).requires_grad_(), padding=1, backend=backend)
        assert isinstance(got, torch.Tensor) and got.device.type == "cpu"
        assert_close(got.numpy(), ref.conv_forward(x, w, padding=(1, 1)))
    out = torch.full((2, 6, 6, 4), float("nan"))
    assert kernelgen.conv(torch.from_numpy(x), torch.from_numpy(w), padding=1, out=out) is out
    assert_close(out.numpy(), ref.conv_forward(x, w, padding=(1, 1)))
    dy = rng.standard_normal((2, 6, 6, 4)).astype(np.float32)
    dw = kernelgen.conv_backward_weight(torch.from_numpy(x), torch.from_numpy(dy), w.shape, padding=1)
    assert_close(dw.numpy(), ref.conv_backward_weight(x, dy, w.shape, padding=(1, 1)))


# --- empty problems, padding modes ----------------------------------------------------------------

def test_an_empty_batch_gives_an_empty_output_and_a_zero_weight_gradient(rng):
    x, w = np.empty((0, 6, 6, 3), np.float32), rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    y = kernelgen.conv(x, w, np.ones(4, np.float32), padding=1, activation="relu")
    assert y.shape == (0, 6, 6, 4) and y.dtype == np.float32
    dy = np.empty((0, 3, 3, 4), np.float32)
    assert kernelgen.conv_backward_data(dy, w, (0, 6, 6, 3), padding=1, stride=2).shape == (0, 6, 6, 3)
    dw = kernelgen.conv_backward_weight(x, dy, w.shape, padding=1, stride=2)
    assert dw.shape == w.shape and not dw.any()
    out = poisoned(w.shape)
    assert kernelgen.conv_backward_weight(x, dy, w.shape, padding=1, stride=2, out=out) is out and not out.any()
    assert kernelgen.deconv(np.empty((0, 3, 3, 3), np.float32), w.transpose(3, 1, 2, 0).copy(), stride=2).shape[0] == 0
    with pytest.raises(ValueError, match="nothing to compute"):
        kernelgen.explain(kernelgen.conv, x, w, padding=1)


def test_an_empty_spatial_size_gives_an_empty_output(rng):
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    assert kernelgen.conv(np.empty((2, 0, 6, 3), np.float32), w, padding=1).shape == (2, 0, 6, 4)
    assert kernelgen.conv(np.empty((2, 6, 0, 3), np.float32), w[:, :1, :1].copy()).shape == (2, 6, 0, 4)


@pytest.mark.parametrize("dilation", [1, 2])
def test_padding_same_and_valid_match_the_reference(rng, assert_close, dilation):
    x = rng.standard_normal((2, 9, 11, 3))
    w = rng.standard_normal((5, 3, 5, 3))
    pad = (dilation, 2 * dilation)
    same = kernelgen.conv(x, w, padding="same", dilation=dilation, backend="cpu")
    assert same.shape[1:3] == x.shape[1:3]
    assert_close(same, ref.conv_forward(x, w, padding=pad, dilation=(dilation, dilation)), "float64")
    valid = kernelgen.conv(x, w, padding="valid", dilation=dilation, backend="cpu")
    assert_close(valid, ref.conv_forward(x, w, padding=(0, 0), dilation=(dilation, dilation)), "float64")
    dy = rng.standard_normal(same.shape)
    assert_close(kernelgen.conv_backward_data(dy, w, x.shape, padding="same", dilation=dilation, backend="cpu"),
                 ref.conv_backward_data(dy, w, x.shape, padding=pad, dilation=(dilation, dilation)), "float64")


# --- read-only arrays, no GPU -----------------------------------------------------------------------

def test_read_only_out_is_refused_by_name(rng):
    x, w = _case(rng)
    out = np.zeros((2, 6, 6, 4), np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out must be writeable"):
        kernelgen.conv(x, w, padding=1, out=out, backend="cpu")


def test_read_only_inputs_reuse_the_kernel_of_writable_ones(rng, assert_close):
    """numba types a read-only array apart from a writable one: without a writable view, a second compile."""
    x, w = _case(rng, hw=5, c=2, k=3)
    kernelgen.conv(x, w, padding=1, backend="cpu")
    prep = next(p for p in api._PREPARED.values() if p.problem.x_shape == x.shape and p.plan is not None
                and p.backend == "cpu")
    before = len(prep.launcher.kernel.overloads)
    xr, wr = x.copy(), w.copy()
    xr.flags.writeable = wr.flags.writeable = False
    assert_close(kernelgen.conv(xr, wr, padding=1, backend="cpu"), ref.conv_forward(x, w, padding=(1, 1)))
    assert len(prep.launcher.kernel.overloads) == before == 1
    assert not xr.flags.writeable and not wr.flags.writeable


def test_backend_cuda_without_a_gpu_is_a_value_error(rng, monkeypatch):
    x, w = _case(rng)
    monkeypatch.setattr(settings, "_process", {**settings._process, "cuda_simulator": False})
    monkeypatch.setattr(api, "gpu_present", lambda: False)
    with pytest.raises(ValueError, match="backend='cuda' needs a CUDA GPU"):
        kernelgen.conv(x, w, padding=1, backend="cuda")


def test_readme_usage_example_runs(tmp_path, monkeypatch):
    """The README's first Python example, run as a user would paste it (on the CPU, shapes shrunk)."""
    text = (Path(__file__).parents[2] / "README.md").read_text()
    block = re.search(r"## Using it\s+```python\n(.*?)```", text, re.S).group(1)
    block = block.replace("8, 32, 32, 64", "2, 8, 8, 4").replace("128, 3, 3, 64", "6, 3, 3, 4")
    block = block.replace('backend="cuda"', 'backend="cpu"')
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "README.md", "exec"), {})
