"""The device half of kernelgen.nn's optimisers and loss scaling (optim.py, amp.py): in-place parameter updates
and the GradScaler's unscale / scale update, each a numba.cuda kernel launched through cuda_launch.kernel.

Every update takes `skip`, a one-element int64 device array: where it holds nonzero the kernel leaves the
parameter and its state alone.  That is how a step whose gradients hold an inf or nan is skipped without the host
reading the flag - what a captured step (graphs.py) needs, where the same kernels replay each step and no host
decision can be recorded - and an uncaptured step passes a flag that stays zero.  The loss scale may likewise live
on the device (`scale_by`, `update_scale`: torch's `_amp_update_scale_` rules)."""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, float64

from kernelgen.nn.cuda_launch import BLOCK, _grid, empty, kernel


@kernel
def _fill_flag_k(a, v):
    if cuda.grid(1) == 0:
        a[0] = v


def zero_flag(flag=None):
    """A one-element int64 device array set to 0 (a new one where `flag` is None) on nn's stream."""
    flag = empty((1,), np.int64) if flag is None else flag
    _fill_flag_k(1, 32, flag, 0)
    return flag


# ---- optimisers (in place) -----------------------------------------------------------------------------

@kernel
def _sgd_k(p, g, v, n, lr, momentum, wd, skip):
    i = cuda.grid(1)
    if i < n and skip[0] == 0:
        gi = g[i] + wd * p[i]
        vi = momentum * v[i] + gi
        v[i] = vi
        p[i] -= lr * vi


@kernel
def _adam_k(p, g, m, v, n, lr, b1, b2, eps, wd, decoupled, bc1, bc2, skip):
    i = cuda.grid(1)
    if i < n and skip[0] == 0:
        pi = float64(p[i])
        gi = float64(g[i])
        if not decoupled:
            gi += wd * pi
        mi = b1 * m[i] + (1.0 - b1) * gi
        vi = b2 * v[i] + (1.0 - b2) * gi * gi
        m[i] = mi
        v[i] = vi
        step = (mi / bc1) / (math.sqrt(vi / bc2) + eps)
        if decoupled:
            step += wd * pi
        p[i] = pi - lr * step


def sgd_step(p, g, v, lr, momentum, wd, skip):
    _sgd_k(_grid(p.size), BLOCK, p, g, v, p.size, float(lr), float(momentum), float(wd), skip)


def adam_step(p, g, m, v, lr, b1, b2, eps, wd, decoupled, t, skip):
    _adam_k(_grid(p.size), BLOCK, p, g, m, v, p.size, float(lr), float(b1), float(b2), float(eps), float(wd),
            int(decoupled), float(1 - b1 ** t), float(1 - b2 ** t), skip)


# ---- loss scaling (kernelgen.nn.amp) ------------------------------------------------------------------------

@kernel
def _unscale_k(g, n, scale, found):
    i = cuda.grid(1)
    if i < n:
        v = g[i] * (float32(1.0) / scale[0])  # (the reciprocal of a power of two is exact: as torch's inv_scale)
        g[i] = v
        if not math.isfinite(v):
            found[0] = 1  # (any writer: every one writes the same value)


def unscale_(g, scale, found):
    """g /= scale[0] in place (scale: a one-element float32 device array); found[0] (int64) set to 1 if any result
    is inf or nan."""
    _unscale_k(_grid(g.size), BLOCK, g, g.size, scale, found)


@kernel
def _scale_by_k(a, scale, out, n):
    i = cuda.grid(1)
    if i < n:
        out[i] = a[i] * scale[0]


def scale_by(a, scale):
    """a * scale[0] in a new array of a's dtype (the scaled loss, and its gradient on the way back)."""
    out = empty(a.shape, a.dtype)
    _scale_by_k(_grid(a.size), BLOCK, a, scale, out, a.size)
    return out


@kernel
def _update_scale_k(scale, tracker, found, growth_factor, backoff_factor, growth_interval):
    if cuda.grid(1) == 0:
        if found[0] != 0:
            scale[0] = scale[0] * backoff_factor
            tracker[0] = 0
        else:
            t = tracker[0] + 1
            if t == growth_interval:
                scale[0] = scale[0] * growth_factor
                t = 0
            tracker[0] = t
        found[0] = 0


def update_scale(scale, tracker, found, growth_factor, backoff_factor, growth_interval):
    """GradScaler.update() on the device: scale[0] backed off after a step with an inf/nan gradient (found[0] set),
    grown after growth_interval clean ones in a row (tracker[0] counts them); found[0] cleared for the next step."""
    _update_scale_k(1, 32, scale, tracker, found, float(growth_factor), float(backoff_factor), int(growth_interval))
