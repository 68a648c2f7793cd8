"""Layer modules, RMSprop/RAdam against PyTorch's update rules, and the ResNet / VGG models.

Every convolution compiles a numba kernel per shape (seconds each, cached for the session), so the model
tests share shapes: batch 2, width 4, and inputs chosen so that each model's layer1 (or first VGG stage)
sees 32x32 maps.  ResNet-34 then reuses all of ResNet-18's kernels, the ImageNet stem adds one
convolution, and VGG-16 four: ~47 kernels, about two minutes on 2 cores with a cold kernel cache.
Those tests are marked slow (run with KERNELGEN_SLOW_TESTS=1); the rest of the file takes seconds."""
import numpy as np
import pytest

from kernelgen.nn import (GELU, SGD, AdaptiveAvgPool2d, AvgPool2d, BatchNorm2d, Conv2d, Dropout, Linear, MaxPool2d,
                          RAdam, ReLU, RMSprop, Sequential, Sigmoid, Tanh, Tensor, no_grad, resnet18, resnet34, vgg16_bn)
from kernelgen.nn import functional as F

# ---- optimisers: PyTorch's update formulas, written out once more in float64 ----


def rmsprop_reference(p, grads, lr, alpha, eps, weight_decay, momentum, centered):
    v, m, buf = np.zeros_like(p), np.zeros_like(p), np.zeros_like(p)
    for g in grads:
        g = g + weight_decay * p
        v = alpha * v + (1 - alpha) * g ** 2
        if centered:
            m = alpha * m + (1 - alpha) * g
            avg = np.sqrt(v - m ** 2) + eps
        else:
            avg = np.sqrt(v) + eps
        if momentum > 0:
            buf = momentum * buf + g / avg
            p = p - lr * buf
        else:
            p = p - lr * g / avg
    return p


def radam_reference(p, grads, lr, betas, eps, weight_decay, decoupled):
    b1, b2 = betas
    m, v = np.zeros_like(p), np.zeros_like(p)
    rho_inf = 2 / (1 - b2) - 1
    for t, g in enumerate(grads, 1):
        if decoupled:
            p = p * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g ** 2
        m_hat = m / (1 - b1 ** t)
        rho_t = rho_inf - 2 * t * b2 ** t / (1 - b2 ** t)
        if rho_t > 5:
            rect = np.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
            p = p - lr * m_hat * rect * np.sqrt(1 - b2 ** t) / (np.sqrt(v) + eps)
        else:
            p = p - lr * m_hat
    return p


RMSPROP_CASES = [dict(lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=False),
                 dict(lr=3e-3, alpha=0.9, eps=1e-6, weight_decay=0.1, momentum=0.9, centered=False),
                 dict(lr=1e-2, alpha=0.95, eps=1e-8, weight_decay=0.01, momentum=0.5, centered=True)]
RADAM_CASES = [dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=False),
               dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, decoupled=False),
               dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, decoupled=True)]
STEPS = 12  # RAdam's rectified step starts at step 6 for beta2 = 0.999: both branches run


def run_optimizer(make, p0, grads):
    p = Tensor(p0.copy(), requires_grad=True)
    opt = make([p])
    for g in grads:
        p.grad = g.copy()
        opt.step()
    return p.data


@pytest.mark.parametrize("kw", RMSPROP_CASES)
def test_rmsprop_matches_pytorch_formulas(kw, rng):
    p0, grads = rng.standard_normal((4, 5)), rng.standard_normal((STEPS, 4, 5))
    np.testing.assert_allclose(run_optimizer(lambda ps: RMSprop(ps, **kw), p0, grads),
                               rmsprop_reference(p0, grads, **kw), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kw", RADAM_CASES)
def test_radam_matches_pytorch_formulas(kw, rng):
    p0, grads = rng.standard_normal((4, 5)), rng.standard_normal((STEPS, 4, 5))
    np.testing.assert_allclose(run_optimizer(lambda ps: RAdam(ps, **kw), p0, grads),
                               radam_reference(p0, grads, **kw), rtol=1e-12, atol=1e-14)


def test_optimizers_match_torch(rng):
    torch = pytest.importorskip("torch")
    p0, grads = rng.standard_normal((4, 5)), rng.standard_normal((STEPS, 4, 5))
    for ours, theirs, kw in [(RMSprop, torch.optim.RMSprop, c) for c in RMSPROP_CASES] + \
                            [(RAdam, torch.optim.RAdam, c) for c in RADAM_CASES]:
        tkw = {("decoupled_weight_decay" if k == "decoupled" else k): v for k, v in kw.items()}
        tp = torch.tensor(p0.copy(), requires_grad=True)
        opt = theirs([tp], **tkw)
        for g in grads:
            tp.grad = torch.tensor(g)
            opt.step()
        np.testing.assert_allclose(run_optimizer(lambda ps: ours(ps, **kw), p0, grads), tp.detach().numpy(),
                                   rtol=1e-10, atol=1e-12, err_msg=f"{ours.__name__} {kw}")


def test_new_optimizers_decrease_a_loss(rng):
    x = rng.standard_normal((32, 5))
    labels = (x @ rng.standard_normal((5, 3))).argmax(axis=1)  # separable: the loss can go well down
    for make in (lambda p: RMSprop(p, lr=0.03, momentum=0.5), lambda p: RAdam(p, lr=0.1, betas=(0.9, 0.99))):
        layer = Linear(5, 3, rng=np.random.default_rng(1), dtype="float64")
        opt = make(layer.parameters())
        losses = []
        for _ in range(40):
            loss = F.cross_entropy(layer(Tensor(x)), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.data))
        assert losses[-1] < 0.5 * losses[0], losses


