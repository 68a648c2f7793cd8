"""Bad input raises ValueError/TypeError naming the argument, before anything is compiled or run.

"Before anything runs" is checked two ways: the kernel cache sees no lookup at all (its stats and
its memory are unchanged) and get_launcher, the only way from a plan to a kernel, is replaced by
a tripwire for the duration of each call.
"""
from __future__ import annotations

import numpy as np
import pytest

import kernelgen
from kernelgen import api
from kernelgen.runtime.cache import KERNELS


def f32(*shape):
    return np.random.default_rng().standard_normal(shape).astype(np.float32)


X, W, DY = f32(2, 6, 6, 4), f32(8, 3, 3, 4), f32(2, 4, 4, 8)  # a valid conv: y = conv(X, W) has DY's shape


def device(a):
    from numba import cuda
    return cuda.to_device(a)


# (id, op, args, kwargs, exception, regex the message must match: the argument's name, what was expected)
CASES = [
    # rank
    ("x_rank_2", kernelgen.conv, (f32(6, 4), W), {}, ValueError, r"x must have rank 3, 4 or 5"),
    ("x_rank_6", kernelgen.conv, (f32(1, 2, 2, 2, 2, 4), W), {}, ValueError, r"x must have rank"),
    ("w_rank", kernelgen.conv, (X, f32(8, 3, 4)), {}, ValueError, r"w must have rank 4"),
    # channels and groups
    ("w_channels", kernelgen.conv, (X, f32(8, 3, 3, 3)), {}, ValueError, r"w must have C // groups = 4"),
    ("groups_vs_C", kernelgen.conv, (X, f32(9, 3, 3, 1)), {"groups": 3}, ValueError, r"divisible by groups \(3\)"),
    ("groups_vs_K", kernelgen.conv, (X, f32(7, 3, 3, 2)), {"groups": 2}, ValueError, r"out-channels \(7\).*groups"),
    ("groups_zero", kernelgen.conv, (X, W), {"groups": 0}, ValueError, r"groups must be >= 1"),
    ("groups_float", kernelgen.conv, (X, W), {"groups": 1.0}, TypeError, r"groups must be an int"),
    # empty output, hyper-parameters
    ("empty_output", kernelgen.conv, (X, f32(8, 7, 7, 4)), {}, ValueError, r"empty output.*>= 1"),
    ("no_channels", kernelgen.conv, (f32(2, 6, 6, 0), f32(8, 3, 3, 0)), {}, ValueError, r"x must have at least one channel"),
    ("same_strided", kernelgen.conv, (X, W), {"padding": "same", "stride": 2}, ValueError, r"padding=.same. needs stride 1"),
    ("same_uneven", kernelgen.conv, (X, f32(8, 2, 2, 4)), {"padding": "same"}, ValueError, r"padding=.same. with filter"),
    ("padding_mode", kernelgen.conv, (X, W), {"padding": "full"}, ValueError, r"padding must be an int, a tuple"),
    ("empty_padded", kernelgen.conv, (f32(1, 0, 6, 4), W), {"padding": 2}, ValueError, r"x has an empty spatial size"),
    ("stride_0", kernelgen.conv, (X, W), {"stride": 0}, ValueError, r"stride must be >= 1"),
    ("stride_per_dim", kernelgen.conv, (X, W), {"stride": (1, 0)}, ValueError, r"stride must be >= 1"),
    ("stride_len", kernelgen.conv, (X, W), {"stride": (1, 1, 1)}, ValueError, r"stride must be .*2 ints"),
    ("stride_str", kernelgen.conv, (X, W), {"stride": "2"}, TypeError, r"stride must be an int"),
    ("stride_bool", kernelgen.conv, (X, W), {"stride": True}, TypeError, r"stride must be an int"),
    ("dilation_0", kernelgen.conv, (X, W), {"dilation": 0}, ValueError, r"dilation must be >= 1"),
    ("padding_neg", kernelgen.conv, (X, W), {"padding": -1}, ValueError, r"padding must be >= 0"),
    ("padding_per_dim_neg", kernelgen.conv, (X, W), {"padding": (0, -2)}, ValueError, r"padding must be >= 0"),
    # dtypes and placement
    ("x_int32", kernelgen.conv, (X.astype(np.int32), W.astype(np.int32)), {}, TypeError, r"x must have dtype float32"),
    ("x_float16", kernelgen.conv, (X.astype(np.float16), W), {}, TypeError,
     r"w must have the same dtype as x \(float16\)"),
    ("float16_fp32", kernelgen.conv, (X.astype(np.float16), W.astype(np.float16)), {}, ValueError,
     r'float16 tensors need precision="fp16".*got precision=\'fp32\''),
    ("mixed_dtypes", kernelgen.conv, (X, W.astype(np.float64)), {}, TypeError, r"w must have the same dtype as x"),
    ("bias_dtype", kernelgen.conv, (X, W, np.zeros(8, np.float64) + 1), {}, TypeError, r"bias must have the same dtype"),
    ("float64_on_cuda", kernelgen.conv, (X.astype(np.float64), W.astype(np.float64)), {"backend": "cuda"}, TypeError,
     r"float32 on the cuda backend"),
    ("bad_bias_shape", kernelgen.conv, (X, W, f32(7)), {}, ValueError, r"bias must have shape \(8,\)"),
    ("bad_bias_rank", kernelgen.conv, (X, W, f32(1, 8)), {}, ValueError, r"bias must have shape \(8,\)"),
    ("bad_backend", kernelgen.conv, (X, W), {"backend": "gpu"}, ValueError, r"backend must be None, 'cuda' or 'cpu'"),
    ("bad_algo", kernelgen.conv, (X, W), {"algo": "no_such_variant", "backend": "cpu"}, ValueError,
     r"algo must be None or one of"),
    # backward passes
    ("bwd_data_dy_shape", kernelgen.conv_backward_data, (f32(2, 5, 4, 8), W, X.shape), {}, ValueError,
     r"dy must have shape \(2, 4, 4, 8\)"),
    ("bwd_data_x_shape_type", kernelgen.conv_backward_data, (DY, W, 6), {}, TypeError, r"x_shape must be a tuple"),
    ("bwd_data_x_shape_rank", kernelgen.conv_backward_data, (DY, W, (2, 6, 4)), {}, ValueError, r"w must have rank 3"),
    ("bwd_data_stride", kernelgen.conv_backward_data, (DY, W, X.shape), {"stride": 0}, ValueError, r"stride"),
    ("bwd_weight_w_shape", kernelgen.conv_backward_weight, (X, DY, (8, 3, 3, 2)), {}, ValueError,
     r"w must have C // groups = 4"),
    ("bwd_weight_dy_shape", kernelgen.conv_backward_weight, (X, f32(2, 4, 4, 7), W.shape), {}, ValueError,
     r"dy must have shape \(2, 4, 4, 8\)"),
    ("bwd_weight_w_shape_type", kernelgen.conv_backward_weight, (X, DY, "8x3x3x4"), {}, TypeError,
     r"w_shape must be a tuple"),
    ("bwd_weight_dtype", kernelgen.conv_backward_weight, (X, DY.astype(np.float64), W.shape), {}, TypeError,
     r"dy must have the same dtype"),
    # deconv: w is (C_in, *filter, C_out // groups)
    ("deconv_outpad_ge_stride", kernelgen.deconv, (X, f32(4, 3, 3, 2)), {"stride": 2, "output_padding": 2},
     ValueError, r"output_padding must be < max\(stride, dilation\)"),
    ("deconv_outpad_ge_dilation", kernelgen.deconv, (X, f32(4, 3, 3, 2)), {"dilation": 2, "output_padding": (0, 2)},
     ValueError, r"output_padding must be < max\(stride, dilation\)"),
    ("deconv_outpad_neg", kernelgen.deconv, (X, f32(4, 3, 3, 2)), {"output_padding": -1}, ValueError,
     r"output_padding must be >= 0"),
    ("deconv_w_cin", kernelgen.deconv, (X, f32(3, 3, 3, 2)), {}, ValueError, r"w must have C_in = 4"),
    ("deconv_groups", kernelgen.deconv, (X, f32(4, 3, 3, 2)), {"groups": 3}, ValueError, r"groups"),
    ("deconv_empty", kernelgen.deconv, (f32(1, 1, 1, 4), f32(4, 1, 1, 2)), {"padding": 1}, ValueError,
     r"empty output"),
    ("deconv_bias_shape", kernelgen.deconv, (X, f32(4, 3, 3, 2), f32(4)), {}, ValueError, r"bias must have shape \(2,\)"),
    ("deconv_rank", kernelgen.deconv, (f32(4, 4), f32(4, 3, 2)), {}, ValueError, r"x must have rank"),
]


