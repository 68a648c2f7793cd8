"""Device kernels for kernelgen.nn's element-wise ops: add (+ ReLU), ReLU, cast, fill, mul with broadcasting,
leaky ReLU, sigmoid, tanh, GELU, dropout, and concat / its split.  Same conventions as
cuda_ops: C-contiguous float32 arrays seen flat, launched through cuda_launch.kernel, memory from the arena.

The activations compute in float32 with the host's formulas (functional.py) and constants
(activation_constants.py): sigmoid and GELU from exp(-|u|), so nothing overflows for any finite input.  Their
backward recomputes the derivative from the input rather than keeping it from the forward: one fewer
activation-sized buffer alive until backward."""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float64

from kernelgen.cuda_index import udiv32, umod32

from kernelgen.nn.activation_constants import GELU_A, GELU_B, GELU_CLIP
from kernelgen.nn.cuda_launch import (BLOCK, _grid, _vgrid, consecutive, empty, is_device, kernel, thread_elements,
                                      to_device)

# numba types a Python float constant as float64 and would promote the float32 math to it
_ONE = np.float32(1.0)
_A = np.float32(GELU_A)
_B = np.float32(GELU_B)
_B3 = np.float32(3 * GELU_B)  # the host's 3 * GELU_B, folded in float64 before rounding, as there
_CLIP = np.float32(GELU_CLIP)
_NEG_INF = np.float32(-np.inf)

LEAKY_RELU, SIGMOID, TANH, GELU, RELU6 = 0, 1, 2, 3, 4
_ACTIVATIONS = {"leaky_relu": LEAKY_RELU, "sigmoid": SIGMOID, "tanh": TANH, "gelu": GELU, "relu6": RELU6}


# ---- add, ReLU, cast, fill (the ops a ResNet trains with; 4 elements a thread where it is memory-bound) -----

@kernel
def _fill_k(a, v, n):
    i = cuda.grid(1)
    if i < n:
        a[i] = v


@kernel
def _add_k(a, b, out, n, relu, run):
    e, k = thread_elements(run)
    if e + 3 * k < n:
        a0, a1, a2, a3 = a[e], a[e + k], a[e + 2 * k], a[e + 3 * k]
        b0, b1, b2, b3 = b[e], b[e + k], b[e + 2 * k], b[e + 3 * k]
        out[e] = _add_value(a0, b0, relu)
        out[e + k] = _add_value(a1, b1, relu)
        out[e + 2 * k] = _add_value(a2, b2, relu)
        out[e + 3 * k] = _add_value(a3, b3, relu)
    else:
        for i in range(e, n, k):
            out[i] = _add_value(a[i], b[i], relu)


@cuda.jit(device=True, inline=True)
def _add_value(a, b, relu):
    v = a + b
    if relu and v < 0:
        v = np.float32(0)
    return v


@kernel
def _relu_k(x, y, n):
    i = cuda.grid(1)
    if i < n:
        v = x[i]
        y[i] = v if v > 0 else np.float32(0)


@kernel
def _relu_bwd_k(g, y, dx, n, run):
    # the mask is read from the output: the input may be gone (fused ops keep only what follows them)
    e, k = thread_elements(run)
    if e + 3 * k < n:
        g0, g1, g2, g3 = g[e], g[e + k], g[e + 2 * k], g[e + 3 * k]
        y0, y1, y2, y3 = y[e], y[e + k], y[e + 2 * k], y[e + 3 * k]
        dx[e] = g0 if y0 > 0 else np.float32(0)
        dx[e + k] = g1 if y1 > 0 else np.float32(0)
        dx[e + 2 * k] = g2 if y2 > 0 else np.float32(0)
        dx[e + 3 * k] = g3 if y3 > 0 else np.float32(0)
    else:
        for i in range(e, n, k):
            dx[i] = g[i] if y[i] > 0 else np.float32(0)


@kernel
def _cast_k(a, out, n):
    i = cuda.grid(1)
    if i < n:
        out[i] = a[i]


def cast(a, dtype):
    """a's values in a new array of `dtype` (float32 <-> float16: the 16-bit activations of fp16 training)."""
    out = empty(a.shape, dtype)
    _cast_k(_grid(a.size), BLOCK, a, out, a.size)
    return out


def fill(a, value):
    _fill_k(_grid(a.size), BLOCK, a, float(value), a.size)
    return a


