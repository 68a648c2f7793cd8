"""Differentiable ops on channels-last Tensors. Every convolution, forward and backward, is a kernelgen
kernel (kernelgen.conv / conv_backward_data / conv_backward_weight); the rest is numpy on the host and
numba.cuda kernels for device data (cuda_ops: the ops a ResNet trains with, fused where it saves passes
over memory - batch_norm_relu, add_relu; cuda_elementwise: the other element-wise ops and concat; the windowed
pools are in pooling.py, add, sub, mul, div, pow, neg in arithmetic.py and reshape in tensor.py, all re-exported
here).
Each op's backward closure maps the output gradient to one gradient per parent (None: not needed).
Reductions whose rounding matters (batch-norm statistics, the loss mean) use kahan_sum."""
from __future__ import annotations

import numpy as np

import kernelgen
from kernelgen import settings
from kernelgen.api import _zero_extend, resolve_precision
from kernelgen.nn.activation_constants import GELU_A, GELU_B, GELU_CLIP
from kernelgen.nn.arithmetic import add, div, mul, neg, pow, sub  # noqa: F401 (part of F.*)
from kernelgen.nn.pooling import adaptive_avg_pool2d, avg_pool2d, max_pool2d  # noqa: F401 (part of F.*)
from kernelgen.nn.tensor import Recomputed, Tensor, reshape  # noqa: F401 (reshape is part of F.*)
from kernelgen.nn.tensor import as_tensor as _as_tensor
from kernelgen.nn.tensor import device_ops as _dev
from kernelgen.nn.tensor import output_reader as _output_reader
from kernelgen.problem import make_problem


def _kahan_steps(terms, c=None):
    """Kahan's recurrence over axis 0 of `terms`, vectorised over the other axes: (sum, compensation),
    the true sum being close to sum - compensation."""
    s = np.zeros_like(terms[0])
    c = np.zeros_like(terms[0]) if c is None else c
    for t in terms:
        y = t - c
        u = s + y
        c = (u - s) - y  # what the addition u = s + y rounded away (negated)
        s = u
    return s, c


