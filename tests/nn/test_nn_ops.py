"""nn ops beyond convolution: activations, pooling, dropout, concat and compensated summation.
Gradients against central finite differences in float64; forward values against plain loop references."""
import math

import numpy as np
import pytest

from kernelgen.nn import functional as F
from kernelgen.nn.tensor import Tensor, no_grad


def numeric_grad(f, a, eps=1e-6):
    g = np.zeros_like(a)
    for idx in np.ndindex(a.shape):
        old = a[idx]
        a[idx] = old + eps
        hi = f()
        a[idx] = old - eps
        lo = f()
        a[idx] = old
        g[idx] = (hi - lo) / (2 * eps)
    return g


def gradcheck(op, arrays, rng, rtol=1e-6, atol=1e-7):
    """Backward of sum(op(*arrays) * proj) for a random proj against finite differences, per input."""
    proj = rng.standard_normal(op(*[Tensor(a) for a in arrays]).shape)

    def loss():
        with no_grad():
            return float((op(*[Tensor(a) for a in arrays]).data * proj).sum())
    tensors = [Tensor(a.copy(), requires_grad=True) for a in arrays]
    op(*tensors).backward(proj)
    for i, t in enumerate(tensors):
        np.testing.assert_allclose(t.grad, numeric_grad(loss, arrays[i]), rtol=rtol, atol=atol,
                                   err_msg=f"gradient of input {i}")


@pytest.mark.parametrize("op", [F.gelu, F.sigmoid, F.tanh, F.relu, lambda x: F.leaky_relu(x, 0.2)],
                         ids=["gelu", "sigmoid", "tanh", "relu", "leaky_relu"])
def test_activation_grads(op, rng):
    gradcheck(op, [3 * rng.standard_normal((3, 4, 5))], rng)


def test_activation_values(rng):
    x = 4 * rng.standard_normal(200)
    z = np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)
    np.testing.assert_allclose(F.gelu(x).data, 0.5 * x * (1 + np.tanh(z)), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(F.gelu(x).data, x / (1 + np.exp(-2 * z)), rtol=1e-13)  # no cancellation for x < 0
    np.testing.assert_allclose(F.sigmoid(x).data, 1 / (1 + np.exp(-x)), rtol=1e-13)
    np.testing.assert_allclose(F.tanh(x).data, np.tanh(x), rtol=1e-15)
    np.testing.assert_array_equal(F.leaky_relu(x, 0.1).data, np.where(x > 0, x, 0.1 * x))
    assert F.gelu(x.astype(np.float32)).dtype == np.float32 and F.sigmoid(x.astype(np.float32)).dtype == np.float32


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gelu_sigmoid_saturate_without_overflow(dtype):
    # the textbook GELU derivative has exp(u) / (1 + exp(u))^2: inf / inf = NaN once exp(u) overflows
    big = np.array([1e4, 3e3, 1e3, 200.0, 89.0, 50.0, 30.0], dtype)
    x = np.concatenate([-big, big])
    for op, lo, hi in ((F.gelu, 0.0, big), (F.sigmoid, 0.0, 1.0)):
        t = Tensor(x.copy(), requires_grad=True)
        with np.errstate(over="raise", invalid="raise", divide="raise"):
            y = op(t)
            y.backward(np.ones_like(x))
        assert y.dtype == np.dtype(dtype) and t.grad.dtype == np.dtype(dtype)
        np.testing.assert_allclose(y.data[:len(big)], lo, atol=1e-12)
        np.testing.assert_allclose(y.data[len(big):], hi, rtol=1e-7)
        np.testing.assert_allclose(t.grad[:len(big)], 0.0, atol=1e-12)
        np.testing.assert_allclose(t.grad[len(big):], 1.0 if op is F.gelu else 0.0, atol=1e-12)


def test_tanh_gradient_keeps_its_precision_in_float32():
    # 1 - tanh^2 from a float32 output is exactly 0 from |x| ~ 9 on; sech^2 from the input is not
    x = np.array([-12.0, -9.0, -5.0, -0.5, 0.5, 5.0, 9.0, 12.0], np.float32)
    t = Tensor(x.copy(), requires_grad=True)
    F.tanh(t).backward(np.ones_like(x))
    assert t.grad.dtype == np.float32
    np.testing.assert_allclose(t.grad, 1 / np.cosh(x.astype(np.float64)) ** 2, rtol=1e-5, atol=0)


def pool_reference(x, kernel, stride, padding, reduce):
    """Window by window: padding as -inf for max, as 0 for the mean (count_include_pad)."""
    n, h, w, c = x.shape
    xp = np.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0)),
                constant_values=-np.inf if reduce is np.max else 0)
    p, q = (h + 2 * padding - kernel) // stride + 1, (w + 2 * padding - kernel) // stride + 1
    out = np.empty((n, p, q, c))
    for i in range(p):
        for j in range(q):
            out[:, i, j] = reduce(xp[:, i * stride:i * stride + kernel, j * stride:j * stride + kernel], axis=(1, 2))
    return out


