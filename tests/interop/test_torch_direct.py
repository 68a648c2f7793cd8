"""kernelgen.torch's direct launches (kernelgen/torch/direct.py) on the CPU, with a stand-in CUDA route: which calls
are kept, the kernel parameters' order, the output's layout, and every way back to kernelgen's op.  The GPU test
(tests/interop/test_interop_gpu.py::test_direct_launches_match_the_op) runs them on the H100 against float64."""
from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from kernelgen import api  # noqa: E402
from kernelgen.torch import direct  # noqa: E402


class StandInRoute:
    """runtime.cuda_call.CudaRoute as DirectRoute uses it: params, out_name, shape, dtype, fast.thread, launch()."""

    def __init__(self, params=("x", "w", "bias", "y"), shape=(2, 3, 3, 5), aligned=True):
        self.params, self.out_name, self.shape, self.dtype = params, "y", shape, "float32"
        self.torch_like = None  # (a real route from torch inputs has torch_empty and torch_like)
        self.fast = type("Fast", (), {"thread": threading.get_ident()})()
        self.aligned, self.launched = aligned, []

    def launch(self, addresses, nstream):
        self.launched.append(list(addresses))
        return self.aligned


@pytest.fixture
def route(monkeypatch):
    found = StandInRoute()
    monkeypatch.setattr(api, "cuda_route_of", lambda op, args, kwargs: found)
    direct.clear()
    yield found
    direct.clear()


def _channels_last(*shape):
    return torch.randn(*shape).contiguous(memory_format=torch.channels_last)


def test_a_kept_call_launches_by_address_in_the_kernels_order(route):
    x, w, b = _channels_last(2, 4, 3, 3), _channels_last(5, 4, 1, 1), torch.randn(5)
    key = direct.key("conv", (x, w, b), ((1, 1), (0, 0), (1, 1), 1), "fp32")
    assert direct.run(key, (x, w, b), None) is None  # nothing kept yet
    direct.keep(key, api.conv, (), {}, (x, w, b), ("x", "w", "bias"), views_only=True)
    y = direct.run(key, (x, w, b), None)
    assert y.shape == (2, 5, 3, 3) and y.is_contiguous(memory_format=torch.channels_last)
    assert route.launched == [[x.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr()]]
    other = _channels_last(2, 4, 3, 3)  # same key, other tensors: their addresses
    direct.run(direct.key("conv", (other, w, b), ((1, 1), (0, 0), (1, 1), 1), "fp32"), (other, w, b), None)
    assert route.launched[-1][0] == other.data_ptr() and len(route.launched) == 2


def test_the_key_tells_layouts_dtypes_hyper_parameters_and_precisions_apart():
    x, w = _channels_last(2, 4, 3, 3), _channels_last(5, 4, 1, 1)
    hyper = ((1, 1), (0, 0), (1, 1), 1)
    base = direct.key("conv", (x, w, None), hyper, "fp32")
    assert base == direct.key("conv", (x.clone(), w, None), hyper, "fp32")
    assert len({base, direct.key("conv", (x.contiguous(), w, None), hyper, "fp32"),
                direct.key("conv", (x.double(), w, None), hyper, "fp32"),
                direct.key("conv", (x, w, None), ((2, 2), (0, 0), (1, 1), 1), "fp32"),
                direct.key("conv", (x, w, None), hyper, "tf32"),
                direct.key("conv_backward_data", (x, w, None), hyper, "fp32")}) == 6


def test_calls_that_copied_a_tensor_or_record_are_not_kept(route):
    x, w = torch.randn(2, 4, 3, 3), _channels_last(5, 4, 1, 1)  # x NCHW: kernelgen's op read a copy
    key = direct.key("conv", (x, w, None), ((1, 1), (0, 0), (1, 1), 1), "fp32")
    direct.keep(key, api.conv, (), {}, (x, w, None), ("x", "w", "bias"), views_only=False)
    assert direct.run(key, (x, w, None), None) is None
    token = api.RECORDING.set([])
    try:
        direct.keep(key, api.conv, (), {}, (x, w, None), ("x", "w", "bias"), views_only=True)
    finally:
        api.RECORDING.reset(token)
    assert direct.run(key, (x, w, None), None) is None and route.launched == []


def test_another_thread_an_unaligned_address_or_an_unknown_parameter_go_back_to_the_op(route):
    x, w = _channels_last(2, 4, 3, 3), _channels_last(5, 4, 1, 1)
    key = direct.key("conv", (x, w, None), ((1, 1), (0, 0), (1, 1), 1), "fp32")
    route.params = ("x", "w", "y")
    direct.keep(key, api.conv, (), {}, (x, w, None), ("x", "w", "bias"), views_only=True)
    seen = []
    worker = threading.Thread(target=lambda: seen.append(direct.run(key, (x, w, None), None)))
    worker.start()
    worker.join()
    assert seen == [None] and route.launched == []
    route.aligned = False
    assert direct.run(key, (x, w, None), None) is None and len(route.launched) == 1
    route.params = ("x", "w", "bias", "y")  # a parameter the call does not give (bias None): never kept
    direct.clear()
    direct.keep(key, api.conv, (), {}, (x, w, None), ("x", "w", "bias"), views_only=True)
    assert direct.run(key, (x, w, None), None) is None
    route.params = ("x", "w", "scale", "y")  # a parameter the call does not name: never kept
    direct.keep(key, api.conv, (), {}, (x, w, None), ("x", "w", "bias"), views_only=True)
    assert direct.run(key, (x, w, None), None) is None
