"""ConvProblem: one convolution, fully specified, validated and normalised to 3 spatial dims.

Every public entry point turns its arguments into a ConvProblem before anything is compiled or
launched, so bad input fails here with a message naming the argument.  1D and 2D problems are
padded to 3D with unit dims in front; templates bake every size in as a constant, so the unit
dims fold away in the generated code.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

DIRECTIONS = ("fwd", "bwd_data", "bwd_weight")
ACTIVATIONS = (None, "relu")


def check_activation(activation):
    """None or one of ACTIVATIONS (a string: anything else, hashable or not, is refused by name)."""
    if not (activation is None or isinstance(activation, str) and activation in ACTIVATIONS):
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    return activation


# float16 / bfloat16: storage only, computed by precision="fp16" / "bf16" (kernelgen.storage)
DTYPES = ("float32", "float64", "float16", "bfloat16")


def _tuple_arg(name, value, ndim, minimum):
    """int or one int per spatial dim -> tuple of ndim ints >= minimum."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int or a tuple of {ndim} ints, got {value!r}")
    if isinstance(value, (int, np.integer)):
        vals = (int(value),) * ndim
    elif isinstance(value, (tuple, list)):
        if len(value) != ndim or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value):
            raise ValueError(f"{name} must be an int or a tuple of {ndim} ints (one per spatial dim), got {value!r}")
        vals = tuple(int(v) for v in value)
    else:
        raise TypeError(f"{name} must be an int or a tuple of {ndim} ints, got {type(value).__name__}")
    if any(v < minimum for v in vals):
        raise ValueError(f"{name} must be >= {minimum} in every spatial dim, got {vals}")
    return vals


def _groups_arg(groups):
    if isinstance(groups, (bool, np.bool_)) or not isinstance(groups, (int, np.integer)):
        raise TypeError(f"groups must be an int, got {groups!r}")
    if groups < 1:
        raise ValueError(f"groups must be >= 1, got {groups}")
    return int(groups)  # a NumPy integer as a plain int: it is baked into rendered source


def _pad3(vals, fill):
    return (fill,) * (3 - len(vals)) + tuple(vals)


def _check_ranks(x_shape, w_shape, x_layout, w_layout):
    """x has 1-3 spatial dims and w the same number of filter dims; returns (x_shape, w_shape, ndim)."""
    x_shape, w_shape = tuple(x_shape), tuple(w_shape)
    if not 3 <= len(x_shape) <= 5:
        raise ValueError(f"x must have rank 3, 4 or 5 {x_layout} with 1-3 spatial dims, got shape {x_shape}")
    ndim = len(x_shape) - 2
    if len(w_shape) != ndim + 2:
        raise ValueError(f"w must have rank {ndim + 2} {w_layout} to match x, got shape {w_shape}")
    return x_shape, w_shape, ndim


def _window_count(size, filt, stride, pad, dil):
    """How many filter windows fit in `size` padded by `pad` on both sides (the convolution's output size)."""
    return (size + 2 * pad - dil * (filt - 1) - 1) // stride + 1


def conv_out_size(size, filt, stride, pad, dil):
    # an empty input dim has an empty output dim (make_problem refuses one that padding would make non-empty)
    return 0 if size == 0 else _window_count(size, filt, stride, pad, dil)


PADDING_MODES = ("valid", "same")


