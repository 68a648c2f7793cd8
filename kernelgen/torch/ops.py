"""kernelgen's convolutions as torch operators: `torch.ops.kernelgen.conv`, `.conv_backward_data`,
`.conv_backward_weight` and `.conv_transpose`, each a `torch.library.custom_op` with a fake (meta) implementation,
so that torch.compile traces through them, and the forward ops with registered autograd formulas whose
gradients are kernelgen ops again.

Every op takes and returns torch's layout, (N, C, *spatial) tensors and (K, C / groups, *filter) weights, and
hands kernelgen the channels-last view of each: a permutation, free for tensors stored channels-last
(torch.channels_last, which the modules' weights and every output here are), one copy for others.  Outputs are
kernelgen's channels-last results seen as (N, C, *spatial): channels-last tensors, so a network's next layer
reads them without a copy.  On CUDA the kernels run on torch's current stream.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from kernelgen import api
from kernelgen.problem import conv_out_size
from kernelgen.torch import direct


def channels_last(t):
    """(N, C, *spatial) as (N, *spatial, C), C-contiguous: a view when t is stored channels-last, else a copy.
    Detached: the autograd formulas below carry the gradients, and torch refuses __cuda_array_interface__ on a
    tensor that requires grad (the ops run under autograd's redispatch with the caller's tensors)."""
    v = t.detach().movedim(1, -1)
    return v if v.is_contiguous() else v.contiguous()


def channels_first(t):
    """A channels-last (N, *spatial, C) tensor seen as (N, C, *spatial) (a view)."""
    return t.movedim(-1, 1)


def _empty_like_kernelgen(ref, shape):
    """What the kernel returns for torch-layout `shape`: a channels-last tensor seen as (N, C, *spatial)."""
    return channels_first(ref.new_empty((shape[0], *shape[2:], shape[1])))


def _where(t, precision):
    """The keyword arguments that put a kernelgen call where t is: its backend, torch's current stream."""
    if not t.is_cuda:
        return {"backend": "cpu", "precision": precision}
    return {"backend": "cuda", "precision": precision, "stream": _current_stream(t)}


_STREAMS: dict = {}  # raw CUstream handle -> torch's Stream object for it, made once


def _current_stream(t):
    """torch's current stream on t's device, or None for the default stream.  torch.cuda.current_stream builds
    a Stream object on every call (~10 µs of Python, three times per convolution of a training step); the raw
    handle is one C call, and the object for it is made once."""
    try:
        raw = torch._C._cuda_getCurrentRawStream(t.get_device())
    except AttributeError:  # (a torch without it: the public call)
        stream = torch.cuda.current_stream(t.device)
        return None if stream.cuda_stream == 0 else stream
    if raw == 0:
        return None
    stream = _STREAMS.get(raw)
    if stream is None:
        stream = _STREAMS[raw] = torch.cuda.current_stream(t.device)
    return stream


def _bias(bias):
    return None if bias is None else bias.detach().contiguous()


def _launch(op, tensors, names, extra, hyper, precision):
    """op(*channels-last views of tensors, *extra, stride=, padding=, dilation=, groups=) on kernelgen, in torch's
    layout: directly by address where a call with this key ran before (kernelgen/torch/direct.py), else through
    kernelgen's op (whose route is then kept for the key, where the tensors were channels-last already)."""
    stride, padding, dilation, groups = hyper
    lead = tensors[0]
    call_key = None
    if lead.is_cuda:
        call_key = direct.key(op.__name__, tensors, (*extra, tuple(stride), tuple(padding), tuple(dilation), groups),
                              precision)
        result = direct.run(call_key, tensors, _current_stream(lead))
        if result is not None:
            return result
    views, args = True, []  # (views: no tensor needed a copy, so a direct launch may read the tensors themselves)
    for t in tensors:
        v = None if t is None else t.detach() if t.dim() == 1 else t.detach().movedim(1, -1)  # (a bias as it is)
        if v is not None and not v.is_contiguous():
            views, v = False, v.contiguous()
        args.append(v)
    args = (*args, *extra)
    kwargs = dict(stride=tuple(stride), padding=tuple(padding), dilation=tuple(dilation), groups=groups,
                  **_where(lead, precision))
    result = op(*args, **kwargs)
    if call_key is not None:
        direct.keep(call_key, op, args, kwargs, tensors, names, views)
    return channels_first(result)


def conv_impl(x, w, bias, stride, padding, dilation, groups, precision):
    return _launch(api.conv, (x, w, bias), ("x", "w", "bias"), (), (stride, padding, dilation, groups), precision)


def conv_backward_data_impl(dy, w, x_shape, stride, padding, dilation, groups, precision):
    shape = (x_shape[0], *x_shape[2:], x_shape[1])
    return _launch(api.conv_backward_data, (dy, w), ("dy", "w"), (shape,), (stride, padding, dilation, groups),
                   precision)


