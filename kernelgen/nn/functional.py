"""Differentiable ops on channels-last Tensors. Every convolution, forward and backward, is a kernelgen
kernel (kernelgen.conv / conv_backward_data / conv_backward_weight); the rest is numpy.
Each op's backward closure maps the output gradient to one gradient per parent (None: not needed)."""
from __future__ import annotations

import numpy as np

import kernelgen

from .tensor import Tensor


def _as_tensor(x):
    return x if isinstance(x, Tensor) else Tensor(np.asarray(x))


def _sum_to(g, shape):
    """Undo numpy broadcasting: sum the gradient back down to the operand's shape."""
    while g.ndim > len(shape):
        g = g.sum(axis=0)
    for axis, n in enumerate(shape):
        if n == 1 and g.shape[axis] != 1:
            g = g.sum(axis=axis, keepdims=True)
    return g


def add(a, b):
    a, b = _as_tensor(a), _as_tensor(b)
    return Tensor.from_op(a.data + b.data, (a, b), lambda g: (_sum_to(g, a.shape), _sum_to(g, b.shape)))


def mul(a, b):
    a, b = _as_tensor(a), _as_tensor(b)
    return Tensor.from_op(a.data * b.data, (a, b),
                          lambda g: (_sum_to(g * b.data, a.shape), _sum_to(g * a.data, b.shape)))


def conv2d(x, w, bias=None, *, stride=1, padding=0, groups=1, backend="cpu"):
    """x (N, H, W, C), w (K, R, S, C//groups), bias (K,) -> (N, P, Q, K)."""
    x, w = _as_tensor(x), _as_tensor(w)
    kw = dict(stride=stride, padding=padding, groups=groups, backend=backend)
    y = kernelgen.conv(x.data, w.data, **kw)
    parents = (x, w)
    if bias is not None:
        bias = _as_tensor(bias)
        y = y + bias.data
        parents = (x, w, bias)

    def backward(g):
        g = np.ascontiguousarray(g, dtype=x.data.dtype)
        dx = kernelgen.conv_backward_data(g, w.data, x.shape, **kw) if x.requires_grad else None
        dw = kernelgen.conv_backward_weight(x.data, g, w.shape, **kw) if w.requires_grad else None
        if bias is None:
            return dx, dw
        return dx, dw, g.reshape(-1, g.shape[-1]).sum(axis=0)
    return Tensor.from_op(y, parents, backward)


def linear(x, w, bias=None):
    """x (N, in), w (out, in), bias (out,) -> (N, out)."""
    x, w = _as_tensor(x), _as_tensor(w)
    y = x.data @ w.data.T
    if bias is None:
        return Tensor.from_op(y, (x, w), lambda g: (g @ w.data, g.T @ x.data))
    bias = _as_tensor(bias)
    return Tensor.from_op(y + bias.data, (x, w, bias), lambda g: (g @ w.data, g.T @ x.data, g.sum(axis=0)))


def relu(x):
    x = _as_tensor(x)
    mask = x.data > 0
    return Tensor.from_op(x.data * mask, (x,), lambda g: (g * mask,))


def reshape(x, shape):
    x = _as_tensor(x)
    return Tensor.from_op(x.data.reshape(shape), (x,), lambda g: (g.reshape(x.shape),))


def flatten(x):
    return reshape(x, (x.shape[0], -1))


def global_avg_pool(x):
    """(N, H, W, C) -> (N, C)."""
    x = _as_tensor(x)
    hw = x.shape[1] * x.shape[2]
    return Tensor.from_op(x.data.mean(axis=(1, 2)), (x,),
                          lambda g: (np.broadcast_to(g[:, None, None, :] / hw, x.shape).copy(),))


def batch_norm(x, weight, bias, running_mean, running_var, *, training, momentum=0.1, eps=1e-5):
    """Per-channel normalisation over (N, H, W) of a channels-last x; running stats updated in place."""
    x, weight, bias = _as_tensor(x), _as_tensor(weight), _as_tensor(bias)
    axes = tuple(range(x.data.ndim - 1))
    if training:
        count = x.data.size // x.shape[-1]
        mean = x.data.mean(axis=axes, dtype=np.float64)
        var = ((x.data - mean) ** 2).mean(axis=axes)
        running_mean *= 1 - momentum
        running_mean += momentum * mean
        running_var *= 1 - momentum
        running_var += momentum * var * count / max(count - 1, 1)  # running variance is unbiased
    else:
        mean, var = running_mean, running_var
    inv_std = (1.0 / np.sqrt(var + eps)).astype(x.dtype)
    x_hat = ((x.data - mean) * inv_std).astype(x.dtype)
    y = x_hat * weight.data + bias.data

    def backward(g):
        dweight = (g * x_hat).sum(axis=axes)
        dbias = g.sum(axis=axes)
        if training:  # the batch statistics depend on x as well
            dx = weight.data * inv_std * (g - dbias / count - x_hat * dweight / count)
        else:
            dx = g * weight.data * inv_std
        return dx.astype(x.dtype), dweight, dbias
    return Tensor.from_op(y, (x, weight, bias), backward)


def cross_entropy(logits, labels):
    """Mean cross-entropy of (N, classes) logits against integer labels; log-softmax fused in."""
    logits = _as_tensor(logits)
    labels = np.asarray(labels)
    if labels.shape != (logits.shape[0],):
        raise ValueError(f"labels must have shape ({logits.shape[0]},), got {labels.shape}")
    z = logits.data - logits.data.max(axis=1, keepdims=True)
    log_probs = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    n = labels.shape[0]
    loss = -log_probs[np.arange(n), labels].mean()

    def backward(g):
        d = np.exp(log_probs)
        d[np.arange(n), labels] -= 1.0
        return (d * (g / n),)
    return Tensor.from_op(np.asarray(loss, dtype=logits.dtype), (logits,), backward)
