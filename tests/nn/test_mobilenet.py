"""MobileNetV2 and the MBConv block (kernelgen/nn/mobilenet.py, issue 28) against PyTorch in float64.

The same network is built in torch by mobilenet.as_torch with copies of the weights; both run a forward and a
backward on fresh random data (kernelgen in float32 on the CPU backend, every depthwise convolution on the direct
depthwise template; torch in float64 on the CPU), and the outputs and the gradients of the input and of every
weight are compared.  The networks are shortened (a few inverted residual rows) so that the numba kernels compile in
seconds; the full network's structure is checked by its parameter count against torchvision's.
"""
import numpy as np
import pytest
from harness import rel_err

from kernelgen.nn import Tensor, mobilenet
from kernelgen.nn.mobilenet import InvertedResidual, MBConv, MobileNetV2, relu6
from kernelgen.nn.modules import Conv2d
from kernelgen.planner import make_plan
from kernelgen.problem import make_problem

torch = pytest.importorskip("torch")
TOL = 2e-4  # float32 against float64 through a dozen layers, batch norm over 4 x 8 x 8 pixels


def nchw(a):
    return torch.tensor(np.ascontiguousarray(a.transpose(0, 3, 1, 2)), dtype=torch.float64, requires_grad=True)


def host(a):
    return a if isinstance(a, np.ndarray) else a.copy_to_host()


