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

# SGD and unscale_ take GROUP tensors a launch (a ResNet-18 has 62 parameters: 62 launches of a few microseconds, and
# as many gaps between a captured graph's kernels, became 8): the kernel's threads run over the tensors' elements one
# after another, slot by slot; a group of fewer tensors passes n = 0 in the slots it leaves empty (their arrays are
# the first slot's, never touched).
GROUP = 8


def _groups(items):
    """items (tuples of arrays and a size) in groups of GROUP, each padded with its first item at size 0."""
    for start in range(0, len(items), GROUP):
        group = list(items[start:start + GROUP])
        yield group + [group[0][:-1] + (0,)] * (GROUP - len(group))


def _group_grid(group):
    return _grid(sum(item[-1] for item in group))


@cuda.jit(device=True, inline=True)
def _sgd_at(p, g, v, i, lr, momentum, wd):
    gi = g[i] + wd * p[i]
    vi = momentum * v[i] + gi
    v[i] = vi
    p[i] -= lr * vi


@kernel
def _sgd_k(p0, g0, v0, n0, p1, g1, v1, n1, p2, g2, v2, n2, p3, g3, v3, n3, p4, g4, v4, n4, p5, g5, v5, n5,
           p6, g6, v6, n6, p7, g7, v7, n7, lr, momentum, wd, skip):
    i = cuda.grid(1)
    if skip[0] != 0:
        return
    if i < n0:
        _sgd_at(p0, g0, v0, i, lr, momentum, wd)
        return
    i -= n0
    if i < n1:
        _sgd_at(p1, g1, v1, i, lr, momentum, wd)
        return
    i -= n1
    if i < n2:
        _sgd_at(p2, g2, v2, i, lr, momentum, wd)
        return
    i -= n2
    if i < n3:
        _sgd_at(p3, g3, v3, i, lr, momentum, wd)
        return
    i -= n3
    if i < n4:
        _sgd_at(p4, g4, v4, i, lr, momentum, wd)
        return
    i -= n4
    if i < n5:
        _sgd_at(p5, g5, v5, i, lr, momentum, wd)
        return
    i -= n5
    if i < n6:
        _sgd_at(p6, g6, v6, i, lr, momentum, wd)
        return
    i -= n6
    if i < n7:
        _sgd_at(p7, g7, v7, i, lr, momentum, wd)
        return


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


def sgd_steps(triples, lr, momentum, wd, skip):
    """The SGD update of each (param, grad, velocity) device triple, in place, GROUP a launch; skipped where skip[0]
    (a one-element int64 device array) is nonzero."""
    for group in _groups([(p, g, v, p.size) for p, g, v in triples]):
        _sgd_k(_group_grid(group), BLOCK, *[a for item in group for a in item], float(lr), float(momentum),
               float(wd), skip)



def adam_step(p, g, m, v, lr, b1, b2, eps, wd, decoupled, t, skip):
    _adam_k(_grid(p.size), BLOCK, p, g, m, v, p.size, float(lr), float(b1), float(b2), float(eps), float(wd),
            int(decoupled), float(1 - b1 ** t), float(1 - b2 ** t), skip)


# ---- loss scaling (kernelgen.nn.amp) ------------------------------------------------------------------------

@cuda.jit(device=True, inline=True)
def _unscale_at(g, i, scale, found):
    v = g[i] * (float32(1.0) / scale[0])  # (the reciprocal of a power of two is exact: as torch's inv_scale)
    g[i] = v
    if not math.isfinite(v):
        found[0] = 1  # (any writer: every one writes the same value)


@kernel
def _unscale_k(g0, n0, g1, n1, g2, n2, g3, n3, g4, n4, g5, n5, g6, n6, g7, n7, scale, found):
    i = cuda.grid(1)
    if i < n0:
        _unscale_at(g0, i, scale, found)
        return
    i -= n0
    if i < n1:
        _unscale_at(g1, i, scale, found)
        return
    i -= n1
    if i < n2:
        _unscale_at(g2, i, scale, found)
        return
    i -= n2
    if i < n3:
        _unscale_at(g3, i, scale, found)
        return
    i -= n3
    if i < n4:
        _unscale_at(g4, i, scale, found)
        return
    i -= n4
    if i < n5:
        _unscale_at(g5, i, scale, found)
        return
    i -= n5
    if i < n6:
        _unscale_at(g6, i, scale, found)
        return
    i -= n6
    if i < n7:
        _unscale_at(g7, i, scale, found)
        return


def unscale_all_(grads, scale, found):
    """g /= scale[0] in place for each g of `grads` (scale: a one-element float32 device array), GROUP a launch;
    found[0] (int64) set to 1 if any result is inf or nan."""
    for group in _groups([(g, g.size) for g in grads]):
        _unscale_k(_group_grid(group), BLOCK, *[a for item in group for a in item], scale, found)



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
