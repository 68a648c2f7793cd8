"""kernelgen.torch's operators on the CPU backend, in float64: values against torch's own convolutions (a float64
reference), gradients through torch.autograd.gradcheck (finite differences against the registered backward,
whose kernels are kernelgen's backward-data and backward-weight), and refusals that name the argument.

Compiling a CPU kernel takes seconds, so the shapes are chosen to share kernels: the transposed convolution is
the 2-d convolution's backward-data on the same weight, and test_torch_modules / test_dlpack reuse PROBLEM_2D.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import kernelgen.torch as kt  # noqa: E402
from kernelgen.torch import functional, ops  # noqa: E402

F = torch.nn.functional
# (x shape, w shape, conv arguments): every hyper-parameter at once, and the three spatial ranks
PROBLEM_2D = ((2, 4, 7, 7), (6, 2, 3, 3), dict(stride=2, padding=1, dilation=2, groups=2))
PROBLEM_1D = ((2, 3, 8), (4, 3, 3), dict(stride=1, padding=1))
PROBLEM_3D = ((1, 2, 4, 4, 4), (3, 2, 2, 2, 2), dict(stride=1, padding=0))
CONVS = {1: (kt.conv1d, F.conv1d), 2: (kt.conv2d, F.conv2d), 3: (kt.conv3d, F.conv3d)}


def tensors(gen, *shapes, grad=True):
    return [torch.randn(*s, dtype=torch.float64, generator=gen, requires_grad=grad) for s in shapes]


@pytest.fixture
def gen():
    g = torch.Generator()
    g.seed()  # fresh data every run
    return g


@pytest.mark.parametrize("problem", [PROBLEM_1D, PROBLEM_2D, PROBLEM_3D], ids=["1d", "2d", "3d"])
def test_conv_values_and_gradcheck(problem, gen):
    x_shape, w_shape, kw = problem
    ours, theirs = CONVS[len(x_shape) - 2]
    x, w, b = tensors(gen, x_shape, w_shape, (w_shape[0],))
    y = ours(x, w, b, **kw)
    want = theirs(x, w, b, **kw)
    assert y.shape == want.shape and y.dtype == torch.float64
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x, w, b: ours(x, w, b, **kw), (x, w, b))


def test_conv_transpose2d_values_and_gradcheck(gen):
    """conv_transpose2d of PROBLEM_2D's output shape with its weight: the transposed problem."""
    x_shape, w_shape, kw = PROBLEM_2D
    y_shape = ops.conv_output_shape(x_shape, w_shape, [kw["stride"]] * 2, [kw["padding"]] * 2, [kw["dilation"]] * 2)
    x, w, b = tensors(gen, y_shape, w_shape, (w_shape[1] * kw["groups"],))
    y = kt.conv_transpose2d(x, w, b, **kw)
    want = F.conv_transpose2d(x, w, b, **kw)
    assert tuple(y.shape) == x_shape
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x, w, b: kt.conv_transpose2d(x, w, b, **kw), (x, w, b))


def test_channels_last_views_and_copies():
    """A channels-last tensor reaches the kernel as a view; an NCHW one costs one copy; outputs are channels-last."""
    x = torch.randn(2, 4, 5, 5)
    cl = x.contiguous(memory_format=torch.channels_last)
    assert ops.channels_last(cl).data_ptr() == cl.data_ptr()
    assert ops.channels_last(x).data_ptr() != x.data_ptr()  # the documented copy
    y = ops.channels_first(torch.empty(2, 5, 5, 3))
    assert y.shape == (2, 3, 5, 5) and y.is_contiguous(memory_format=torch.channels_last)


def test_fake_shapes_match_torch():
    """The meta implementations (what torch.compile sees) give torch's output shapes and channels-last strides."""
    x_shape, w_shape, kw = PROBLEM_2D
    x, w = torch.empty(x_shape, device="meta"), torch.empty(w_shape, device="meta")
    s, p, d = ([kw[k]] * 2 for k in ("stride", "padding", "dilation"))
    y = ops.conv(x, w, None, s, p, d, kw["groups"], "fp32")
    assert y.shape == F.conv2d(x, w, **kw).shape and y.is_contiguous(memory_format=torch.channels_last)
    xt = torch.empty(y.shape, device="meta")
    yt = ops.conv_transpose(xt, w, None, s, p, [1, 1], d, kw["groups"], "fp32")
    assert yt.shape == F.conv_transpose2d(xt, w, output_padding=1, **kw).shape


