"""Device kernels for kernelgen.nn's windowed pools on channels-last (N, H, W, C) float32 data: max_pool2d,
avg_pool2d, adaptive_avg_pool2d, forward and backward.  Same conventions as cuda_ops (flat C-contiguous
arrays, cuda_launch.kernel, arena memory); the geometry is validated by functional.py before any launch.

Each backward is a gather: one thread per input element sums the gradients of the outputs whose window
covers it.  Overlapping windows (stride < kernel) then need no atomics, and the sums are deterministic."""
from __future__ import annotations

import numpy as np
from numba import cuda, float64

from kernelgen.cuda_index import udiv32, umod32

from kernelgen.nn.cuda_elementwise import check_float32
from kernelgen.nn.cuda_launch import BLOCK, _grid, empty, kernel

_NEG_INF = np.float32(-np.inf)


@cuda.jit(device=True)
def _nhwc(i, h, w, c):
    """(n, row, col, channel) of flat index i in an (N, h, w, c) array."""
    ch = umod32(i, c)
    t = udiv32(i, c)
    col = umod32(t, w)
    t = udiv32(t, w)
    return udiv32(t, h), umod32(t, h), col, ch


@cuda.jit(device=True)
def _covering(pos, pad, k, s, n_out):
    """[lo, hi): the outputs whose window (start o*s - pad, k long) covers input position pos."""
    t = pos + pad - k + 1
    lo = 0 if t <= 0 else udiv32(t + s - 1, s)
    return lo, min(n_out, udiv32(pos + pad, s) + 1)


@kernel
def _max_pool_k(x, y, arg, n_out, h, w, c, p, q, kh, kw, sh, sw, ph, pw):
    # arg: the offset di * kw + dj of the maximum in its window, for the backward.  Padding reads as -inf
    # and only a strictly larger value replaces the best so far: ties go to the first offset, as on the host
    o = cuda.grid(1)
    if o < n_out:
        b, oi, oj, ch = _nhwc(o, p, q, c)
        h0 = oi * sh - ph
        w0 = oj * sw - pw
        best = _NEG_INF
        k_best = 0
        for di in range(kh):
            hh = h0 + di
            for dj in range(kw):
                ww = w0 + dj
                v = _NEG_INF
                if 0 <= hh < h and 0 <= ww < w:
                    v = x[((b * h + hh) * w + ww) * c + ch]
                if v > best or (di == 0 and dj == 0):
                    best = v
                    k_best = di * kw + dj
        y[o] = best
        arg[o] = k_best


@kernel
def _max_pool_bwd_k(g, arg, dx, n_in, h, w, c, p, q, kh, kw, sh, sw, ph, pw):
    i = cuda.grid(1)
    if i < n_in:
        b, hh, ww, ch = _nhwc(i, h, w, c)
        i_lo, i_hi = _covering(hh, ph, kh, sh, p)
        j_lo, j_hi = _covering(ww, pw, kw, sw, q)
        acc = float64(0.0)
        for oi in range(i_lo, i_hi):
            for oj in range(j_lo, j_hi):
                o = ((b * p + oi) * q + oj) * c + ch
                if arg[o] == (hh + ph - oi * sh) * kw + (ww + pw - oj * sw):
                    acc += g[o]
        dx[i] = acc


@cuda.jit(device=True)
def _avg_divisor(oi, oj, h, w, kh, kw, sh, sw, ph, pw, include_pad):
    if include_pad:
        return kh * kw
    h0 = oi * sh - ph
    w0 = oj * sw - pw
    return (min(h0 + kh, h) - max(h0, 0)) * (min(w0 + kw, w) - max(w0, 0))


@kernel
def _avg_pool_k(x, y, n_out, h, w, c, p, q, kh, kw, sh, sw, ph, pw, include_pad):
    o = cuda.grid(1)
    if o < n_out:
        b, oi, oj, ch = _nhwc(o, p, q, c)
        h0 = oi * sh - ph
        w0 = oj * sw - pw
        s = float64(0.0)
        for hh in range(max(h0, 0), min(h0 + kh, h)):
            for ww in range(max(w0, 0), min(w0 + kw, w)):
                s += x[((b * h + hh) * w + ww) * c + ch]
        y[o] = s / _avg_divisor(oi, oj, h, w, kh, kw, sh, sw, ph, pw, include_pad)


