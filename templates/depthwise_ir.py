"""The direct depthwise kernels' IR, built from a Geometry (templates/depthwise_geometry.py).

Every direction shares the same pieces: the block's coordinates, the window copy (the source tensor's halo for the
block, global -> staging registers -> shared memory, 16-byte loads of 4 channels where the tensor allows), and the
segment loads (the source positions a thread's register strip reads for one filter row, each loaded once and
reused by every tap and pixel of the strip: from the shared window, or from global memory when `halo` is off).
Register arrays are indexed by unrolled loop variables only, so on CUDA they become scalars.

Names: grid `blk` (spatial tile; backward-weight: channel block), `cb` (channel block; backward-weight: split);
thread `tid` -> (tc, tw, th) channel-fastest; cg: the first channel group of the thread; gs: its share of its
groups' outputs where group_split threads share them (narrow groups).
"""
from __future__ import annotations

from kernelgen.ir import Assign, Buffer, Call, Const, For, If, Load, Var, VectorLoad, all_of, select
from kernelgen.templates.depthwise_geometry import STAGE_REGISTERS, Geometry, TapRun, cdiv

ZERO = Const(0.0)


def rounded(value, rnd):
    """An operand as the precision reads it (fp16 / bf16 rounding of float32 tensors; None: as it is)."""
    return Call(rnd, (value,)) if rnd else value


def unroll(var, extent, body):
    return [For(var, extent, tuple(body), "unroll")] if extent > 0 else []


# --- coordinates ---------------------------------------------------------------------------------------------------

