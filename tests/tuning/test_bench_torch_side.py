"""The bench's torch side on the CPU: the tensors and arguments it gives torch (channels-last memory, conv1d /
conv2d / conv3d, per-dim stride / padding / dilation, groups, transposed) checked against kernelgen's float64
reference on tiny versions of the layer kinds of the `unseen` table; and the depthwise rows' separate geo-means.
The cuDNN runs themselves need a GPU (scripts/gpu_run.sh)."""
from __future__ import annotations

import numpy as np
import pytest

from kernelgen import reference
from kernelgen.tuning import bench
from kernelgen.tuning.shapes import Layer

TINY = {  # each a small stand-in for a family of the unseen table
    "1d": {"dims": 1, "N": 2, "W": 13, "C": 4, "K": 6, "S": 5, "stride": 2, "padding": 2},
    "1d_dilated": {"dims": 1, "N": 2, "W": 17, "C": 3, "K": 5, "S": 3, "padding": 4, "dilation": 4},
    "3d": {"dims": 3, "N": 2, "D": 4, "H": 5, "W": 6, "C": 3, "K": 4, "T": 3, "R": 3, "S": 3, "padding": [1, 1, 0],
           "stride": [1, 2, 1]},
    "3d_temporal": {"dims": 3, "N": 1, "D": 6, "H": 3, "W": 4, "C": 5, "K": 3, "T": 3, "R": 1, "S": 1,
                    "stride": [2, 1, 1], "padding": [1, 0, 0]},
    "grouped": {"N": 2, "H": 6, "W": 7, "C": 8, "K": 12, "R": 3, "padding": 1, "stride": 2, "groups": 4},
    "depthwise": {"N": 2, "H": 6, "W": 6, "C": 6, "K": 6, "R": 5, "padding": 2, "groups": 6},
    "dilated": {"N": 2, "H": 11, "W": 12, "C": 4, "K": 5, "R": 3, "padding": [2, 3], "dilation": [2, 3]},
    "1x7": {"N": 2, "H": 5, "W": 9, "C": 3, "K": 4, "R": 1, "S": 7, "padding": [0, 3]},
    "transposed": {"N": 2, "H": 4, "W": 5, "C": 6, "K": 4, "R": 4, "stride": 2, "padding": 1,
                   "output_padding": [0, 1], "groups": 2, "transposed": True},
    "transposed_1d": {"dims": 1, "N": 2, "W": 5, "C": 4, "K": 6, "S": 4, "stride": 3, "padding": 1,
                      "output_padding": 2, "transposed": True},
}
LAYERS = {name: Layer.from_dict({"name": name, **d}) for name, d in TINY.items()}


@pytest.fixture(scope="module")
def cpu_torch():
    return pytest.importorskip("torch")


def _reference(layer, direction, x, w, dy):
    """What kernelgen computes for the layer in `direction`, in float64 (a transposed layer: its deconvolution)."""
    kw = dict(stride=layer.stride, padding=layer.padding, dilation=layer.dilation, groups=layer.groups)
    if layer.transposed:
        return reference.deconv(dy, w, output_padding=layer.output_padding, **kw)
    if direction == "fwd":
        return reference.conv_forward(x, w, **kw)
    if direction == "bwd_data":
        return reference.conv_backward_data(dy, w, x.shape, **kw)
    return reference.conv_backward_weight(x, dy, w.shape, **kw)


def _cases():
    return [pytest.param(layer, direction, id=f"{name}-{direction}") for name, layer in LAYERS.items()
            for direction in (("fwd",) if layer.transposed else ("fwd", "bwd_data", "bwd_weight"))]


