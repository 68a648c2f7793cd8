"""Which tensor dtypes each precision computes (checked when a call is planned, before anything compiles).

float32: every precision.  float64: "fp32" only (the CPU backend's exact reference path).  float16
(half-precision storage, like PyTorch's half convolutions): precision="fp16" only, the one tensor-core
operand format that holds every float16 exactly, so staging an operand rounds nothing; products accumulate
in float32 and each output is rounded to float16 once, when it is stored.  (TF32 would compute them too,
but a float16 tensor asking for TF32 or bf16 math is more likely a mistake than a wish.)  bfloat16 (PyTorch's,
JAX's, ml_dtypes' bfloat16; NumPy and numba have none, so its elements travel as uint16 bit patterns): precision
"bf16" only, the same way round.
"""
from __future__ import annotations

import numpy as np

PRECISIONS = ("fp32", "tf32", "fp16", "bf16")  # fp32 math, or tensor-core operands with fp32 accumulation
PRECISIONS_BY_DTYPE = {"float32": ("fp32", "tf32", "fp16", "bf16"), "float64": ("fp32",), "float16": ("fp16",),
                       "bfloat16": ("bf16",)}
# the 16-bit storage dtypes and the one precision that computes each: its operands are exact as stored
HALF_PRECISION = {"float16": "fp16", "bfloat16": "bf16"}
HALF_DTYPES = tuple(HALF_PRECISION)


def numpy_dtype(dtype):
    """The NumPy dtype that holds a storage dtype's elements: itself, or uint16 bit patterns for bfloat16 (NumPy
    and numba have no bfloat16; the kernels decode and encode the bits)."""
    return np.dtype(np.uint16) if dtype == "bfloat16" else np.dtype(dtype)


def stored_exactly(dtype, precision) -> bool:
    """Are `dtype` elements already `precision` operands (float16 at fp16, bfloat16 at bf16: nothing to round)?"""
    return HALF_PRECISION.get(dtype) == precision


def check_precision(precision, name="precision"):
    """precision, if it is one of PRECISIONS (ValueError naming the argument otherwise)."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"{name} must be one of {PRECISIONS}, got {precision!r}")
    return precision


def check_dtype_precision(dtype, precision):
    """`precision` can compute tensors of `dtype`, else ValueError naming precision=."""
    allowed = PRECISIONS_BY_DTYPE[dtype]
    if precision in allowed:
        return
    if dtype == "float16":
        raise ValueError(f'float16 tensors need precision="fp16" (fp16 operands, float32 accumulation, float16 '
                         f"results), got precision={precision!r}")
    if dtype == "bfloat16":
        raise ValueError(f'bfloat16 tensors need precision="bf16" (bf16 operands, float32 accumulation, bfloat16 '
                         f"results), got precision={precision!r}")
    raise ValueError(f"precision={precision!r} needs float32 tensors (or float16 with precision=\"fp16\"), "
                     f"got {dtype}")


# the suffix of an output parameter the launcher allocates in float32, zeroes, and rounds into the caller's array of
# the name without it after the kernel (runtime/launch.py Launcher.widened): split backward-weight on float16 tensors
# (its blocks add partial sums atomically, and there are no 16-bit atomic adds)
WIDE_SUFFIX = "__fp32"


def can_split(problem) -> bool:
    """Can problem's output take split-K?  Split-K adds partial sums into the output atomically: that needs a
    float32 output.  On float16 / bfloat16 tensors the blocks add into a float32 workspace the launcher zeroes and
    rounds into the output (WIDE_SUFFIX): backward-weight's dw, the forward's y and a stride-1 backward-data's dx;
    a strided backward-data (KS-deconv's classes) has none."""
    return problem.dtype not in HALF_DTYPES or not (problem.direction == "bwd_data" and max(problem.stride) > 1)


def check_split_k(problem, config):
    """config's split-K, if any, where problem's output can take it (can_split)."""
    if config.split_k > 1 and not can_split(problem):
        raise ValueError(f"config: split_k must be 1 for a strided backward-data on {problem.dtype} tensors (split-K "
                         f"adds partial sums into the output, which must then be float32), got {config}")


def widen_bits(bits):
    """float32 values of bfloat16 bit patterns (uint16): the upper half of each float32, exactly."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def narrow_bits(values):
    """bfloat16 bit patterns (uint16) of float32 values, rounded to nearest, ties to even; NaN stays NaN."""
    words = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (words + 0x7FFF + ((words >> 16) & 1)) >> 16
    nan = (words & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, (words >> 16) | 0x40, rounded).astype(np.uint16)


def random_storage(rng, shape, dtype):
    """Standard-normal data of `shape` as `dtype` stores it (bfloat16: its bit patterns, rounded to nearest)."""
    values = rng.standard_normal(shape, dtype=np.float32)
    return narrow_bits(values) if dtype == "bfloat16" else values.astype(dtype, copy=False)


def stored_values(a, dtype):
    """The values an array of `dtype` storage holds, as a NumPy array (bfloat16 bits widened to float32)."""
    return widen_bits(np.asarray(a)) if dtype == "bfloat16" else a


def poisoned(size, dtype):
    """`size` NaNs as `dtype` stores them: an output every element of which a kernel must write."""
    return np.full(size, 0x7FC0, np.uint16) if dtype == "bfloat16" else np.full(size, np.nan, dtype)
