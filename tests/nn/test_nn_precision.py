"""Mixed precision in the nn layer (kernelgen/nn/mixed_precision.py): convolutions in tf32 / fp16 / bf16 on
the CPU backend's tensor-core emulation, parameters and gradients float32.

Every test uses the same problem (batch 2, 8x8 maps, 8 -> 16 channels, 3x3, padding 1), and a transposed
layer 16 -> 8 whose deconvolution and gradients are that problem's backward-data, forward and
backward-weight, so each precision compiles three kernels once for the whole file."""
from __future__ import annotations

import numpy as np
import pytest

import kernelgen
from kernelgen import reference as ref
from kernelgen.nn import SGD, Conv2d, ConvTranspose2d, GlobalAvgPool, Linear, ReLU, Sequential, Tensor, precision
from kernelgen.nn import functional as F
from harness import TOLERANCE, norm_err

X_SHAPE, C_IN, C_OUT = (2, 8, 8, 8), 8, 16
FP32_ERROR_CEILING = 1e-5  # 50x the fp32 kernels' error on this problem, 1/20 of the tensor cores'


def random_layer(kind, rng, layer_precision):
    if kind == "conv":
        layer = Conv2d(C_IN, C_OUT, 3, padding=1, rng=rng, precision=layer_precision)
    else:
        layer = ConvTranspose2d(C_OUT, C_IN, 3, padding=1, rng=rng, precision=layer_precision)
    layer.bias.data[:] = rng.standard_normal(layer.bias.shape)  # not the zeros it starts with
    return layer


def run(layer, x, g):
    """(y, dx, dw) of one forward and backward with upstream gradient g."""
    xt = Tensor(x, requires_grad=True)
    layer.weight.grad = layer.bias.grad = None
    y = layer(xt)
    y.backward(g)
    return y.data, xt.grad, layer.weight.grad


def float64_reference(kind, layer, x, g):
    x, w, b, g = (np.asarray(a, np.float64) for a in (x, layer.weight.data, layer.bias.data, g))
    if kind == "conv":
        return (ref.conv_forward(x, w, b, padding=1), ref.conv_backward_data(g, w, x.shape, padding=1),
                ref.conv_backward_weight(x, g, w.shape, padding=1))
    # conv_transpose is conv's backward-data: its gradients are conv's forward and backward-weight
    return (ref.deconv(x, w, b, padding=1), ref.conv_forward(g, w, padding=1),
            ref.conv_backward_weight(g, x, w.shape, padding=1))


def inputs(kind, rng):
    x_shape = X_SHAPE if kind == "conv" else X_SHAPE[:-1] + (C_OUT,)
    g_shape = x_shape[:-1] + (C_OUT if kind == "conv" else C_IN,)
    return (rng.standard_normal(x_shape).astype(np.float32), rng.standard_normal(g_shape).astype(np.float32))


@pytest.mark.parametrize("kind", ["conv", "conv_transpose"])
@pytest.mark.parametrize("prec", [pytest.param("tf32", marks=pytest.mark.slow), "fp16",
                                  pytest.param("bf16", marks=pytest.mark.slow)])  # (CI time; bf16: the fp16 paths on
# bf16 operands, tests/templates/test_bf16_storage.py; tf32: a float32 layer's tensor-core kernels, test_tensor_core.py)
def test_layer_and_gradients_within_the_bounds_and_not_fp32(kind, prec, rng, spy):
    layer = random_layer(kind, rng, prec)
    x, g = inputs(kind, rng)
    got = run(layer, x, g)
    assert spy == [prec] * 3  # forward, backward-data, backward-weight
    for name, a, want in zip(("y", "dx", "dw"), got, float64_reference(kind, layer, x, g)):
        assert a.dtype == np.float32, name
        assert norm_err(a, want) <= TOLERANCE[prec], f"{name}: {norm_err(a, want):.3g} from float64"
        # fp32 kernels are ~2e-7 from float64 here, these ~2e-4 (tf32, fp16) and ~2e-3 (bf16): the operands
        # were rounded, so the precision reached the kernel (a fp32 twin run would cost three compiles)
        assert norm_err(a, want) > FP32_ERROR_CEILING, f"{name}: {norm_err(a, want):.3g}, as if in fp32"


@pytest.fixture
def spy(monkeypatch):
    """The precision= of every kernelgen convolution the nn layer runs, in order."""
    seen = []
    for name in ("conv", "conv_backward_data", "conv_backward_weight", "deconv"):
        def recording(*args, _real=getattr(kernelgen, name), **kw):
            seen.append(kw["precision"])
            return _real(*args, **kw)
        monkeypatch.setattr(kernelgen, name, recording)
    return seen


def test_backward_uses_the_forward_precision(rng, spy):
    layer = random_layer("conv", rng, None)  # no precision of its own: the block's setting
    x, g = inputs("conv", rng)

    def grads(setting_at_backward):
        xt = Tensor(x, requires_grad=True)
        layer.weight.grad = None
        with precision("fp16"):
            y = layer(xt)
        with precision(setting_at_backward):
            y.backward(g)
        return xt.grad, layer.weight.grad

    want = grads("fp16")
    del spy[:]
    got = grads("bf16")
    assert spy == ["fp16"] * 3
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_layer_precision_wins_over_the_block_which_is_restored(rng, spy):
    layer = random_layer("conv", rng, "bf16")
    x, g = inputs("conv", rng)
    before = kernelgen.get_precision()
    with precision("fp16"):
        assert kernelgen.get_precision() == "fp16"
        y = layer(Tensor(x, requires_grad=True))
    y.backward(g)
    assert spy == ["bf16"] * 3 and kernelgen.get_precision() == before


def test_sgd_steps_in_fp16_reduce_the_loss_and_keep_fp32_master_weights(rng):
    net = Sequential(Conv2d(C_IN, C_OUT, 3, padding=1, rng=rng, precision="fp16"), ReLU(), GlobalAvgPool(),
                     Linear(C_OUT, 3, rng=rng))
    x, labels = rng.standard_normal(X_SHAPE).astype(np.float32), rng.integers(0, 3, X_SHAPE[0])
    opt = SGD(net.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(8):
        loss = F.cross_entropy(net(Tensor(x)), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    for p, v in zip(opt.params, opt.velocity):
        assert p.data.dtype == p.grad.dtype == v.dtype == np.float32


def test_bad_precision_raises_naming_the_argument(rng):
    with pytest.raises(ValueError, match="precision must be one of"):
        Conv2d(C_IN, C_OUT, 3, precision="fp8")
    with pytest.raises(ValueError, match="precision must be one of"):
        ConvTranspose2d(C_OUT, C_IN, 3, precision="half")
    x, w = inputs("conv", rng)[0], rng.standard_normal((C_OUT, 3, 3, C_IN)).astype(np.float32)
    with pytest.raises(ValueError, match="precision must be one of"):
        F.conv(x, w, precision="float16")
    before = kernelgen.get_precision()
    with pytest.raises(ValueError, match="precision must be one of"):
        with precision("tf16"):
            pass
    assert kernelgen.get_precision() == before


def test_train_command_passes_the_precision_and_reports_it(monkeypatch, capsys):
    from kernelgen.nn import train
    calls = []
    monkeypatch.setattr(train, "train_digits", lambda **kw: calls.append(kw) or (None, [(0.5, 0.9)]))
    assert train.main(["digits", "--epochs", "1", "--precision", "bf16"]) == 0
    assert calls[0]["precision"] == "bf16" and "precision bf16" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        train.main(["digits", "--precision", "fp8"])
