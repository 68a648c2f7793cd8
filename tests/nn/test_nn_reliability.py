"""Regression tests of the "Reliability" issue (kernelgen.nn on the CPU): each test failed before its fix.

Numbers in the test names are the issue's items: 1 backward twice, 2 Linear over leading dimensions,
3 cross-entropy targets, 4 `train --epochs 0`, 5 scalars keeping the dtype, 6 save/load paths and atomic
saves, 7 channel and group errors at the right moment, 8 torch CPU tensors as Tensor data.  PyTorch is the
reference where it is installed (CPU is enough); float64 analytic references otherwise."""
import os

import numpy as np
import pytest

from kernelgen.nn import BatchNorm2d, Conv1d, Conv2d, ConvTranspose2d, Linear, SmallResNet, Tensor
from kernelgen.nn import functional as F


@pytest.fixture(scope="module")
def torch_cpu():
    return pytest.importorskip("torch")


def linear_loss(rng):
    """(loss, weight) of a small float64 Linear + cross-entropy, a scalar loss with a graph."""
    layer = Linear(5, 3, rng=rng, dtype="float64")
    x = Tensor(rng.standard_normal((4, 5)))
    return F.cross_entropy(layer(x), rng.integers(0, 3, 4)), layer.weight


# ---- 1: backward twice -------------------------------------------------------------------------------------

def test_1_retain_graph_then_backward_accumulates_twice(rng):
    x = Tensor(rng.standard_normal((3, 4)), requires_grad=True)
    g = rng.standard_normal((3, 4))
    y = F.mul(x, x)
    y.backward(g, retain_graph=True)
    once = x.grad.copy()
    np.testing.assert_allclose(once, 2 * x.data * g, rtol=1e-14)
    y.backward(g)
    np.testing.assert_allclose(x.grad, 2 * once, rtol=1e-14)  # was 3x: the root kept its gradient
    loss, w = linear_loss(rng)
    loss.backward(retain_graph=True)
    once = w.grad.copy()
    loss.backward()
    np.testing.assert_allclose(w.grad, 2 * once, rtol=1e-14)
    assert loss.grad is None  # as PyTorch: a non-leaf gets no .grad


def test_1_second_backward_without_retain_graph_raises(rng):
    loss, w = linear_loss(rng)
    loss.backward()
    before = w.grad.copy()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()
    np.testing.assert_array_equal(w.grad, before)  # raised before any gradient moved


def test_1_backward_through_a_freed_subgraph_raises(rng):
    x = Tensor(rng.standard_normal(3), requires_grad=True)
    h = F.mul(x, x)
    h.backward(np.ones(3))
    z = F.mul(h, F.relu(x))  # a new op on h, whose own graph is gone
    with pytest.raises(RuntimeError, match="second time"):
        z.backward(np.ones(3))


def test_1_backward_checks_its_gradient_and_the_graph():
    with pytest.raises(RuntimeError, match="does not require grad"):
        Tensor(np.ones(3)).backward(np.ones(3))
    y = F.relu(Tensor(np.ones(3), requires_grad=True))
    with pytest.raises(ValueError, match=r"grad must have the tensor's shape \(3,\)"):
        y.backward(np.ones(4))


def test_1_backward_of_a_long_chain_does_not_recurse():
    x = Tensor(np.ones(2), requires_grad=True)
    y = x
    for _ in range(25000):  # deeper than the recursion limit kernelgen sets (20000)
        y = F.add(y, 1.0)
    y.backward(np.ones(2))
    np.testing.assert_array_equal(x.grad, [1.0, 1.0])


# ---- 2: Linear over leading dimensions ---------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(2, 3, 5), (2, 1, 3, 5), (5,)])
def test_2_linear_over_leading_dims_matches_float64_reference(rng, shape):
    layer = Linear(5, 4, rng=rng, dtype="float64")
    layer.bias.data[:] = rng.standard_normal(4)
    x = Tensor(rng.standard_normal(shape), requires_grad=True)
    y = layer(x)
    assert y.shape == shape[:-1] + (4,)
    g = rng.standard_normal(y.shape)
    y.backward(g)
    w, b = layer.weight.data, layer.bias.data
    rows, grows = x.data.reshape(-1, 5), g.reshape(-1, 4)
    np.testing.assert_allclose(y.data, x.data @ w.T + b, rtol=1e-13)
    np.testing.assert_allclose(x.grad, g @ w, rtol=1e-13)
    np.testing.assert_allclose(layer.weight.grad, np.einsum("ro,ri->oi", grows, rows), rtol=1e-12)
    np.testing.assert_allclose(layer.bias.grad, grows.sum(axis=0), rtol=1e-12)


