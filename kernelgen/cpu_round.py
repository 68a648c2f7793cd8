"""Operand rounding for generated CPU kernels (imported by rendered modules that use tensor-core IR):
scalar float32 -> float32 exactly representable in TF32 / fp16 / bf16, as the GPU's cvt does it."""
from __future__ import annotations

import math

import numpy as np
from numba import float32, float64, njit

_F32_MAX = 3.4028234663852886e38


@njit(cache=True)
def tf32(x):
    """Round to TF32 like cvt.rna.tf32.f32: 11 significant bits, ties away from zero.
    (Exact for normal floats; an fp32 subnormal keeps 11 significant bits here where the hardware
    keeps fewer, a difference below 1e-41.)"""
    if x == 0.0 or not math.isfinite(x):
        return float32(x)
    m, e = math.frexp(x)  # x = m * 2**e, 0.5 <= |m| < 1
    return float32(math.copysign(math.ldexp(math.floor(abs(m) * 2048.0 + 0.5), e - 11), x))


@njit(cache=True)
def _round_even(x, bits, min_exp, max_finite):
    """x rounded to `bits` significant bits, nearest even, on a grid no finer than 2**min_exp (the
    format's subnormal step); past max_finite -> inf.  float64 holds every step exactly."""
    x = float64(x)
    if x == 0.0 or not math.isfinite(x):
        return float32(x)
    _, e = math.frexp(x)
    q = max(e - bits, min_exp)
    r = math.ldexp(np.rint(math.ldexp(abs(x), -q)), q)
    return float32(math.copysign(r if r <= max_finite else math.inf, x))


@njit(cache=True)
def fp16(x):
    """Round to fp16 like cvt.rn.f16.f32 (back to float32): 11 significant bits, nearest even,
    subnormals below 2**-14 on the 2**-24 grid, overflow to inf."""
    return _round_even(x, 11, -24, 65504.0)


@njit(cache=True)
def bf16(x):
    """Round to bf16 like cvt.rn.bf16.f32 (back to float32): 8 significant bits, nearest even,
    float32's exponent range (subnormals on the 2**-133 grid), overflow to inf."""
    return _round_even(x, 8, -133, _F32_MAX)
