"""kernelgen.torch's modules and convert(): a small ResNet-like network converted in place computes torch's outputs and
gradients (float64 on the CPU backend, so a wrong term cannot hide in rounding), state_dicts round-trip with torch's
modules, weights stay channels-last through load_state_dict and optimiser steps, and torch.compile runs the
converted network (marked slow: Inductor's CPU compile takes minutes on a loaded two-core machine).

The convolutions reuse test_torch_ops.PROBLEM_2D's kernels (the stem) where they can: CPU compiles take seconds.
"""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import kernelgen.torch as kt  # noqa: E402
from torch import nn  # noqa: E402


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


class Net(nn.Module):
    """stem (every hyper-parameter: stride 2, padding, dilation 2, groups 2, bias), a residual block, a classifier."""

    def __init__(self):
        super().__init__()
        self.stem, self.bn = nn.Conv2d(4, 6, 3, stride=2, padding=1, dilation=2, groups=2), nn.BatchNorm2d(6)
        self.block = Block(6)
        self.fc = nn.Linear(6, 5)

    def forward(self, x):
        x = self.block(torch.relu(self.bn(self.stem(x))))
        return self.fc(x.mean(dim=(2, 3)))


def pair(seed=None):
    torch.manual_seed(seed if seed is not None else torch.seed())
    theirs = Net().double()
    ours = kt.convert(copy.deepcopy(theirs))
    return theirs, ours


def test_convert_swaps_every_conv_in_place():
    theirs, ours = pair()
    convs = [m for m in ours.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 3 and all(type(m) is kt.Conv2d for m in convs)
    assert all(type(m) is nn.Conv2d for m in theirs.modules() if isinstance(m, nn.Conv2d))
    assert all(m.weight.is_contiguous(memory_format=torch.channels_last) for m in convs)
    model = nn.Sequential(nn.Conv1d(2, 3, 3))
    params = list(model.parameters())
    assert kt.convert(model) is model and list(model.parameters()) == params  # the same Parameter objects


def test_converted_model_matches_torch_outputs_and_grads():
    theirs, ours = pair()
    x = torch.randn(2, 4, 7, 7, dtype=torch.float64)
    labels = torch.randint(0, 5, (2,))
    losses = []
    for model in (theirs, ours):
        loss = nn.functional.cross_entropy(model(x), labels)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-10, atol=1e-12)
    for (name, p), q in zip(theirs.named_parameters(), ours.parameters()):
        assert q.grad is not None and torch.isfinite(q.grad).all(), name
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-9, atol=1e-11, msg=name)


def test_state_dict_round_trips_with_torch_modules():
    theirs, ours = pair()
    mine, torchs = ours.state_dict(), theirs.state_dict()
    assert list(mine) == list(torchs)
    assert all(mine[k].shape == torchs[k].shape and torch.equal(mine[k], torchs[k]) for k in mine)
    fresh = Net().double()
    fresh.load_state_dict(mine)  # kernelgen's state_dict into torch's module
    other = kt.convert(Net().double())
    other.load_state_dict(torchs)  # and torch's into kernelgen's: copied into the channels-last weights
    for k, v in other.state_dict().items():
        assert torch.equal(v, torchs[k]) and torch.equal(fresh.state_dict()[k], torchs[k]), k
    assert other.stem.weight.is_contiguous(memory_format=torch.channels_last)


def test_modules_built_directly_are_torch_modules():
    conv = kt.Conv2d(4, 6, 3, stride=2, padding=1, dilation=2, groups=2, dtype=torch.float64)
    assert isinstance(conv, nn.Conv2d) and "Conv2d(4, 6" in repr(conv)
    assert conv.weight.shape == (6, 2, 3, 3) and conv.weight.is_contiguous(memory_format=torch.channels_last)
    opt = torch.optim.SGD(conv.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(2, 4, 7, 7, dtype=torch.float64)
    for _ in range(2):
        opt.zero_grad()
        conv(x).square().sum().backward()
        opt.step()
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)  # in-place updates keep the layout
    torch.testing.assert_close(conv(x), nn.functional.conv2d(x, conv.weight, conv.bias, 2, 1, 2, 2))
    t = kt.ConvTranspose2d(6, 4, 3, stride=2, padding=1, dilation=2, groups=2, dtype=torch.float64)
    assert isinstance(t, nn.ConvTranspose2d) and t.weight.shape == (6, 2, 3, 3)


@pytest.mark.slow
def test_torch_compile_runs_a_converted_model():
    if not hasattr(torch, "compile"):
        pytest.skip("torch.compile is not available")
    _, ours = pair()
    ours.eval()
    x = torch.randn(2, 4, 7, 7, dtype=torch.float64)
    compiled = torch.compile(ours)
    torch.testing.assert_close(compiled(x), ours(x), rtol=1e-10, atol=1e-12)