def zeros(shape, dtype=np.float32):
    return fill(empty(shape, dtype), 0.0)


def add(a, b, relu=False, out=None):
    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(f"b must have a's shape {tuple(a.shape)} on the device (no broadcasting), got {tuple(b.shape)}")
    out = empty(a.shape, a.dtype) if out is None else out
    _add_k(_vgrid(a.size), BLOCK, a, b, out, a.size, int(relu), consecutive(a))
    return out


def relu(x):
    y = empty(x.shape, x.dtype)
    _relu_k(_grid(x.size), BLOCK, x, y, x.size)
    return y


def relu_backward(g, y):
    dx = empty(g.shape, g.dtype)
    _relu_bwd_k(_vgrid(g.size), BLOCK, g, y, dx, g.size, consecutive(g))
    return dx


# ---- activations ---------------------------------------------------------------------------------------
_ZERO, _SIX = np.float32(0.0), np.float32(6.0)  # relu6's bounds (MobileNetV2, kernelgen.nn.mobilenet)


def check_float32(a, name):
    """Device kernels are compiled for float32 only; another dtype would silently compile a second
    overload (and lose the fast launch route) or misread memory, so it is rejected by name."""
    if not is_device(a):
        raise TypeError(f"{name} must be a device array, got {type(a).__name__}")
    if np.dtype(a.dtype) != np.float32:
        raise TypeError(f"{name} must be float32 on the device, got {a.dtype}")


# ---- activations -----------------------------------------------------------------------------------------

@cuda.jit(device=True)
def _sigmoid_parts(u):
    e = math.exp(-abs(u))
    s = (_ONE if u >= 0 else e) / (_ONE + e)
    return s, e / ((_ONE + e) * (_ONE + e))


@kernel
def _act_k(x, y, n, op, slope):
    i = cuda.grid(1)
    if i < n:
        v = x[i]
        if op == LEAKY_RELU:
            y[i] = v if v > 0 else v * np.float32(slope)  # a float32 product, as the host's
        elif op == SIGMOID:
            y[i] = _sigmoid_parts(v)[0]
        elif op == TANH:
            y[i] = math.tanh(v)
        elif op == RELU6:
            y[i] = min(max(v, _ZERO), _SIX)
        else:
            xc = min(max(v, -_CLIP), _CLIP)  # the clip keeps xc^3 finite; y uses the unclipped x, as the host
            y[i] = v * _sigmoid_parts(xc * (_A + _B * xc * xc))[0]


@kernel
def _act_bwd_k(g, src, dx, n, op, slope):
    # src: the op's input (tanh too: 1 - y^2 from the output cancels to 0 in float32 for |x| >~ 9)
    i = cuda.grid(1)
    if i < n:
        v = src[i]
        if op == LEAKY_RELU:
            d = _ONE if v > 0 else np.float32(slope)
        elif op == SIGMOID:
            d = _sigmoid_parts(v)[1]
        elif op == TANH:
            d = np.float32(4) * _sigmoid_parts(v + v)[1]  # sech^2 v = 4 s(2v) (1 - s(2v))
        elif op == RELU6:
            d = _ONE if _ZERO < v < _SIX else _ZERO
        else:
            xc = min(max(v, -_CLIP), _CLIP)
            s, ds = _sigmoid_parts(xc * (_A + _B * xc * xc))
            d = s + xc * ds * (_A + _B3 * xc * xc)
        dx[i] = g[i] * d


def activation(x, name, slope=0.0):
    check_float32(x, "x")
    y = empty(x.shape)
    _act_k(_grid(x.size), BLOCK, x, y, x.size, _ACTIVATIONS[name], float(slope))
    return y


def activation_backward(g, src, name, slope=0.0):
    """src: the forward's input x."""
    dx = empty(src.shape)
    _act_bwd_k(_grid(src.size), BLOCK, g, src, dx, src.size, _ACTIVATIONS[name], float(slope))
    return dx


# ---- mul with broadcasting --------------------------------------------------------------------------------

@kernel
def _mul_k(a, b, y, n):
    i = cuda.grid(1)
    if i < n:
        y[i] = a[i] * b[i]


@cuda.jit(device=True)
def _two_offsets(i, meta, nd, row_a, row_b):
    """Flat index i over the shape in meta row 0 -> its offsets under the strides of rows row_a and row_b."""
    rem = i
    ia = 0
    ib = 0
    for d in range(nd - 1, -1, -1):
        size = meta[d]
        c = umod32(rem, size)
        rem = udiv32(rem, size)
        ia += c * meta[row_a * nd + d]
        ib += c * meta[row_b * nd + d]
    return ia, ib


