"""kernelgen.nn's device ops on a real GPU against PyTorch (fp32, TF32 off) on the same fresh random data:
forward values, the gradient of every input, running statistics, optimiser updates.  Marker `gpu`;
skipped without torch.  Errors are relative to the largest reference value."""
import numpy as np
import pytest

from kernelgen.nn import SGD, Adam, ResNet, Tensor
from kernelgen.nn import functional as F

from nn_reference import dropout_keep, dropout_seed
from harness import rel_err
from torch_compare import compare_with_torch, nchw, nhwc

pytestmark = pytest.mark.gpu
TOL = 1e-4


def compare(torch, ours, theirs, arrays, rng, tol=TOL, torch_dtype=None):
    """ours(device Tensors) and theirs(torch CUDA tensors, same NHWC layout): forward and gradients of
    sum(output * random projection)."""
    from kernelgen.nn import cuda_ops
    compare_with_torch(torch, ours, theirs, arrays, rng, tol, lambda a: Tensor(a, requires_grad=True).cuda(),
                       lambda p: cuda_ops.to_device(p) if p.ndim else None, lambda t: t.grad.copy_to_host(),
                       torch_dtype)


def test_elementwise(torch, rng):
    a, b = rng.standard_normal((2, 4, 4, 8)).astype(np.float32), rng.standard_normal((2, 4, 4, 8)).astype(np.float32)
    compare(torch, F.relu, torch.relu, [a], rng)
    compare(torch, lambda x, y: F.add_relu(F.add(x, y), x), lambda x, y: torch.relu(x + y + x), [a, b], rng)


# ours, and torch's (built from the fixture's module)
ACTIVATIONS = {"leaky_relu": (lambda a: F.leaky_relu(a, 0.1), lambda t: lambda a: t.nn.functional.leaky_relu(a, 0.1)),
               "sigmoid": (F.sigmoid, lambda t: t.sigmoid),
               "tanh": (F.tanh, lambda t: t.tanh),
               "gelu": (F.gelu, lambda t: lambda a: t.nn.functional.gelu(a, approximate="tanh"))}


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_activations(torch, name, rng):
    ours, theirs = ACTIVATIONS[name][0], ACTIVATIONS[name][1](torch)
    compare(torch, ours, theirs, [(3 * rng.standard_normal((3, 5, 5, 8))).astype(np.float32)], rng)
    # far tails apart (relative errors are against the largest value): saturated, finite, no NaN gradient.
    # PyTorch in float64 is the reference there: its float32 sigmoid backward s * (1 - s) cancels to ~1 %
    # error at u = 12 (measured on the H100), where ours keeps e^-|u| / (1 + e^-|u|)^2 exact to fp32
    tails = np.array([-1e4, -3e3, -200, -89, -60, -30, -12, 12, 30, 60, 89, 200, 3e3, 1e4], np.float32)
    compare(torch, ours, theirs, [tails * rng.choice([1, 1.01], tails.shape).astype(np.float32)], rng,
            torch_dtype=torch.float64)


@pytest.mark.parametrize("a_shape,b_shape", [((4, 3, 3, 5), (4, 3, 3, 5)), ((4, 3, 3, 5), (5,)),
                                             ((4, 3, 3, 5), (4, 1, 1, 5)), ((3, 1, 5), (4, 1, 1, 1)),
                                             ((5,), (4, 3, 3, 5)), ((4, 3, 3, 5), ())])
def test_mul_broadcasting(torch, a_shape, b_shape, rng):
    a = np.asarray(rng.standard_normal(a_shape), np.float32)
    b = np.asarray(rng.standard_normal(b_shape), np.float32)
    compare(torch, F.mul, lambda x, y: x * y, [a, b], rng)


@pytest.mark.parametrize("axis", [0, 1, 2, 3, -1])
def test_concat(torch, axis, rng):
    shapes = [(2, 3, 4, 5), (2, 3, 4, 5), (2, 3, 4, 5)]
    shapes[1] = tuple(n + 2 if d == axis % 4 else n for d, n in enumerate(shapes[1]))  # a wider middle piece
    arrays = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    compare(torch, lambda *t: F.concat(t, axis=axis), lambda *t: torch.cat(t, dim=axis), arrays, rng)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout(torch, p, rng):
    """torch draws its own masks: it applies ours (the host reference of the device hash) instead, which
    checks the device mask bit for bit, the inverted scaling and the backward's reuse of the mask."""
    x = rng.standard_normal((4, 6, 6, 8)).astype(np.float32)
    gen_seed = int(rng.integers(2 ** 63))
    keep = dropout_keep(dropout_seed(gen_seed), x.shape, p)
    mask = torch.tensor(keep / (1 - p), dtype=torch.float32, device="cuda")
    compare(torch, lambda t: F.dropout(t, p, generator=np.random.default_rng(gen_seed)), lambda t: t * mask, [x], rng)
    assert abs(keep.mean() - (1 - p)) <= 5 * np.sqrt(p * (1 - p) / keep.size)


