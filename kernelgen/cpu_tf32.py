"""TF32 rounding for generated CPU kernels (imported by rendered modules that use tensor-core IR)."""
from __future__ import annotations

import math

from numba import float32, njit


@njit(cache=True)
def tf32(x):
    """Round to TF32 like cvt.rna.tf32.f32: 11 significant bits, ties away from zero.
    (Exact for normal floats; an fp32 subnormal keeps 11 significant bits here where the hardware
    keeps fewer, a difference below 1e-41.)"""
    if x == 0.0 or not math.isfinite(x):
        return float32(x)
    m, e = math.frexp(x)  # x = m * 2**e, 0.5 <= |m| < 1
    return float32(math.copysign(math.ldexp(math.floor(abs(m) * 2048.0 + 0.5), e - 11), x))
