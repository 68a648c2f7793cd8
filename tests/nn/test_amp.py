"""kernelgen.nn.amp: GradScaler's rules (PyTorch's) on host gradients, its device kernel in the simulator, and
loss scaling doing what it is for: with fp16 convolutions, gradients below fp16's range survive only when scaled."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

from kernelgen.nn import SGD, Conv2d, Tensor, amp
from kernelgen.nn import functional as F


class _Param:
    def __init__(self, grad):
        self.data, self.grad = np.zeros_like(grad), grad


class _Opt:
    def __init__(self, *grads):
        self.params, self.steps = [_Param(np.asarray(g, np.float32)) for g in grads], 0

    def step(self):
        self.steps += 1


def test_unscale_step_update_follow_pytorch_s_rules():
    scaler = amp.GradScaler(init_scale=8.0, growth_interval=2)
    opt = _Opt([8.0, -16.0], [4.0])
    assert scaler.step(opt) and opt.steps == 1  # unscaled: divided by 8, finite
    np.testing.assert_array_equal(opt.params[0].grad, [1.0, -2.0])
    np.testing.assert_array_equal(opt.params[1].grad, [0.5])
    scaler.update()
    assert scaler.get_scale() == 8.0  # one clean step of two
    scaler.step(_Opt([1.0]))
    scaler.update()
    assert scaler.get_scale() == 16.0  # two clean steps: grown
    bad = _Opt([np.inf, 1.0], [np.nan])
    assert not scaler.step(bad) and bad.steps == 0  # skipped
    scaler.update()
    assert scaler.get_scale() == 8.0  # backed off, growth counting again from 0
    scaler.step(_Opt([1.0]))
    scaler.update()
    assert scaler.get_scale() == 8.0


def test_call_order_and_arguments_are_checked():
    scaler = amp.GradScaler()
    opt = _Opt([1.0])
    with pytest.raises(RuntimeError, match="update"):
        scaler.update()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already called"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="another optimizer"):
        scaler.step(_Opt([1.0]))
    for bad in (dict(init_scale=0), dict(init_scale=float("inf")), dict(growth_factor=1.0),
                dict(backoff_factor=1.5), dict(growth_interval=0), dict(growth_interval=True)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            amp.GradScaler(**bad)


def test_disabled_is_a_pass_through_and_state_round_trips():
    off = amp.GradScaler(enabled=False)
    loss = Tensor(np.float32(2.0))
    opt = _Opt([np.inf])
    assert off.scale(loss) is loss and off.get_scale() == 1.0 and off.step(opt) and opt.steps == 1
    off.update()
    on = amp.GradScaler(init_scale=4.0, growth_interval=3)
    on.step(_Opt([1.0]))
    on.update()
    again = amp.GradScaler()
    again.load_state_dict(on.state_dict())
    assert again.state_dict() == on.state_dict() == {"scale": 4.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                                                     "growth_interval": 3, "growth_tracker": 1}


def test_scaling_keeps_fp16_gradients_that_would_underflow(rng):
    """A 1x1 convolution whose logits are scaled by 1e-7: the gradient reaching it (~1e-9 a value) is below fp16's
    smallest subnormal (6e-8), so with fp16 convolutions the input gradient vanishes unscaled; scaled by 2**16 and
    unscaled afterwards it matches the float32 gradient to fp16's precision."""
    x = rng.standard_normal((2, 4, 4, 8)).astype(np.float32)
    conv, labels = Conv2d(8, 8, 1), np.array([1, 5])

    def grad(precision, scale):
        conv.weight.grad = conv.bias.grad = None
        xt = Tensor(x, requires_grad=True)
        with amp.autocast(precision):
            loss = F.cross_entropy(F.global_avg_pool(conv(xt)) * np.float32(1e-7), labels)
        (loss * np.float32(scale)).backward()
        return xt.grad / scale
    want = grad("fp32", 1.0)
    assert not grad("fp16", 1.0).any()  # every value flushed to zero
    got = grad("fp16", 2.0 ** 16)
    assert np.abs(got - want).max() <= 2e-3 * np.abs(want).max()


def test_training_with_a_scaler_skips_overflowing_steps_and_backs_off(rng):
    """SGD steps of a tiny net through the scaler, starting at a scale (2**40) at which the fp16 convolutions'
    gradients overflow: those steps are skipped, leaving the parameters as they were, and halve the scale, until
    one is finite and the parameters move."""
    conv = Conv2d(3, 4, 3, padding=1)
    opt = SGD(conv.parameters(), lr=0.1)
    scaler = amp.GradScaler(init_scale=2.0 ** 40)
    x, y = rng.standard_normal((2, 5, 5, 3)).astype(np.float32), np.array([1, 3])
    before = conv.weight.data.copy()
    for step in range(40):
        opt.zero_grad()
        with amp.autocast("fp16"):
            loss = F.cross_entropy(F.global_avg_pool(conv(Tensor(x))), y)
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        stepped = scaler.step(opt)
        scaler.update()
        if stepped:
            break
        assert np.array_equal(conv.weight.data, before) and scaler.get_scale() == scale / 2
    assert stepped and step > 0 and not np.array_equal(conv.weight.data, before)


