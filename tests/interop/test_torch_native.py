"""kernelgen.torch's native entry point (kernelgen/torch/native.cpp, native.py) on the CPU: the extension built with
torch's C++ tools, its replay of kept driver steps (stand-in driver functions), every way back to Python's fallback,
and a converted module's forward and backward through the C++ autograd Function against float64 (on the CPU its
fallback runs kernelgen's CPU backend on every call).  The GPU test (test_interop_gpu.py::
test_native_path_matches_float64_and_keeps_its_programs) runs the replay on the H100."""
from __future__ import annotations

import ctypes
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kernelgen  # noqa: E402
import kernelgen.torch as kt  # noqa: E402
from kernelgen.torch import native  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("ninja") is None or shutil.which("c++") is None,
                                reason="torch's C++ extension build needs ninja and a C++ compiler")


@pytest.fixture(scope="module")
def ext():
    assert native.wait(1200), native.status()
    return native._EXT


DRIVER = ctypes.CFUNCTYPE(ctypes.c_int, *[ctypes.c_uint64] * 11)


class StandInDriver:
    """A driver function C++ can call: records its arguments, returns `result`."""

    def __init__(self, result=0):
        self.calls, self.result = [], result
        self.fn = DRIVER(self._call)
        self.address = ctypes.cast(self.fn, ctypes.c_void_p).value

    def _call(self, *args):
        self.calls.append(args)
        return self.result


class Fallbacks:
    def __init__(self):
        self.calls = []

    def __call__(self, slot, key, inputs, out):
        self.calls.append((slot, [None if t is None else t.data_ptr() for t in inputs], out.data_ptr(), key[0]))


class Refreshes:
    """NativePlan.refresh's stand-in: records (slot, key), answers `count` (None: the program is gone)."""

    def __init__(self, count=None):
        self.calls, self.count = [], count

    def __call__(self, slot, key):
        self.calls.append((slot, key))
        return self.count


def _plan(ext, fallback, refresh=None):
    return ext.new_plan("float32", [[2, 3], [2, 3], [2, 3]], fallback, refresh or Refreshes())


def test_kept_steps_replay_on_their_addresses_and_anything_else_falls_back(ext):
    driver, fallback = StandInDriver(), Fallbacks()
    plan = _plan(ext, fallback)
    a, b, out = torch.zeros(4), torch.zeros(4), torch.zeros(4)
    key = [7, a.data_ptr(), b.data_ptr(), 0, out.data_ptr()]
    assert ext.keep(plan, 1, key, [(driver.address, [1, 2, 3]), (driver.address, list(range(11)))], 0, 0)
    ext.run(plan, 1, [a, b, None], out, 7)
    assert driver.calls == [(1, 2, 3) + (0,) * 8, tuple(range(11))] and not fallback.calls
    other = torch.zeros(4)
    ext.run(plan, 1, [a, b, None], other, 7)  # another output address
    ext.run(plan, 1, [a, b, None], out, 8)  # another stream
    ext.run(plan, 0, [a, b, None], out, 7)  # another slot
    assert len(driver.calls) == 2
    assert [c[0] for c in fallback.calls] == [1, 1, 0]
    assert fallback.calls[0] == (1, [a.data_ptr(), b.data_ptr(), None], other.data_ptr(), 7)
    assert ext.programs(plan, 1) == 1 and ext.programs(plan, 0) == 0


def test_a_program_with_maps_reads_them_again_after_a_ring_upload(ext):
    """Where the ring uploaded since the program read its maps, Python reads them again (refresh) and C++ replays
    once the count refresh answers is the ring's; where refresh has no such program, the op runs (fallback)."""
    driver, fallback, refresh = StandInDriver(), Fallbacks(), Refreshes(count=6)
    plan = _plan(ext, fallback, refresh)
    uploads = (ctypes.c_int64 * 1)(5)
    a, out = torch.zeros(2), torch.zeros(2)
    key = [0, a.data_ptr(), 0, 0, out.data_ptr()]
    ext.keep(plan, 0, key, [(driver.address, [9])], ctypes.addressof(uploads), 5)
    ext.run(plan, 0, [a], out, 0)
    assert len(driver.calls) == 1 and not refresh.calls
    uploads[0] = 6  # a map uploaded since: the slot may hold another map now
    ext.run(plan, 0, [a], out, 0)
    assert refresh.calls == [(0, tuple(key))] and len(driver.calls) == 2 and not fallback.calls
    ext.run(plan, 0, [a], out, 0)  # read at 6: replays without asking again
    assert len(refresh.calls) == 1 and len(driver.calls) == 3
    uploads[0] = 7
    refresh.count = None  # Python's copy gone: the op
    ext.run(plan, 0, [a], out, 0)
    assert len(driver.calls) == 3 and len(fallback.calls) == 1
    refresh.count = 8  # read while the ring uploaded again (8, not 7): not replayed on a count it never read at
    uploads[0] = 9
    ext.run(plan, 0, [a], out, 0)
    assert len(driver.calls) == 3 and len(fallback.calls) == 2


