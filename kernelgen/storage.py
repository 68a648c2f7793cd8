"""Which tensor dtypes each precision computes (checked when a call is planned, before anything compiles).

float32: every precision.  float64: "fp32" only (the CPU backend's exact reference path).  float16
(half-precision storage, like PyTorch's half convolutions): precision="fp16" only, the one tensor-core
operand format that holds every float16 exactly, so staging an operand rounds nothing; products accumulate
in float32 and each output is rounded to float16 once, when it is stored.  (TF32 would compute them too,
but a float16 tensor asking for TF32 or bf16 math is more likely a mistake than a wish.)  bfloat16 storage is
refused where arrays are read (kernelgen.arrays): bf16 is a compute precision on float32 tensors.
"""
from __future__ import annotations

PRECISIONS = ("fp32", "tf32", "fp16", "bf16")  # fp32 math, or tensor-core operands with fp32 accumulation
PRECISIONS_BY_DTYPE = {"float32": ("fp32", "tf32", "fp16", "bf16"), "float64": ("fp32",), "float16": ("fp16",)}


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
    raise ValueError(f"precision={precision!r} needs float32 tensors (or float16 with precision=\"fp16\"), "
                     f"got {dtype}")


# the suffix of an output parameter the launcher allocates in float32, zeroes, and rounds into the caller's array of
# the name without it after the kernel (runtime/launch.py Launcher.widened): split backward-weight on float16 tensors
# (its blocks add partial sums atomically, and there are no 16-bit atomic adds)
WIDE_SUFFIX = "__fp32"


def check_split_k(dtype, config, direction=None):
    """Split-K adds partial sums into the output atomically: that needs a float32 output.  Backward-weight on float16
    tensors adds into a float32 workspace the launcher rounds into dw (WIDE_SUFFIX); any other float16 output
    cannot split."""
    if dtype == "float16" and config.split_k > 1 and direction != "bwd_weight":
        raise ValueError(f"config: split_k must be 1 for float16 tensors outside backward-weight (split-K adds "
                         f"partial sums into the output, which must then be float32), got {config}")