def conv_backward_weight_impl(x, dy, w_shape, stride, padding, dilation, groups, precision):
    shape = (w_shape[0], *w_shape[2:], w_shape[1])
    return _launch(api.conv_backward_weight, (x, dy), ("x", "dy"), (shape,), (stride, padding, dilation, groups),
                   precision)


def conv_transpose_impl(x, w, bias, stride, padding, output_padding, dilation, groups, precision):
    y = api.deconv(channels_last(x), channels_last(w), _bias(bias), stride=tuple(stride), padding=tuple(padding),
                   output_padding=tuple(output_padding), dilation=tuple(dilation), groups=groups,
                   **_where(x, precision))
    return channels_first(y)


@torch.library.custom_op("kernelgen::conv", mutates_args=())
def conv(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], stride: List[int], padding: List[int],
         dilation: List[int], groups: int, precision: str) -> torch.Tensor:
    return conv_impl(x, w, bias, stride, padding, dilation, groups, precision)


@torch.library.custom_op("kernelgen::conv_backward_data", mutates_args=())
def conv_backward_data(dy: torch.Tensor, w: torch.Tensor, x_shape: List[int], stride: List[int], padding: List[int],
                       dilation: List[int], groups: int, precision: str) -> torch.Tensor:
    return conv_backward_data_impl(dy, w, x_shape, stride, padding, dilation, groups, precision)


@torch.library.custom_op("kernelgen::conv_backward_weight", mutates_args=())
def conv_backward_weight(x: torch.Tensor, dy: torch.Tensor, w_shape: List[int], stride: List[int],
                         padding: List[int], dilation: List[int], groups: int, precision: str) -> torch.Tensor:
    return conv_backward_weight_impl(x, dy, w_shape, stride, padding, dilation, groups, precision)


@torch.library.custom_op("kernelgen::conv_transpose", mutates_args=())
def conv_transpose(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], stride: List[int],
                   padding: List[int], output_padding: List[int], dilation: List[int], groups: int,
                   precision: str) -> torch.Tensor:
    return conv_transpose_impl(x, w, bias, stride, padding, output_padding, dilation, groups, precision)


# --- shapes without data (torch.compile, meta tensors) ----------------------------------------------------------

def conv_output_shape(x_shape, w_shape, stride, padding, dilation):
    spatial = [conv_out_size(i, f, s, p, d) for i, f, s, p, d in zip(x_shape[2:], w_shape[2:], stride, padding,
                                                                         dilation)]
    return [x_shape[0], w_shape[0], *spatial]


def conv_transpose_output_shape(x_shape, w_shape, stride, padding, output_padding, dilation, groups):
    spatial = [(i - 1) * s - 2 * p + d * (f - 1) + op + 1 for i, f, s, p, op, d in
               zip(x_shape[2:], w_shape[2:], stride, padding, output_padding, dilation)]
    return [x_shape[0], w_shape[1] * groups, *spatial]


@conv.register_fake
def _(x, w, bias, stride, padding, dilation, groups, precision):
    return _empty_like_kernelgen(x, conv_output_shape(x.shape, w.shape, stride, padding, dilation))


@conv_backward_data.register_fake
def _(dy, w, x_shape, stride, padding, dilation, groups, precision):
    return _empty_like_kernelgen(dy, x_shape)


@conv_backward_weight.register_fake
def _(x, dy, w_shape, stride, padding, dilation, groups, precision):
    return _empty_like_kernelgen(x, w_shape)


@conv_transpose.register_fake
def _(x, w, bias, stride, padding, output_padding, dilation, groups, precision):
    return _empty_like_kernelgen(x, conv_transpose_output_shape(x.shape, w.shape, stride, padding, output_padding,
                                                                dilation, groups))


# --- autograd: the gradients are kernelgen ops ------------------------------------------------------------------

def _bias_grad(dy):
    return dy.sum(dim=[0, *range(2, dy.dim())])


def _conv_setup(ctx, inputs, output):
    x, w, bias, stride, padding, dilation, groups, precision = inputs
    ctx.save_for_backward(x, w)
    ctx.hyper = (stride, padding, dilation, groups, precision)
    ctx.has_bias = bias is not None


def _conv_backward(ctx, dy, conv_backward_data=conv_backward_data, conv_backward_weight=conv_backward_weight):
    x, w = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    dx = conv_backward_data(dy, w, list(x.shape), *ctx.hyper) if need_x else None
    dw = conv_backward_weight(x, dy, list(w.shape), *ctx.hyper) if need_w else None
    db = _bias_grad(dy) if ctx.has_bias and need_b else None
    return dx, dw, db, None, None, None, None, None


def _conv_transpose_setup(ctx, inputs, output):
    x, w, bias, stride, padding, output_padding, dilation, groups, precision = inputs
    ctx.save_for_backward(x, w)
    ctx.hyper = (stride, padding, dilation, groups, precision)
    ctx.has_bias = bias is not None
    ctx.y_shape = list(output.shape)