def test_a_failed_driver_call_raises_and_a_full_slot_starts_again(ext):
    failing, fallback = StandInDriver(result=700), Fallbacks()
    plan = _plan(ext, fallback)
    a, out = torch.zeros(2), torch.zeros(2)
    ext.keep(plan, 2, [0, a.data_ptr(), 0, 0, out.data_ptr()], [(failing.address, [])], 0, 0)
    with pytest.raises(RuntimeError, match="CUDA error 700"):
        ext.run(plan, 2, [a], out, 0)
    kept = [ext.keep(plan, 0, [0, i, 0, 0, 0], [], 0, 0) for i in range(65)]
    assert all(kept[:64]) and not kept[64] and ext.programs(plan, 0) == 1


@pytest.fixture
def on_cpu(ext, monkeypatch):
    monkeypatch.setattr(native, "DEVICES", ("cuda", "cpu"))


def _reference(x, w, b, stride, padding, dilation, groups, dy):
    x, w = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b = None if b is None else b.detach().double().requires_grad_()
    y = torch.nn.functional.conv2d(x, w, b, stride, padding, dilation, groups)
    y.backward(dy.double())
    return y.detach(), x.grad, w.grad, None if b is None else b.grad


@pytest.mark.parametrize("channels_last, bias, stride, groups", [
    (True, False, 1, 1), (False, True, 2, 1), (True, True, 1, 2)])
def test_a_module_trains_through_the_native_function(on_cpu, channels_last, bias, stride, groups):
    """Forward, input, weight and bias gradients through the C++ Function (kernelgen's CPU backend underneath)
    against torch's float64 convolution on fresh random data; an NCHW input is made channels-last in C++."""
    rng = np.random.default_rng()
    conv = kt.Conv2d(4, 6, 3, stride=stride, padding=1, bias=bias, groups=groups).double()
    x = torch.from_numpy(rng.standard_normal((2, 4, 7, 6)))
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    y = conv(x)
    assert any(isinstance(p, native.NativePlan) for p in native.plans_of(conv).values())
    dy = torch.from_numpy(rng.standard_normal(tuple(y.shape)))
    y.backward(dy)
    ref_y, ref_dx, ref_dw, ref_db = _reference(x, conv.weight, conv.bias, stride, 1, 1, groups, dy)
    np.testing.assert_allclose(y.detach().numpy(), ref_y.numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(x.grad.numpy(), ref_dx.numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(conv.weight.grad.numpy(), ref_dw.numpy(), rtol=1e-10, atol=1e-10)
    if bias:
        np.testing.assert_allclose(conv.bias.grad.numpy(), ref_db.numpy(), rtol=1e-10, atol=1e-10)


def test_only_the_gradients_asked_for_are_computed(on_cpu, monkeypatch):
    slots = []
    real = native.NativePlan.fallback
    monkeypatch.setattr(native.NativePlan, "fallback", lambda self, slot, *a: (slots.append(slot), real(self, slot, *a)))
    conv = kt.Conv2d(3, 5, 3, padding=1, bias=False).double()
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)  # no grad: the backward-data slot never runs
    conv(x).sum().backward()
    assert slots == [native.FWD, native.BWD_WEIGHT]
    conv.weight.requires_grad_(False)
    with torch.no_grad():
        conv(x)
    assert slots[-1] == native.FWD


def test_the_setting_off_and_recordings_take_the_python_path(on_cpu):
    conv = kt.Conv2d(3, 5, 1).double()
    x = torch.randn(1, 3, 4, 4, dtype=torch.float64)
    with kernelgen.settings.scope(torch_native=False):
        y = conv(x)
    assert not any(isinstance(p, native.NativePlan) for p in native.plans_of(conv).values())
    np.testing.assert_allclose(y.detach().numpy(), torch.nn.functional.conv2d(x, conv.weight, conv.bias).detach()
                               .numpy(), rtol=1e-10)
    assert native.forward(conv, x.unsqueeze(0)[0], conv.weight, conv.bias) is not None  # (back on)


def test_a_module_that_ran_natively_still_copies_and_pickles(on_cpu):
    """The plans live beside the module (native.plans_of), not in it: deepcopy, pickle and torch.save see torch's
    module only, and the copy gets plans of its own."""
    import copy
    import io
    import pickle
    conv = kt.Conv2d(3, 4, 3, padding=1).double()
    x = torch.randn(1, 3, 5, 5, dtype=torch.float64)
    y = conv(x)
    assert native.plans_of(conv)
    twin = copy.deepcopy(conv)
    again = pickle.loads(pickle.dumps(conv))
    torch.save(conv, io.BytesIO())
    for other in (twin, again):
        assert not native.plans_of(other)
        np.testing.assert_allclose(other(x).detach().numpy(), y.detach().numpy(), rtol=1e-12)
        assert native.plans_of(other)



def test_inference_and_no_grad_calls(on_cpu):
    conv = kt.Conv2d(3, 4, 3, padding=1).double()
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    want = torch.nn.functional.conv2d(x, conv.weight.detach(), conv.bias.detach(), padding=1)
    with torch.inference_mode():
        got = conv(x)
    with torch.no_grad():
        again = conv(x)
    assert native.plans_of(conv) and not got.requires_grad and not again.requires_grad
    for y in (got, again):
        np.testing.assert_allclose(y.numpy(), want.numpy(), rtol=1e-10, atol=1e-12)