def kahan_sum(x, axis=None, keepdims=False):
    """Compensated sum in x's own precision: error about one rounding of the result, independent of the
    number of terms (a plain float32 running sum loses ~n/2 roundings).  The m terms are split into
    ~sqrt(m) interleaved segments (Alpha §5.6) summed side by side, so numpy loops ~2 sqrt(m) times
    rather than m; the segment sums are then Kahan-summed, seeded with the segments' compensations."""
    x = np.asarray(x)
    axes = tuple(range(x.ndim)) if axis is None else tuple(sorted(a % x.ndim for a in np.atleast_1d(axis)))
    rest = tuple(a for a in range(x.ndim) if a not in axes)
    out_shape = tuple(x.shape[a] for a in rest)
    rows = np.transpose(x, axes + rest).reshape(-1, int(np.prod(out_shape, dtype=np.int64)))
    m = rows.shape[0]
    lanes = max(1, int(np.ceil(np.sqrt(m))))
    steps = -(-m // lanes)
    if steps * lanes != m:  # zero rows pad the last step; adding 0 is exact
        rows = np.concatenate([rows, np.zeros((steps * lanes - m, rows.shape[1]), rows.dtype)])
    seg_sum, seg_c = _kahan_steps(rows.reshape(steps, lanes, -1))
    total, c = _kahan_steps(seg_sum, seg_c.sum(axis=0))
    out = (total - c).reshape(out_shape)
    if keepdims:
        out = out.reshape(tuple(1 if a in axes else n for a, n in enumerate(x.shape)))
    return out


def kahan_mean(x, axis=None, keepdims=False):
    """Sum first, divide once at the end: one rounding for the division instead of one per term."""
    x = np.asarray(x)
    axes = range(x.ndim) if axis is None else np.atleast_1d(axis)
    count = int(np.prod([x.shape[a] for a in axes], dtype=np.int64))
    return kahan_sum(x, axis, keepdims) / np.asarray(count, x.dtype)


def add_relu(a, b, inplace=False):
    """relu(a + b), one pass on the device (a residual block's end); the mask is read from the output.
    inplace: on the device, write into a's buffer - for an `a` that no backward reads (a batch norm's
    output without ReLU, as in a residual block), which saves one activation's memory."""
    a, b = _as_tensor(a), _as_tensor(b)
    if ops := _dev(a, b):
        y = ops.add(a.data, b.data, relu=True, out=a.data if inplace else None)
        recompute = None
        if _recomputing(True, a if inplace else None):
            def recompute():
                return ops.add(a.data, b.data, relu=True)
        out = Tensor.from_op(y, (a, b), None, recompute)
        if out.requires_grad:
            output = _output_reader(out, y)

            def backward(g):
                dx = ops.relu_backward(g, output())
                return dx, dx
            out._backward = backward
        if inplace:
            a.release()  # its buffer holds the sum now: read again, a is computed anew (where it can be)
        return out
    return relu(add(a, b))


def _recomputing(training, overwritten=None):
    """Whether a device op's output is made a Recomputed tensor (settings.nn_recompute, in training).  Not where
    the op wrote into `overwritten`'s buffer and that one cannot be computed again itself: computing the output
    again would read the buffer, which holds the output."""
    return training and settings.get("nn_recompute") and (overwritten is None or isinstance(overwritten, Recomputed))


def conv(x, w, bias=None, *, stride=1, padding=0, dilation=1, groups=1, activation=None, backend="cpu",
         precision=None, _half=True):
    """x (N, *spatial, C), w (K, *filter, C // groups), bias (K,) -> (N, *out, K); 1, 2 or 3 spatial dims.
    activation="relu": relu(conv + bias), fused into the convolution's epilogue on the device (the
    backward masks the gradient with the output, as F.relu does).
    precision: "fp32" / "tf32" / "fp16" / "bf16", None: the global setting now (mixed_precision.py); the
    backward uses the precision the forward ran in.  At "fp16" on the device the output is float16
    (settings.nn_half_activations; _half=False: float32, for linear's logits)."""
    x, w = _as_tensor(x), _as_tensor(w)
    bias = None if bias is None else _as_tensor(bias)
    # resolved now, so the backward (which reuses kw) cannot pick up a setting changed in between
    kw = dict(stride=stride, padding=padding, dilation=dilation, groups=groups,
              precision=resolve_precision(precision))
    if ops := _dev(x, w, bias):
        kw.update(backend="cuda", **_stream_kw(ops))
        half = _half and kw["precision"] == "fp16" and settings.get("nn_half_activations")
        return _conv_device(ops, x, w, bias, activation, kw, np.dtype(np.float16) if half else w.dtype)
    kw["backend"] = backend
    y = kernelgen.conv(x.data, w.data, activation=activation if bias is None else None, **kw)
    if bias is not None:
        y = y + bias.data
        y = np.maximum(y, 0) if activation == "relu" else y

    def backward(g):
        if activation == "relu":
            g = g * (y > 0)
        g = np.ascontiguousarray(g, dtype=x.data.dtype)
        dx = kernelgen.conv_backward_data(g, w.data, x.shape, **kw) if x.requires_grad else None
        dw = kernelgen.conv_backward_weight(x.data, g, w.shape, **kw) if w.requires_grad else None
        return (dx, dw) if bias is None else (dx, dw, _bias_grad(None, g))
    return Tensor.from_op(y, (x, w) if bias is None else (x, w, bias), backward)


def _conv_device(ops, x, w, bias, activation, kw, dtype):
    """The convolution on device arrays of `dtype`, bias and activation in its epilogue.  float16 at fp16 precision
    (settings.nn_half_activations), as torch.autocast runs it: the output (the activation the next op reads and a
    batch norm keeps) and the gradients flowing back are float16 - half the memory, and the tensor-core kernels
    stream half the bytes - while the parameters stay float32, cast for the call (the weight's copy kept for the
    backward), and so do their gradients.  An input of another dtype (the image) is cast, and cast again in the
    backward rather than kept; its gradient is cast back."""
    def as_dtype(a):
        return a if a.dtype == dtype else ops.cast(a, dtype)
    wd = as_dtype(w.data)
    y = kernelgen.conv(as_dtype(x.data), wd, None if bias is None else as_dtype(bias.data), activation=activation,
                       **kw)

    def backward(g):
        g = as_dtype(g)
        if activation == "relu":
            g = ops.relu_backward(g, y)
        dx = dw = None
        if x.requires_grad:
            dx = kernelgen.conv_backward_data(g, wd, x.shape, **kw)
            dx = dx if dx.dtype == x.dtype else ops.cast(dx, x.dtype)
        if w.requires_grad:
            dw = kernelgen.conv_backward_weight(as_dtype(x.data), g, w.shape, **kw)
            dw = dw if dw.dtype == w.dtype else ops.cast(dw, w.dtype)
        return (dx, dw) if bias is None else (dx, dw, _bias_grad(ops, g))
    return Tensor.from_op(y, (x, w) if bias is None else (x, w, bias), backward)


conv1d = conv2d = conv3d = conv


def _stream_kw(ops):
    """stream= for kernelgen's ops where nn's device work is on a stream of its own (a captured step's): the
    backward reuses the forward's, as it runs in the same capture."""
    stream = ops.current_stream() if ops else None
    return {} if stream is None else {"stream": stream}


def _bias_grad(ops, g):
    return ops.channel_sums(g)[0] if ops else g.reshape(-1, g.shape[-1]).sum(axis=0)


def conv_transpose(x, w, bias=None, *, stride=1, padding=0, output_padding=0, dilation=1, groups=1,
                   backend="cpu", precision=None):
    """PyTorch's conv_transpose, channels-last: x (N, *spatial, C_in), w (C_in, *filter, C_out // groups).
    It is the backward-data pass of the convolution with weight w, so its gradients are that convolution's
    forward (for x) and its backward-weight with the roles of input and output gradient swapped (for w).
    precision: as conv's, fixed at the forward for the backward too."""
    x, w = _as_tensor(x), _as_tensor(w)
    bias = None if bias is None else _as_tensor(bias)
    ops = _dev(x, w, bias)
    kw = dict(stride=stride, padding=padding, dilation=dilation, groups=groups, backend="cuda" if ops else backend,
              precision=resolve_precision(precision), **_stream_kw(ops))
    y = kernelgen.deconv(x.data, w.data, None if bias is None else bias.data, output_padding=output_padding, **kw)

    # x as the convolution that deconv transposes sees it: an output_padding past the stride adds trailing
    # outputs that no element of x feeds, i.e. zero rows after x (what deconv itself pads with)
    seen = make_problem("fwd", tuple(y.shape), tuple(w.shape), stride=stride, padding=padding, dilation=dilation,
                        groups=groups).output_shape

    def backward(g):
        g = g if ops else np.ascontiguousarray(g, dtype=x.data.dtype)
        dx = dw = None
        if x.requires_grad:
            dx = kernelgen.conv(g, w.data, **kw)
            dx = dx if seen == x.shape else _cropped(dx, x.shape, ops)
        if w.requires_grad:
            dw = kernelgen.conv_backward_weight(g, x.data if seen == x.shape else _zero_extend(x.data, seen), w.shape,
                                                **kw)
        return (dx, dw) if bias is None else (dx, dw, _bias_grad(ops, g))
    return Tensor.from_op(y, (x, w) if bias is None else (x, w, bias), backward)


conv_transpose1d = conv_transpose2d = conv_transpose3d = conv_transpose


def _cropped(a, shape, ops):
    """a's leading corner of `shape`, contiguous (only when output_padding >= stride: a host round trip)."""
    host = a.copy_to_host() if ops else a
    host = np.ascontiguousarray(host[tuple(slice(0, n) for n in shape)])
    return ops.to_device(host) if ops else host


def _check_linear(x, w, bias):
    if w.data.ndim != 2:
        raise ValueError(f"w must have shape (out_features, in_features), got {w.shape}")
    if x.data.ndim == 0 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"x must have in_features = {w.shape[1]} in its last dimension, got shape {x.shape}")
    if bias is not None and bias.shape != (w.shape[0],):
        raise ValueError(f"bias must have shape ({w.shape[0]},), got {bias.shape}")


