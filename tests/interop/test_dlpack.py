"""DLPack and bfloat16 on the CPU backend: arrays of a framework kernelgen does not know (here a stand-in that only
speaks DLPack, as a JAX array does) are viewed without a copy, kept alive by their views, and computed like NumPy
arrays; bfloat16 tensors (torch, and DLPack's kDLBfloat) compute with precision="bf16" and come back bfloat16,
within 1e-2 of float64.  Each result is checked against the float64 reference on fresh data, written over a
NaN-poisoned out= where the call takes one.

The problem is test_torch_ops.PROBLEM_2D in channels-last layout, so its float64 kernel is shared.
"""
from __future__ import annotations

import gc

import numpy as np
import pytest

import kernelgen
from harness import DLPackProducer as Producer, assert_close, poisoned, random_array, reference
from kernelgen import arrays, dlpack
from kernelgen.storage import narrow_bits, widen_bits

torch = pytest.importorskip("torch")

KW = dict(stride=2, padding=1, dilation=2, groups=2)
X, W, Y = (2, 7, 7, 4), (6, 3, 3, 2), (2, 3, 3, 6)


def data_ptr(a):
    return a.data_ptr() if isinstance(a, torch.Tensor) else a.ctypes.data


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_dlpack_host_arrays_are_views(kind, rng):
    x = random_array(rng, X, "float64")
    source = torch.from_numpy(x) if kind == "torch" else x
    view = arrays.as_array_arg(Producer(source), "x")
    assert isinstance(view, np.ndarray) and view.ctypes.data == data_ptr(source) and view.shape == X


def test_dlpack_conv_matches_float64_reference(rng):
    x, w, b = (random_array(rng, s, "float64") for s in (X, W, (6,)))
    for _ in range(2):  # the second call too (kernelgen's dispatch cache must not keep the first one's view)
        out = poisoned(Y, "float64")
        got = kernelgen.conv(Producer(x), Producer(torch.from_numpy(w)), Producer(b), out=out, backend="cpu", **KW)
        assert got is out
        assert_close(out, reference("fwd", x, w, None, KW, bias=b))


def test_torch_cpu_tensors_in_and_out_without_copies(rng):
    x, w = (torch.from_numpy(random_array(rng, s, "float64")) for s in (X, W))
    out = torch.from_numpy(poisoned(Y, "float64"))
    got = kernelgen.conv(x, w, out=out, **KW)
    assert got is out
    assert_close(out.numpy(), reference("fwd", x.numpy(), w.numpy(), None, KW))
    assert arrays.host_view(x).ctypes.data == x.data_ptr()  # what the kernel reads: x's own memory


def test_a_view_keeps_the_producers_memory_alive(rng):
    values = random_array(rng, X, "float32")
    t = torch.from_numpy(values.copy()).bfloat16()
    expect = t.float().numpy()
    view = arrays.as_array_arg(Producer(t), "x")
    assert isinstance(view, dlpack.BFloat16Array) and view.bits.ctypes.data == t.data_ptr()
    del t
    gc.collect()
    np.testing.assert_array_equal(widen_bits(view.bits), expect)


def test_bfloat16_torch_tensors(rng):
    """torch bfloat16 in, bfloat16 out (and into a bfloat16 out=), within 1e-2 of float64 on the same values."""
    x, w, b = (torch.from_numpy(random_array(rng, s)).bfloat16() for s in (X, W, (6,)))
    want = reference("fwd", *(t.double().numpy() for t in (x, w)), None, KW, bias=b.double().numpy())
    y = kernelgen.conv(x, w, b, **KW)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16
    assert_close(y.float().numpy(), want, tol=1e-2)
    out = torch.full(Y, float("nan"), dtype=torch.bfloat16)
    assert kernelgen.conv(x, w, b, out=out, precision="bf16", **KW) is out
    assert torch.equal(out, y)
    # the same tensors as DLPack kDLBfloat arrays: the same kernel, so the same bits
    got = kernelgen.conv(Producer(x), Producer(w), Producer(b), **KW)
    assert isinstance(got, dlpack.BFloat16Array) and not got.on_device
    np.testing.assert_array_equal(got.bits, y.view(torch.int16).numpy().view(np.uint16))


def test_bfloat16_rounding_matches_torch(rng):
    values = np.concatenate([random_array(rng, 4096) * 10.0 ** rng.integers(-30, 30, 4096),
                             np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.4e38, -3.4e38, 1 + 2 ** -8,
                                       1 + 3 * 2 ** -8, 1 + 2 ** -8 + 2 ** -20], np.float32)]).astype(np.float32)
    got = narrow_bits(values)
    want = torch.from_numpy(values).bfloat16().view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(values)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert np.isnan(widen_bits(got[nan])).all()
    np.testing.assert_array_equal(widen_bits(want), torch.from_numpy(want.view(np.int16)).view(
        torch.bfloat16).float().numpy())


@pytest.mark.parametrize("call, exc, message", [
    (lambda x, w: kernelgen.conv(x, w.float()), TypeError, r"x must not be bfloat16 unless every tensor"),
    (lambda x, w: kernelgen.conv(x, w, precision="fp32"), ValueError, r'bfloat16 tensors need precision="bf16"'),
    (lambda x, w: kernelgen.conv(x, w, out=torch.zeros(2, 3, 3, 4)), TypeError, "out must have dtype bfloat16"),
    (lambda x, w: kernelgen.conv(Producer(x.float().numpy().astype(np.int32)), Producer(w.float().numpy())),
     TypeError, "x must have dtype float32"),
])
def test_refusals_before_any_kernel(call, exc, message, monkeypatch):
    def tripwire(plan):
        raise AssertionError(f"a bad call got as far as get_launcher: {plan.problem.key()}")
    monkeypatch.setattr(kernelgen.api, "get_launcher", tripwire)
    x, w = torch.ones(2, 5, 5, 3, dtype=torch.bfloat16), torch.ones(4, 3, 3, 3, dtype=torch.bfloat16)
    with pytest.raises(exc, match=message):
        call(x, w)


@pytest.mark.sim
def test_device_narrowing_in_the_simulator(rng):
    """The CUDA kernel that rounds a float32 workspace into bfloat16 bits (split backward-weight) against the host
    conversion."""
    from numba import cuda
    from kernelgen.runtime.narrow import narrow_device
    values = random_array(rng, 1000)
    dst = cuda.device_array(values.size, np.uint16)
    narrow_device(cuda.to_device(values), dst, bfloat16=True)
    np.testing.assert_array_equal(dst.copy_to_host(), narrow_bits(values))