def test_a_remembered_stride_still_refuses_bools():
    """functional._tuple keeps its answers per value, and (1, True) == (1, 1) as a dict key."""
    assert functional._tuple((1, 1), 2, "stride") == [1, 1] == functional._tuple((1, 1), 2, "stride")
    with pytest.raises(ValueError, match="stride must be an int or 2 ints"):
        functional._tuple((1, True), 2, "stride")


@pytest.mark.parametrize("call, exc, message", [
    (lambda: kt.conv2d(torch.ones(3, 4), torch.ones(4, 3, 3, 3)), ValueError, "input must have 4 dims"),
    (lambda: kt.conv2d(torch.ones(1, 3, 4, 4), torch.ones(4, 3, 3)), ValueError, "weight must have 4 dims"),
    (lambda: kt.conv2d(torch.ones(1, 3, 4, 4).numpy(), torch.ones(4, 3, 3, 3)), TypeError, "torch tensors"),
    (lambda: kt.conv2d(torch.ones(1, 3, 4, 4), torch.ones(4, 3, 3, 3), stride=(1, 2, 3)), ValueError, "stride"),
    (lambda: kt.conv2d(torch.ones(1, 3, 4, 4), torch.ones(4, 3, 3, 3), stride=(1, True)), ValueError, "stride"),
    (lambda: kt.conv2d(torch.ones(1, 3, 4, 4), torch.ones(4, 3, 3, 3), dilation=True), ValueError, "dilation"),
    (lambda: kt.conv2d(torch.ones(1, 3, 4, 4), torch.ones(4, 3, 3, 3), padding="same", stride=2), ValueError,
     "stride 1"),
    (lambda: kt.conv2d(torch.ones(1, 3, 4, 4), torch.ones(4, 2, 3, 3)), ValueError, "w"),
    (lambda: kt.conv2d(torch.ones(1, 3, 4, 4, dtype=torch.int32), torch.ones(4, 3, 3, 3, dtype=torch.int32)),
     TypeError, "x must have dtype float32"),
    (lambda: kt.convert(object()), TypeError, "model must be a torch.nn.Module"),
])
def test_refusals_name_the_argument(call, exc, message, monkeypatch):
    def tripwire(plan):
        raise AssertionError(f"a bad call got as far as get_launcher: {plan.problem.key()}")
    monkeypatch.setattr("kernelgen.api.get_launcher", tripwire)
    with pytest.raises(exc, match=message):
        call()


def test_the_custom_ops_torch_compile_sees_have_the_same_gradients(gen):
    """Eager calls run through autograd Functions (the custom ops' dispatch costs more than a small kernel); the
    custom ops torch.compile traces carry the same formulas: both gradchecked, both against torch's forward."""
    x_shape, w_shape, kw = PROBLEM_2D
    s, p, d = [[kw[k]] * 2 for k in ("stride", "padding", "dilation")]
    x, w, b = tensors(gen, x_shape, w_shape, (w_shape[0],))
    for apply in (ops.conv, ops.apply_conv):
        def f(x, w, b, apply=apply):
            return apply(x, w, b, s, p, d, kw["groups"], "fp32")
        torch.testing.assert_close(f(x, w, b), F.conv2d(x, w, b, **kw), rtol=1e-12, atol=1e-12)
        assert torch.autograd.gradcheck(f, (x, w, b))
    y_shape = ops.conv_output_shape(x_shape, w_shape, s, p, d)
    xt, _, bt = tensors(gen, y_shape, w_shape, (w_shape[1] * kw["groups"],))
    for apply in (ops.conv_transpose, ops.apply_conv_transpose):
        def g(x, w, b, apply=apply):
            return apply(x, w, b, s, p, [0, 0], d, kw["groups"], "fp32")
        torch.testing.assert_close(g(xt, w, bt), F.conv_transpose2d(xt, w, bt, **kw), rtol=1e-12, atol=1e-12)
        assert torch.autograd.gradcheck(g, (xt, w, bt))
