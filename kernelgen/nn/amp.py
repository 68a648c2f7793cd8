"""Automatic mixed precision, as torch.amp: `autocast` and a dynamic loss scaler, `GradScaler` (issue 30).

    scaler = kernelgen.nn.amp.GradScaler()
    with kernelgen.nn.amp.autocast("fp16"):
        loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)      # unscales the gradients; skips the step if any is inf or nan
    scaler.update()       # halves the scale after a skipped step, doubles it after growth_interval clean ones

autocast is mixed_precision.precision: the convolutions run on the 16-bit tensor-core kernels with fp32
accumulation, the parameters (fp32 master weights), gradients and optimizer state stay float32.  What fp16 loses
without a scaler is the backward's small values: the convolutions round dy to fp16, whose normal range ends at
6e-5, so late in training most of a gradient's bits are gone.  The scaler multiplies the loss - and so every
gradient on the way back - by a large power of two, and divides the parameters' gradients by it before the
optimizer steps.  bf16 has fp32's range and needs no scaler (enabled=False makes every method a pass-through).
"""
from __future__ import annotations

import math

import numpy as np

from kernelgen.nn.mixed_precision import precision as autocast  # noqa: F401 (the torch.amp name)
from kernelgen.nn.tensor import Tensor, _on_device, device_kernels


def amp_precision(precision: str) -> str:
    """The convolutions' precision under AMP (train --amp): a 16-bit format as given, fp16 otherwise."""
    return precision if precision in ("fp16", "bf16") else "fp16"


def _positive(name, value, above_one=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    if above_one and value <= 1:
        raise ValueError(f"{name} must be > 1, got {value!r}")
    return float(value)


class GradScaler:
    """Dynamic loss scaling (PyTorch's GradScaler rules and defaults): the loss is multiplied by `scale`; before a
    step the gradients are divided by it and checked; a step with an inf or nan gradient is skipped and the scale
    multiplied by backoff_factor; after growth_interval steps in a row without one it is multiplied by
    growth_factor.  One scaler serves one optimizer per step (unscale_ / step / update, in that order).

    With device gradients the scale, the growth count and the found-inf flag live on the device, as torch's do
    (cuda_optim.py): scaling, unscaling and the update are kernels, and the host reads the flag once a step to
    decide the step - except in graph mode (a captured step and its warm-up, graphs.py), where nothing is read
    back: the optimizer's kernels skip on the flag themselves, and step() returns None."""

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 enabled=True):
        self._scale = _positive("init_scale", init_scale)
        self.growth_factor = _positive("growth_factor", growth_factor, above_one=True)
        self.backoff_factor = _positive("backoff_factor", backoff_factor)
        if self.backoff_factor >= 1:
            raise ValueError(f"backoff_factor must be < 1, got {backoff_factor!r}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be an int >= 1, got {growth_interval!r}")
        self.growth_interval, self.enabled = growth_interval, bool(enabled)
        self._growth_tracker = 0
        self._unscaled = None   # the optimizer whose gradients this step unscaled, until update()
        self._found_inf = False  # (None: on the device only, in graph mode)
        self._dev = None        # (scale float32, growth tracker int64, found-inf flag int64), each one element on
                                # the device, from the first device loss on: then they hold the state, not the host

    def _device_state(self):
        if self._dev is None:
            ops = device_kernels()
            self._dev = (ops.to_device(np.array([self._scale], np.float32)),
                         ops.to_device(np.array([self._growth_tracker], np.int64)), ops.zero_flag())
        return self._dev

    def get_scale(self) -> float:
        if not self.enabled:
            return 1.0
        if self._dev is not None:
            return float(device_kernels().to_host(self._dev[0])[0])
        return self._scale

    def scale(self, loss):
        """The loss times the scale (a new Tensor: backward() from it scales every gradient)."""
        if not self.enabled:
            return loss
        if isinstance(loss, Tensor) and loss.is_cuda:
            return _scaled(loss, self._device_state()[0])
        return loss * self.get_scale()  # (the device's scale, once the state is there: the host's copy is stale)

    def unscale_(self, optimizer):
        """Divide the optimizer's parameters' gradients by the scale, in place, and note whether any is inf or nan
        (then step() skips).  Call it before clipping gradients; step() calls it where it was not."""
        if not self.enabled:
            return
        if self._unscaled is not None:
            raise RuntimeError("unscale_() was already called on this step's gradients; call update() first")
        inv, found, on_device = None, False, []
        for p in optimizer.params:
            g = p.grad
            if g is None:
                continue
            if _on_device(g):
                on_device.append(g)
            else:
                inv = 1.0 / self.get_scale() if inv is None else inv  # (the device's scale, where it lives there)
                g *= np.asarray(inv, g.dtype)
                found = found or not np.isfinite(g).all()
        if on_device:
            scale, _, flag = self._device_state()
            ops = device_kernels()
            ops.unscale_all_(on_device, scale, flag)
            found = None if ops.in_graph_mode() else found or bool(ops.to_host(self._dev[2])[0])  # (a sync, as torch's)
        self._unscaled, self._found_inf = optimizer, found

    def step(self, optimizer):
        """optimizer.step() unless a gradient is inf or nan; returns whether it stepped (None in graph mode: the
        device decides)."""
        if not self.enabled:
            optimizer.step()
            return True
        if self._unscaled is None:
            self.unscale_(optimizer)
        elif self._unscaled is not optimizer:
            raise RuntimeError("unscale_() was called with another optimizer on this step")
        if self._found_inf is None:
            optimizer._step_unless(self._dev[2])
            return None
        if self._found_inf:
            return False
        optimizer.step()
        return True

    def update(self):
        """The next step's scale: backed off after a skipped step, grown after growth_interval clean ones."""
        if not self.enabled:
            return
        if self._unscaled is None:
            raise RuntimeError("update() needs this step's unscale_() or step() first")
        if self._dev is not None:  # (the device's flag decides: the host's copy may not know it, in graph mode)
            device_kernels().update_scale(*self._dev, self.growth_factor, self.backoff_factor, self.growth_interval)
        elif self._found_inf:
            self._scale *= self.backoff_factor
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._scale *= self.growth_factor
                self._growth_tracker = 0
        self._unscaled, self._found_inf = None, False

    def state_dict(self) -> dict:
        tracker = self._growth_tracker
        if self._dev is not None:
            tracker = int(device_kernels().to_host(self._dev[1])[0])
        return {"scale": self.get_scale() if self.enabled else self._scale, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "growth_tracker": tracker}

    def load_state_dict(self, state):
        self._scale = _positive("scale", state["scale"])
        self.growth_factor = _positive("growth_factor", state["growth_factor"], above_one=True)
        self.backoff_factor = _positive("backoff_factor", state["backoff_factor"])
        self.growth_interval, self._growth_tracker = int(state["growth_interval"]), int(state["growth_tracker"])
        if self._dev is not None:  # (written in place: a captured step's kernels read these arrays)
            self._dev[0].copy_to_device(np.array([self._scale], np.float32))
            self._dev[1].copy_to_device(np.array([self._growth_tracker], np.int64))


def _scaled(loss, scale):
    """loss * scale[0] (scale: the device's one-element array), with the gradient scaled on the way back."""
    ops = device_kernels()
    return Tensor.from_op(ops.scale_by(loss.data, scale), (loss,), lambda g: (ops.scale_by(g, scale),))