@pytest.mark.parametrize("kernel,stride,padding", [(2, 2, 0), (3, 2, 1), (3, 1, 1), (2, 1, 0)])
def test_max_avg_pool(kernel, stride, padding, rng):
    x = rng.standard_normal((2, 5, 6, 3))
    np.testing.assert_array_equal(F.max_pool2d(x, kernel, stride, padding).data,
                                  pool_reference(x, kernel, stride, padding, np.max))
    np.testing.assert_allclose(F.avg_pool2d(x, kernel, stride, padding).data,
                               pool_reference(x, kernel, stride, padding, np.mean), rtol=1e-13)
    gradcheck(lambda t: F.max_pool2d(t, kernel, stride, padding), [x], rng)
    gradcheck(lambda t: F.avg_pool2d(t, kernel, stride, padding), [x], rng)
    gradcheck(lambda t: F.avg_pool2d(t, kernel, stride, padding, count_include_pad=False), [x], rng)


def test_avg_pool_excluding_padding_divides_by_real_elements(rng):
    x = rng.standard_normal((1, 4, 4, 2))
    y = F.avg_pool2d(x, 3, 1, 1, count_include_pad=False).data
    np.testing.assert_allclose(y[0, 0, 0], x[0, :2, :2].mean(axis=(0, 1)), rtol=1e-13)  # corner: 4 real elements
    np.testing.assert_allclose(y[0, 1, 1], x[0, :3, :3].mean(axis=(0, 1)), rtol=1e-13)


def test_pool_rejects_bad_geometry():
    with pytest.raises(ValueError, match="padding"):
        F.max_pool2d(np.ones((1, 4, 4, 1)), 2, 2, 2)
    with pytest.raises(ValueError, match="empty"):
        F.avg_pool2d(np.ones((1, 2, 2, 1)), 3)


@pytest.mark.parametrize("out", [1, (2, 3), (3, 2), (5, 7), (6, 9)])
def test_adaptive_avg_pool(out, rng):
    x = rng.standard_normal((2, 5, 7, 3))
    oh, ow = (out, out) if isinstance(out, int) else out
    want = np.empty((2, oh, ow, 3))
    for i in range(oh):
        for j in range(ow):  # PyTorch's bins, written out
            h0, h1 = math.floor(i * 5 / oh), math.ceil((i + 1) * 5 / oh)
            w0, w1 = math.floor(j * 7 / ow), math.ceil((j + 1) * 7 / ow)
            want[:, i, j] = x[:, h0:h1, w0:w1].mean(axis=(1, 2))
    np.testing.assert_allclose(F.adaptive_avg_pool2d(x, out).data, want, rtol=1e-13)
    gradcheck(lambda t: F.adaptive_avg_pool2d(t, out), [x], rng)


def test_dropout(rng):
    seed = int(rng.integers(2 ** 32))
    x = rng.standard_normal((4, 6, 6, 8)) + 3  # away from 0, so a dropped element is unambiguous
    gradcheck(lambda t: F.dropout(t, 0.3, generator=np.random.default_rng(seed)), [x], rng)
    y = F.dropout(x, 0.3, generator=np.random.default_rng(seed)).data
    np.testing.assert_array_equal(y, F.dropout(x, 0.3, generator=np.random.default_rng(seed)).data)
    kept = y != 0
    assert 0.6 < kept.mean() < 0.8
    np.testing.assert_allclose(y[kept], x[kept] / 0.7, rtol=1e-15)  # inverted: the expectation stays x
    t = Tensor(x)
    assert F.dropout(t, 0.3, training=False) is t and F.dropout(t, 0.0) is t
    assert not F.dropout(x, 1.0).data.any()
    with pytest.raises(ValueError):
        F.dropout(x, 1.5)