@pytest.fixture
def no_kernels(monkeypatch):
    """Fail loudly if a call gets as far as fetching a kernel; check the cache saw nothing."""
    def tripwire(plan):
        raise AssertionError(f"validation let a bad call through to get_launcher: {plan.problem}")
    monkeypatch.setattr(api, "get_launcher", tripwire)
    before = (dict(KERNELS.stats.__dict__), len(KERNELS._memory))
    yield
    assert (dict(KERNELS.stats.__dict__), len(KERNELS._memory)) == before, "the kernel cache was touched"


@pytest.mark.parametrize("op, args, kwargs, exc, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_before_any_kernel(op, args, kwargs, exc, message, no_kernels):
    with pytest.raises(exc, match=message):
        op(*args, **kwargs)


def test_mixed_host_and_device_arrays(no_kernels):
    with pytest.raises(TypeError, match=r"must all be NumPy arrays or all CUDA arrays.*x on GPU.*w on host"):
        kernelgen.conv(device(X), W)
    with pytest.raises(TypeError, match=r"bias on GPU"):
        kernelgen.conv(X, W, device(f32(8)), backend="cpu")
    with pytest.raises(TypeError, match=r"must all be NumPy arrays or all CUDA arrays"):
        kernelgen.conv_backward_weight(X, device(DY), W.shape)


def test_device_arrays_validated_too(no_kernels):
    with pytest.raises(ValueError, match=r"backend must be 'cuda' \(or None\) for CUDA arrays"):
        kernelgen.conv(device(X), device(W), backend="cpu")
    with pytest.raises(TypeError, match=r"float32 on the cuda backend"):
        kernelgen.conv(device(X.astype(np.float64)), device(W.astype(np.float64)))
    with pytest.raises(ValueError, match=r"w must have C // groups = 4"):
        kernelgen.conv(device(X), device(f32(8, 3, 3, 3)))
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
        kernelgen.conv(device(X), device(W), device(f32(3)))


def test_valid_call_reaches_the_tripwire(no_kernels):
    """The tripwire is live: a valid call gets past validation and into it (so the cases above
    really raised in validation, not somewhere later)."""
    with pytest.raises(AssertionError, match="validation let a bad call through"):
        kernelgen.conv(X, W, backend="cpu")