@pytest.mark.parametrize("kernel,stride,padding", [(2, 2, 0), (3, 2, 1), (3, 1, 1), ((3, 2), (1, 2), (1, 0))])
def test_pools(torch, kernel, stride, padding, rng):
    x = rng.standard_normal((2, 9, 9, 6)).astype(np.float32)
    tf = torch.nn.functional
    compare(torch, lambda a: F.max_pool2d(a, kernel, stride, padding),
            lambda a: nhwc(tf.max_pool2d(nchw(a), kernel, stride, padding)), [x], rng)
    # torch's avg_pool2d CUDA backward on channels_last input with padding > 0 returns wrong gradients
    # (pytorch/pytorch#188344, see test_nn_torch_parity.py): compare with its NCHW-contiguous kernel
    for include in (True, False):
        compare(torch, lambda a: F.avg_pool2d(a, kernel, stride, padding, count_include_pad=include),
                lambda a: nhwc(tf.avg_pool2d(nchw(a).contiguous(), kernel, stride, padding,
                                             count_include_pad=include)), [x], rng)


@pytest.mark.parametrize("out", [1, 3, (2, 4), (9, 11)])
def test_adaptive_avg_pool(torch, out, rng):
    x = rng.standard_normal((2, 7, 9, 5)).astype(np.float32)
    compare(torch, lambda a: F.adaptive_avg_pool2d(a, out),
            lambda a: nhwc(torch.nn.functional.adaptive_avg_pool2d(nchw(a).contiguous(), out)), [x], rng)


@pytest.mark.parametrize("training,relu", [(True, False), (True, True), (False, False), (False, True)])
def test_batch_norm(torch, training, relu, rng):
    c = 16
    x = (1 + 2 * rng.standard_normal((8, 6, 6, c))).astype(np.float32)
    w, b = (1 + rng.random(c)).astype(np.float32), rng.standard_normal(c).astype(np.float32)
    rm, rv = rng.standard_normal(c).astype(np.float32), (0.5 + rng.random(c)).astype(np.float32)
    trm, trv = torch.tensor(rm, device="cuda"), torch.tensor(rv, device="cuda")
    drm, drv = Tensor(rm).cuda().data, Tensor(rv).cuda().data
    fn = F.batch_norm_relu if relu else F.batch_norm
    act = torch.relu if relu else (lambda t: t)
    compare(torch, lambda x, w, b: fn(x, w, b, drm, drv, training=training, momentum=0.2),
            lambda x, w, b: nhwc(act(torch.nn.functional.batch_norm(nchw(x), trm, trv, w, b, training, 0.2, 1e-5))),
            [x, w, b], rng)
    assert rel_err(drm.copy_to_host(), trm.cpu().numpy()) <= 1e-6
    assert rel_err(drv.copy_to_host(), trv.cpu().numpy()) <= 1e-6


def test_batch_norm_add_relu(torch, rng):
    c = 16
    x, r = rng.standard_normal((8, 4, 4, c)).astype(np.float32), rng.standard_normal((8, 4, 4, c)).astype(np.float32)
    w, b = (1 + rng.random(c)).astype(np.float32), rng.standard_normal(c).astype(np.float32)
    drm, drv = Tensor(np.zeros(c, np.float32)).cuda().data, Tensor(np.ones(c, np.float32)).cuda().data
    trm, trv = torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")
    compare(torch, lambda x, w, b, r: F.batch_norm_add_relu(x, w, b, drm, drv, F.add(r, r), training=True, inplace=True),
            lambda x, w, b, r: torch.relu(nhwc(torch.nn.functional.batch_norm(nchw(x), trm, trv, w, b, True)) + 2 * r),
            [x, w, b, r], rng)