def linear(x, w, bias=None):
    """x (*, in), w (out, in), bias (out,) -> (*, out), any number of leading dimensions (as PyTorch's).
    On the device: a 1x1 kernelgen convolution of (rows, 1, 1, in) data, so the matrix products are
    kernelgen kernels too."""
    x, w = _as_tensor(x), _as_tensor(w)
    bias = None if bias is None else _as_tensor(bias)
    _check_linear(x, w, bias)
    lead, (f_out, f_in) = x.shape[:-1], w.shape
    if _dev(x, w, bias, names=("x", "w", "bias")):
        rows = int(np.prod(lead, dtype=np.int64))
        y = conv2d(reshape(x, (rows, 1, 1, f_in)), reshape(w, (f_out, 1, 1, f_in)), bias,
                   _half=False)  # (float32 logits: the loss reads them)
        return reshape(y, lead + (f_out,))
    y = x.data @ w.data.T

    def backward(g):
        # the weight's and bias's gradients sum over every leading dimension: seen as rows of a matrix
        g2 = g.reshape(-1, f_out)
        dx = g @ w.data if x.requires_grad else None
        dw = g2.T @ x.data.reshape(-1, f_in) if w.requires_grad else None
        return (dx, dw) if bias is None else (dx, dw, g2.sum(axis=0))
    if bias is None:
        return Tensor.from_op(y, (x, w), backward)
    return Tensor.from_op(y + bias.data, (x, w, bias), backward)