@pytest.mark.sim
def test_device_unscale_kernel_matches_the_host(rng):
    from kernelgen.nn import cuda_ops
    g = rng.standard_normal(300).astype(np.float32) * 64
    flag, scale = cuda_ops.zero_flag(), cuda_ops.to_device(np.array([64.0], np.float32))
    d = cuda_ops.to_device(g)
    cuda_ops.unscale_all_([d], scale, flag)
    np.testing.assert_array_equal(cuda_ops.to_host(d), g * np.float32(1 / 64))
    assert cuda_ops.to_host(flag)[0] == 0
    g[17] = np.inf
    cuda_ops.unscale_all_([cuda_ops.to_device(g)], scale, flag)
    assert cuda_ops.to_host(flag)[0] == 1
    # ten gradients, 8 a launch: every one unscaled, and an inf in the second launch's last one sets the flag
    grads = [rng.standard_normal(n).astype(np.float32) * 64 for n in (5, 1, 30, 7, 2, 64, 3, 9, 11, 4)]
    flag = cuda_ops.zero_flag()
    dev = [cuda_ops.to_device(a) for a in grads]
    cuda_ops.unscale_all_(dev, scale, flag)
    for a, d in zip(grads, dev):
        np.testing.assert_array_equal(cuda_ops.to_host(d), a * np.float32(1 / 64))
    assert cuda_ops.to_host(flag)[0] == 0
    grads[-1][3] = np.inf
    cuda_ops.unscale_all_([cuda_ops.to_device(a) for a in grads], scale, flag)
    assert cuda_ops.to_host(flag)[0] == 1


@pytest.mark.sim
def test_the_device_scale_update_follows_the_host_rules():
    """update_scale (the device's GradScaler.update) against the host rules, step by step: growth after
    growth_interval clean steps, backoff and a reset count after a flagged one, the flag cleared each time."""
    from kernelgen.nn import cuda_ops
    scale, tracker = cuda_ops.to_device(np.array([8.0], np.float32)), cuda_ops.to_device(np.array([0], np.int64))
    flag = cuda_ops.zero_flag()
    host = amp.GradScaler(init_scale=8.0, growth_interval=2)
    for bad in (False, False, False, True, False, False, True, True, False):
        if bad:
            flag.copy_to_device(np.array([1], np.int64))
        cuda_ops.update_scale(scale, tracker, flag, 2.0, 0.5, 2)
        host.step(_Opt([np.inf if bad else 1.0]))
        host.update()
        assert cuda_ops.to_host(scale)[0] == host.get_scale() and cuda_ops.to_host(flag)[0] == 0
        assert cuda_ops.to_host(tracker)[0] == host.state_dict()["growth_tracker"]


@pytest.mark.sim
@pytest.mark.parametrize("graph_mode", [False, True], ids=["eager", "graph-mode"])
def test_a_step_with_an_inf_gradient_is_skipped_on_the_device(graph_mode):
    """A device step whose gradient holds an inf leaves the weights and the momentum alone and backs the scale off;
    in graph mode (a captured step's) the host never reads the flag - step() returns None - and the optimizer's
    kernels skip themselves; the next clean step steps."""
    from kernelgen.nn import cuda_ops
    conv = Conv2d(2, 3, 3, padding=1, rng=np.random.default_rng(0)).to("cuda")
    opt, scaler = SGD(conv.parameters(), lr=0.5, momentum=0.9), amp.GradScaler(init_scale=2.0 ** 8)
    x = Tensor(np.ones((1, 4, 4, 2), np.float32)).to("cuda")
    mode = cuda_ops.graph_mode if graph_mode else contextlib.nullcontext
    for poison in (True, False):
        before = {k: v.copy() for k, v in conv.state_dict().items()}
        loss = F.cross_entropy(F.global_avg_pool(conv(x)), np.array([1]))
        with mode():
            scaler.scale(loss).backward()
            if poison:
                g = cuda_ops.to_host(conv.weight.grad)
                g[0, 0, 0, 0] = np.inf
                conv.weight.grad.copy_to_device(g)
            stepped = scaler.step(opt)
            scaler.update()
        assert stepped is (None if graph_mode else not poison)
        changed = not np.array_equal(conv.state_dict()["weight"], before["weight"])
        assert changed is not poison
        assert scaler.get_scale() == 2.0 ** 8 / 2  # backed off once, not yet grown
        opt.zero_grad()


@pytest.mark.sim
def test_host_gradients_are_unscaled_by_the_device_scale():
    """Once the scale lives on the device, a host loss and host gradients (an optimizer over host and device
    parameters) use the device's scale, not the host's copy from before the device backed it off."""
    from kernelgen.nn import cuda_ops
    scaler = amp.GradScaler(init_scale=8.0)
    device_grad = cuda_ops.to_device(np.array([np.inf], np.float32))
    opt = _Opt([8.0])
    opt.params.append(_Param(device_grad))
    scaler.scale(Tensor(np.ones((), np.float32)).to("cuda"))  # the state moves to the device (scale 8)
    assert scaler.step(opt) is False  # the device gradient's inf: skipped
    scaler.update()  # backed off on the device: 4
    assert scaler.get_scale() == 4.0
    assert float(scaler.scale(Tensor(np.ones((), np.float32))).data) == 4.0
    opt = _Opt([8.0])
    scaler.unscale_(opt)
    np.testing.assert_array_equal(opt.params[0].grad, [2.0])


@pytest.mark.sim
def test_a_device_step_through_the_scaler_equals_the_unscaled_step(rng):
    """The whole scaler path on device tensors (the simulator): the scaled loss's backward, the device unscale and
    the optimizer step give the parameters an unscaled step gives (a power-of-two scale is exact in float32)."""
    x, y = rng.standard_normal((2, 4, 4, 2)).astype(np.float32), np.array([0, 2])

    def step(scaler):
        conv = Conv2d(2, 3, 3, padding=1, rng=np.random.default_rng(0)).to("cuda")
        opt = SGD(conv.parameters(), lr=0.5)
        loss = F.cross_entropy(F.global_avg_pool(conv(Tensor(x).to("cuda"))), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            assert scaler.step(opt)
            scaler.update()
        return conv.state_dict()
    want, got = step(None), step(amp.GradScaler(init_scale=2.0 ** 12))
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7)
