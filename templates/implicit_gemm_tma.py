"""The implicit GEMM's operands as TMA boxes (TileConfig.tma): x (or dy) as an im2col tensor map - (C, W, H, N), or
(C, W, H, D, N) for a 3-D convolution - and w as a tiled one, for the forward, a stride-1 backward-data (the forward
convolution of dy with w flipped) and 16-bit backward-weight (both operands MN-major).  The views of implicit_gemm.py
hand these to the schedules (tma_schedule.py) through GemmView.tma; what each needs of a problem is its *_unmet."""
from __future__ import annotations

from dataclasses import replace
from math import prod as _prod

from kernelgen.ir import TensorMap, minimum
from kernelgen.storage import HALF_DTYPES

from .config import TileConfig
from .tma_schedule import TmaOperands, swizzled_row


def tma_forward_problem(p):
    """The forward convolution whose TMA boxes compute p: p itself, or for a stride-1 backward-data (groups 1) the
    forward convolution of dy with the filter transposed (k <-> c) and its taps reversed, padded dil * (T - 1) -
    pad (>= 0); None for anything else."""
    if p.direction == "fwd":
        return p
    if p.direction != "bwd_data" or p.stride != (1, 1, 1) or p.groups != 1:
        return None
    pad = tuple(d * (f - 1) - pd for f, pd, d in zip(p.filter_size, p.padding, p.dilation))
    if min(pad) < 0:
        return None
    return replace(p, direction="fwd", C=p.K, K=p.C, in_size=p.out_size, out_size=p.in_size, padding=pad)


def tma_unmet(p):
    """What this module's TMA boxes need that problem p lacks (an empty list: forward_tma builds).  A strided
    backward-data runs as KS-deconv's classes instead, with their own boxes: implicit_gemm_tc.tma_unmet asks
    the module that builds each problem."""
    if p.direction == "bwd_weight":
        return backward_weight_tma_unmet(p)
    f = tma_forward_problem(p)
    if f is None:
        return ["a forward convolution or a stride-1 backward-data with groups=1 and padding <= dilation x "
                "(filter - 1)"]
    if p.dtype not in ("float32",) + HALF_DTYPES:
        return ["float32, float16 or bfloat16 arrays"]
    row = swizzled_row(p.dtype)
    return [w for bad, w in ((f.groups != 1, "groups=1"), _im2col_unmet(f),
                             (f.Cg % row, f"channels a multiple of {row} (of the reduction, {p.dtype})")) if bad]


def _im2col_unmet(f):
    """(bad, why): can x of convolution f be an im2col map (im2col_map)?  Window corners 1-8 apart, and corners in
    the driver's range: -128..127 for a 4-D map, -16..15 for a 5-D one (a 3-D convolution's)."""
    bound = 16 if has_depth(f) else 128
    fits = all(-bound <= c < bound for c in _im2col_corners(f))
    return (max(f.stride) > 8 or not fits,
            f"stride 1 to 8 and im2col corners (-padding, padding - dilation x (filter - 1)) in {-bound}..{bound - 1}")


def has_depth(f):
    """Does convolution f have a depth (a 3-D one whose x is a 5-D (C, W, H, D, N) im2col map)?"""
    return f.in_size[0] > 1 or f.filter_size[0] > 1 or f.padding[0] > 0


def _im2col_corners(f):
    """The lower and upper corners of f's x as an im2col map, innermost first: (w, h[, d]) each."""
    dims = range(3 if has_depth(f) else 2)
    lower = tuple(-f.padding[2 - i] for i in dims)
    upper = tuple(f.padding[2 - i] - (f.filter_size[2 - i] - 1) * f.dilation[2 - i] for i in dims)
    return lower + upper


def im2col_map(name, source, f, e, box, dtype, rounding=""):
    """x of convolution f (channels-last, e bytes an element) as an im2col TensorMap of `box` (channels, pixels):
    (C, W, H, N), or (C, W, H, D, N) where f has a depth; the window corners f.stride apart."""
    n = 3 if has_depth(f) else 2
    sizes = f.in_size[::-1][:n]  # (W, H[, D])
    dims, strides, step = (f.C, *sizes, f.N), [], e * f.C
    for size in sizes:
        strides.append(step)
        step *= size
    strides.append(step)
    corners = _im2col_corners(f)
    walk = f.stride[::-1][:n]
    return TensorMap(name, source, "im2col", dims, tuple(strides), box, corners[:n], corners[n:], 128, rounding,
                     dtype=dtype, traversal=walk if max(walk) > 1 else ())