def relu(x):
    x = _as_tensor(x)
    if ops := _dev(x):
        y = ops.relu(x.data)
        return Tensor.from_op(y, (x,), lambda g: (ops.relu_backward(g, y),))
    mask = x.data > 0
    return Tensor.from_op(x.data * mask, (x,), lambda g: (g * mask,))


def flatten(x):
    return reshape(x, (x.shape[0], -1))


def global_avg_pool(x):
    """(N, H, W, C) -> (N, C)."""
    x = _as_tensor(x)
    if ops := _dev(x):
        return Tensor.from_op(ops.global_avg_pool(x.data), (x,), lambda g: (ops.global_avg_pool_backward(g, x.shape),))
    hw = x.shape[1] * x.shape[2]
    return Tensor.from_op(x.data.mean(axis=(1, 2)), (x,),
                          lambda g: (np.broadcast_to(g[:, None, None, :] / hw, x.shape).copy(),))


def _check_batch_norm(x, weight, bias, running_mean, running_var):
    c = weight.shape[0] if weight.data.ndim == 1 else None
    if c is None:
        raise ValueError(f"weight must have shape (channels,), got {weight.shape}")
    if x.data.ndim < 2 or x.shape[-1] != c:
        raise ValueError(f"x: expected {c} channels, got {x.shape[-1] if x.data.ndim else 0} (the last dimension "
                         f"of channels-last data, shape {x.shape})")
    for name, a in (("bias", bias.data), ("running_mean", running_mean), ("running_var", running_var)):
        if tuple(a.shape) != (c,):
            raise ValueError(f"{name} must have shape ({c},), got {tuple(a.shape)}")


