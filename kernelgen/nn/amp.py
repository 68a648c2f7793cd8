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
from kernelgen.nn.tensor import _on_device, device_kernels


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
    growth_factor.  One scaler serves one optimizer per step (unscale_ / step / update, in that order)."""

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
        self._found_inf = False
        self._flag = None       # the device's found-inf flag (one int64), made at the first device gradient

    def get_scale(self) -> float:
        return self._scale if self.enabled else 1.0

    def scale(self, loss):
        """The loss times the scale (a new Tensor: backward() from it scales every gradient)."""
        return loss * self._scale if self.enabled else loss

    def unscale_(self, optimizer):
        """Divide the optimizer's parameters' gradients by the scale, in place, and note whether any is inf or nan
        (then step() skips).  Call it before clipping gradients; step() calls it where it was not."""
        if not self.enabled:
            return
        if self._unscaled is not None:
            raise RuntimeError("unscale_() was already called on this step's gradients; call update() first")
        inv, found = 1.0 / self._scale, False
        for p in optimizer.params:
            g = p.grad
            if g is None:
                continue
            if _on_device(g):
                if self._flag is None:
                    self._flag = device_kernels().to_device(np.zeros(1, np.int64))
                device_kernels().unscale_(g, inv, self._flag)
            else:
                g *= np.asarray(inv, g.dtype)
                found = found or not np.isfinite(g).all()
        if self._flag is not None:
            found = found or bool(device_kernels().to_host(self._flag)[0])  # (one sync a step, as torch's)
            self._flag.copy_to_device(np.zeros(1, np.int64))
        self._unscaled, self._found_inf = optimizer, found

    def step(self, optimizer):
        """optimizer.step() unless a gradient is inf or nan; returns whether it stepped."""
        if not self.enabled:
            optimizer.step()
            return True
        if self._unscaled is None:
            self.unscale_(optimizer)
        elif self._unscaled is not optimizer:
            raise RuntimeError("unscale_() was called with another optimizer on this step")
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
        if self._found_inf:
            self._scale *= self.backoff_factor
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._scale *= self.growth_factor
                self._growth_tracker = 0
        self._unscaled, self._found_inf = None, False

    def state_dict(self) -> dict:
        return {"scale": self._scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "growth_tracker": self._growth_tracker}

    def load_state_dict(self, state):
        self._scale = _positive("scale", state["scale"])
        self.growth_factor = _positive("growth_factor", state["growth_factor"], above_one=True)
        self.backoff_factor = _positive("backoff_factor", state["backoff_factor"])
        self.growth_interval, self._growth_tracker = int(state["growth_interval"]), int(state["growth_tracker"])