def im2col_box(f, m, c, tap):
    """(coords, offsets) of the im2col box of output pixel m's window (its corner), channel c, at filter tap `tap`
    (Exprs; the tap flat over f's filter, w fastest)."""
    (_, fh, fw), (dd, dh, dw) = f.filter_size, f.dilation
    (od, oh, ow), (sd, sh, sw), (pd, ph, pw) = f.out_size, f.stride, f.padding
    n, wo = m // (od * oh * ow), m % ow
    ho = (m % (oh * ow)) // ow
    if not has_depth(f):
        return (c, wo * sw - pw, ho * sh - ph, n), ((tap % fw) * dw, (tap // fw) * dh)
    do = (m % (od * oh * ow)) // (oh * ow)
    return ((c, wo * sw - pw, ho * sh - ph, do * sd - pd, n),
            ((tap % fw) * dw, ((tap // fw) % fh) * dh, (tap // (fw * fh)) * dd))


def forward_tma(p, cfg: TileConfig, m0, n0):
    """The forward operands as TMA boxes (TileConfig.tma): A's slice kt is the im2col box of BM output pixels x BK
    channels (128 bytes: 32 float32, 64 float16) at one filter tap (x seen as (C, W, H, N), base pixel = the first
    pixel's window corner, the tap as the offsets, the corners `stride` apart; a 3-D convolution's x as (C, W, H, D,
    N): im2col_map), B's the tiled box of BN filters x
    BK of their k (w seen as Kr x K).  Float32 maps read copies of x and w rounded to TF32 (TensorMap.rounding):
    once per call, where rounding the landed boxes would round each pixel of x once per filter tap, in the compute
    threads' time.  A stride-1 backward-data is the forward convolution tma_forward_problem names: its maps read
    dy, and the launcher's copy of w flipped (TensorMap.flip), or with b_mn w itself, MN-major."""
    why = tma_unmet(p)
    if why:
        raise ValueError(f"config: tma={cfg.tma} needs {', '.join(why)}; got {p.key()} with {cfg}")
    f = tma_forward_problem(p)
    taps = _prod(f.filter_size)
    Kr = taps * f.C
    ROW, e = swizzled_row(p.dtype), 4 if p.dtype == "float32" else 2  # a slice's channels; bytes per element
    if cfg.BK != ROW:
        raise ValueError(f"config: tma={cfg.tma} on {p.dtype} arrays needs BK={ROW} (a 128-byte row), got {cfg}")
    rounding = "tf32" if p.dtype == "float32" else ""  # 16-bit operands are exact as stored
    a = im2col_map("x_map", "x", f, e, (ROW, cfg.BM), p.dtype, rounding)
    b = TensorMap("w_map", "w", "tiled", (Kr, f.K), (e * Kr,), (ROW, cfg.BN), swizzle=128, rounding=rounding,
                  dtype=p.dtype)
    if p.direction == "bwd_data":
        a, b = replace(a, name="dy_map", source="dy"), replace(b, flip=(p.K, taps, p.C))
    chunks = f.C // ROW  # channel slices per filter tap

    def a_box(kt, part=0):
        return im2col_box(f, m0, (kt % chunks) * ROW, kt // chunks)

    if cfg.b_mn:  # backward-data reading w as stored, MN-major (TileConfig.b_mn): no flipped copy
        if p.direction != "bwd_data" or has_depth(f):
            raise ValueError(f"config: b_mn=1 reads a backward-data filter as stored (a 1-D or 2-D convolution's; a "
                             f"forward reads w K-major already), got {p.key()} with {cfg}")
        _, fh, fw = f.filter_size

        def b_box(kt):  # f's flipped tap kt // chunks = (r, s) is w's tap (fh - 1 - r, fw - 1 - s)
            tap = kt // chunks
            return (n0, fw - 1 - tap % fw, fh - 1 - tap // fw, (kt % chunks) * ROW)
        return b_mn_operands(p, cfg, a, a_box, b_box)
    return TmaOperands(a, b, a_box, lambda kt, part: ((kt * ROW, n0), ()))


def _part_start(first, part):
    """The first column (or row) of an MN-major operand's box `part`: 64 columns a box (part 0 leaves the Expr as
    it was)."""
    return first + 64 * part if part else first


def b_mn_operands(p, cfg: TileConfig, a, a_box, b_box):
    """TmaOperands whose B reads w as stored (TileConfig.b_mn), seen as (c, s, r, k): b_box(kt) -> the slice's
    (first column, tap along w, tap along h, first k); a box of 64 columns x BK rows per 64 columns of the tile.
    a_box(kt, part) -> A's (coords, offsets)."""
    if p.C * 2 % 16:  # a tensor map's rows are multiples of 16 bytes
        raise ValueError(f"config: b_mn=1 reads w as stored, whose rows of C channels must be a multiple of 16 bytes "
                         f"(C a multiple of 8 at 16 bits), got C={p.C}")
    _, th, tw = p.filter_size
    b = TensorMap("w_map", "w", "tiled", (p.C, tw, th, p.K), (2 * p.C, 2 * p.C * tw, 2 * p.C * tw * th),
                  (64, 1, 1, cfg.BK), swizzle=128, dtype=p.dtype)

    def b_part(kt, part):
        first, *rest = b_box(kt)
        return (_part_start(first, part), *rest), ()
    return TmaOperands(a, b, a_box, b_part, b_parts=cfg.BN // 64)


def backward_weight_tma_unmet(p):
    """What backward_weight_tma needs that problem p lacks (an empty list: it builds)."""
    return [w for bad, w in ((p.dtype not in HALF_DTYPES, "float16 or bfloat16 arrays (both operands MN-major: "
                                                          "the TF32 wgmma reads K-major ones only)"),
                             (p.groups != 1, "groups=1"), _im2col_unmet(p),
                             (p.C % 64, "channels a multiple of 64 (a 64-column box stays in one filter tap)"),
                             (p.K % 8, "output channels a multiple of 8 (dy's rows: 16-byte multiples)")) if bad]


def backward_weight_tma(p, cfg: TileConfig, m0, n0):
    """Backward-weight's operands as TMA boxes, both MN-major (TileConfig.a_mn, b_mn): the reduction runs over the
    output pixels (n, oh, ow) in slices of BK = 64, and each operand stores that axis outermost.  A's part j is the
    tiled box of dy seen as (K, N * OH * OW): output channels m0 + 64 j .. + 63 x the slice's pixels; B's part j
    the im2col box of x at column n0 + 64 j = (tap, c): channels c .. c + 63 x the slice's pixels, the window corners
    as the forward's (x seen as (C, W, H, N), or (C, W, H, D, N): im2col_map) and the tap as the offsets.  Pixels
    past the last one read zeros from dy's box, so their products are 0 whatever x's box holds; columns past the
    filter read its last tap and are not stored."""
    why = backward_weight_tma_unmet(p)
    if why:
        raise ValueError(f"config: tma={cfg.tma} needs {', '.join(why)}; got {p.key()} with {cfg}")
    if not (cfg.a_mn and cfg.b_mn and cfg.BK == 64):
        raise ValueError(f"config: tma={cfg.tma} on backward-weight reads both operands MN-major: it needs a_mn=1, "
                         f"b_mn=1 and BK 64; got {cfg}")
    e, BK, taps = 2, cfg.BK, _prod(p.filter_size)
    a = TensorMap("dy_map", "dy", "tiled", (p.K, p.N * _prod(p.out_size)), (e * p.K,), (64, BK), swizzle=128,
                  dtype=p.dtype)
    b = im2col_map("x_map", "x", p, e, (64, BK), p.dtype)
    ragged = (taps * p.C) % cfg.BN != 0

    def a_box(kt, part):
        return (_part_start(m0, part), kt * BK), ()

    def b_box(kt, part):
        col = _part_start(n0, part)
        tap = minimum(col // p.C, taps - 1) if ragged else col // p.C
        return im2col_box(p, kt * BK, col % p.C, tap)
    return TmaOperands(a, b, a_box, b_box, a_parts=cfg.BM // 64, b_parts=cfg.BN // 64, zeros_past_end=True)