def batch_norm(x, weight, bias, running_mean, running_var, *, training, momentum=0.1, eps=1e-5):
    """Per-channel normalisation over (N, H, W) of a channels-last x; running stats updated in place."""
    x, weight, bias = _as_tensor(x), _as_tensor(weight), _as_tensor(bias)
    _check_batch_norm(x, weight, bias, running_mean, running_var)
    if ops := _dev(x, weight, bias):
        return _batch_norm_device(ops, x, weight, bias, running_mean, running_var, training, momentum, eps, False)
    axes = tuple(range(x.data.ndim - 1))
    if training:
        count = x.data.size // x.shape[-1]
        mean = kahan_mean(x.data, axes)
        var = kahan_mean((x.data - mean) ** 2, axes)
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


def batch_norm_relu(x, weight, bias, running_mean, running_var, *, training, momentum=0.1, eps=1e-5):
    """relu(batch_norm(x, ...)): on the device one normalising pass, and the backward recomputes x_hat from
    x and reads the ReLU mask from the output, so nothing but x and y is kept (as PyTorch keeps them)."""
    x, weight, bias = _as_tensor(x), _as_tensor(weight), _as_tensor(bias)
    _check_batch_norm(x, weight, bias, running_mean, running_var)
    if ops := _dev(x, weight, bias):
        return _batch_norm_device(ops, x, weight, bias, running_mean, running_var, training, momentum, eps, True)
    return relu(batch_norm(x, weight, bias, running_mean, running_var, training=training, momentum=momentum,
                           eps=eps))


def batch_norm_add_relu(x, weight, bias, running_mean, running_var, residual, *, training, momentum=0.1, eps=1e-5,
                        inplace=False):
    """relu(batch_norm(x, ...) + residual): a residual block whose shortcut is projected (conv + batch norm)
    ends in one pass on the device, the batch norm's output never stored.  inplace: on the device, write
    into residual's buffer - for a residual that no backward reads (a batch norm's output without ReLU)."""
    x, weight, bias, residual = _as_tensor(x), _as_tensor(weight), _as_tensor(bias), _as_tensor(residual)
    _check_batch_norm(x, weight, bias, running_mean, running_var)
    if ops := _dev(x, weight, bias, residual):
        return _batch_norm_device(ops, x, weight, bias, running_mean, running_var, training, momentum, eps, True,
                                  residual, inplace)
    return add_relu(batch_norm(x, weight, bias, running_mean, running_var, training=training, momentum=momentum,
                               eps=eps), residual)


def _batch_norm_device(ops, x, weight, bias, running_mean, running_var, training, momentum, eps, fuse_relu,
                       residual=None, inplace=False):
    if not (ops.is_device(running_mean) and ops.is_device(running_var)):
        raise TypeError("running_mean and running_var must be device arrays for cuda tensors (Module.to('cuda'))")
    y, mean, inv_std = ops.batch_norm_forward(x.data, weight.data, bias.data, running_mean, running_var,
                                              training, momentum, eps, fuse_relu, None if residual is None else
                                              residual.data, residual.data if inplace else None)
    recompute = None  # the same pass on the same statistics: the same bits as y
    if _recomputing(training, residual if inplace else None):
        def recompute():
            return ops.batch_norm_apply(x.data, weight.data, bias.data, mean, inv_std, fuse_relu,
                                        None if residual is None else residual.data)
    parents = (x, weight, bias) if residual is None else (x, weight, bias, residual)
    out = Tensor.from_op(y, parents, None, recompute)
    if out.requires_grad:
        output = _output_reader(out, y)  # read for the ReLU mask only: without it the backward needs only x
        if residual is None:
            out._backward = lambda g: ops.batch_norm_backward(g, x.data, output() if fuse_relu else None, fuse_relu,
                                                              weight.data, mean, inv_std, training)
        else:
            def backward(g):
                g = ops.relu_backward(g, output())  # the gradient of the sum, to both of its terms
                return ops.batch_norm_backward(g, x.data, None, False, weight.data, mean, inv_std, training) + (g,)
            out._backward = backward
    if inplace:
        residual.release()  # its buffer holds the sum now: read again, it is computed anew (where it can be)
    return out