# ---- modules ----

def test_layer_modules_call_their_ops(rng):
    x = rng.standard_normal((2, 6, 6, 3))
    for module, op in [(GELU(), F.gelu), (Sigmoid(), F.sigmoid), (Tanh(), F.tanh),
                       (MaxPool2d(3, 2, 1), lambda t: F.max_pool2d(t, 3, 2, 1)),
                       (AvgPool2d(2), lambda t: F.avg_pool2d(t, 2, 2)),
                       (AdaptiveAvgPool2d((2, 3)), lambda t: F.adaptive_avg_pool2d(t, (2, 3)))]:
        np.testing.assert_array_equal(module(Tensor(x)).data, op(x).data)


def test_dropout_module_follows_train_and_eval(rng):
    x = Tensor(rng.standard_normal((4, 8)) + 5)
    net = Sequential(Dropout(0.5, rng=0), ReLU())
    y = net(x).data
    assert (y == 0).any() and not np.array_equal(y, net(x).data)  # a fresh mask per call
    np.testing.assert_array_equal(Sequential(Dropout(0.5, rng=0), ReLU())(x).data, y)  # the seed fixes the masks
    net.eval()
    np.testing.assert_array_equal(net(x).data, x.data)


# ---- models ----

def count(model, kind):
    found = [model] if isinstance(model, kind) else []
    for c in model.children():
        found += count(c, kind)
    return found


def check_one_training_step(model, x, classes, rng):
    """Forward shape, one backward pass with a finite gradient of the right shape for every parameter, an
    optimiser step that changes the output, and batch-norm running statistics that moved."""
    logits = model(Tensor(x))
    assert logits.shape == (x.shape[0], classes) and np.isfinite(logits.data).all()
    loss = F.cross_entropy(logits, rng.integers(0, classes, x.shape[0]))
    loss.backward()
    params = model.parameters()
    for i, p in enumerate(params):
        assert p.grad is not None and p.grad.shape == p.shape, i
        assert np.isfinite(p.grad).all(), i
    assert sum(float(np.abs(p.grad).sum()) for p in params) > 0
    assert all(not np.allclose(bn.running_mean, 0) for bn in count(model, BatchNorm2d))
    SGD(params, lr=0.1).step()
    with no_grad():
        assert not np.allclose(model(Tensor(x)).data, logits.data)


@pytest.mark.slow
def test_resnet18_cifar_stem_trains(rng):
    model = resnet18(10, width=4, stem="cifar", seed=int(rng.integers(1000)))
    assert len(count(model, Conv2d)) == 20 and len(count(model, BatchNorm2d)) == 20  # 17 convs + 3 projections
    check_one_training_step(model, rng.standard_normal((2, 32, 32, 3)).astype(np.float32), 10, rng)


@pytest.mark.slow
def test_resnet34_cifar_stem_trains(rng):
    model = resnet34(7, width=4, stem="cifar", seed=int(rng.integers(1000)))
    assert len(count(model, Conv2d)) == 36  # 33 convs + 3 projections
    check_one_training_step(model, rng.standard_normal((2, 32, 32, 3)).astype(np.float32), 7, rng)


@pytest.mark.slow
def test_resnet18_imagenet_stem_trains(rng):
    model = resnet18(5, width=4, stem="imagenet", seed=int(rng.integers(1000)))
    x = rng.standard_normal((2, 128, 128, 3)).astype(np.float32)
    with no_grad():
        assert model.stem(Tensor(x)).shape == (2, 32, 32, 4)  # 7x7/2 convolution, then 3x3/2 max-pool
    check_one_training_step(model, x, 5, rng)


