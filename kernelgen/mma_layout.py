"""Fragment layout of the warp-level m16n8k8 TF32 MMA (PTX ISA, "Matrix Fragments for mma.m16n8k8"),
as plain functions shared by the template (who loads what), the CPU renderer (whose register holds
what) and the tests.  No numba here.

Per lane (g = lane // 4, t = lane % 4):  A (16 x 8, row-major) 4 registers, B (8 x 8, col-major)
2 registers, C/D (16 x 8) 4 registers:

    a[r] = A[g + 8 * (r % 2), t + 4 * (r // 2)]
    b[r] = B[t + 4 * r, g]
    d[r] = D[g + 8 * (r // 2), 2 * t + r % 2]
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