def test_concat_and_shape_ops(rng):
    a, b, c = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 1, 4)), rng.standard_normal((2, 2, 4))
    np.testing.assert_array_equal(F.concat([a, b, c], axis=1).data, np.concatenate([a, b, c], axis=1))
    gradcheck(lambda *t: F.concat(t, axis=1), [a, b, c], rng)
    gradcheck(lambda *t: F.concat(t, axis=-1), [a, rng.standard_normal((2, 3, 2))], rng)
    gradcheck(lambda t, u: F.flatten(F.add(t, u)).reshape(4, 6), [a, rng.standard_normal((3, 1))], rng)


def test_kahan_sum_beats_float32_summation(rng):
    # 2^24 first, then terms below one of its ulps (2): a running float32 sum drops every one of them
    x = rng.uniform(0.0, 0.9, 200_000).astype(np.float32)
    x[0] = 2.0 ** 24
    exact = math.fsum(x.astype(np.float64))
    ulp = float(np.spacing(np.float32(exact)))
    kahan = F.kahan_sum(x)
    assert kahan.dtype == np.float32
    err = abs(float(kahan) - exact)
    assert err <= 1.01 * ulp, (float(kahan), exact)  # the float32 nearest the exact sum, or a neighbour
    assert abs(float(np.cumsum(x)[-1]) - exact) > 10_000 * ulp  # sequential float32 accumulation
    assert err <= max(abs(float(x.sum()) - exact), ulp)  # numpy's pairwise float32 sum


def test_kahan_sum_axes(rng):
    x = rng.standard_normal((5, 4, 3, 6))
    for axis in [None, 0, -1, (0, 1, 2), (1, 3)]:
        np.testing.assert_allclose(F.kahan_sum(x, axis), x.sum(axis=axis), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(F.kahan_mean(x, axis, keepdims=True), x.mean(axis=axis, keepdims=True),
                                   rtol=1e-12, atol=1e-12)


def test_batch_norm_statistics_and_loss_are_accurate_in_float32(rng):
    # a large offset with a small spread: float32 statistics must still match float64 ones
    x = (1000 + rng.standard_normal((64, 16, 16, 3))).astype(np.float32)
    rm, rv = np.zeros(3, np.float32), np.ones(3, np.float32)
    F.batch_norm(x, np.ones(3, np.float32), np.zeros(3, np.float32), rm, rv, training=True, momentum=1.0)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(rm, x64.mean(axis=(0, 1, 2)), rtol=2e-7)
    np.testing.assert_allclose(rv, x64.var(axis=(0, 1, 2), ddof=1), rtol=1e-5)
    logits, labels = rng.standard_normal((4096, 10)), rng.integers(0, 10, 4096)
    loss32 = F.cross_entropy(logits.astype(np.float32), labels).data
    assert loss32.dtype == np.float32
    np.testing.assert_allclose(loss32, F.cross_entropy(logits, labels).data, rtol=1e-6)


@pytest.mark.parametrize("kernel,stride,padding", [(3, 2, 1), (3, 1, 1), (2, 2, 0)])
def test_avg_pool_gradient_matches_finite_differences(kernel, stride, padding, rng):
    """The padded case is the one a PyTorch CUDA kernel gets wrong for channels-last input (#188344)."""
    x = rng.standard_normal((2, 7, 7, 3))
    proj = rng.standard_normal(F.avg_pool2d(Tensor(x), kernel, stride, padding).shape)
    t = Tensor(x.copy(), requires_grad=True)
    F.avg_pool2d(t, kernel, stride, padding).backward(proj)
    f = lambda a: float((F.avg_pool2d(Tensor(a), kernel, stride, padding).numpy() * proj).sum())
    num, eps = np.zeros_like(x), 1e-6
    for i in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[i] += eps
        down[i] -= eps
        num[i] = (f(up) - f(down)) / (2 * eps)
    assert np.abs(t.grad - num).max() <= 1e-7 * max(1.0, np.abs(num).max())
