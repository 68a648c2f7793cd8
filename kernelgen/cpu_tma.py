"""ir.TensorCopy on the CPU backend (imported by rendered modules): the box a TMA copy would bring, copied
synchronously into the shared array, zeros outside the tensor, in the same shared layout (rows of box[0]
elements; with a 128-byte swizzle the 16-byte chunk j of row r at chunk j ^ (r % 8)).  float32 words, or float16
as their uint16 bit patterns (the CPU's float16), moved unchanged.

The im2col walk is the reading that scripts/tma_check.py checks on the H100: `pixels` base positions from
(w, h, n), w fastest, within [lower, size - 1 + upper] per spatial dim, each read at (h + dh, w + dw); a map's
traversal steps (a strided convolution's) take w and h that many apart, back to the lower corner when they pass
the upper one (as TileLang's Hopper im2col convolution reads it; the H100 agrees: the strided shapes of
tests/templates/test_tma_fp16.py pass there, BENCHMARKS.md 2026-11-25).  A 5-D map, a 3-D convolution's x as
(C, W, H, D, N), walks w, h, then d, then n, each pixel read at (d + dd, h + dh, w + dw)."""
from __future__ import annotations

from numba import njit


@njit(cache=True)
def _place(row, e, row_elements, swizzle):
    if swizzle:  # a 128-byte row of row_elements: 8 chunks of 16 bytes
        c = row_elements // 8
        return row * row_elements + ((e // c) ^ (row % 8)) * c + e % c
    return row * row_elements + e


@njit(cache=True)
def tma_tiled_2d(dst, d0, src, dim0, dim1, stride1, box0, box1, c0, c1, swizzle):
    """box1 rows of box0 elements at (c0, c1) of the 2-D tensor src (row stride `stride1` elements)."""
    for r in range(box1):
        y = c1 + r
        for e in range(box0):
            x = c0 + e
            inside = 0 <= x < dim0 and 0 <= y < dim1
            dst[d0 + _place(r, e, box0, swizzle)] = src[y * stride1 + x] if inside else 0


@njit(cache=True)
def tma_tiled_4d(dst, d0, src, dim0, dim1, dim2, dim3, stride1, stride2, stride3, box0, box1, box2, box3,
                 c0, c1, c2, c3, swizzle):
    """The 4-D box at (c0, c1, c2, c3) of src (element strides of dims 1..3): rows of box0 elements, dim 1 of
    the box fastest, zeros outside the tensor (a negative tap of KS-deconv's sub-filters)."""
    r = 0
    for i3 in range(box3):
        for i2 in range(box2):
            for i1 in range(box1):
                y1, y2, y3 = c1 + i1, c2 + i2, c3 + i3
                row_in = 0 <= y1 < dim1 and 0 <= y2 < dim2 and 0 <= y3 < dim3
                for e in range(box0):
                    x = c0 + e
                    inside = row_in and 0 <= x < dim0
                    dst[d0 + _place(r, e, box0, swizzle)] = src[y3 * stride3 + y2 * stride2 + y1 * stride1 + x] \
                        if inside else 0
                r += 1


@njit(cache=True)
def tma_im2col_4d(dst, d0, src, C, W, H, N, lower_w, lower_h, upper_w, upper_h, channels, pixels, step_w, step_h,
                  c, w, h, n, dw, dh, swizzle):
    """`pixels` rows of `channels` channels of the channels-last src[N, H, W, C] (see the module docstring): the
    5-D walk over images one deep."""
    tma_im2col_5d(dst, d0, src, C, W, H, 1, N, lower_w, lower_h, 0, upper_w, upper_h, 0, channels, pixels, step_w,
                  step_h, 1, c, w, h, 0, n, dw, dh, 0, swizzle)


@njit(cache=True)
def tma_im2col_5d(dst, d0, src, C, W, H, D, N, lower_w, lower_h, lower_d, upper_w, upper_h, upper_d, channels, pixels,
                  step_w, step_h, step_d, c, w, h, d, n, dw, dh, dd, swizzle):
    """`pixels` rows of `channels` channels of the channels-last src[N, D, H, W, C]: the 4-D walk with a depth."""
    for p in range(pixels):
        di, hi, wi = d + dd, h + dh, w + dw
        for e in range(channels):
            ch = c + e
            inside = 0 <= ch < C and 0 <= wi < W and 0 <= hi < H and 0 <= di < D and 0 <= n < N
            dst[d0 + _place(p, e, channels, swizzle)] = src[(((n * D + di) * H + hi) * W + wi) * C + ch] \
                if inside else 0
        w += step_w
        if w > W - 1 + upper_w:
            w = lower_w
            h += step_h
            if h > H - 1 + upper_h:
                h = lower_h
                d += step_d
                if d > D - 1 + upper_d:
                    d = lower_d
                    n += 1