@kernel
def _mul_bcast_k(a, b, y, n, meta, nd):
    # meta rows: output shape, a's strides, b's strides (0 along a broadcast dimension)
    i = cuda.grid(1)
    if i < n:
        ia, ib = _two_offsets(i, meta, nd, 1, 2)
        y[i] = a[ia] * b[ib]


@kernel
def _mul_bcast_bwd_k(g, other, dx, n, meta, nd, m):
    # one thread per element of the operand: its gradient sums g * other over the m output elements it was
    # broadcast to (no atomics, a fixed summation order).  meta rows: the operand's shape, the sizes of the
    # dimensions it was broadcast along (1 elsewhere), the output's strides, other's strides
    i = cuda.grid(1)
    if i < n:
        o, io = _two_offsets(i, meta, nd, 2, 3)
        acc = float64(0.0)
        for j in range(m):
            rem = j
            oo = o
            jo = io
            for d in range(nd - 1, -1, -1):
                size = meta[nd + d]
                if size > 1:
                    c = umod32(rem, size)
                    rem = udiv32(rem, size)
                    oo += c * meta[2 * nd + d]
                    jo += c * meta[3 * nd + d]
            acc += float64(g[oo]) * float64(other[jo])
        dx[i] = acc


def _strides(shape):
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return out[::-1]


def broadcast_shape(a_shape, b_shape):
    """numpy's broadcast result, or ValueError naming b: checked before anything is allocated or launched."""
    try:
        return tuple(np.broadcast_shapes(tuple(a_shape), tuple(b_shape)))
    except ValueError:
        raise ValueError(f"b's shape {tuple(b_shape)} does not broadcast with a's shape {tuple(a_shape)}") from None


_META = {}  # shapes -> int64 device array: uploaded once per shape pair, not once per launch


def _meta(key, rows):
    arr = _META.get(key)
    if arr is None:
        arr = _META[key] = to_device(np.asarray(rows, np.int64).reshape(-1))
    return arr


def _padded(shape, nd):
    return (1,) * (nd - len(shape)) + tuple(shape)


def _bcast_strides(shape, out):
    return [0 if n == 1 and o != 1 else s for n, o, s in zip(shape, out, _strides(shape))]


def mul(a, b):
    check_float32(a, "a")
    check_float32(b, "b")
    out = broadcast_shape(a.shape, b.shape)
    y = empty(out)
    n = int(math.prod(out))
    if tuple(a.shape) == tuple(b.shape):
        _mul_k(_grid(n), BLOCK, a, b, y, n)
        return y
    nd = max(len(out), 1)
    sa, sb, so = _padded(a.shape, nd), _padded(b.shape, nd), _padded(out, nd)
    meta = _meta(("fwd", sa, sb), [so, _bcast_strides(sa, so), _bcast_strides(sb, so)])
    _mul_bcast_k(_grid(n), BLOCK, a, b, y, n, meta, nd)
    return y


def mul_backward(g, self_shape, other):
    """d(a * b)/d(self) for the operand of shape self_shape: g * other, summed back over the dimensions
    self was broadcast along (numpy's rule, as functional._sum_to on the host)."""
    out = tuple(g.shape)
    self_shape = tuple(self_shape)
    if self_shape == out and tuple(other.shape) == out:
        return mul(g, other)
    nd = max(len(out), 1)
    ss, so, st = _padded(self_shape, nd), _padded(out, nd), _padded(other.shape, nd)
    reduced = [o if s == 1 and o != 1 else 1 for s, o in zip(ss, so)]
    meta = _meta(("bwd", ss, so, st), [ss, reduced, _strides(so), _bcast_strides(st, so)])
    dx = empty(self_shape)
    n = int(math.prod(self_shape))
    _mul_bcast_bwd_k(_grid(n), BLOCK, g, other, dx, n, meta, nd, int(math.prod(reduced)))
    return dx


# ---- dropout -----------------------------------------------------------------------------------------------

_M32 = 0xFFFFFFFF


@cuda.jit(device=True)
def _mul32(x, c):
    # x * c mod 2**32 from 16-bit halves: every product stays below 2**48, so the int64 arithmetic numba
    # uses never overflows, and the simulator (Python ints) and the GPU give the same bits
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & _M32