def test_pool_linear_conv_loss(torch, rng):
    x = rng.standard_normal((4, 5, 5, 16)).astype(np.float32)
    compare(torch, F.global_avg_pool, lambda t: t.mean(dim=(1, 2)), [x], rng)
    compare(torch, F.linear, torch.nn.functional.linear,
            [rng.standard_normal((8, 32)).astype(np.float32), rng.standard_normal((10, 32)).astype(np.float32),
             rng.standard_normal(10).astype(np.float32)], rng)
    w, b = rng.standard_normal((12, 3, 3, 16)).astype(np.float32), rng.standard_normal(12).astype(np.float32)
    compare(torch, lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1),
            lambda x, w, b: nhwc(torch.nn.functional.conv2d(nchw(x), nchw(w), b, stride=2, padding=1)), [x, w, b], rng)
    labels = rng.integers(0, 10, 16)
    tl = torch.tensor(labels, device="cuda")
    compare(torch, lambda z: F.cross_entropy(z, labels), lambda z: torch.nn.functional.cross_entropy(z, tl),
            [(3 * rng.standard_normal((16, 10))).astype(np.float32)], rng)


@pytest.mark.parametrize("name,kw", [("SGD", dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
                                     ("Adam", dict(lr=0.01, weight_decay=0.1)),
                                     ("AdamW", dict(lr=0.01, weight_decay=0.1))])
def test_optimizers(torch, name, kw, rng):
    p0, grads = rng.standard_normal(1000).astype(np.float32), rng.standard_normal((5, 1000)).astype(np.float32)
    p = Tensor(p0.copy(), requires_grad=True).cuda()
    ours = SGD([p], **kw) if name == "SGD" else Adam([p], decoupled=name == "AdamW", **kw)
    tp = torch.tensor(p0.copy(), device="cuda", requires_grad=True)
    theirs = getattr(torch.optim, name)([tp], **kw)
    for g in grads:
        p.grad, tp.grad = Tensor(g).cuda().data, torch.tensor(g, device="cuda")
        ours.step()
        theirs.step()
    assert rel_err(p.numpy(), tp.detach().cpu().numpy()) <= 1e-5


def _resnet_pair(torch, rng):
    """A whole ResNet (one block per stage) on the device and PyTorch's twin given the same weights
    (torch_twins.copy_weights); with the (ours, theirs, is_conv) parameter pairs."""
    from kernelgen.nn.modules import BatchNorm2d, Conv2d, Linear
    from kernelgen.nn.torch_twins import copy_weights, torch_resnet18, weighted_layers
    model = ResNet((1, 1, 1, 1), 10, width=8, stem="cifar", seed=int(rng.integers(1000))).to("cuda")
    twin = torch_resnet18(torch, 10, 8, blocks=(1, 1, 1, 1)).cuda()
    copy_weights(torch, model, twin)
    theirs = [m for m in twin.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.BatchNorm2d, torch.nn.Linear))]
    pairs = []
    for o, t in zip(weighted_layers(model, (Conv2d, BatchNorm2d, Linear)), theirs):
        pairs.append((o.weight, t.weight, isinstance(t, torch.nn.Conv2d)))
        if getattr(t, "bias", None) is not None:
            pairs.append((o.bias, t.bias, False))
    return model, twin, pairs


def _as_ours(t, conv):
    return (t.permute(0, 2, 3, 1) if conv else t).detach().cpu().numpy()


def test_resnet_training_step_matches_pytorch(torch, rng):
    """A whole ResNet (one block per stage) on the device, PyTorch's twin given the same weights: the loss,
    every parameter's gradient and the parameters after an SGD step agree."""
    model, twin, pairs = _resnet_pair(torch, rng)
    x = rng.standard_normal((8, 16, 16, 3)).astype(np.float32)
    labels = rng.integers(0, 10, 8)
    opt, topt = SGD(model.parameters(), lr=0.1, momentum=0.9), torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    loss = F.cross_entropy(model(Tensor(x).cuda()), labels)
    loss.backward()
    tloss = torch.nn.functional.cross_entropy(twin(nchw(torch.tensor(x, device="cuda"))), torch.tensor(labels).cuda())
    tloss.backward()
    assert abs(loss.item() - tloss.item()) <= 1e-4 * abs(tloss.item())
    for i, (o, t, conv) in enumerate(pairs):
        err = rel_err(o.grad.copy_to_host(), _as_ours(t.grad, conv))
        assert err <= 1e-3, f"parameter {i} {tuple(o.shape)}: gradient relative error {err:.3g}"
    opt.step()
    topt.step()
    for i, (o, t, conv) in enumerate(pairs):
        assert rel_err(o.numpy(), _as_ours(t, conv)) <= 1e-4, f"parameter {i} after the step"


