"""Gradients of nn ops against central finite differences in float64 (convs through kernelgen's CPU path)."""
import numpy as np
import pytest

from kernelgen.nn import functional as F
from kernelgen.nn.tensor import Tensor, no_grad


def numeric_grad(f, arrays, i, eps=1e-6):
    a = arrays[i]
    g = np.zeros_like(a)
    it = np.nditer(a, flags=["multi_index"])
    for _ in it:
        idx = it.multi_index
        old = a[idx]
        a[idx] = old + eps
        hi = f(*arrays)
        a[idx] = old - eps
        lo = f(*arrays)
        a[idx] = old
        g[idx] = (hi - lo) / (2 * eps)
    return g


def check(op, *shapes, seed=0):
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(s) for s in shapes]
    proj = rng.standard_normal(op(*[Tensor(a) for a in arrays]).shape)  # random projection -> scalar loss

    def scalar(*arrs):
        with no_grad():
            return float((op(*[Tensor(a) for a in arrs]).data * proj).sum())
    tensors = [Tensor(a.copy(), requires_grad=True) for a in arrays]
    op(*tensors).backward(proj)
    for i, t in enumerate(tensors):
        np.testing.assert_allclose(t.grad, numeric_grad(scalar, arrays, i), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stride,padding,groups", [(1, 1, 1), (2, 1, 2)])
def test_conv2d_grad(stride, padding, groups):
    check(lambda x, w, b: F.conv2d(x, w, b, stride=stride, padding=padding, groups=groups),
          (2, 5, 5, 4), (4, 3, 3, 4 // groups), (4,))


def test_conv_relu_grad():
    # the fused relu: the gradient is masked by the output, with and without a bias
    check(lambda x, w, b: F.conv2d(x, w, b, padding=1, activation="relu"), (2, 5, 5, 3), (4, 3, 3, 3), (4,))
    check(lambda x, w: F.conv2d(x, w, stride=2, padding=1, activation="relu"), (2, 5, 5, 3), (4, 3, 3, 3))


@pytest.mark.parametrize("x_shape,w_shape,kw", [
    ((2, 7, 4), (4, 3, 2), dict(stride=2, padding=1, dilation=1, groups=2)),              # 1D, grouped
    ((1, 4, 3, 5, 2), (3, 2, 3, 2, 2), dict(stride=(1, 2, 1), padding=1, dilation=(1, 1, 2))),  # 3D, dilated
])
def test_conv_1d_3d_grad(x_shape, w_shape, kw):
    check(lambda x, w, b: F.conv(x, w, b, **kw), x_shape, w_shape, (w_shape[0],))


@pytest.mark.parametrize("x_shape,w_shape,kw", [
    ((2, 4, 3, 4), (4, 3, 3, 3), dict(stride=2, padding=1, output_padding=1)),
    ((1, 3, 4, 4), (4, 3, 3, 1), dict(stride=2, padding=1, groups=2)),
    ((2, 5, 2), (2, 3, 3), dict(stride=2, padding=0, output_padding=2, dilation=3)),  # output_padding >= stride
    ((1, 2, 2, 3, 2), (2, 2, 2, 2, 3), dict(stride=(2, 1, 2))),                       # 3D
])
def test_conv_transpose_grad(x_shape, w_shape, kw):
    check(lambda x, w, b: F.conv_transpose(x, w, b, **kw), x_shape, w_shape, (w_shape[-1] * kw.get("groups", 1),))


def test_conv_modules_shapes():
    from kernelgen.nn import Conv1d, Conv3d, ConvTranspose2d
    rng = np.random.default_rng(0)
    x1 = Tensor(rng.standard_normal((2, 9, 4)).astype(np.float32))
    assert Conv1d(4, 6, 3, padding=1, rng=rng)(x1).shape == (2, 9, 6)
    x3 = Tensor(rng.standard_normal((1, 4, 4, 4, 2)).astype(np.float32))
    assert Conv3d(2, 3, 3, stride=2, padding=1, rng=rng)(x3).shape == (1, 2, 2, 2, 3)
    x2 = Tensor(rng.standard_normal((1, 5, 5, 4)).astype(np.float32))
    up = ConvTranspose2d(4, 2, 3, stride=2, padding=1, output_padding=1, rng=rng)
    assert up.weight.shape == (4, 3, 3, 2) and up(x2).shape == (1, 10, 10, 2)


def test_linear_relu_add_mul_grad():
    check(lambda x, w, b: F.relu(F.linear(x, w, b)), (3, 5), (4, 5), (4,))
    check(lambda a, b: F.mul(F.add(a, b), a), (3, 4), (4,))


def test_pool_flatten_cross_entropy_grad():
    labels = np.array([0, 2, 1])
    check(lambda x: F.global_avg_pool(x), (3, 2, 2, 4))
    check(lambda x: F.reshape(F.flatten(x), (3, 8)), (3, 2, 2, 2))
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((3, 4))
    t = Tensor(logits.copy(), requires_grad=True)
    F.cross_entropy(t, labels).backward()
    num = numeric_grad(lambda l: float(F.cross_entropy(Tensor(l), labels).data), [logits], 0)
    np.testing.assert_allclose(t.grad, num, rtol=1e-5, atol=1e-7)


def test_no_grad_builds_no_graph():
    x = Tensor(np.ones((2, 3)), requires_grad=True)
    with no_grad():
        y = F.relu(x)
    assert not y.requires_grad and y._parents == ()


@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_grad(training):
    rm, rv = np.zeros(3), np.ones(3) * 1.5
    check(lambda x, w, b: F.batch_norm(x, w, b, rm.copy(), rv.copy(), training=training), (2, 3, 2, 3), (3,), (3,))
