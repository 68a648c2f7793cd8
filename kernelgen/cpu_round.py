"""Operand rounding for generated CPU kernels (imported by rendered modules that use tensor-core IR):
scalar float32 -> float32 exactly representable in TF32 / fp16 / bf16, as the GPU's cvt does it.

And 16-bit storage: numba's CPU target has no float16 or bfloat16 type, so those arrays reach CPU kernels as their
uint16 bit patterns (a view, no copy); a load decodes the bits (f16_bits_to_f32 / bf16_bits_to_f32, exact) and a
store encodes a float32 value, rounded like cvt.rn.f16.f32 / cvt.rn.bf16.f32 (f32_to_f16_bits / f32_to_bf16_bits)."""
from __future__ import annotations

import math

import numpy as np
from numba import float32, float64, njit, types, uint16
from numba.extending import overload

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


@njit(cache=True)
def _bits_to_f32(bits, frac_bits, exp_bits):
    """The float32 value of a 16-bit float's bit pattern: 1 sign bit, exp_bits exponent bits (bias 2**(exp_bits - 1)
    - 1), frac_bits fraction bits.  Exact: every fp16 and bf16 is a float32."""
    b = int(bits)
    bias, top = (1 << (exp_bits - 1)) - 1, (1 << exp_bits) - 1
    sign = -1.0 if b & 0x8000 else 1.0
    exp, frac = (b >> frac_bits) & top, b & ((1 << frac_bits) - 1)
    if exp == top:
        return float32(sign * math.inf if frac == 0 else math.nan)
    if exp == 0:  # zero or subnormal: frac steps of 2**(1 - bias - frac_bits)
        return float32(sign * math.ldexp(float64(frac), 1 - bias - frac_bits))
    return float32(sign * math.ldexp(float64(frac + (1 << frac_bits)), exp - bias - frac_bits))


@njit(cache=True)
def _f32_to_bits(x, rounded, frac_bits, exp_bits, quiet_nan):
    """The bit pattern of `rounded` (x already rounded to the 16-bit format, or inf) in the format of
    _bits_to_f32; NaN x as quiet_nan with x's sign."""
    sign = 0x8000 if math.copysign(1.0, x) < 0 else 0
    if math.isnan(x):
        return uint16(sign | quiet_nan)
    bias, top = (1 << (exp_bits - 1)) - 1, (1 << exp_bits) - 1
    r = abs(float64(rounded))
    if r == math.inf:
        return uint16(sign | (top << frac_bits))
    if r < 2.0 ** (1 - bias):  # subnormal (or zero): the fraction counts steps of the subnormal grid
        return uint16(sign | int(math.ldexp(r, bias - 1 + frac_bits)))
    _, e = math.frexp(r)  # r = m * 2**e, 0.5 <= m < 1: exponent field e - 1 + bias, frac_bits bits below the 1
    return uint16(sign | ((e - 1 + bias) << frac_bits) | (int(math.ldexp(r, frac_bits + 1 - e)) - (1 << frac_bits)))


@njit(cache=True)
def f16_bits_to_f32(bits):
    """The float32 value of fp16 bit pattern `bits` (exact: every fp16 is a float32)."""
    return _bits_to_f32(bits, 10, 5)


@njit(cache=True)
def f32_to_f16_bits(x):
    """The fp16 bit pattern of x rounded like cvt.rn.f16.f32: nearest even, subnormals on the 2**-24 grid,
    overflow to inf, NaN to the canonical quiet NaN (0x7E00, sign kept)."""
    return _f32_to_bits(x, fp16(x), 10, 5, 0x7E00)


@njit(cache=True)
def bf16_bits_to_f32(bits):
    """The float32 value of bf16 bit pattern `bits`: the upper half of a float32 word (exact)."""
    return _bits_to_f32(bits, 7, 8)


@njit(cache=True)
def f32_to_bf16_bits(x):
    """The bf16 bit pattern of x rounded like cvt.rn.bf16.f32: nearest even, overflow to inf, NaN to a quiet NaN
    (0x7FC0, sign kept)."""
    return _f32_to_bits(x, bf16(x), 7, 8, 0x7FC0)


@njit(cache=True)
def tf32_truncate(x):
    """x with its low 13 mantissa bits dropped (toward zero): how a warpgroup MMA reads a float32 operand."""
    if x == 0.0 or not math.isfinite(x):
        return float32(x)
    m, e = math.frexp(x)
    return float32(math.copysign(math.ldexp(math.floor(abs(m) * 2048.0), e - 11), x))