def _fp16_step_errors(torch, rng):
    """One ResNet step at fp16 three ways against PyTorch fp32 on the same weights and data: kernelgen on float16
    activations, kernelgen on float32 arrays rounded in its kernels, torch.autocast(float16).  Per way: (loss
    relative error, gradients' error relative to the largest, the dtype of layer1's output)."""
    from kernelgen import settings
    from kernelgen.nn import amp
    model, twin, pairs = _resnet_pair(torch, rng)
    x = rng.standard_normal((16, 16, 16, 3)).astype(np.float32)
    labels = rng.integers(0, 10, 16)
    xt, yt = nchw(torch.tensor(x, device="cuda")), torch.tensor(labels).cuda()

    def torch_grads(autocast):
        twin.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16, enabled=autocast):
            loss = torch.nn.functional.cross_entropy(twin(xt), yt)
        loss.backward()
        return loss.item(), np.concatenate([_as_ours(t.grad.float(), conv).ravel() for _, t, conv in pairs])
    ref_loss, ref = torch_grads(False)
    errors = {}
    for name, half in (("float16 activations", True), ("float32 arrays", False)):
        for o, _, _ in pairs:
            o.grad = None
        with settings.scope(nn_half_activations=half), amp.autocast("fp16"):
            hidden = model.layer1(model.stem(Tensor(x).cuda()))
            loss = F.cross_entropy(model.fc(F.global_avg_pool(model.layer4(model.layer3(model.layer2(hidden))))),
                                   labels)
        loss.backward()
        grads = [o.grad.copy_to_host() for o, _, _ in pairs]
        assert all(g.dtype == np.float32 for g in grads), name
        errors[name] = (abs(loss.item() - ref_loss) / abs(ref_loss),
                        rel_err(np.concatenate([g.ravel() for g in grads]), ref), hidden.dtype)
    loss, grads = torch_grads(True)
    errors["torch.autocast"] = (abs(loss - ref_loss) / abs(ref_loss), rel_err(grads, ref), None)
    return errors


def test_fp16_training_step_on_float16_activations_is_as_close_to_fp32_as_pytorch_autocast(torch, rng):
    """kernelgen.nn.amp.autocast("fp16") on float16 activations (settings.nn_half_activations: the convolutions read
    and write float16 arrays, the batch norms and sums run on them, the parameters' gradients are float32) lands
    as close to the fp32 step (PyTorch, same weights and data) as torch.autocast(float16) does: fp16 rounds
    activations to 10 bits, and a batch norm's backward amplifies that in the weights just before it, on either
    side - within 3x PyTorch's own distance, plus 1 % of the largest gradient."""
    errors = _fp16_step_errors(torch, rng)
    print(errors)
    half, arrays, theirs = errors["float16 activations"], errors["float32 arrays"], errors["torch.autocast"]
    assert half[2] == np.float16 and arrays[2] == np.float32
    assert half[0] <= 3 * theirs[0] + 1e-2, errors
    assert half[1] <= 3 * theirs[1] + 1e-2, errors


def _last_to_second(t):   # (N, *spatial, C) -> (N, C, *spatial)
    return t.permute(0, t.dim() - 1, *range(1, t.dim() - 1))


def _second_to_last(t):
    return t.permute(0, *range(2, t.dim()), 1)


def test_conv1d_conv3d_conv_transpose(torch, rng):
    fn = torch.nn.functional
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)
    compare(torch, lambda x, w, b: F.conv1d(x, w, b, stride=2, padding=1, groups=2),
            lambda x, w, b: _second_to_last(fn.conv1d(_last_to_second(x), _last_to_second(w), b, stride=2, padding=1,
                                                       groups=2)),
            [f32(2, 11, 4), f32(6, 3, 2), f32(6)], rng)
    compare(torch, lambda x, w, b: F.conv3d(x, w, b, padding=1, dilation=(1, 2, 1)),
            lambda x, w, b: _second_to_last(fn.conv3d(_last_to_second(x), _last_to_second(w), b, padding=1,
                                                       dilation=(1, 2, 1))),
            [f32(2, 4, 5, 6, 3), f32(4, 3, 3, 3, 3), f32(4)], rng)
    # PyTorch's transposed weight is (C_in, C_out // groups, *filter); ours keeps C_out // groups last
    compare(torch, lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, padding=1, output_padding=1, groups=2),
            lambda x, w, b: nhwc(fn.conv_transpose2d(nchw(x), nchw(w), b, stride=2, padding=1, output_padding=1,
                                                     groups=2)),
            [f32(2, 5, 6, 4), f32(4, 3, 3, 3), f32(6)], rng)