def _check_labels(labels, n, classes, ignore_index, on_device):
    """labels (the target) checked against (n, classes) logits before any kernel runs: integer dtype, shape
    (n,), each in [0, classes) or ignore_index.  Host labels are returned as a NumPy array; device labels
    (already on the GPU, int64) are checked by shape and dtype only, as their values would cost a copy."""
    if not on_device or not hasattr(labels, "copy_to_host"):
        labels = np.asarray(labels)
        if labels.size == 0 and labels.dtype.kind == "f":
            labels = labels.astype(np.int64)  # np.asarray([]) is float64: an empty batch has no bad label
    if np.dtype(labels.dtype).kind not in "iu":
        raise TypeError(f"labels (target) must be class indices of an integer dtype, got {labels.dtype}")
    if tuple(labels.shape) != (n,):
        raise ValueError(f"labels (target) must have shape ({n},), got {tuple(labels.shape)}")
    if isinstance(labels, np.ndarray):
        bad = (labels != ignore_index) & ((labels < 0) | (labels >= classes))
        if bad.any():
            raise ValueError(f"labels (target) must be in [0, {classes}) or ignore_index={ignore_index}, got "
                             f"{labels[bad][0]} at index {int(np.flatnonzero(bad)[0])}")
    return labels


def cross_entropy(logits, labels, ignore_index=-100):
    """Mean cross-entropy of (N, classes) logits against integer labels (PyTorch's target); log-softmax
    fused in.  Labels equal to ignore_index count neither in the loss nor in the mean (PyTorch's rule: the
    mean is over the other labels, NaN if there are none); only the host supports them."""
    logits = _as_tensor(logits)
    if logits.data.ndim != 2:
        raise ValueError(f"logits must have shape (N, classes), got {logits.shape}")
    ops = _dev(logits)
    n, classes = logits.shape
    labels = _check_labels(labels, n, classes, ignore_index, ops is not None)
    if ops:
        if isinstance(labels, np.ndarray) and (labels == ignore_index).any():
            raise ValueError(f"labels (target) equal to ignore_index={ignore_index} are not supported on the "
                             f"device yet")
        loss, dev_labels = ops.cross_entropy(logits.data, labels)
        return Tensor.from_op(loss, (logits,), lambda g: (ops.cross_entropy_backward(logits.data, dev_labels, g),))
    z = logits.data - logits.data.max(axis=1, keepdims=True)
    log_probs = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    rows = np.flatnonzero(labels != ignore_index)
    picked = log_probs[rows, labels[rows]]
    loss = -kahan_mean(picked) if len(rows) else np.nan  # every label ignored: NaN, as PyTorch

    def backward(g):
        d = np.zeros_like(log_probs)
        d[rows] = np.exp(log_probs[rows])
        d[rows, labels[rows]] -= 1.0
        return (d * (g / max(len(rows), 1)),)
    return Tensor.from_op(np.asarray(loss, dtype=logits.dtype), (logits,), backward)


def concat(tensors, axis=0):
    tensors = [_as_tensor(t) for t in tensors]
    if tensors and (ops := _dev(*tensors, names=[f"tensors[{k}]" for k in range(len(tensors))])):
        y = ops.concat([t.data for t in tensors], axis)
        shapes = [t.shape for t in tensors]
        return Tensor.from_op(y, tuple(tensors), lambda g: tuple(
            ops.split(g, shapes, axis, [t.requires_grad for t in tensors])))
    ends = np.cumsum([t.shape[axis] for t in tensors])[:-1]
    return Tensor.from_op(np.concatenate([t.data for t in tensors], axis=axis), tuple(tensors),
                          lambda g: tuple(np.split(g, ends, axis=axis)))


