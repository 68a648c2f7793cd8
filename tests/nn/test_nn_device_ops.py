"""The device ops beyond a ResNet's (cuda_elementwise, cuda_pool): each op's forward and gradients in numba's CUDA
simulator against the host implementation run in float64 on the same fresh random data (the host ops are
checked against finite differences in test_nn_ops.py).  Every device buffer an op allocates starts as NaN
(the `poisoned` fixture), so an element a kernel never writes fails the comparison.  Tiny shapes: the
simulator runs one Python thread per CUDA thread."""
import harness
import numpy as np
import pytest
from harness import rel_err
from nn_reference import dropout_keep, dropout_seed
from test_nn_device import TOL, compare

from kernelgen.nn import Tensor
from kernelgen.nn import functional as F

pytestmark = pytest.mark.sim


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    """Device allocations of the modules under test come back NaN-filled instead of zeroed."""
    from kernelgen.nn import cuda_elementwise, cuda_pool

    def poison(module):
        real = module.empty

        def empty(shape, dtype=np.float32):
            a = real(shape, dtype)
            if np.dtype(dtype).kind == "f":
                a.copy_to_device(harness.poisoned(a.shape, dtype))
            return a
        monkeypatch.setattr(module, "empty", empty)
    poison(cuda_elementwise)
    poison(cuda_pool)
    return poison


ACTIVATIONS = {"leaky_relu": lambda t: F.leaky_relu(t, 0.2), "sigmoid": F.sigmoid, "tanh": F.tanh, "gelu": F.gelu}


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_activation(name, rng):
    op = ACTIVATIONS[name]
    compare(lambda t, _: op(t[0]), [3 * rng.standard_normal((2, 3, 4))], rng)