@njit(cache=True)
def _operand_word(start, row, k, lbo, sbo, swizzle, itemsize=4):
    """Shared element of (row, k) of a WarpgroupMma operand whose descriptor starts at element `start`
    (itemsize-byte elements; the core-matrix layout is float32's only)."""
    if swizzle:  # 128-byte rows, the 16-byte chunk XORed with row % 8 (bits 4-6 of the address with bits 7-9)
        byte = itemsize * (start + (row // 8) * sbo + (row % 8) * (128 // itemsize) + k)
        return (byte ^ (((byte >> 7) & 7) << 4)) // itemsize
    return start + (row // 8) * sbo + (row % 8) * 4 + (k // 4) * lbo + k % 4


@njit(cache=True)
def _mn_word(start, col, k, n_block, k_group):
    """Shared element of (col, k) of an MN-major 16-bit B (ir.WarpgroupMma.b_mn), or of (row, k) of such an A
    (a_mn): rows of 64 columns along k,
    the 16-byte chunk XORed with k % 8 (the row within its 1024-byte group)."""
    byte = 2 * (start + (col // 64) * n_block + (k // 8) * k_group + (k % 8) * 64 + col % 64)
    return (byte ^ (((byte >> 7) & 7) << 4)) // 2


@njit(cache=True)
def wgmma_tf32(acc, first, a, a0, b, b0, n, lbo, sbo, thread, swizzle=0):
    """ir.WarpgroupMma for one thread: acc[first + 4 j + r] += sum over k < 8 of A[row, k] B[col, k], with
    row = 16 w + g + 8 (r // 2), col = 8 j + 2 t + r % 2 (w, g, t: the thread's warp in its warpgroup, group
    and thread in group), both operands read from their core-matrix (or 128-byte swizzled) layout in shared
    memory and truncated to TF32.  The products are exact in float32 (11 + 11 significant bits); they are summed
    in float32."""
    _wgmma(acc, first, a, a0, b, b0, n, lbo, sbo, thread, swizzle, 8, 4)


@njit(cache=True)
def wgmma_f16(acc, first, a, a0, b, b0, n, lbo, sbo, thread, swizzle=128, b_block=0, b_group=0, a_block=0,
              a_group=0):
    """wgmma_tf32 for kind "fp16": k < 16, the operands float16 bit patterns (uint16) in the 128-byte swizzled
    layout, used exactly; the products are exact in float32, summed in float32.  b_block > 0: B MN-major with
    these (n block, k group) strides (ir.WarpgroupMma.b_mn); a_block > 0: A MN-major likewise (a_mn)."""
    _wgmma(acc, first, a, a0, b, b0, n, lbo, sbo, thread, swizzle, 16, 2, b_block, b_group, False, a_block, a_group)


@njit(cache=True)
def wgmma_bf16(acc, first, a, a0, b, b0, n, lbo, sbo, thread, swizzle=128, b_block=0, b_group=0, a_block=0,
               a_group=0):
    """wgmma_f16 for kind "bf16": the operands bfloat16 bit patterns (uint16), used exactly (8 x 8 significant bits:
    the products are exact in float32)."""
    _wgmma(acc, first, a, a0, b, b0, n, lbo, sbo, thread, swizzle, 16, 2, b_block, b_group, True, a_block, a_group)


def _operand(v):
    """A WarpgroupMma operand element as the MMA uses it (overloaded by the shared array's type)."""


@overload(_operand)
def _operand_impl(v):
    if isinstance(v, types.Integer):  # float16 bits (the CPU's float16): exact
        return lambda v: f16_bits_to_f32(v)
    return lambda v: tf32_truncate(v)  # float32: wgmma reads TF32 by truncation


@njit(cache=True)
def _wgmma(acc, first, a, a0, b, b0, n, lbo, sbo, thread, swizzle, depth, itemsize, b_block=0, b_group=0,
           bfloat16=False, a_block=0, a_group=0):
    w, g, t = (thread % 128) // 32, (thread % 32) // 4, thread % 4
    for i in range(n // 2):
        j, r = i // 4, i % 4
        row, col = 16 * w + g + 8 * (r // 2), 8 * j + 2 * t + r % 2
        s = float32(0.0)
        for k in range(depth):
            aw = a[_mn_word(a0, row, k, a_block, a_group) if a_block else
                   _operand_word(a0, row, k, lbo, sbo, swizzle, itemsize)]
            bw = _mn_word(b0, col, k, b_block, b_group) if b_block else _operand_word(b0, col, k, lbo, sbo, swizzle,
                                                                                      itemsize)
            if bfloat16:
                s += bf16_bits_to_f32(aw) * bf16_bits_to_f32(b[bw])
            else:
                s += _operand(aw) * _operand(b[bw])
        acc[first + i] += s