@kernel
def _avg_pool_bwd_k(g, dx, n_in, h, w, c, p, q, kh, kw, sh, sw, ph, pw, include_pad):
    i = cuda.grid(1)
    if i < n_in:
        b, hh, ww, ch = _nhwc(i, h, w, c)
        i_lo, i_hi = _covering(hh, ph, kh, sh, p)
        j_lo, j_hi = _covering(ww, pw, kw, sw, q)
        acc = float64(0.0)
        for oi in range(i_lo, i_hi):
            for oj in range(j_lo, j_hi):
                acc += float64(g[((b * p + oi) * q + oj) * c + ch]) / _avg_divisor(
                    oi, oj, h, w, kh, kw, sh, sw, ph, pw, include_pad)
        dx[i] = acc


def _geometry(x_shape, y_shape, kernel, stride, padding):
    (_, h, w, c), (p, q) = x_shape, y_shape[1:3]
    return tuple(int(v) for v in (h, w, c, p, q) + tuple(kernel) + tuple(stride) + tuple(padding))


def max_pool2d(x, y_shape, kernel, stride, padding):
    """(y, argmax offsets); kernel, stride, padding: (rows, cols) pairs, already validated."""
    check_float32(x, "x")
    y, arg = empty(y_shape), empty(y_shape, np.int32)
    _max_pool_k(_grid(y.size), BLOCK, x, y, arg, int(y.size), *_geometry(x.shape, y_shape, kernel, stride, padding))
    return y, arg


def max_pool2d_backward(g, arg, x_shape, kernel, stride, padding):
    dx = empty(x_shape)
    _max_pool_bwd_k(_grid(dx.size), BLOCK, g, arg, dx, int(dx.size),
                    *_geometry(x_shape, g.shape, kernel, stride, padding))
    return dx


def avg_pool2d(x, y_shape, kernel, stride, padding, count_include_pad):
    check_float32(x, "x")
    y = empty(y_shape)
    _avg_pool_k(_grid(y.size), BLOCK, x, y, int(y.size), *_geometry(x.shape, y_shape, kernel, stride, padding),
                int(count_include_pad))
    return y


def avg_pool2d_backward(g, x_shape, kernel, stride, padding, count_include_pad):
    dx = empty(x_shape)
    _avg_pool_bwd_k(_grid(dx.size), BLOCK, g, dx, int(dx.size), *_geometry(x_shape, g.shape, kernel, stride, padding),
                    int(count_include_pad))
    return dx


# ---- adaptive average pooling: PyTorch's bins [floor(i n / out), ceil((i + 1) n / out)) -------------------

@cuda.jit(device=True)
def _bin(i, n, n_out):
    return udiv32(i * n, n_out), udiv32((i + 1) * n + n_out - 1, n_out)


@kernel
def _adaptive_avg_k(x, y, n_out, h, w, c, oh, ow):
    o = cuda.grid(1)
    if o < n_out:
        b, oi, oj, ch = _nhwc(o, oh, ow, c)
        h0, h1 = _bin(oi, h, oh)
        w0, w1 = _bin(oj, w, ow)
        s = float64(0.0)
        for hh in range(h0, h1):
            for ww in range(w0, w1):
                s += x[((b * h + hh) * w + ww) * c + ch]
        y[o] = s / ((h1 - h0) * (w1 - w0))


@kernel
def _adaptive_avg_bwd_k(g, dx, n_in, h, w, c, oh, ow):
    # the bins covering row hh are i in [floor(hh oh / h), ceil((hh + 1) oh / h)): more than one where bins
    # overlap (out does not divide n), and an input row can be in several when oh > h
    i = cuda.grid(1)
    if i < n_in:
        b, hh, ww, ch = _nhwc(i, h, w, c)
        i_lo, i_hi = _bin(hh, oh, h)
        j_lo, j_hi = _bin(ww, ow, w)
        acc = float64(0.0)
        for oi in range(i_lo, i_hi):
            h0, h1 = _bin(oi, h, oh)
            for oj in range(j_lo, j_hi):
                w0, w1 = _bin(oj, w, ow)
                acc += float64(g[((b * oh + oi) * ow + oj) * c + ch]) / ((h1 - h0) * (w1 - w0))
        dx[i] = acc


def adaptive_avg_pool2d(x, output_size):
    check_float32(x, "x")
    (n, h, w, c), (oh, ow) = map(int, x.shape), output_size
    y = empty((n, oh, ow, c))
    _adaptive_avg_k(_grid(y.size), BLOCK, x, y, int(y.size), h, w, c, int(oh), int(ow))
    return y


def adaptive_avg_pool2d_backward(g, x_shape):
    (_, h, w, c), (oh, ow) = map(int, x_shape), map(int, g.shape[1:3])
    dx = empty(x_shape)
    _adaptive_avg_bwd_k(_grid(dx.size), BLOCK, g, dx, int(dx.size), h, w, c, oh, ow)
    return dx