@cuda.jit(device=True)
def _hash32(x):
    # "lowbias32" (C. Wellons): a bijection on 32 bits whose output bits each flip with ~1/2 probability
    # for any one-bit change of the input
    x ^= x >> 16
    x = _mul32(x, 0x7FEB352D)
    x ^= x >> 15
    x = _mul32(x, 0x846CA68B)
    x ^= x >> 16
    return x


@kernel
def _dropout_k(x, y, n, seed, threshold, scale):
    # counter-based: element i keeps iff hash(hash(seed) + i) >> 8 (uniform on 24 bits) >= threshold, so the
    # mask is a pure function of (seed, i) - the backward recomputes the same mask instead of storing it
    i = cuda.grid(1)
    if i < n:
        h = _hash32((_hash32(seed) + i) & _M32)
        y[i] = x[i] * scale if (h >> 8) >= threshold else np.float32(0)


def dropout_threshold(p):
    """Drop iff the 24-bit draw is below this: P(drop) = round(p * 2**24) / 2**24, within 3e-8 of p."""
    return round(p * (1 << 24))


def dropout(x, p, seed):
    """x with each element dropped with probability p and the rest scaled by 1 / (1 - p), the mask a
    function of (seed, element index) only; dropout(g, p, seed) is therefore also its backward."""
    check_float32(x, "x")
    y = empty(x.shape)
    scale = 1.0 / (1.0 - p) if p < 1 else 0.0
    _dropout_k(_grid(x.size), BLOCK, x, y, x.size, int(seed) & _M32, dropout_threshold(p), float(scale))
    return y


# ---- concat / split --------------------------------------------------------------------------------------

@kernel
def _slab_copy_k(part, whole, n, seg, row, base, into_whole):
    # part seen as (outer, seg) rows, whole as (outer, row): part's columns are whole's [base, base + seg)
    i = cuda.grid(1)
    if i < n:
        j = udiv32(i, seg) * row + base + umod32(i, seg)
        if into_whole:
            whole[j] = part[i]
        else:
            part[i] = whole[j]


def concat_shape(shapes, axis):
    """(output shape, axis in [0, ndim)) or ValueError naming `tensors`, before anything runs."""
    shapes = [tuple(s) for s in shapes]
    if not shapes:
        raise ValueError("tensors must not be empty")
    nd = len(shapes[0])
    if not -nd <= axis < nd:
        raise ValueError(f"axis must be in [{-nd}, {nd}) for {nd}-dimensional tensors, got {axis}")
    axis %= nd
    for k, s in enumerate(shapes):
        if len(s) != nd or s[:axis] + s[axis + 1:] != shapes[0][:axis] + shapes[0][axis + 1:]:
            raise ValueError(f"tensors[{k}] has shape {s}, which does not match tensors[0]'s {shapes[0]} "
                             f"outside axis {axis}")
    return shapes[0][:axis] + (sum(s[axis] for s in shapes),) + shapes[0][axis + 1:], axis


def _slabs(shapes, axis):
    inner = int(math.prod(shapes[0][axis + 1:]))
    total = sum(s[axis] for s in shapes)
    base = 0
    for s in shapes:
        yield s, s[axis] * inner, total * inner, base * inner
        base += s[axis]


def concat(arrays, axis):
    for k, a in enumerate(arrays):
        check_float32(a, f"tensors[{k}]")
    out_shape, axis = concat_shape([a.shape for a in arrays], axis)
    y = empty(out_shape)
    for a, (_, seg, row, base) in zip(arrays, _slabs([tuple(a.shape) for a in arrays], axis)):
        if a.size:
            _slab_copy_k(_grid(a.size), BLOCK, a, y, int(a.size), int(seg), int(row), int(base), 1)
    return y


def split(g, shapes, axis, need=None):
    """concat's backward: g cut along axis into pieces of the given shapes (None where need[k] is false)."""
    out = []
    for k, (s, seg, row, base) in enumerate(_slabs([tuple(s) for s in shapes], axis % len(shapes[0]))):
        if need is not None and not need[k]:
            out.append(None)
            continue
        part = empty(s)
        if part.size:
            _slab_copy_k(_grid(part.size), BLOCK, part, g, int(part.size), int(seg), int(row), int(base), 0)
        out.append(part)
    return out
