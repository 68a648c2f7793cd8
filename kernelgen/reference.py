"""float64 NumPy references: the ground truth every generated kernel is tested against.

Written as a loop over filter taps with strided slicing (obviously correct, fast enough for
test sizes), all in float64 whatever the input dtype.
"""
from __future__ import annotations

import numpy as np

from kernelgen.problem import deconv_output_shape, make_problem


def _as5(a, ndim):
    """(N, *spatial, C) -> (N, D, H, W, C) view with unit dims in front."""
    return a.reshape((a.shape[0],) + (1,) * (3 - ndim) + a.shape[1:])


def _tap_slices(prob, t, r, s):
    """Slices of the padded input that tap (t, r, s) reads for every output position."""
    return tuple(slice(k * d, k * d + st * (o - 1) + 1, st)
                 for k, d, st, o in zip((t, r, s), prob.dilation, prob.stride, prob.out_size))


def _padded_shape(prob):
    return (prob.N,) + tuple(i + 2 * p for i, p in zip(prob.in_size, prob.padding)) + (prob.C,)


def _interior(prob):
    return (slice(None),) + tuple(slice(p, p + i) for i, p in zip(prob.in_size, prob.padding)) + (slice(None),)


def _padded_input(prob, x):
    """x in float64, zero-padded, as (N, D, H, W, C)."""
    xp = np.zeros(_padded_shape(prob))
    xp[_interior(prob)] = _as5(np.asarray(x, np.float64), prob.ndim)
    return xp


def conv_forward(x, w, bias=None, *, stride=1, padding=0, dilation=1, groups=1):
    prob = make_problem("fwd", x.shape, w.shape, stride=stride, padding=padding, dilation=dilation, groups=groups)
    xp = _padded_input(prob, x)
    w5 = _as5(np.asarray(w, np.float64), prob.ndim)
    y = np.zeros((prob.N,) + prob.out_size + (prob.K,))
    G, Cg, Kg = prob.groups, prob.Cg, prob.Kg
    for t, r, s in np.ndindex(*prob.filter_size):
        patch = xp[(slice(None),) + _tap_slices(prob, t, r, s)]
        for g in range(G):
            y[..., g * Kg:(g + 1) * Kg] += patch[..., g * Cg:(g + 1) * Cg] @ w5[g * Kg:(g + 1) * Kg, t, r, s, :].T
    if bias is not None:
        y += np.asarray(bias, np.float64)
    return y.reshape(prob.y_shape)


def conv_backward_data(dy, w, x_shape, *, stride=1, padding=0, dilation=1, groups=1):
    prob = make_problem("bwd_data", x_shape, w.shape, stride=stride, padding=padding, dilation=dilation,
                        groups=groups, y_shape=dy.shape)
    dy5 = _as5(np.asarray(dy, np.float64), prob.ndim)
    w5 = _as5(np.asarray(w, np.float64), prob.ndim)
    dxp = np.zeros(_padded_shape(prob))
    G, Cg, Kg = prob.groups, prob.Cg, prob.Kg
    for t, r, s in np.ndindex(*prob.filter_size):
        sl = (slice(None),) + _tap_slices(prob, t, r, s)
        for g in range(G):
            dxp[sl + (slice(g * Cg, (g + 1) * Cg),)] += dy5[..., g * Kg:(g + 1) * Kg] @ w5[g * Kg:(g + 1) * Kg, t, r, s, :]
    return dxp[_interior(prob)].reshape(prob.x_shape)


def conv_backward_weight(x, dy, w_shape, *, stride=1, padding=0, dilation=1, groups=1):
    prob = make_problem("bwd_weight", x.shape, w_shape, stride=stride, padding=padding, dilation=dilation,
                        groups=groups, y_shape=dy.shape)
    xp = _padded_input(prob, x)
    dy5 = _as5(np.asarray(dy, np.float64), prob.ndim)
    dw = np.zeros((prob.K,) + prob.filter_size + (prob.Cg,))
    G, Cg, Kg = prob.groups, prob.Cg, prob.Kg
    dyf = dy5.reshape(-1, prob.K)
    for t, r, s in np.ndindex(*prob.filter_size):
        patch = xp[(slice(None),) + _tap_slices(prob, t, r, s)].reshape(-1, prob.C)
        for g in range(G):
            dw[g * Kg:(g + 1) * Kg, t, r, s, :] = dyf[:, g * Kg:(g + 1) * Kg].T @ patch[:, g * Cg:(g + 1) * Cg]
    return dw.reshape(prob.w_shape)


def deconv(x, w, bias=None, *, stride=1, padding=0, output_padding=0, dilation=1, groups=1):
    out_shape = deconv_output_shape(x.shape, w.shape, stride, padding, output_padding, dilation, groups)
    y_shape = make_problem("fwd", out_shape, w.shape, stride=stride, padding=padding, dilation=dilation,
                           groups=groups).y_shape
    # output_padding >= stride (allowed when dilation > stride): trailing conv outputs no x feeds, dy = 0
    x = np.pad(np.asarray(x, np.float64), [(0, n - m) for n, m in zip(y_shape, x.shape)])
    y = conv_backward_data(x, w, out_shape, stride=stride, padding=padding, dilation=dilation, groups=groups)
    if bias is not None:
        y = y + np.asarray(bias, np.float64)
    return y