def test_resnet_parameter_counts_match_torchvision():
    # torchvision's resnet18 / resnet34 (1000 classes): 11,689,512 and 21,797,672 parameters
    for make, n in ((resnet18, 11_689_512), (resnet34, 21_797_672)):
        assert sum(p.data.size for p in make(1000).parameters()) == n


@pytest.mark.slow
def test_vgg16_bn_trains(rng):
    model = vgg16_bn(10, width=4, hidden=16, seed=int(rng.integers(1000)))
    assert len(count(model, Conv2d)) == 13 and len(count(model, BatchNorm2d)) == 13 and len(count(model, Linear)) == 3
    x = rng.standard_normal((2, 32, 32, 3)).astype(np.float32)
    with no_grad():
        assert model.avgpool(model.features(Tensor(x))).shape == (2, 7, 7, 32)  # 1x1 maps spread to 7x7
    check_one_training_step(model, x, 10, rng)
    model.eval()  # dropout off, running statistics: evaluation is deterministic
    with no_grad():
        np.testing.assert_array_equal(model(Tensor(x)).data, model(Tensor(x)).data)


@pytest.mark.slow
def test_model_state_round_trip_through_npz(tmp_path, rng):
    a, b = resnet18(10, width=4, stem="cifar", seed=1), resnet18(10, width=4, stem="cifar", seed=2)
    for bn in count(a, BatchNorm2d):  # buffers travel too
        bn.running_mean[...] = rng.standard_normal(bn.running_mean.shape)
    a.save(tmp_path / "resnet18.npz")
    b.load(tmp_path / "resnet18.npz")
    x = Tensor(rng.standard_normal((2, 32, 32, 3)).astype(np.float32))
    with no_grad():
        np.testing.assert_array_equal(a.eval()(x).data, b.eval()(x).data)
    with pytest.raises(ValueError, match="keys"):
        resnet34(10, width=4, stem="cifar").load(tmp_path / "resnet18.npz")


def test_resnet50_has_torchvision_s_parameters_in_the_torch_twin_s_order():
    """kernelgen.nn.resnet50 and its PyTorch twin (kernelgen.nn.torch_twins, the bench's comparator): 25,557,032
    parameters at 1000 classes (torchvision's ResNet-50), layer by layer the same shapes (filters channels-last)."""
    torch = pytest.importorskip("torch")
    from kernelgen.nn import resnet50
    from kernelgen.nn.torch_twins import torch_resnet50
    ours = resnet50(1000)
    twin = torch_resnet50(torch, 1000)
    theirs = [tuple(p.shape) for p in twin.parameters()]
    assert sum(int(np.prod(s)) for s in theirs) == 25_557_032
    mine = [p.shape for p in ours.parameters()]
    assert len(mine) == len(theirs)
    as_nhwc = [(s[0],) + s[2:] + (s[1],) if len(s) == 4 else s for s in theirs]
    assert mine[:-2] == as_nhwc[:-2]  # (the final Linear lists its bias first)
    assert sorted(mine[-2:]) == sorted(as_nhwc[-2:])


def test_copy_weights_gives_the_torch_twin_our_filters_and_statistics(rng):
    """torch_twins.copy_weights: each convolution's filter (channels-last -> PyTorch's (K, C, R, S)), each batch
    norm's weight, bias and running statistics, the linear layer's weight and bias - layer by layer."""
    torch = pytest.importorskip("torch")
    from kernelgen.nn import resnet18
    from kernelgen.nn.torch_twins import copy_weights, torch_resnet18
    model = resnet18(10, width=4, stem="cifar", seed=int(rng.integers(1000)))
    model.layer1.layers[0].bn1.running_mean[:] = rng.standard_normal(4)
    twin = torch_resnet18(torch, 10, 4)
    copy_weights(torch, model, twin)
    block, tblock = model.layer2.layers[0], twin[5]  # (the stem is 3 layers, then layer1's 2 blocks)
    np.testing.assert_array_equal(tblock.conv1.weight.detach().numpy(), block.conv1.weight.data.transpose(0, 3, 1, 2))
    np.testing.assert_array_equal(tblock.shortcut[0].weight.detach().numpy(),
                                  block.shortcut.layers[0].weight.data.transpose(0, 3, 1, 2))
    np.testing.assert_array_equal(twin[3].bn1.running_mean.numpy(), model.layer1.layers[0].bn1.running_mean)
    np.testing.assert_array_equal(twin[-1].weight.detach().numpy(), model.fc.weight.data)
    np.testing.assert_array_equal(twin[-1].bias.detach().numpy(), model.fc.bias.data)
    with pytest.raises(ValueError, match="different layers"):
        copy_weights(torch, resnet18(10, width=4, stem="imagenet"), torch_resnet18(torch, 10, 4, blocks=(1, 1, 1, 1)))