@pytest.mark.parametrize("layer, direction", _cases())
def test_torch_call_matches_the_reference(cpu_torch, layer, direction):
    """The bench's torch call on channels_first views of kernelgen's channels-last tensors gives, back in
    channels-last, what kernelgen's reference gives for the layer's problem (float64: only the arguments differ)."""
    torch = cpu_torch
    p = layer.problem(direction, "float64")
    rng = np.random.default_rng(0)
    x, w, dy = (rng.standard_normal(s) for s in (p.x_shape, p.w_shape, p.y_shape))
    views = [bench.channels_first(torch.from_numpy(a)) for a in (x, w, dy)]
    got = bench.torch_result(bench.torch_conv_call(torch, layer, direction, *views)(), direction)
    want = _reference(layer, direction, x, w, dy)
    assert tuple(got.shape) == want.shape == p.output_shape
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("shape, memory_format", [((2, 9, 3), None), ((2, 5, 6, 3), "channels_last"),
                                                  ((2, 4, 5, 6, 3), "channels_last_3d")])
@pytest.mark.parametrize("cudnn_dtype, storage", [(None, "float32"), ("float16", "float16")])
def test_tensors_are_channels_last_memory(cpu_torch, monkeypatch, shape, memory_format, cudnn_dtype, storage):
    """TorchConv.nhwc: kernelgen's contiguous NWC / NHWC / NDHWC tensor and torch's channels-first view of the same
    memory (channels_last / channels_last_3d to torch), at fp32 and at fp16 (float16 both)."""
    torch = cpu_torch
    for flag in (torch.backends.cudnn, torch.backends.cuda.matmul):  # TorchConv sets torch's global switches
        monkeypatch.setattr(flag, "allow_tf32", flag.allow_tf32)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
    tc = bench.TorchConv(dtype=cudnn_dtype, device="cpu")
    k, view = tc.nhwc(shape, torch.Generator().manual_seed(0), storage)
    assert k.is_contiguous() and k.dtype == getattr(torch, storage) and tuple(k.shape) == shape
    assert tuple(view.shape) == (shape[0], shape[-1], *shape[1:-1])
    assert view.data_ptr() == k.data_ptr() and view.dtype == k.dtype
    if memory_format:
        assert view.is_contiguous(memory_format=getattr(torch, memory_format))
    else:  # 1D: channels innermost, as NWC
        assert view.stride() == (shape[1] * shape[2], 1, shape[2])
    assert torch.equal(bench.channels_last(view), k)


def _row(layer, direction, ratio, **extra):
    """A measured row as bench_problem writes it (only the fields the summary and the table read)."""
    return {"layer": layer, "direction": direction, "variant": "implicit_gemm", "config": "cfg", "ratio": ratio,
            "kernelgen_tflops": 1.0, "cudnn_tflops": ratio, "pct_of_floor": 0.5, "rel_err_vs_cudnn": 1e-7,
            "precision": "fp32", **extra}


def test_depthwise_rows_have_geo_means_of_their_own():
    rows = [_row("a", "fwd", 2.0), _row("b", "fwd", 0.5), _row("dw", "fwd", 0.01, depthwise=True),
            {"layer": "dw", "direction": "bwd_data", "depthwise": True, "error": "plan: no"},
            _row("t", "deconv", 4.0)]
    summ = bench.summary(rows)
    assert summ["fwd"] == {"geomean_ratio": pytest.approx(1.0), "n": 2}  # the depthwise 0.01 left out
    assert summ["depthwise fwd"] == {"geomean_ratio": pytest.approx(0.01), "n": 1}
    assert summ["deconv"]["n"] == 1 and "depthwise deconv" not in summ and "depthwise bwd_data" not in summ
    md = bench.markdown(rows, summ)
    assert "| dw (depthwise) | fwd |" in md and "depthwise fwd: **0.010** over 1 (not in the geo-means above)" in md


def test_rows_name_the_layer_kind():
    row = bench._row_base(LAYERS["depthwise"], "fwd", {"forced": "implicit_gemm"})
    assert row["depthwise"] is True and row["forced"] == "implicit_gemm" and row["shape"].endswith(" g6")
    assert bench._row_base(LAYERS["transposed_1d"], "fwd", {})["direction"] == "deconv"
    assert "depthwise" not in bench._row_base(LAYERS["grouped"], "fwd", {})