def _conv_transpose_backward(ctx, dy, conv=conv, conv_backward_weight=conv_backward_weight):
    """conv_transpose is the backward-data pass of the convolution with weight w: its input gradient is that
    convolution's forward of dy, its weight gradient the convolution's backward-weight with dy as the input and x as
    the output gradient.  An output_padding past the stride gives trailing outputs no element of x feeds: the
    convolution's output there is cropped off (dx), and x is extended by zeros (dw)."""
    x, w = ctx.saved_tensors
    stride, padding, dilation, groups, precision = ctx.hyper
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    seen = conv_output_shape(ctx.y_shape, w.shape, stride, padding, dilation)
    seen[1] = x.shape[1]
    dx = dw = db = None
    if need_x:
        dx = conv(dy, w, None, stride, padding, dilation, groups, precision)
        if list(dx.shape) != list(x.shape):
            dx = dx[tuple(slice(0, n) for n in x.shape)]
    if need_w:
        xe = x if list(x.shape) == seen else torch.nn.functional.pad(
            x, [v for n, m in reversed(list(zip(seen[2:], x.shape[2:]))) for v in (0, n - m)])
        dw = conv_backward_weight(dy, xe, list(w.shape), stride, padding, dilation, groups, precision)
    if ctx.has_bias and need_b:
        db = _bias_grad(dy)
    return dx, dw, db, None, None, None, None, None, None


conv.register_autograd(_conv_backward, setup_context=_conv_setup)
conv_transpose.register_autograd(_conv_transpose_backward, setup_context=_conv_transpose_setup)


# --- eager mode: the same formulas without the operator dispatch --------------------------------------------------
# A custom_op call costs ~50 µs of Python in eager mode (on this machine: 58 µs for a forward under autograd, 163 µs
# forward and backward, against 10 and 57 µs through an autograd.Function), more than a small convolution's kernel.
# So outside torch.compile the functional API runs the implementations through these Functions; torch.compile
# (torch.compiler.is_compiling) sees the custom ops.

class _EagerConv(torch.autograd.Function):
    # (forward takes ctx: a Function with a separate setup_context has its arguments bound through
    # inspect.signature on every call, ~1.5 ms of a ResNet-18 step's host time under cProfile on the H100)
    @staticmethod
    def forward(ctx, x, w, bias, stride, padding, dilation, groups, precision):
        _conv_setup(ctx, (x, w, bias, stride, padding, dilation, groups, precision), None)
        return conv_impl(x, w, bias, stride, padding, dilation, groups, precision)

    @staticmethod
    def backward(ctx, dy):
        return _conv_backward(ctx, dy, conv_backward_data_impl, conv_backward_weight_impl)


class _EagerConvTranspose(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias, stride, padding, output_padding, dilation, groups, precision):
        y = conv_transpose_impl(x, w, bias, stride, padding, output_padding, dilation, groups, precision)
        _conv_transpose_setup(ctx, (x, w, bias, stride, padding, output_padding, dilation, groups, precision), y)
        return y

    @staticmethod
    def backward(ctx, dy):
        return _conv_transpose_backward(ctx, dy, conv_impl, conv_backward_weight_impl)


def apply_conv(x, w, bias, stride, padding, dilation, groups, precision):
    """The differentiable convolution: the custom op under torch.compile, the eager Function otherwise."""
    if torch.compiler.is_compiling():
        return conv(x, w, bias, stride, padding, dilation, groups, precision)
    y = _EagerConv.apply(x, w, bias, stride, padding, dilation, groups, precision)
    if api.RECORDING.get() is not None:
        record_backward(_conv_setup, _conv_backward, (conv_backward_data_impl, conv_backward_weight_impl),
                        (x, w, bias, stride, padding, dilation, groups, precision), y)
    return y


def apply_conv_transpose(x, w, bias, stride, padding, output_padding, dilation, groups, precision):
    """The differentiable transposed convolution (as apply_conv)."""
    if torch.compiler.is_compiling():
        return conv_transpose(x, w, bias, stride, padding, output_padding, dilation, groups, precision)
    y = _EagerConvTranspose.apply(x, w, bias, stride, padding, output_padding, dilation, groups, precision)
    if api.RECORDING.get() is not None:
        record_backward(_conv_transpose_setup, _conv_transpose_backward, (conv_impl, conv_backward_weight_impl),
                        (x, w, bias, stride, padding, output_padding, dilation, groups, precision), y)
    return y


class _TraceContext:
    """What a backward formula reads of its ctx, for record_backward."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def record_backward(setup, backward, impls, inputs, y):
    """Under kernelgen.torch.precompile's recording: the calls `backward` would make for this forward call, made
    now, in this thread (planned and recorded, not run; torch's own CUDA backward runs on threads where the
    recording is not in force), for the inputs that require grad."""
    ctx = _TraceContext()
    setup(ctx, inputs, y)
    ctx.needs_input_grad = tuple(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)
    with torch.no_grad():
        backward(ctx, torch.zeros_like(y), *impls)
