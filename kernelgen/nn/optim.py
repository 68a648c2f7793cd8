"""Optimisers: SGD (momentum, weight decay), Adam / AdamW, RMSprop and RAdam, updating parameters in place
(PyTorch's update rules and defaults).  SGD updates device parameters with fused kernels of 8 parameters each,
Adam(W) with one per parameter (cuda_optim, through tensor.device_kernels); RMSprop and RAdam are host-only.  SGD's
device step can be skipped on the device, by GradScaler's found-inf flag, so a captured step needs no host decision
(graphs.py)."""
from __future__ import annotations

import numpy as np

from kernelgen.nn.tensor import _on_device, device_kernels


def _zeros_like(a):
    if _on_device(a):
        return device_kernels().zeros(a.shape, a.dtype)
    return np.zeros_like(a)


def _same_device(p, state):
    if _on_device(p.data) != _on_device(state):
        raise TypeError("optimizer state and parameter are on different devices: build the optimizer after "
                        "model.to(device)")
    return _on_device(p.data)


def _host_only(params, name):
    if any(_on_device(p.data) for p in params):
        raise TypeError(f"{name} has no device implementation yet: params must be cpu tensors")


class SGD:
    def __init__(self, params, lr=0.1, momentum=0.0, weight_decay=0.0):
        self.params, self.lr, self.momentum, self.wd = list(params), lr, momentum, weight_decay
        self.velocity = [_zeros_like(p.data) for p in self.params]
        self._never = None  # a device flag that stays 0: the `skip` of an update nothing skips

    def step(self):
        self._step_unless(None)

    def _skip_flag(self, found):
        """The device updates' `skip` (cuda_optim.py): GradScaler's found-inf flag, or one that stays 0."""
        if found is not None:
            return found
        if self._never is None:
            self._never = device_kernels().zero_flag()
        return self._never

    def _step_unless(self, found):
        """step(), with the device updates skipped where the device flag `found` (GradScaler's) is set: a captured
        step decides on the device, where the host cannot read the flag (graphs.py)."""
        on_device = []  # (param, grad, velocity) device triples: updated together, a few launches for all of them
        for p, v in zip(self.params, self.velocity):
            if p.grad is None:
                continue
            if _same_device(p, v):
                on_device.append((p.data, p.grad, v))
                continue
            g = p.grad + self.wd * p.data
            v *= self.momentum
            v += g
            p.data -= (self.lr * v).astype(p.data.dtype)
        if on_device:
            device_kernels().sgd_steps(on_device, self.lr, self.momentum, self.wd, self._skip_flag(found))

    def zero_grad(self):
        for p in self.params:
            p.grad = None


class Adam(SGD):
    """Adam; decoupled=True is AdamW (weight decay applied to the weights, not the gradient)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=False):
        super().__init__(params, lr, 0.0, weight_decay)
        self.b1, self.b2, self.eps, self.decoupled, self.t = betas[0], betas[1], eps, decoupled, 0
        self.m = [_zeros_like(p.data) for p in self.params]

    def _step_unless(self, found):
        if found is not None:  # (its step count, and so the bias corrections, are the host's: a graph would replay
            raise TypeError("Adam cannot step inside a captured step (its step count is kept on the host); "
                            "capture the step with SGD, or run it uncaptured")  # the capture's)
        self.t += 1
        for p, m, v in zip(self.params, self.m, self.velocity):
            if p.grad is None:
                continue
            if _same_device(p, m):
                device_kernels().adam_step(p.data, p.grad, m, v, self.lr, self.b1, self.b2, self.eps, self.wd,
                                           self.decoupled, self.t, self._skip_flag(None))
                continue
            g = p.grad if self.decoupled else p.grad + self.wd * p.data
            m *= self.b1
            m += (1 - self.b1) * g
            v *= self.b2
            v += (1 - self.b2) * g * g
            mhat, vhat = m / (1 - self.b1 ** self.t), v / (1 - self.b2 ** self.t)
            update = self.lr * (mhat / (np.sqrt(vhat) + self.eps) + (self.wd * p.data if self.decoupled else 0))
            p.data -= update.astype(p.data.dtype)


class RMSprop(SGD):
    """PyTorch's RMSprop: v = alpha v + (1 - alpha) g^2, step g / (sqrt(v) + eps); centered subtracts the
    squared running mean of g from v; momentum keeps a buffer of those steps."""

    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=False):
        params = list(params)
        _host_only(params, "RMSprop")
        super().__init__(params, lr, momentum, weight_decay)
        self.alpha, self.eps, self.centered = alpha, eps, centered
        self.square_avg = [np.zeros_like(p.data) for p in self.params]
        self.grad_avg = [np.zeros_like(p.data) for p in self.params] if centered else None

    def step(self):
        for i, (p, v, buf) in enumerate(zip(self.params, self.square_avg, self.velocity)):
            if p.grad is None:
                continue
            g = p.grad + self.wd * p.data
            v *= self.alpha
            v += (1 - self.alpha) * g * g
            if self.centered:
                m = self.grad_avg[i]
                m *= self.alpha
                m += (1 - self.alpha) * g
                avg = np.sqrt(v - m * m) + self.eps
            else:
                avg = np.sqrt(v) + self.eps
            if self.momentum > 0:
                buf *= self.momentum
                buf += g / avg
                p.data -= (self.lr * buf).astype(p.data.dtype)
            else:
                p.data -= (self.lr * g / avg).astype(p.data.dtype)


class RAdam(Adam):
    """PyTorch's RAdam: Adam whose adaptive step is switched on, rectified, once the variance estimate is
    trustworthy (rho_t > 5); before that a bias-corrected momentum step.  decoupled: AdamW-style decay."""

    def step(self):
        _host_only(self.params, "RAdam")
        self.t += 1
        t, b1, b2 = self.t, self.b1, self.b2
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
        rho_inf = 2 / (1 - b2) - 1
        rho_t = rho_inf - 2 * t * b2 ** t / bc2
        for p, m, v in zip(self.params, self.m, self.velocity):
            if p.grad is None:
                continue
            if self.decoupled:
                p.data *= 1 - self.lr * self.wd
                g = p.grad
            else:
                g = p.grad + self.wd * p.data
            m *= b1
            m += (1 - b1) * g
            v *= b2
            v += (1 - b2) * g * g
            update = self.lr * m / bc1
            if rho_t > 5:
                rect = np.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
                update = update * rect * np.sqrt(bc2) / (np.sqrt(v) + self.eps)
            p.data -= update.astype(p.data.dtype)