def _padding_arg(padding, ndim, filt, dilation, stride):
    """padding as make_problem takes it: an int, one per spatial dim, or PyTorch's "valid" / "same" (stride 1;
    the total padding d * (f - 1) split evenly, which needs it even in every dim)."""
    if not isinstance(padding, str):
        return _tuple_arg("padding", padding, ndim, 0)
    if padding not in PADDING_MODES:
        raise ValueError(f"padding must be an int, a tuple of {ndim} ints, or one of {PADDING_MODES}, got {padding!r}")
    if padding == "valid":
        return (0,) * ndim
    if any(s != 1 for s in stride):
        raise ValueError(f"padding='same' needs stride 1 (as in PyTorch), got stride={stride}")
    totals = [d * (f - 1) for f, d in zip(filt, dilation)]
    if any(t % 2 for t in totals):
        raise ValueError(f"padding='same' with filter {tuple(filt)} and dilation {tuple(dilation)} needs uneven "
                         f"padding, which kernelgen does not support; pad x yourself and pass padding=0")
    return tuple(t // 2 for t in totals)


@dataclass(frozen=True)
class ConvProblem:
    """A convolution y = x * w in channels-last layout, seen from one direction.

    direction: "fwd" computes y, "bwd_data" computes dx from dy, "bwd_weight" computes dw.
    Sizes are 3-tuples (D, H, W); `ndim` remembers how many spatial dims the caller used.
    """
    direction: str
    N: int
    C: int
    K: int
    in_size: tuple
    filter_size: tuple
    out_size: tuple
    stride: tuple
    padding: tuple
    dilation: tuple
    groups: int = 1
    ndim: int = 2
    dtype: str = "float32"
    has_bias: bool = False
    activation: str | None = None

    def __post_init__(self):
        if self.direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {self.direction!r}")
        if self.dtype not in DTYPES:
            raise TypeError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        check_activation(self.activation)
        if min(self.N, self.C, self.K, *self.filter_size) < 0 or min(self.in_size) < 0:
            raise ValueError(f"sizes must be >= 0, got {self}")
        expect = tuple(conv_out_size(*a) for a in zip(self.in_size, self.filter_size, self.stride,
                                                       self.padding, self.dilation))
        if expect != tuple(self.out_size):
            raise ValueError(f"output size {self.out_size} does not match input/filter sizes (expected {expect})")

    # --- derived sizes -------------------------------------------------------------------
    @property
    def empty(self):
        """Nothing to compute: an empty batch or spatial size (the output is empty, or a zero dw)."""
        return self.N == 0 or 0 in self.out_size

    @property
    def Cg(self):
        return self.C // self.groups

    @property
    def Kg(self):
        return self.K // self.groups

    @property
    def x_shape(self):
        return (self.N,) + self.in_size[3 - self.ndim:] + (self.C,)

    @property
    def w_shape(self):
        return (self.K,) + self.filter_size[3 - self.ndim:] + (self.Cg,)

    @property
    def y_shape(self):
        return (self.N,) + self.out_size[3 - self.ndim:] + (self.K,)

    @property
    def output_shape(self):
        return {"fwd": self.y_shape, "bwd_data": self.x_shape, "bwd_weight": self.w_shape}[self.direction]

    @property
    def flops(self):
        """2 * multiply-adds of the direct convolution (the figure cuDNN comparisons use)."""
        taps = int(np.prod(self.filter_size))
        return 2 * self.N * int(np.prod(self.out_size)) * self.K * self.Cg * taps

    def with_direction(self, direction):
        return replace(self, direction=direction, has_bias=False, activation=None)

    def folded_2d(self):
        """The 2-D convolution that computes this 3-D one on the same memory, or None where there is none.  Both
        are channels-last, and kernels take flat arrays, so:
        - a filter one deep, along depth at stride 1 without padding (a (2+1)-D network's spatial convolution),
          is a 2-D convolution of N x D images of H x W: x (N, D, H, W, C) is x (N * D, H, W, C), y likewise;
        - a filter one wide and high, at stride 1 without padding in those dims (the temporal convolution), is a
          2-D convolution of N images of D x (H W) with a T x 1 filter.
        The GEMM implicit-GEMM kernels build runs over the same rows and reductions; the 2-D form takes the 2-D
        paths (TMA boxes, tuned tiles) that 3-D problems lack."""
        if self.ndim != 3:
            return None
        (t, r, s), (sd, sh, sw), (pd, ph, pw), (dd, dh, dw) = self.filter_size, self.stride, self.padding, self.dilation
        (d, h, w), (od, oh, ow) = self.in_size, self.out_size
        if (t, sd, pd) == (1, 1, 0):
            return replace(self, N=self.N * d, in_size=(1, h, w), filter_size=(1, r, s), out_size=(1, oh, ow),
                           stride=(1, sh, sw), padding=(0, ph, pw), dilation=(1, dh, dw), ndim=2)
        if (r, s, sh, sw, ph, pw) == (1, 1, 1, 1, 0, 0):
            return replace(self, in_size=(1, d, h * w), filter_size=(1, t, 1), out_size=(1, od, h * w),
                           stride=(1, sd, 1), padding=(0, pd, 0), dilation=(1, dd, 1), ndim=2)
        return None

    def key(self):
        """A short, stable, human-readable specialisation key (also a valid identifier part)."""
        sp = lambda t: "x".join(map(str, t[3 - self.ndim:]))
        parts = [self.direction, f"n{self.N}", f"c{self.C}", f"k{self.K}", f"i{sp(self.in_size)}",
                 f"f{sp(self.filter_size)}", f"s{sp(self.stride)}", f"p{sp(self.padding)}",
                 f"d{sp(self.dilation)}", f"g{self.groups}", self.dtype]
        if self.has_bias:
            parts.append("bias")
        if self.activation:
            parts.append(self.activation)
        return "_".join(parts)


def make_problem(direction, x_shape, w_shape, *, stride=1, padding=0, dilation=1, groups=1,
                 dtype="float32", has_bias=False, activation=None, y_shape=None):
    """Validate shapes and hyper-parameters (argument names as in the public API) and build a ConvProblem.

    x_shape is (N, *spatial, C), w_shape is (K, *filter, C // groups).  y_shape, when given
    (the dy of a backward pass), must equal the computed output shape.
    """
    x_shape, w_shape, ndim = _check_ranks(x_shape, w_shape, "(N, *spatial, C)", "(K, *filter, C // groups)")
    groups = _groups_arg(groups)
    N, C = x_shape[0], x_shape[-1]
    K = w_shape[0]
    if min(x_shape) < 0 or C < 1:  # an empty batch or spatial size is an empty problem, as in PyTorch
        raise ValueError(f"x must have at least one channel and no negative dim, got shape {x_shape}")
    if min(w_shape) < 1:
        raise ValueError(f"w must have no empty dim, got shape {w_shape}")
    if C % groups:
        raise ValueError(f"x channels ({C}) must be divisible by groups ({groups})")
    if K % groups:
        raise ValueError(f"w out-channels ({K}) must be divisible by groups ({groups})")
    if w_shape[-1] != C // groups:
        raise ValueError(f"w must have C // groups = {C // groups} in-channels (last dim), got {w_shape[-1]}")
    stride = _tuple_arg("stride", stride, ndim, 1)
    dilation = _tuple_arg("dilation", dilation, ndim, 1)
    padding = _padding_arg(padding, ndim, w_shape[1:-1], dilation, stride)
    in_size, filt = _pad3(x_shape[1:-1], 1), _pad3(w_shape[1:-1], 1)
    stride3, pad3, dil3 = _pad3(stride, 1), _pad3(padding, 0), _pad3(dilation, 1)
    out = tuple(conv_out_size(*a) for a in zip(in_size, filt, stride3, pad3, dil3))
    for i, f, st, pd, dl in zip(in_size, filt, stride3, pad3, dil3):
        if i == 0 and _window_count(0, f, st, pd, dl) > 0:
            raise ValueError(f"x has an empty spatial size {x_shape[1:-1]} that padding {padding} would make a "
                             f"non-empty output; expected padding that keeps an empty input empty")
    if all(in_size) and min(out) < 1:
        raise ValueError(f"empty output: input {x_shape[1:-1]} with filter {w_shape[1:-1]}, padding {padding}, "
                         f"dilation {dilation} gives output size {out[3 - ndim:]}; expected every dim >= 1")
    prob = ConvProblem(direction, N, C, K, in_size, filt, out, stride3, pad3, dil3, groups, ndim,
                       dtype, has_bias, activation)
    if y_shape is not None and tuple(y_shape) != prob.y_shape:
        raise ValueError(f"dy must have shape {prob.y_shape} for this convolution, got {tuple(y_shape)}")
    return prob


def deconv_output_shape(x_shape, w_shape, stride, padding, output_padding, dilation, groups):
    """Output shape of a transposed convolution (PyTorch's conv_transpose semantics), validated."""
    x_shape, w_shape, ndim = _check_ranks(x_shape, w_shape, "(N, *spatial, C_in)", "(C_in, *filter, C_out // groups)")
    if w_shape[0] != x_shape[-1]:
        raise ValueError(f"w must have C_in = {x_shape[-1]} as its first dim (x channels), got {w_shape[0]}")
    groups = _groups_arg(groups)
    stride = _tuple_arg("stride", stride, ndim, 1)
    padding = _tuple_arg("padding", padding, ndim, 0)
    dilation = _tuple_arg("dilation", dilation, ndim, 1)
    output_padding = _tuple_arg("output_padding", output_padding, ndim, 0)
    for op, s, d in zip(output_padding, stride, dilation):
        if op >= max(s, d):
            raise ValueError(f"output_padding must be < max(stride, dilation) in every dim, got "
                             f"output_padding={output_padding}, stride={stride}, dilation={dilation}")
    out = tuple((i - 1) * s - 2 * p + d * (f - 1) + op + 1
                for i, f, s, p, d, op in zip(x_shape[1:-1], w_shape[1:-1], stride, padding, dilation, output_padding))
    if min(out) < 1:
        raise ValueError(f"empty output: transposed convolution gives output size {out}; expected every dim >= 1")
    return (x_shape[0],) + out + (w_shape[-1] * groups,)