def test_tanh_gradient_keeps_its_precision():
    x = np.array([-12.0, -9.0, -5.0, -0.5, 0.5, 5.0, 9.0, 12.0], np.float32)
    dev = Tensor(x, requires_grad=True).cuda()
    F.tanh(dev).backward(Tensor(np.ones(x.shape, np.float32)).cuda().data)
    np.testing.assert_allclose(dev.grad.copy_to_host(), 1 / np.cosh(x.astype(np.float64)) ** 2, rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", ["sigmoid", "gelu"])
def test_activation_tails_stay_finite(name):
    """exp(-|u|) never overflows: far tails give the host's saturated values and gradients, no NaN."""
    op = ACTIVATIONS[name]
    x = np.array([-1e4, -3e3, -200.0, -89.0, -30.0, -12.0, 12.0, 30.0, 89.0, 200.0, 3e3, 1e4])
    host = Tensor(x, requires_grad=True)
    op(host).backward(np.ones_like(x))
    dev = Tensor(x.astype(np.float32), requires_grad=True).cuda()
    y = op(dev)
    y.backward(Tensor(np.ones(x.shape, np.float32)).cuda().data)
    got_y, got_g = y.numpy(), dev.grad.copy_to_host()
    assert np.isfinite(got_y).all() and np.isfinite(got_g).all()
    np.testing.assert_allclose(got_y, op(Tensor(x)).data, rtol=1e-6, atol=1e-30)
    np.testing.assert_allclose(got_g, host.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("a_shape,b_shape", [((2, 3, 4), (2, 3, 4)), ((3, 4), (4,)), ((4,), (3, 4)),
                                             ((2, 1, 3), (4, 1)), ((1, 3), (2, 1)), ((2, 3), ())])
def test_mul_broadcasting(a_shape, b_shape, rng):
    compare(lambda t, _: F.mul(t[0], t[1]), [np.asarray(rng.standard_normal(a_shape)), np.asarray(rng.standard_normal(b_shape))],
            rng)


def test_mul_and_add_share_an_input(rng):
    # the autograd test's graph: `a` reaches the product twice, its device gradient accumulated
    compare(lambda t, _: F.mul(F.add(t[0], t[1]), t[0]), [rng.standard_normal((3, 4)), rng.standard_normal((3, 4))],
            rng)


def test_mul_gradient_only_for_inputs_that_need_it(rng):
    a = Tensor(rng.standard_normal((3, 4)).astype(np.float32), requires_grad=True).cuda()
    b = Tensor(rng.standard_normal(4).astype(np.float32)).cuda()
    F.mul(a, b).backward(Tensor(np.ones((3, 4), np.float32)).cuda().data)
    assert b.grad is None
    np.testing.assert_allclose(a.grad.copy_to_host(), np.broadcast_to(b.numpy(), (3, 4)), rtol=1e-7)


def test_bad_input_is_rejected_by_name(rng):
    from numba import cuda
    x = Tensor(rng.standard_normal((2, 3)).astype(np.float32)).cuda()
    with pytest.raises(ValueError, match="b's shape"):
        F.mul(x, Tensor(rng.standard_normal((3, 2)).astype(np.float32)).cuda())
    with pytest.raises(TypeError, match="same device: b is a cpu tensor"):
        F.mul(x, Tensor(rng.standard_normal((2, 3)).astype(np.float32)))
    with pytest.raises(TypeError, match="same device: a is a cpu tensor"):
        F.mul(Tensor(rng.standard_normal((2, 3)).astype(np.float32)), x)
    x64 = Tensor(cuda.to_device(rng.standard_normal((2, 3))))  # float64 device data, built around .cuda()
    with pytest.raises(TypeError, match="a must be float32"):
        F.mul(x64, x)
    with pytest.raises(TypeError, match="x must be float32"):
        F.gelu(x64)
    with pytest.raises(TypeError, match="x must be float32"):
        F.dropout(x64, 0.5)


@pytest.mark.parametrize("p", [0.3, 0.5, 1.0])
def test_dropout_mask_is_seeded_and_reused_by_backward(p, rng):
    gen_seed = int(rng.integers(2 ** 63))
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    x[x == 0] = 1.0  # a dropped element must be unambiguous
    proj = rng.standard_normal(x.shape).astype(np.float32)
    t = Tensor(x, requires_grad=True).cuda()
    y = F.dropout(t, p, generator=np.random.default_rng(gen_seed))
    y.backward(Tensor(proj).cuda().data)
    keep = dropout_keep(dropout_seed(gen_seed), x.shape, p)
    scale = 1 / (1 - p) if p < 1 else 0.0
    # the device multiplies by the float64 scale and rounds once: the same bits as this
    np.testing.assert_array_equal(y.numpy(), np.where(keep, (x * scale).astype(np.float32), 0))
    np.testing.assert_array_equal(t.grad.copy_to_host(), np.where(keep, (proj * scale).astype(np.float32), 0))
    again = F.dropout(Tensor(x).cuda(), p, generator=np.random.default_rng(gen_seed)).numpy()
    np.testing.assert_array_equal(again, y.numpy())
    if p < 1:
        other = F.dropout(Tensor(x).cuda(), p, generator=np.random.default_rng(gen_seed + 1)).numpy()
        assert (other != y.numpy()).any()


def test_dropout_hash_keeps_the_right_fraction():
    """The mask's statistics, on the host reference the device matches bit for bit (test above): keep rate
    within 5 sigma of 1 - p, and no correlation between neighbours (a weak hash shows one)."""
    n = 200_000
    for seed, p in [(0, 0.5), (1, 0.1), (2 ** 32 - 1, 0.9), (12345, 0.3)]:
        keep = dropout_keep(seed, (n,), p)
        assert abs(keep.mean() - (1 - p)) <= 5 * np.sqrt(p * (1 - p) / n), (seed, p, keep.mean())
        k = keep.astype(np.float64) - keep.mean()
        assert abs((k[1:] * k[:-1]).mean()) / k.var() <= 5 / np.sqrt(n), (seed, p)
    assert (dropout_keep(7, (n,), 0.5) != dropout_keep(8, (n,), 0.5)).mean() > 0.45


def test_dropout_identity_cases(rng):
    t = Tensor(rng.standard_normal((2, 3)).astype(np.float32)).cuda()
    assert F.dropout(t, 0.3, training=False) is t and F.dropout(t, 0.0) is t
    with pytest.raises(ValueError, match="p must be"):
        F.dropout(t, 1.5)


def test_rel_err_sees_nan():
    # the poisoning relies on this: a NaN anywhere fails the comparison
    assert not rel_err(np.array([1.0, np.nan]), np.array([1.0, 1.0])) <= TOL


@pytest.mark.parametrize("shapes,axis", [([(2, 3, 4), (2, 1, 4), (2, 2, 4)], 1), ([(1, 3, 2), (2, 3, 2)], 0),
                                         ([(2, 3, 2), (2, 3, 3)], -1), ([(1, 2, 2, 3), (1, 2, 2, 1)], 3),
                                         ([(3, 2)], 0)])
def test_concat(shapes, axis, rng):
    compare(lambda t, _: F.concat(t, axis=axis), [rng.standard_normal(s) for s in shapes], rng)


def test_concat_gradient_only_where_needed_and_accumulated(rng):
    a = Tensor(rng.standard_normal((2, 3)).astype(np.float32), requires_grad=True).cuda()
    b = Tensor(rng.standard_normal((2, 2)).astype(np.float32)).cuda()
    g = rng.standard_normal((2, 8)).astype(np.float32)
    F.concat([a, b, a], axis=1).backward(Tensor(g).cuda().data)  # `a` twice: both slices reach its gradient
    assert b.grad is None
    np.testing.assert_allclose(a.grad.copy_to_host(), g[:, :3] + g[:, 5:], rtol=1e-6)


def test_concat_rejects_bad_input_by_name(rng):
    x = Tensor(rng.standard_normal((2, 3)).astype(np.float32)).cuda()
    with pytest.raises(ValueError, match=r"tensors\[1\] has shape \(3, 3\)"):
        F.concat([x, Tensor(rng.standard_normal((3, 3)).astype(np.float32)).cuda()], axis=1)
    with pytest.raises(ValueError, match=r"tensors\[1\] has shape \(2, 3, 1\)"):
        F.concat([x, Tensor(rng.standard_normal((2, 3, 1)).astype(np.float32)).cuda()], axis=0)
    with pytest.raises(ValueError, match="axis must be in"):
        F.concat([x, x], axis=2)
    with pytest.raises(TypeError, match=r"tensors\[1\] is a cpu tensor"):
        F.concat([x, Tensor(rng.standard_normal((2, 3)).astype(np.float32))], axis=0)


POOL_GEOMETRY = [(2, 2, 0), (3, 2, 1), (3, 1, 1), (2, 1, 0), ((3, 2), (1, 2), (1, 0))]


@pytest.mark.parametrize("kernel,stride,padding", POOL_GEOMETRY)
def test_max_pool(kernel, stride, padding, rng):
    compare(lambda t, _: F.max_pool2d(t[0], kernel, stride, padding), [rng.standard_normal((1, 4, 5, 2))], rng)


def test_max_pool_ties_go_to_the_first_offset(rng):
    """Overlapping windows over tied values: each output's gradient lands on the first maximum of its
    window in row-major order, as the host routes it (and the sums of overlapping routes agree)."""
    x = rng.integers(0, 2, (1, 5, 5, 2)).astype(np.float64)  # 0s and 1s: ties everywhere
    x[x == 0] = -1.0  # the data is never 0
    compare(lambda t, _: F.max_pool2d(t[0], 3, 1, 1), [x], rng, tol=1e-6)  # a misrouted gradient is off by O(1)


@pytest.mark.parametrize("count_include_pad", [True, False])
@pytest.mark.parametrize("kernel,stride,padding", POOL_GEOMETRY)
def test_avg_pool(kernel, stride, padding, count_include_pad, rng):
    compare(lambda t, _: F.avg_pool2d(t[0], kernel, stride, padding, count_include_pad),
            [rng.standard_normal((1, 4, 5, 2))], rng)


@pytest.mark.parametrize("out", [1, (2, 3), (3, 2), (4, 6)])
def test_adaptive_avg_pool(out, rng):
    # 3x5 input: (2, 3) and (3, 2) give overlapping bins, (4, 6) more bins than rows and columns
    compare(lambda t, _: F.adaptive_avg_pool2d(t[0], out), [rng.standard_normal((2, 3, 5, 2))], rng)


def test_pools_reject_bad_input_by_name(rng):
    x = Tensor(rng.standard_normal((1, 4, 4, 2)).astype(np.float32)).cuda()
    with pytest.raises(ValueError, match="channels-last"):
        F.avg_pool2d(Tensor(rng.standard_normal((4, 4, 2)).astype(np.float32)).cuda(), 2)
    with pytest.raises(ValueError, match="padding must be at most half"):
        F.max_pool2d(x, 2, 2, 2)
    with pytest.raises(ValueError, match="stride must be integers"):
        F.max_pool2d(x, 2, 0)
    with pytest.raises(ValueError, match="kernel must be integers"):
        F.avg_pool2d(x, 1.5)
    with pytest.raises(ValueError, match="empty output"):
        F.avg_pool2d(x, 5)
    with pytest.raises(ValueError, match="output_size"):
        F.adaptive_avg_pool2d(x, (0, 2))
