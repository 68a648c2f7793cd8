"""Windowed pools on channels-last Tensors (max, average, adaptive average): numpy on the host,
cuda_pool's kernels (through cuda_ops) for device data; each op's backward routes the output gradient to the window
positions that produced it."""
from __future__ import annotations

import numpy as np

from kernelgen.nn.tensor import Tensor
from kernelgen.nn.tensor import as_tensor as _as_tensor
from kernelgen.nn.tensor import device_ops as _dev


def _pair(v):
    return (v, v) if np.isscalar(v) else tuple(v)


def _check_nhwc(x):
    if len(x.shape) != 4:
        raise ValueError(f"x must be channels-last (N, H, W, C), got shape {x.shape}")


def _pool_geometry(x_shape, kernel, stride, padding):
    """((kh, kw), (sh, sw), (ph, pw), (p, q)) as Python ints, or ValueError naming the bad argument."""
    (kh, kw), (sh, sw), (ph, pw) = _pair(kernel), _pair(kernel if stride is None else stride), _pair(padding)
    for name, pair, low in (("kernel", (kh, kw), 1), ("stride", (sh, sw), 1), ("padding", (ph, pw), 0)):
        if any(int(v) != v or v < low for v in pair):
            raise ValueError(f"{name} must be integers >= {low}, got {pair}")
    (kh, kw), (sh, sw), (ph, pw) = (int(kh), int(kw)), (int(sh), int(sw)), (int(ph), int(pw))
    if ph > kh // 2 or pw > kw // 2:
        raise ValueError(f"padding must be at most half the kernel, got padding {padding} for kernel {kernel}")
    p, q = (x_shape[1] + 2 * ph - kh) // sh + 1, (x_shape[2] + 2 * pw - kw) // sw + 1
    if p < 1 or q < 1:
        raise ValueError(f"pooling a {x_shape[1:3]} input with kernel {kernel} leaves an empty output")
    return (kh, kw), (sh, sw), (ph, pw), (p, q)


def _pool_windows(x_shape, kernel, stride, padding):
    """Padding and, per kernel offset, the strided slices of the padded input that it reads."""
    (kh, kw), (sh, sw), (ph, pw), (p, q) = _pool_geometry(x_shape, kernel, stride, padding)
    offsets = [(slice(i, i + sh * (p - 1) + 1, sh), slice(j, j + sw * (q - 1) + 1, sw))
               for i in range(kh) for j in range(kw)]
    return (ph, pw), offsets


def _pad_hw(a, ph, pw, value):
    return np.pad(a, ((0, 0), (ph, ph), (pw, pw), (0, 0)), constant_values=value) if ph or pw else a


def max_pool2d(x, kernel, stride=None, padding=0):
    """(N, H, W, C) -> (N, P, Q, C); padding counts as -inf, ties go to the first offset (as PyTorch)."""
    x = _as_tensor(x)
    _check_nhwc(x)
    if ops := _dev(x):
        k, s, pad, (p, q) = _pool_geometry(x.shape, kernel, stride, padding)
        y, arg = ops.max_pool2d(x.data, (x.shape[0], p, q, x.shape[3]), k, s, pad)
        return Tensor.from_op(y, (x,), lambda g: (ops.max_pool2d_backward(g, arg, x.shape, k, s, pad),))
    (ph, pw), offsets = _pool_windows(x.shape, kernel, stride, padding)
    xp = _pad_hw(x.data, ph, pw, -np.inf)
    best = xp[:, offsets[0][0], offsets[0][1]].copy()
    arg = np.zeros(best.shape, np.int32)  # which offset holds the maximum: the backward routes g there
    for k, (hs, ws) in enumerate(offsets[1:], 1):
        v = xp[:, hs, ws]
        better = v > best
        best[better], arg[better] = v[better], k

    def backward(g):
        dxp = np.zeros(xp.shape, g.dtype)
        for k, (hs, ws) in enumerate(offsets):
            dxp[:, hs, ws] += np.where(arg == k, g, 0)
        return (dxp[:, ph:ph + x.shape[1], pw:pw + x.shape[2]],)
    return Tensor.from_op(best, (x,), backward)


def avg_pool2d(x, kernel, stride=None, padding=0, count_include_pad=True):
    """(N, H, W, C) -> (N, P, Q, C); count_include_pad=False divides by the number of real elements."""
    x = _as_tensor(x)
    _check_nhwc(x)
    if ops := _dev(x):
        k, s, pad, (p, q) = _pool_geometry(x.shape, kernel, stride, padding)
        y = ops.avg_pool2d(x.data, (x.shape[0], p, q, x.shape[3]), k, s, pad, count_include_pad)
        return Tensor.from_op(y, (x,), lambda g: (
            ops.avg_pool2d_backward(g, x.shape, k, s, pad, count_include_pad),))
    (ph, pw), offsets = _pool_windows(x.shape, kernel, stride, padding)
    xp = _pad_hw(x.data, ph, pw, 0)
    if count_include_pad:
        inv = np.asarray(1.0 / len(offsets), x.dtype)
    else:
        ones = _pad_hw(np.ones((1,) + x.shape[1:3] + (1,), x.dtype), ph, pw, 0)
        inv = 1 / sum(ones[:, hs, ws] for hs, ws in offsets)
    y = sum(xp[:, hs, ws] for hs, ws in offsets) * inv

    def backward(g):
        dxp, gi = np.zeros(xp.shape, g.dtype), g * inv
        for hs, ws in offsets:
            dxp[:, hs, ws] += gi
        return (dxp[:, ph:ph + x.shape[1], pw:pw + x.shape[2]],)
    return Tensor.from_op(y.astype(x.dtype), (x,), backward)


def _adaptive_bins(n, out):
    """PyTorch's bins: [floor(i n / out), ceil((i + 1) n / out)); they overlap when out does not divide n."""
    return [(i * n // out, -(-(i + 1) * n // out)) for i in range(out)]


def adaptive_avg_pool2d(x, output_size):
    """(N, H, W, C) -> (N, oh, ow, C), each output the mean of its bin."""
    x = _as_tensor(x)
    _check_nhwc(x)
    oh, ow = _pair(output_size)
    if int(oh) != oh or int(ow) != ow or oh < 1 or ow < 1:
        raise ValueError(f"output_size must be positive integers, got {output_size}")
    oh, ow = int(oh), int(ow)
    if ops := _dev(x):
        y = ops.adaptive_avg_pool2d(x.data, (oh, ow))
        return Tensor.from_op(y, (x,), lambda g: (ops.adaptive_avg_pool2d_backward(g, x.shape),))
    cells = [(i, j, hb, wb) for i, hb in enumerate(_adaptive_bins(x.shape[1], oh))
             for j, wb in enumerate(_adaptive_bins(x.shape[2], ow))]
    y = np.empty((x.shape[0], oh, ow, x.shape[3]), x.dtype)
    for i, j, (h0, h1), (w0, w1) in cells:
        y[:, i, j] = x.data[:, h0:h1, w0:w1].mean(axis=(1, 2))

    def backward(g):
        dx = np.zeros(x.shape, g.dtype)
        for i, j, (h0, h1), (w0, w1) in cells:
            dx[:, h0:h1, w0:w1] += g[:, i, j, None, None] / ((h1 - h0) * (w1 - w0))
        return (dx,)
    return Tensor.from_op(y, (x,), backward)