# ---- activations ----

def _activation_device(ops, x, name, slope=0.0):
    y = ops.activation(x.data, name, slope)
    return Tensor.from_op(y, (x,), lambda g: (ops.activation_backward(g, x.data, name, slope),))


def leaky_relu(x, negative_slope=0.01):
    x = _as_tensor(x)
    if ops := _dev(x):
        return _activation_device(ops, x, "leaky_relu", negative_slope)
    slope = np.where(x.data > 0, 1, negative_slope).astype(x.dtype)
    return Tensor.from_op(x.data * slope, (x,), lambda g: (g * slope,))


def _sigmoid_parts(u):
    """(sigmoid(u), sigmoid(u) * (1 - sigmoid(u))) from e = exp(-|u|) <= 1: exp never overflows, and the
    derivative e / (1 + e)^2 keeps its precision where 1 - sigmoid(u) would cancel to 0."""
    e = np.exp(-np.abs(u))
    s = np.where(u >= 0, 1, e) / (1 + e)
    return s, e / (1 + e) ** 2


def sigmoid(x):
    x = _as_tensor(x)
    if ops := _dev(x):
        return _activation_device(ops, x, "sigmoid")
    s, ds = _sigmoid_parts(x.data)
    return Tensor.from_op(s, (x,), lambda g: (g * ds,))


def tanh(x):
    x = _as_tensor(x)
    if ops := _dev(x):
        return _activation_device(ops, x, "tanh")
    # sech^2 x = 4 s(2x) (1 - s(2x)) from the input: 1 - tanh^2 cancels to 0 in float32 for |x| >~ 9
    _, ds = _sigmoid_parts(2 * x.data)
    return Tensor.from_op(np.tanh(x.data), (x,), lambda g: (g * (4 * ds),))


def gelu(x):
    """GELU, tanh form: x sigmoid(u), u = A x + B x^3.  The derivative s + x s(1-s) (A + 3B x^2) is computed
    from exp(-|u|) (Alpha §5.6): the textbook form's exp(u) overflows for x << 0 and gives inf/inf = NaN."""
    x = _as_tensor(x)
    if ops := _dev(x):
        return _activation_device(ops, x, "gelu")
    xc = np.clip(x.data, -GELU_CLIP, GELU_CLIP)
    s, ds = _sigmoid_parts(xc * (GELU_A + GELU_B * xc * xc))
    dy = (s + xc * ds * (GELU_A + 3 * GELU_B * xc * xc)).astype(x.dtype)
    return Tensor.from_op((x.data * s).astype(x.dtype), (x,), lambda g: (g * dy,))


def dropout(x, p=0.5, training=True, generator=None):
    """Zero each element with probability p and scale the rest by 1 / (1 - p) (inverted dropout), so
    evaluation is the identity.  generator: a numpy Generator, for reproducible masks.  On the device the
    mask is a hash of (seed, element index), the seed drawn from the generator: one integer per call
    instead of a host-drawn mask copied over, and the backward regenerates the very same mask."""
    if not 0 <= p <= 1:
        raise ValueError(f"p must be in [0, 1], got {p}")
    x = _as_tensor(x)
    if not training or p == 0:
        return x
    if ops := _dev(x):
        seed = int((generator if generator is not None else np.random.default_rng()).integers(2 ** 32))
        return Tensor.from_op(ops.dropout(x.data, p, seed), (x,), lambda g: (ops.dropout(g, p, seed),))
    rng = generator if generator is not None else np.random.default_rng()
    keep = rng.random(x.shape) >= p
    mask = (keep / (1 - p) if p < 1 else keep).astype(x.dtype)
    return Tensor.from_op(x.data * mask, (x,), lambda g: (g * mask,))
