"""Fragment layout of the warp-level m16n8k8 TF32 MMA (PTX ISA, "Matrix Fragments for mma.m16n8k8"),
as plain functions shared by the template (who loads what), the CPU renderer (whose register holds
what) and the tests; the operand roundings in NumPy.  No numba here.

Per lane (g = lane // 4, t = lane % 4):  A (16 x 8, row-major) 4 registers, B (8 x 8, col-major)
2 registers, C/D (16 x 8) 4 registers:

    a[r] = A[g + 8 * (r % 2), t + 4 * (r // 2)]
    b[r] = B[t + 4 * r, g]
    d[r] = D[g + 8 * (r // 2), 2 * t + r % 2]

The 16-bit MMA m16n8k16 (.f16 / .bf16, "Matrix Fragments for mma.m16n8k16 with floating point type")
holds per lane A in 4 .b32 registers of 2 halves each (the lower k in the lower 16 bits): (row g, k 2t,
2t + 1), (row g + 8, k 2t, 2t + 1), (row g, k 2t + 8, 2t + 9), (row g + 8, k 2t + 8, 2t + 9); B in 2:
(k 2t, 2t + 1; col g), (k 2t + 8, 2t + 9; col g); C/D exactly as m16n8k8's.  k is a reduction index, so
the MMA's k slots may stand for any permutation of the logical k as long as A and B use the same one.
Reading slot 8 s + 2 t + j as logical k = t + 4 j of the s-th 8-deep step, a lane's registers are pairs
of its m16n8k8 TF32 fragments of two consecutive steps (pack16): A = (a0, a2), (a1, a3) of step 0, then
of step 1; B = (b0, b1) of step 0, then of step 1.  So the fragment loads of the TF32 schedule feed the
16-bit MMA unchanged, and one m16n8k16 replaces two m16n8k8.
"""
from __future__ import annotations

import numpy as np

M, N, K, WARP = 16, 8, 8, 32


def a_coord(lane, r):
    return lane // 4 + 8 * (r % 2), lane % 4 + 4 * (r // 2)


def b_coord(lane, r):
    """(k, n) of the B element lane holds in register r."""
    return lane % 4 + 4 * r, lane // 4


def d_coord(lane, r):
    return lane // 4 + 8 * (r // 2), 2 * (lane % 4) + r % 2


def a_owner(row, k):
    """(lane, register) holding A[row, k]: the inverse of a_coord."""
    return (row % 8) * 4 + k % 4, row // 8 + 2 * (k // 4)


def b_owner(k, n):
    return n * 4 + k % 4, k // 4


def tf32_round(x):
    """NumPy float32 -> float32 rounded to TF32 like PTX cvt.rna.tf32.f32: nearest, ties away from
    zero, 10 mantissa bits (adding half an ulp to the magnitude bits, then truncating, does that)."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def pack16(a, b):
    """The registers of an m16n8k16 f16/bf16 MMA as (low half, high half) pairs, from the 8 A and 4 B
    fragment values of an ir.Mma m16n8k16 (two m16n8k8 steps): (4 A pairs, 2 B pairs)."""
    return ((a[0], a[2]), (a[1], a[3]), (a[4], a[6]), (a[5], a[7])), ((b[0], b[1]), (b[2], b[3]))


def fp16_round(x):
    """NumPy float32 -> float32 exactly representable in fp16, like PTX cvt.rn.f16.f32: nearest even,
    overflow to inf, fp16 subnormals kept."""
    with np.errstate(over="ignore"):  # overflow to inf is the point
        return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def bf16_round(x):
    """NumPy float32 -> float32 exactly representable in bf16, like PTX cvt.rn.bf16.f32: nearest even on
    the top 16 bits (a carry out of the mantissa bumps the exponent, up to inf); NaN stays NaN."""
    x = np.ascontiguousarray(x, np.float32)
    bits = x.view(np.uint32)
    out = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000))
    return np.where(np.isnan(x), x, out.view(np.float32))


ROUND = {"tf32": tf32_round, "fp16": fp16_round, "bf16": bf16_round}