def compare(model, x, rng, device="cpu"):
    """Forward + backward of sum(output * a random projection) in both frameworks (ours on `device`: "cuda" moves
    the model, the input and the projection there); outputs and gradients (the input's and every convolution
    weight's, in kernelgen's (K, R, S, C / g) layout) within TOL."""
    theirs = mobilenet.as_torch(torch, model, torch.float64)
    xt = nchw(x)
    want = theirs(xt)
    xk = Tensor(x, requires_grad=True)
    if device == "cuda":
        from kernelgen.nn import cuda_ops
        model.to("cuda")
        xk = xk.cuda()
    got = model(xk)
    proj = rng.standard_normal(got.shape).astype(np.float32)
    got.backward(proj if device == "cpu" else cuda_ops.to_device(proj))
    perm = (0, 2, 3, 1) if want.dim() == 4 else (0, 1)
    (want * torch.tensor(proj.transpose(*np.argsort(perm)) if want.dim() == 4 else proj, dtype=torch.float64)).sum()\
        .backward()
    assert rel_err(got.numpy(), want.detach().numpy().transpose(*perm)) <= TOL
    assert rel_err(host(xk.grad), xt.grad.numpy().transpose(0, 2, 3, 1)) <= TOL
    ours = [p for p in model.parameters() if p.data.ndim == 4]
    mine = [m for m in theirs.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(ours) == len(mine) > 0
    for p, m in zip(sorted(ours, key=lambda p: p.data.shape), sorted(mine, key=lambda m: _kernelgen_shape(m))):
        assert rel_err(host(p.grad), m.weight.grad.numpy().transpose(0, 2, 3, 1)) <= TOL, p.data.shape


def _kernelgen_shape(m):
    k, c, r, s = m.weight.shape
    return (k, r, s, c)


def test_inverted_residual_matches_torch_in_float64(rng):
    block = InvertedResidual(8, 8, 1, 1, rng, "cpu")
    assert block.residual and [m.kw["groups"] for m in _convs(block)] == [8, 1]
    compare(block, rng.standard_normal((2, 7, 7, 8)).astype(np.float32), rng)


@pytest.mark.parametrize("shape", [pytest.param((1, 4, 5, 8), marks=pytest.mark.sim, id="sim"),
                                   pytest.param((8, 28, 28, 64), marks=pytest.mark.gpu, id="gpu")])
def test_mbconv_on_the_device_matches_torch_in_float64(rng, shape):
    """An MBConv block (5x5 depthwise, squeeze-excite, residual) on the device: the depthwise template's CUDA
    kernels, relu6 / SiLU / broadcast multiply and batch norm of kernelgen.nn's device ops."""
    compare(MBConv(shape[-1], shape[-1], 5, 1, 2, rng=rng), rng.standard_normal(shape).astype(np.float32), rng,
            "cuda")


@pytest.mark.slow
def test_mobilenet_v2_step_matches_torch_in_float64(rng):
    """A cifar-stem MobileNetV2 of three rows: t = 1, a residual pair, a stride-2 row (the cifar stem keeps the first
    stride-2 row at stride 1), 16x16 inputs."""
    model = MobileNetV2(10, stem="cifar", settings=((1, 8, 1, 1), (6, 8, 2, 2), (6, 16, 1, 2)), dropout=0.0,
                        seed=int(rng.integers(1 << 30)))
    dw = [m for m in _convs(model) if m.kw["groups"] > 1]
    assert [m.kw["stride"] for m in dw] == [1, 1, 1, 2] and all(m.kw["groups"] == m.in_channels for m in dw)
    x = rng.standard_normal((4, 16, 16, 3)).astype(np.float32)
    compare(model, x, rng)


@pytest.mark.slow
@pytest.mark.parametrize("k, stride, expand", [(5, 1, 4), (3, 2, 1)])
def test_mbconv_matches_torch_in_float64(rng, k, stride, expand):
    block = MBConv(8, 8, k, stride, expand, rng=rng)
    assert block.residual == (stride == 1)
    compare(block, rng.standard_normal((2, 9, 9, 8)).astype(np.float32), rng)


def _convs(module):
    out = [module] if isinstance(module, Conv2d) else []
    for child in module.children():
        out += _convs(child)
    return out


def test_full_mobilenet_v2_has_torchvisions_parameters_and_depthwise_plans():
    model = MobileNetV2(1000)
    assert sum(p.data.size for p in model.parameters()) == 3_504_872  # torchvision.models.mobilenet_v2()
    dw = [m for m in _convs(model) if m.kw["groups"] > 1]
    assert len(dw) == 17 and {m.weight.shape[1:] for m in dw} == {(3, 3, 1)}
    p = make_problem("fwd", (128, 56, 56, 144), dw[2].weight.shape, padding=1, groups=144)
    assert make_plan(p, "cuda").variant == "depthwise"
    assert MobileNetV2(10, stem="cifar", width=0.5).classifier.weight.shape == (10, 1280)
    with pytest.raises(ValueError, match="stem"):
        MobileNetV2(stem="tiny")
    with pytest.raises(ValueError, match="width"):
        MobileNetV2(width=0)


def test_relu6_clips_and_passes_gradient_inside(rng):
    x = Tensor(np.array([-1.0, 0.0, 3.0, 6.0, 7.5], np.float32), requires_grad=True)
    y = relu6(x)
    y.backward(np.ones(5, np.float32))
    assert y.numpy().tolist() == [0.0, 0.0, 3.0, 6.0, 6.0] and x.grad.tolist() == [0.0, 0.0, 1.0, 0.0, 0.0]


@pytest.mark.sim
def test_relu6_on_the_device_matches_the_host(rng):
    x = rng.standard_normal(300).astype(np.float32) * 5
    g = rng.standard_normal(300).astype(np.float32)
    host, dev = Tensor(x, requires_grad=True), Tensor(x, requires_grad=True).to("cuda")
    dev.requires_grad = True
    relu6(host).backward(g)
    y = relu6(dev)
    y.backward(Tensor(g).to("cuda").data)
    assert np.array_equal(y.numpy(), np.clip(x, 0, 6)) and np.array_equal(dev.grad.copy_to_host(), host.grad)


def test_bench_step_builds_mobilenet_v2_and_its_torch_twin():
    from argparse import Namespace
    from kernelgen.nn import bench_step
    small = bench_step.build_model(Namespace(model="mobilenet_v2", classes=10, image=32, width=64))
    large = bench_step.build_model(Namespace(model="mobilenet_v2", classes=10, image=224, width=64))
    assert small.features.layers[0].layers[0].kw["stride"] == 1 and large.features.layers[0].layers[0].kw["stride"] == 2
    assert bench_step.describe(Namespace(model="mobilenet_v2", image=224)) == "MobileNetV2 (width 1.0, ImageNet stem)"
    twin = mobilenet.as_torch(torch, large)
    assert sum(p.numel() for p in twin.parameters()) == sum(p.data.size for p in large.parameters())
    assert type(bench_step.build_model(Namespace(classes=10, width=8, image=32))).__name__ == "ResNet"
