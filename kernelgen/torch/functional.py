"""torch.nn.functional's convolutions on kernelgen: conv1d/2d/3d and conv_transpose1d/2d/3d with torch's
signatures and layouts, differentiable (kernelgen.torch.ops), and aware of autocast.

Precision: bfloat16 tensors compute with precision="bf16", float16 ones with "fp16", float32 ones with
kernelgen's setting in force (kernelgen.set_precision: "fp32" unless changed), float64 ones (CPU) exactly.
Under torch.autocast the convolution runs as torch's does there: the tensors cast to the autocast dtype (bfloat16 or
float16), computed with precision="bf16" / "fp16" (16-bit operands, float32 accumulation) by kernels that read and
write 16-bit tensors, the result in that dtype.
"""
from __future__ import annotations

import torch

from kernelgen import api
from kernelgen.torch import ops


_TUPLES: dict = {}  # (type, value, nd) -> _tuple's answer, for hashable values: a module passes the same tuples every call


def _tuple(value, nd, name):
    """value (an int or nd ints) as a list of nd ints, for the operators' List[int] arguments (not to be changed:
    the same list is returned for the same value)."""
    try:
        found = _TUPLES.get((type(value), value, nd))
    except TypeError:  # (a list)
        found = None
    if found is not None and (type(value) is int or all(type(v) is int for v in value)):  # ((1, True) == (1, 1))
        return found
    try:
        values = (value,) * nd if isinstance(value, int) and not isinstance(value, bool) else tuple(value)
    except TypeError:  # (True, 2.0, None: not ints, not a sequence)
        values = ()
    if len(values) != nd or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{name} must be an int or {nd} ints, got {value!r}")
    if isinstance(value, (int, tuple)) and len(_TUPLES) < 4096:
        _TUPLES[type(value), value, nd] = list(values)
    return list(values)


def _check_ranks(nd, x, w, op):
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
        raise TypeError(f"{op}: input and weight must be torch tensors, got {type(x).__name__} and "
                        f"{type(w).__name__}")
    if x.dim() not in (nd + 1, nd + 2):
        raise ValueError(f"input must have {nd + 2} dims (N, C, *spatial) or {nd + 1} (unbatched) for {op}, "
                         f"got shape {tuple(x.shape)}")
    if w.dim() != nd + 2:
        raise ValueError(f"weight must have {nd + 2} dims for {op}, got shape {tuple(w.shape)}")


def _precision(x):
    """(precision, dtype to compute on or None, dtype of the result or None) for a call on x."""
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.dtype in (torch.float32, torch.bfloat16, torch.float16):
        dtype = torch.get_autocast_dtype(device)
        if dtype == torch.bfloat16:
            return "bf16", torch.bfloat16, torch.bfloat16
        if dtype == torch.float16:
            return "fp16", torch.float16, torch.float16
    if x.dtype == torch.bfloat16:
        return "bf16", None, None
    if x.dtype == torch.float16:
        return "fp16", None, None
    return (api.get_precision() if x.dtype == torch.float32 else "fp32"), None, None


def _cast(t, dtype):
    # (t.to of a tensor already of that dtype returns it, after ~8 µs of argument parsing on the H100 machine's host)
    return t if t is None or dtype is None or t.dtype == dtype else t.to(dtype)


def _same_padding(x, w, stride, dilation):
    """padding="same" (stride 1): the even part as kernelgen's padding, an odd remainder padded on x's far side
    first, as torch does."""
    if any(s != 1 for s in stride):
        raise ValueError(f'padding="same" needs stride 1, got stride={stride}')
    total = [d * (f - 1) for d, f in zip(dilation, w.shape[2:])]
    extra = [t % 2 for t in total]
    if any(extra):
        x = torch.nn.functional.pad(x, [v for e in reversed(extra) for v in (0, e)])
    return x, [t // 2 for t in total]


def _conv(nd, x, w, bias, stride, padding, dilation, groups, op):
    _check_ranks(nd, x, w, op)
    unbatched = x.dim() == nd + 1
    x = x.unsqueeze(0) if unbatched else x
    stride, dilation = _tuple(stride, nd, "stride"), _tuple(dilation, nd, "dilation")
    if padding == "same":
        x, padding = _same_padding(x, w, stride, dilation)
    padding = [0] * nd if padding == "valid" else _tuple(padding, nd, "padding")
    precision, compute, result = _precision(x)
    y = ops.apply_conv(_cast(x, compute), _cast(w, compute), _cast(bias, compute), stride, padding, dilation, groups,
                 precision)
    y = _cast(y, result)
    return y.squeeze(0) if unbatched else y


def _conv_transpose(nd, x, w, bias, stride, padding, output_padding, groups, dilation, op):
    _check_ranks(nd, x, w, op)
    unbatched = x.dim() == nd + 1
    x = x.unsqueeze(0) if unbatched else x
    precision, compute, result = _precision(x)
    y = ops.apply_conv_transpose(_cast(x, compute), _cast(w, compute), _cast(bias, compute), _tuple(stride, nd, "stride"),
                           _tuple(padding, nd, "padding"), _tuple(output_padding, nd, "output_padding"),
                           _tuple(dilation, nd, "dilation"), groups, precision)
    y = _cast(y, result)
    return y.squeeze(0) if unbatched else y


def conv1d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """torch.nn.functional.conv1d on kernelgen."""
    return _conv(1, input, weight, bias, stride, padding, dilation, groups, "conv1d")


def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """torch.nn.functional.conv2d on kernelgen."""
    return _conv(2, input, weight, bias, stride, padding, dilation, groups, "conv2d")


def conv3d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """torch.nn.functional.conv3d on kernelgen."""
    return _conv(3, input, weight, bias, stride, padding, dilation, groups, "conv3d")


def conv_transpose1d(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
    """torch.nn.functional.conv_transpose1d on kernelgen (torch's argument order: groups before dilation)."""
    return _conv_transpose(1, input, weight, bias, stride, padding, output_padding, groups, dilation,
                           "conv_transpose1d")


def conv_transpose2d(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
    """torch.nn.functional.conv_transpose2d on kernelgen."""
    return _conv_transpose(2, input, weight, bias, stride, padding, output_padding, groups, dilation,
                           "conv_transpose2d")


def conv_transpose3d(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
    """torch.nn.functional.conv_transpose3d on kernelgen."""
    return _conv_transpose(3, input, weight, bias, stride, padding, output_padding, groups, dilation,
                           "conv_transpose3d")