def block_coords(g: Geometry, tile):
    """Assigns of the block's batch index bn, output plane bd and H / W tiles bh / bw (spatial tile `tile`)."""
    rest = tile // g.w.tiles
    return [Assign("bw", tile % g.w.tiles), Assign("bh", rest % g.h.tiles),
            Assign("bd", (rest // g.h.tiles) % g.out_depth), Assign("bn", rest // g.h.tiles // g.out_depth)]


def group_lane(g: Geometry):
    """The thread's lane among the block's VC-group lanes: tc, or tc // group_split where threads share groups."""
    return Var("tc") // g.cfg.group_split if g.cfg.group_split > 1 else Var("tc")


def thread_coords(g: Geometry, c0):
    """tc, tw, th of thread tid (channel-fastest), cg, its first channel group (block's first: c0), and (group_split
    > 1) gs, its share of the groups' outputs (the sharing threads neighbours: their stores are)."""
    cfg, tid = g.cfg, Var("tid")
    share = [Assign("gs", Var("tc") % cfg.group_split)] if cfg.group_split > 1 else []
    return [Assign("tc", tid % cfg.TC), Assign("tw", (tid // cfg.TC) % cfg.TW), Assign("th", tid // (cfg.TC * cfg.TW)),
            Assign("cg", c0 + group_lane(g) * cfg.VC)] + share


def plane(g: Geometry, t):
    """(source plane, its validity) of depth tap t for the block's output plane bd: forward x plane
    bd * stride - pad + t * dil; backward-data dy plane (bd + pad - t * dil) / stride where that divides."""
    p, bd = g.problem, Var("bd")
    T, sd, pd, dd = p.filter_size[0], p.stride[0], p.padding[0], p.dilation[0]
    if g.gather == "bwd_data":
        num = bd + pd - t * dd
        conds = ([num >= 0] if pd < (T - 1) * dd else []) + ([(num % sd).eq(0)] if sd > 1 else [])
        if (g.out_depth - 1 + pd) // sd >= g.src_depth:
            conds.append(num // sd < g.src_depth)
        return num // sd, all_of(conds)
    src = bd * sd - pd + t * dd
    conds = ([src >= 0] if pd else []) + ([src < g.src_depth] if (g.out_depth - 1) * sd - pd + (T - 1) * dd
                                          >= g.src_depth else [])
    return src, all_of(conds)


def _in_axis(axis, pos):
    return ([pos >= 0] if axis.below else []) + ([pos < axis.src_size] if axis.beyond else [])


def src_index(g: Geometry, t, row, col):
    """(flat index of the first source channel of window position (t, row, col) at channel 0, its validity)."""
    d, ok = plane(g, t)
    srow, scol = g.h.src_origin(Var("bh")) + row, g.w.src_origin(Var("bw")) + col
    base = (((Var("bn") * g.src_depth + d) * g.h.src_size + srow) * g.w.src_size + scol) * g.src_channels
    return base, all_of([ok] + _in_axis(g.h, srow) + _in_axis(g.w, scol))


# --- the window copy -----------------------------------------------------------------------------------------------

def window_copy(g: Geometry, src: str, window: Buffer, stage: Buffer, c0, rnd):
    """Thread tid's part of the block's window copy: batches of chunks (copy_vector channels each), every chunk of a
    batch loaded into staging registers before any is stored, so the loads are in flight together."""
    cfg, vec = g.cfg, g.copy_vector
    T, HH, HW, _ = g.window_shape
    per_pixel = cfg.block_groups * g.src_per_group // vec
    total, batch = g.copy_chunks, stage.shape[0]
    batches = cdiv(cdiv(total, cfg.threads), batch)
    ragged = batches * batch * cfg.threads > total

    def chunk(i):
        e = Var("tid") + (Var("b") * batch + i) * cfg.threads
        pix, ch = e // per_pixel, (e % per_pixel) * vec
        t, row, col = pix // (HH * HW), (pix // HW) % HH, pix % HW
        base, ok = src_index(g, t, row, col)
        conds = ([e < total] if ragged else []) + [ok]
        if g.src_channels % (cfg.block_groups * g.src_per_group):
            conds.append(c0 * g.src_per_group + ch < g.src_channels)
        return e, (t, row, col, ch), base + c0 * g.src_per_group + ch, all_of(conds)

    def load(i):
        _, _, at, ok = chunk(Var(i))
        if vec > 1:
            return [VectorLoad(tuple(stage[Var(i), w] for w in range(vec)), src, at, ok)]
        return [stage.store((Var(i), 0), select(ok, Load(src, (at,)), ZERO))]

    def store(i):
        e, (t, row, col, ch), _, _ = chunk(Var(i))
        stores = [window.store((t, row, col, ch + w), rounded(stage[Var(i), w], rnd)) for w in range(vec)]
        return [If(e < total, tuple(stores))] if ragged else stores

    body = unroll("i", batch, load("i")) + unroll("i", batch, store("i"))
    return [For("b", batches, tuple(body), "serial" if batches > 1 else "unroll")]


def stage_buffer(g: Geometry, dtype):
    rows = max(1, min(STAGE_REGISTERS // g.copy_vector, cdiv(g.copy_chunks, g.cfg.threads)))
    return Buffer("stage", (rows, g.copy_vector), dtype, "register")


# --- segment loads -------------------------------------------------------------------------------------------------

def segment_loads(g: Geometry, src: str, window: Buffer | None, xin: Buffer, t, row, run: TapRun, rnd):
    """xin[u, ch] = the source at window position (t, row, strip start + run's first offset + u * gap), for the
    thread's VC groups' source channels: from the shared window, or (window None) from global memory."""
    cfg, axis = g.cfg, g.w
    gap, length = axis.segment(run, cfg.PW)
    col = Var("tw") * (cfg.PW * axis.step) + (run.off0 - axis.lo) + Var("u") * gap
    width = cfg.VC * g.src_per_group
    if window is not None:
        first = group_lane(g) * width
        body = [xin.store((Var("u"), ch), window[t, row, col, first + ch]) for ch in range(width)]
        return unroll("u", length, body)
    base, ok = src_index(g, t, row, col)
    base = base + Var("cg") * g.src_per_group
    ragged = g.groups % cfg.block_groups
    body = []
    vec = vector_width(g.problem.dtype, width, g.src_channels)
    if vec > 1:
        for c in range(0, width, vec):
            cond = all_of([ok] + ([Var("cg") * g.src_per_group + c < g.src_channels] if ragged else []))
            body.append(VectorLoad(tuple(xin[Var("u"), c + w] for w in range(vec)), src, base + c, cond))
            if rnd:
                body += [xin.store((Var("u"), c + w), rounded(xin[Var("u"), c + w], rnd)) for w in range(vec)]
    else:
        for c in range(width):
            cond = all_of([ok] + ([Var("cg") * g.src_per_group + c < g.src_channels] if ragged else []))
            body.append(xin.store((Var("u"), c), select(cond, rounded(Load(src, (base + c,)), rnd), ZERO)))
    return unroll("u", length, body)


def vector_width(dtype, width, channels):
    """Elements per global vector load of `width` consecutive channels of a `channels`-channel tensor: 16 bytes (8
    float16, 4 float32), 8 bytes (4 float16) or 4 bytes (2 float16) where both divide, else 1 (element by element)."""
    for vec in ((8, 4, 2) if dtype == "float16" else (4,)):
        if width % vec == 0 and channels % vec == 0:
            return vec
    return 1


def segment_buffer(g: Geometry, dtype):
    length = max([g.w.segment(run, g.cfg.PW)[1] for run in g.w.runs if run.count] or [1])
    return Buffer("xin", (length, g.cfg.VC * g.src_per_group), dtype, "register")


def tap_index(g: Geometry, t, r, s):
    _, R, S = g.problem.filter_size
    return (t * R + r) * S + s


def filter_rows(g: Geometry, src, window, xin, rnd, run_h: TapRun, run_w: TapRun, qh, product):
    """For every depth tap, filter row of run_h and tap of run_w: the segment loads of the row, then
    product(tap, p, u) -> statements for strip pixel p reading xin[u] at filter tap `tap`."""
    axis_h, T = g.h, g.problem.filter_size[0]
    if not (run_h.count and run_w.count):
        return []
    gap, _ = g.w.segment(run_w, g.cfg.PW)
    row = qh * axis_h.step + (run_h.off0 - axis_h.lo) + Var("kh") * run_h.doff
    tap = tap_index(g, Var("t"), run_h.first + Var("kh") * run_h.tap_step, run_w.first + Var("kw") * run_w.tap_step)
    u = (Var("p") * g.w.step + Var("kw") * run_w.doff) // gap
    taps = unroll("kw", run_w.count, unroll("p", g.cfg.PW, product(tap, Var("p"), u)))
    loads = segment_loads(g, src, window, xin, Var("t"), row, run_w, rnd)
    return unroll("t", T, unroll("kh", run_h.count, loads + taps))


def shared_filter_rows(g: Geometry, src, window, xin, rnd, run_h: TapRun, run_w: TapRun, qh0, product):
    """filter_rows for the PH output rows qh0 + ph at once (share_rows): every source row any of them reads is loaded
    once, then product(ph)(tap, p, u) -> statements for row ph's strip pixel p reading xin[u] at filter tap `tap`,
    for each (ph, filter row) pair that reads it.  (A stride-2 5x5 strip of 4 rows reads 11 source rows, not 20.)"""
    axis_h, T = g.h, g.problem.filter_size[0]
    if not (run_h.count and run_w.count):
        return []
    gap, _ = g.w.segment(run_w, g.cfg.PW)
    readers = {}  # source row offset from the first row's first tap -> [(ph, kh)]
    for ph in range(g.cfg.PH):
        for kh in range(run_h.count):
            readers.setdefault(ph * axis_h.step + kh * run_h.doff, []).append((ph, kh))
    u = (Var("p") * g.w.step + Var("kw") * run_w.doff) // gap
    body = []
    for off in sorted(readers):
        row = qh0 * axis_h.step + (run_h.off0 - axis_h.lo) + off
        body += segment_loads(g, src, window, xin, Var("t"), row, run_w, rnd)
        for ph, kh in readers[off]:
            tap = tap_index(g, Var("t"), run_h.first + kh * run_h.tap_step, run_w.first + Var("kw") * run_w.tap_step)
            body += unroll("kw", run_w.count, unroll("p", g.cfg.PW, product(ph)(tap, Var("p"), u)))
    return unroll("t", T, body)


def channel_ok(g: Geometry, v):
    """Is group cg + v a channel (a ragged last channel block has fewer)?"""
    return [Var("cg") + v < g.groups] if g.groups % g.cfg.block_groups else []
