"""The host (NumPy) implementations of kernelgen.nn's activations, pools, mul, concat and dropout against
PyTorch on the GPU machine.

test_nn_gpu.py covers the device kernels of the same ops; these run on NumPy arrays, and are compared
here with torch's CUDA implementation (fp32, TF32 off) on the same fresh random data: forward values and
the gradient of every input for sum(output * random projection).  Marker `gpu`; skipped without torch.
"""
import numpy as np
import pytest

from kernelgen.nn import Tensor
from kernelgen.nn import functional as F

from torch_compare import compare_with_torch, nchw, nhwc

pytestmark = pytest.mark.gpu
TOL = 1e-5


def compare(torch, ours, theirs, arrays, rng, tol=TOL):
    compare_with_torch(torch, ours, theirs, arrays, rng, tol, lambda a: Tensor(a, requires_grad=True),
                       lambda p: p, lambda t: t.grad)


def test_activations(torch, rng):
    x = (4 * rng.standard_normal((3, 5, 5, 8))).astype(np.float32)
    x[0, 0, 0, :4] = [-60.0, 60.0, -1e4, 1e4]  # far tails: no overflow, no NaN in the gradients
    compare(torch, lambda a: F.leaky_relu(a, 0.1), lambda a: torch.nn.functional.leaky_relu(a, 0.1), [x], rng)
    compare(torch, F.sigmoid, torch.sigmoid, [x], rng)
    compare(torch, F.tanh, torch.tanh, [x], rng)
    compare(torch, F.gelu, lambda a: torch.nn.functional.gelu(a, approximate="tanh"), [x], rng)


@pytest.mark.parametrize("kernel,stride,padding", [(2, 2, 0), (3, 2, 1), (3, 1, 1)])
def test_pools(torch, rng, kernel, stride, padding):
    x = rng.standard_normal((2, 9, 9, 6)).astype(np.float32)
    compare(torch, lambda a: F.max_pool2d(a, kernel, stride, padding),
            lambda a: nhwc(torch.nn.functional.max_pool2d(nchw(a), kernel, stride, padding)), [x], rng)
    # torch's avg_pool2d CUDA backward on channels_last input with padding > 0 returns wrong gradients
    # (pytorch/pytorch#188344, torch 2.11 on the GPU machine; ours matches finite differences): compare
    # with its NCHW-contiguous kernel
    compare(torch, lambda a: F.avg_pool2d(a, kernel, stride, padding),
            lambda a: nhwc(torch.nn.functional.avg_pool2d(nchw(a).contiguous(), kernel, stride, padding)), [x], rng)


@pytest.mark.parametrize("out", [1, 3, (2, 4)])
def test_adaptive_avg_pool(torch, rng, out):
    x = rng.standard_normal((2, 7, 9, 5)).astype(np.float32)
    compare(torch, lambda a: F.adaptive_avg_pool2d(a, out),
            lambda a: nhwc(torch.nn.functional.adaptive_avg_pool2d(nchw(a), out)), [x], rng)


def test_mul_concat_dropout(torch, rng):
    a, b = rng.standard_normal((4, 3, 3, 5)).astype(np.float32), rng.standard_normal((4, 3, 3, 5)).astype(np.float32)
    compare(torch, F.mul, lambda x, y: x * y, [a, b], rng)
    compare(torch, lambda x, y: F.concat([x, y], axis=3), lambda x, y: torch.cat([x, y], dim=3), [a, b], rng)
    # dropout: same mask on both sides (torch draws its own): inverted scaling and its gradient
    keep = np.random.default_rng(7).random(a.shape) >= 0.3
    mask = torch.tensor(keep / 0.7, dtype=torch.float32, device="cuda")
    compare(torch, lambda x: F.dropout(x, 0.3, generator=np.random.default_rng(7)), lambda x: x * mask, [a], rng)