def test_2_linear_3d_matches_torch(rng, torch_cpu):
    torch = torch_cpu
    layer = Linear(6, 3, rng=rng)
    x = rng.standard_normal((2, 4, 6)).astype(np.float32)
    g = rng.standard_normal((2, 4, 3)).astype(np.float32)
    xt = Tensor(x, requires_grad=True)
    layer(xt).backward(g)
    ref = torch.nn.Linear(6, 3)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(layer.weight.data))
        ref.bias.copy_(torch.from_numpy(layer.bias.data))
    xr = torch.from_numpy(x).requires_grad_()
    ref(xr).backward(torch.from_numpy(g))
    for got, want in ((xt.grad, xr.grad), (layer.weight.grad, ref.weight.grad), (layer.bias.grad, ref.bias.grad)):
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.sim
def test_2_linear_over_leading_dims_on_the_device_with_retained_backwards(rng):
    """The device path (a 1x1 convolution of the flattened rows) in the simulator; two backwards through a
    retained graph accumulate twice there too."""
    layer = Linear(5, 4, rng=rng)
    layer.bias.data[:] = rng.standard_normal(4)
    w, b = layer.weight.data.astype(np.float64), layer.bias.data.astype(np.float64)
    x = rng.standard_normal((2, 3, 5)).astype(np.float32)
    g = rng.standard_normal((2, 3, 4)).astype(np.float32)
    layer.cuda()
    xt = Tensor(x, requires_grad=True).cuda()
    y = layer(xt)
    assert y.is_cuda and y.shape == (2, 3, 4)
    np.testing.assert_allclose(y.numpy(), x @ w.T + b, rtol=1e-5, atol=1e-5)
    gd = Tensor(g).cuda().data
    y.backward(gd, retain_graph=True)
    y.backward(gd)
    rows, grows = x.reshape(-1, 5).astype(np.float64), g.reshape(-1, 4).astype(np.float64)
    np.testing.assert_allclose(xt.grad.copy_to_host(), 2 * g @ w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(layer.weight.grad.copy_to_host(), 2 * grows.T @ rows, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(layer.bias.grad.copy_to_host(), 2 * grows.sum(axis=0), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="second time"):
        y.backward(gd)


# ---- 3: cross-entropy targets ------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [-1, 3, -100 + 1])
def test_3_cross_entropy_rejects_labels_out_of_range(bad):
    logits = Tensor(np.zeros((2, 3)), requires_grad=True)
    with pytest.raises(ValueError, match=r"labels \(target\) must be in \[0, 3\)"):
        F.cross_entropy(logits, [0, bad])


@pytest.mark.parametrize("labels", [np.array([0.0, 1.0]), np.array([True, False]), ["0", "1"]])
def test_3_cross_entropy_rejects_non_integer_labels(labels):
    with pytest.raises(TypeError, match=r"labels \(target\) must be class indices of an integer dtype"):
        F.cross_entropy(Tensor(np.zeros((2, 3))), labels)


def test_3_cross_entropy_checks_shapes():
    with pytest.raises(ValueError, match=r"labels \(target\) must have shape \(2,\)"):
        F.cross_entropy(Tensor(np.zeros((2, 3))), [0, 1, 2])
    with pytest.raises(ValueError, match=r"logits must have shape \(N, classes\)"):
        F.cross_entropy(Tensor(np.zeros((2, 3, 1))), [0, 1])


@pytest.mark.parametrize("ignore_index", [-100, 1])
def test_3_cross_entropy_ignore_index(rng, ignore_index):
    logits = rng.standard_normal((5, 4))
    labels = np.array([0, ignore_index, 2, 3, ignore_index])
    t = Tensor(logits.copy(), requires_grad=True)
    loss = F.cross_entropy(t, labels, ignore_index=ignore_index)
    loss.backward()
    keep = labels != ignore_index
    z = logits - logits.max(axis=1, keepdims=True)
    log_probs = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    m = keep.sum()
    np.testing.assert_allclose(loss.data, -log_probs[keep, labels[keep]].sum() / m, rtol=1e-13)
    want = np.exp(log_probs)
    want[keep, labels[keep]] -= 1
    want[~keep] = 0
    np.testing.assert_allclose(t.grad, want / m, rtol=1e-12, atol=1e-15)


def test_3_cross_entropy_matches_torch_with_ignored_labels(rng, torch_cpu):
    torch = torch_cpu
    logits = rng.standard_normal((6, 5)).astype(np.float32)
    labels = np.array([4, -100, 0, 2, -100, 1])
    t = Tensor(logits.copy(), requires_grad=True)
    loss = F.cross_entropy(t, labels)
    loss.backward()
    lt = torch.from_numpy(logits).requires_grad_()
    want = torch.nn.functional.cross_entropy(lt, torch.from_numpy(labels))
    want.backward()
    assert loss.dtype == np.float32
    np.testing.assert_allclose(loss.data, want.item(), rtol=1e-6)
    np.testing.assert_allclose(t.grad, lt.grad.numpy(), rtol=1e-5, atol=1e-7)
    # every label ignored: NaN loss and a zero gradient, as PyTorch
    t = Tensor(logits.copy(), requires_grad=True)
    loss = F.cross_entropy(t, np.full(6, -100))
    loss.backward()
    assert np.isnan(loss.data) and not t.grad.any()


@pytest.mark.sim
def test_3_cross_entropy_checks_labels_before_the_device_kernel(rng):
    logits = Tensor(rng.standard_normal((2, 3)).astype(np.float32), requires_grad=True).cuda()
    with pytest.raises(ValueError, match=r"labels \(target\) must be in \[0, 3\)"):
        F.cross_entropy(logits, [0, 3])
    with pytest.raises(ValueError, match="ignore_index=-100 are not supported on the device"):
        F.cross_entropy(logits, [0, -100])
    with pytest.raises(TypeError, match="integer dtype"):
        F.cross_entropy(logits, np.array([0.0, 1.0]))
    loss = F.cross_entropy(logits, Tensor(np.array([2, 1])).cuda().data)  # labels already on the device
    assert loss.is_cuda and np.isfinite(loss.item())


# ---- 4: train --epochs 0 -----------------------------------------------------------------------------------

def test_4_train_epochs_zero_means_zero_and_negative_is_a_usage_error(monkeypatch, capsys):
    from kernelgen.nn import train
    calls = []
    monkeypatch.setattr(train, "train_digits", lambda **kw: calls.append(kw) or (None, [(float("nan"), 0.1)]))
    assert train.main(["digits", "--epochs", "0"]) == 0
    assert calls[-1]["epochs"] == 0 and "after 0 epochs" in capsys.readouterr().out
    train.main(["digits"])
    assert calls[-1]["epochs"] == 8
    for bad in ("-1", "two"):
        with pytest.raises(SystemExit):
            train.main(["digits", "--epochs", bad])
        assert "argument --epochs: must be an integer >= 0" in capsys.readouterr().err


def test_4_train_digits_with_zero_epochs_evaluates_the_untrained_model():
    from kernelgen.nn.train import train_digits
    with pytest.raises(ValueError, match="epochs must be >= 0"):
        train_digits(epochs=-1)
    model, history = train_digits(epochs=0, width=4)
    assert len(history) == 1 and np.isnan(history[0][0]) and 0 <= history[0][1] <= 1
    untrained = SmallResNet(width=4, seed=0)
    for (name, got), (_, want) in zip(sorted(model.state_dict().items()), sorted(untrained.state_dict().items())):
        np.testing.assert_array_equal(got, want, err_msg=name)  # not one step taken


# ---- 5: a Python scalar keeps the tensor's dtype -----------------------------------------------------------

SCALAR_OPS = {
    "t + 1": lambda t: t + 1, "1 + t": lambda t: 1 + t, "t - 1": lambda t: t - 1, "1 - t": lambda t: 1 - t,
    "t * 0.5": lambda t: t * 0.5, "0.5 * t": lambda t: 0.5 * t, "t / 3": lambda t: t / 3,
    "3 / t": lambda t: 3 / t, "t ** 2": lambda t: t ** 2, "2 ** t": lambda t: 2 ** t, "t ** 0.5": lambda t: t ** 0.5,
    "-t": lambda t: -t, "F.add(t, 1)": lambda t: F.add(t, 1), "F.mul(t, 0.5)": lambda t: F.mul(t, 0.5),
    "F.mul(t, np.float64(0.5))": lambda t: F.mul(t, np.float64(0.5)), "F.sub(2, t)": lambda t: F.sub(2, t),
    "F.div(t, 4.0)": lambda t: F.div(t, 4.0), "F.pow(t, 3)": lambda t: F.pow(t, 3),
}


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", list(SCALAR_OPS))
def test_5_scalar_operands_keep_the_dtype(rng, dtype, name):
    op = SCALAR_OPS[name]
    x = (rng.random((3, 4)) + 0.5).astype(dtype)  # positive: ** 0.5 is defined
    t = Tensor(x, requires_grad=True)
    y = op(t)
    assert y.dtype == np.dtype(dtype), f"{name}: {y.dtype}"
    want = op(Tensor(x.astype(np.float64))).data  # the same op in float64, rounded once
    np.testing.assert_allclose(y.data, want.astype(dtype), rtol=2e-3 if dtype == "float16" else 1e-6)
    y.backward(np.ones(y.shape, dtype))
    assert t.grad.dtype == np.dtype(dtype), f"{name}: gradient {t.grad.dtype}"


def test_5_scalar_promotion_follows_torch(torch_cpu):
    torch = torch_cpu
    cases = [(np.int64, 0.5), (np.int64, 2), (np.int32, 2), (np.bool_, 1), (np.bool_, 1.5), (np.float16, 2.5),
             (np.float64, 0.5)]
    for dtype, s in cases:
        x = np.array([1, 2, 3], dtype)
        for op in (lambda a, b: a + b, lambda a, b: a * b, lambda a, b: b * a):
            got, want = op(Tensor(x), s), op(torch.from_numpy(x), s)
            assert str(got.dtype) == str(want.dtype).replace("torch.", ""), (dtype, s, got.dtype, want.dtype)
            np.testing.assert_allclose(got.data, want.numpy())
    # two tensors promote as numpy and torch do, the gradient keeping each leaf's dtype
    a = Tensor(np.ones(3, np.float32), requires_grad=True)
    b = Tensor(np.full(3, 2.0), requires_grad=True)
    y = a * b
    assert y.dtype == np.float64
    y.backward(np.ones(3))
    assert a.grad.dtype == np.float32 and b.grad.dtype == np.float64


def test_5_sub_div_pow_gradients_against_finite_differences(rng):
    a, b = rng.random((3, 4)) + 0.5, rng.random((4,)) + 0.5
    g = rng.standard_normal((3, 4))
    for op in (F.sub, F.div, F.pow, lambda x, y: -x * y):
        ta, tb = Tensor(a.copy(), requires_grad=True), Tensor(b.copy(), requires_grad=True)
        op(ta, tb).backward(g)
        for arr, t in ((a, ta), (b, tb)):
            num = np.zeros_like(arr)
            for idx in np.ndindex(arr.shape):
                old = arr[idx]
                arr[idx] = old + 1e-6
                hi = (op(Tensor(a), Tensor(b)).data * g).sum()
                arr[idx] = old - 1e-6
                lo = (op(Tensor(a), Tensor(b)).data * g).sum()
                arr[idx] = old
                num[idx] = (hi - lo) / 2e-6
            np.testing.assert_allclose(t.grad, num, rtol=1e-6, atol=1e-8)


# ---- 6: save / load ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,file", [("ckpt", "ckpt.npz"), ("m.npz", "m.npz"), ("run.v2", "run.v2.npz")])
def test_6_save_and_load_agree_on_the_path(tmp_path, name, file):
    a, b = SmallResNet(width=4, seed=0), SmallResNet(width=4, seed=1)
    for path in (str(tmp_path / name), tmp_path / name):  # str and os.PathLike
        a.save(path)
        assert sorted(os.listdir(tmp_path)) == [file]  # that one file, no temporary left behind
        b.load(path)
        for (k, va), (_, vb) in zip(sorted(a.state_dict().items()), sorted(b.state_dict().items())):
            np.testing.assert_array_equal(va, vb, err_msg=k)
        os.unlink(tmp_path / file)


def test_6_a_failed_save_leaves_the_old_checkpoint_and_no_litter(tmp_path, monkeypatch):
    a = SmallResNet(width=4, seed=0)
    path = tmp_path / "m.npz"
    a.save(path)
    good = path.read_bytes()
    (tmp_path / "other.txt").write_text("not ours")

    def crashing_savez(file, **arrays):  # writes part of an archive, then the disk fills up
        f = open(file, "wb") if isinstance(file, (str, os.PathLike)) else file
        f.write(b"PK\x03\x04 half a checkpoint")
        f.flush()
        raise OSError("No space left on device")
    monkeypatch.setattr(np, "savez", crashing_savez)
    with pytest.raises(OSError, match="No space left"):
        SmallResNet(width=4, seed=1).save(path)
    assert path.read_bytes() == good
    assert sorted(os.listdir(tmp_path)) == ["m.npz", "other.txt"]
    assert (tmp_path / "other.txt").read_text() == "not ours"


def test_6_saved_checkpoints_get_the_usual_permissions(tmp_path):
    mask = os.umask(0o022)
    try:
        SmallResNet(width=4, seed=0).save(tmp_path / "m")
    finally:
        os.umask(mask)
    assert os.stat(tmp_path / "m.npz").st_mode & 0o777 == 0o644  # not mkstemp's 0600


# ---- 7: channel and group errors ---------------------------------------------------------------------------

@pytest.mark.parametrize("make,match", [
    (lambda: Conv2d(3, 4, 3, groups=2), r"in_channels must be divisible by groups"),
    (lambda: Conv2d(4, 3, 3, groups=2), r"out_channels must be divisible by groups"),
    (lambda: Conv1d(4, 4, 3, groups=0), r"groups must be a positive integer"),
    (lambda: ConvTranspose2d(3, 4, 3, groups=2), r"in_channels must be divisible by groups"),
    (lambda: Conv2d(4, 4, (3, 3, 3)), r"kernel_size must be"),
    (lambda: Linear(0, 3), r"in_features must be positive"),
])
def test_7_bad_layer_arguments_fail_at_construction(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_7_channel_mismatches_name_the_layer_argument(rng):
    x = Tensor(rng.standard_normal((2, 5, 5, 5)).astype(np.float32))
    for bn in (BatchNorm2d(4), BatchNorm2d(4).eval()):
        with pytest.raises(ValueError, match="expected 4 channels, got 5"):
            bn(x)
    with pytest.raises(ValueError, match="expected 4 channels, got 5"):
        F.batch_norm(x, np.ones(4, np.float32), np.zeros(4, np.float32), np.zeros(4), np.ones(4), training=True)
    with pytest.raises(ValueError, match=r"Conv2d: expected 4 channels \(in_channels"):
        Conv2d(4, 4, 3)(x)
    with pytest.raises(ValueError, match=r"ConvTranspose2d: expected 3 channels \(in_channels"):
        ConvTranspose2d(3, 4, 3)(x)
    with pytest.raises(ValueError, match=r"Conv2d: expected a 4-D input"):
        Conv2d(5, 4, 3)(Tensor(x.data[0]))
    with pytest.raises(ValueError, match=r"in_features = 4 in its last dimension"):
        Linear(4, 3)(Tensor(rng.standard_normal((2, 5))))


# ---- 8: torch CPU tensors as data --------------------------------------------------------------------------

def test_8_tensor_from_a_torch_cpu_tensor(torch_cpu):
    torch = torch_cpu
    src = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    t = Tensor(src)
    assert isinstance(t.data, np.ndarray) and t.dtype == np.float32 and t.shape == (2, 3) and not t.is_cuda
    src[0, 0] = 42.0
    assert t.data[0, 0] == 42.0  # the torch tensor's memory, not a copy
    p = torch.nn.Parameter(torch.ones(3))  # requires grad: detached, not refused
    np.testing.assert_array_equal(F.relu(Tensor(p, requires_grad=True)).data, np.ones(3, np.float32))
    np.testing.assert_array_equal(Tensor(torch.tensor([1 + 2j]).conj()).data, [1 - 2j])  # a lazy view, resolved
    with pytest.raises(TypeError, match="no NumPy dtype"):
        Tensor(torch.ones(2, dtype=torch.bfloat16))


def test_8_non_numeric_data_is_a_type_error():
    with pytest.raises(TypeError, match="data must be numeric"):
        Tensor(["a", "b"])
    with pytest.raises(TypeError, match="data must be numeric"):
        Tensor([object()])
