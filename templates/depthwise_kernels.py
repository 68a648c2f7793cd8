"""The direct depthwise kernels: the gather (forward, and backward-data on the flipped filter) and backward-weight.

Gather: one block per (spatial tile, channel block); the window copy, a barrier, then each thread loads the filter
taps of its VC groups into registers once and, per output row and residue class, accumulates its PW-pixel strip
over the taps that meet it, and stores it (bias and relu fused, forward).  Narrow groups (Cg > 1) are the same
gather with every output of a group summing over all of the group's sources: a thread's strip accumulates its
share (group_split) of its groups' outputs from the segment of all their sources.

Backward-weight: dw[k, tap] = sum over (n, o) of x[n, o * stride - pad + tap * dil, k / m] * dy[n, o, k].  One block
per (channel block, split); a split walks its share of the spatial tiles, each thread accumulating dw of its VC
groups at every tap in registers from its strips; then the block's threads add theirs up through shared memory,
and split_k > 1 adds the block's sums into the zeroed dw atomically.  float16 tensors have no 16-bit atomic adds: with
split_k > 1 their kernel adds into a float32 dw named dw + WIDE_SUFFIX, which the launcher provides zeroed and
rounds into the caller's float16 dw after the kernel (runtime/launch.py, Launcher.widened).
"""
from __future__ import annotations

from kernelgen.ir import Assign, Barrier, Buffer, For, If, Kernel, Load, Store, Var, VectorLoad, all_of, compute_dtype, \
    minimum, select
from kernelgen.storage import HALF_DTYPES, WIDE_SUFFIX
from kernelgen.templates.depthwise_geometry import Geometry, cdiv
from kernelgen.templates.depthwise_ir import (ZERO, block_coords, channel_ok, filter_rows, rounded, segment_buffer,
                                              shared_filter_rows, stage_buffer, thread_coords, unroll, vector_width,
                                              window_copy)
from kernelgen.templates.implicit_gemm import epilogue_value

TENSORS = {"fwd": ("x", "w", "y"), "bwd_data": ("dy", "w", "dx")}


def _filter_registers(g: Geometry, wreg: Buffer, rnd):
    """wreg[tap, v * m + j] = w[(cg + v) * m + j, tap] (0 past the last channel)."""
    m, taps = g.m, g.taps
    body = []
    for v in range(g.cfg.VC):
        for j in range(m):
            value = rounded(Load("w", (((Var("cg") + v) * m + j) * taps + Var("tap"),)), rnd)
            cond = channel_ok(g, v)
            body.append(wreg.store((Var("tap"), v * m + j), select(all_of(cond), value, ZERO) if cond else value))
    return unroll("tap", taps, body)


def _narrow_filter_registers(g: Geometry, wreg: Buffer, rnd):
    """Narrow groups: wreg[tap, (v * opt + o) * spg + s] = the filter word of the thread's output o of group cg + v
    and the group's source s (forward: w[k, tap, s], k the output; backward-data: w[k, tap, c], k the source s and c
    the output o), 0 past the last group; opt = out_per_thread, spg = src_per_group."""
    p, cfg, opt, spg, taps = g.problem, g.cfg, g.out_per_thread, g.src_per_group, g.taps
    share = Var("gs") * opt if cfg.group_split > 1 else None
    body = []
    for v in range(cfg.VC):
        for o in range(opt):
            mine = o if share is None else share + o  # the output's index in its group
            for s in range(spg):
                first = (Var("cg") + v) * p.Kg  # the group's first filter
                k, c = (first + s, mine) if g.gather == "bwd_data" else (first + mine, s)
                value = rounded(Load("w", ((k * taps + Var("tap")) * p.Cg + c,)), rnd)
                cond = channel_ok(g, v)
                body.append(wreg.store((Var("tap"), (v * opt + o) * spg + s),
                                       select(all_of(cond), value, ZERO) if cond else value))
    return unroll("tap", taps, body)


def _gather_row(g: Geometry, bufs, rnd, rho_h, rho_w, out):
    """The thread's PH output rows of class (rho_h, rho_w): zero each strip, accumulate its taps, store it.  Each of
    the thread's outputs sums all its group's sources (depthwise: forward has one, backward-data one output).  One
    row at a time (a serial loop, its segment loaded per filter row), or with share_rows all PH rows together, each
    source row loaded once for every (row, filter row) pair that reads it."""
    cfg, opt, spg = g.cfg, g.out_per_thread, g.src_per_group
    acc, xin, wreg = bufs["acc"], bufs["xin"], bufs["wreg"]
    rows_at_once = cfg.PH if cfg.share_rows else 1

    def product(ph):
        def taps(tap, p, u):
            strip = ph * cfg.PW + p if ph else p  # (row 0 indexed by p itself: the unshared kernels' IR as before)
            return [acc.store((strip, v * opt + o), xin[u, v * spg + s] * wreg[tap, (v * opt + o) * spg + s],
                              accumulate=True)
                    for v in range(cfg.VC) for o in range(opt) for s in range(spg)]
        return taps

    zero = [acc.store((p, a), ZERO) for p in range(rows_at_once * cfg.PW) for a in range(cfg.VC * opt)]
    run_h, run_w = g.h.runs[rho_h], g.w.runs[rho_w]
    if not cfg.share_rows:
        qh = Var("th") * cfg.PH + Var("ph")
        rows = filter_rows(g, bufs["src"], bufs.get("window"), xin, rnd, run_h, run_w, qh, product(0))
        stores = _strip_stores(g, acc, 0, qh, rho_h, rho_w, out)
        return [For("ph", cfg.PH, tuple(zero + rows + stores), "serial")]
    rows = shared_filter_rows(g, bufs["src"], bufs.get("window"), xin, rnd, run_h, run_w, Var("th") * cfg.PH, product)
    stores = [st for ph in range(cfg.PH) for st in _strip_stores(g, acc, ph, Var("th") * cfg.PH + ph, rho_h, rho_w,
                                                                 out)]
    return zero + rows + stores


def _strip_stores(g: Geometry, acc: Buffer, ph, qh, rho_h, rho_w, out):
    """The stores of strip `ph` of acc (output row qh of class (rho_h, rho_w)), bias and activation applied."""
    cfg, opg, opt = g.cfg, g.out_per_group, g.out_per_thread
    oh = Var("bh") * g.h.block_out + rho_h + g.h.classes * qh
    stores = []
    for p in range(cfg.PW):
        ow = Var("bw") * g.w.block_out + rho_w + g.w.classes * (Var("tw") * cfg.PW + p)
        pix = ([oh < g.h.out_size] if g.h.ragged else []) + ([ow < g.w.out_size] if g.w.ragged else [])
        at = ((Var("bn") * g.out_depth + Var("bd")) * g.h.out_size + oh) * g.w.out_size + ow
        for v in range(cfg.VC):
            for j in range(opt):
                ch = (Var("cg") + v) * opg + (j if cfg.group_split == 1 else Var("gs") * opt + j)
                value = epilogue_value(g.problem, acc[ph * cfg.PW + p, v * opt + j], ch)
                st = Store(out, ((at * (g.groups * opg) + ch),), value)
                cond = pix + channel_ok(g, v)
                stores.append(If(all_of(cond), (st,)) if cond else st)
    return stores


def gather_kernel(g: Geometry, rnd) -> Kernel:
    p, cfg = g.problem, g.cfg
    src, w, out = TENSORS[g.gather]
    dtype = compute_dtype(p.dtype)
    strips = cfg.PH if cfg.share_rows else 1
    bufs = {"src": src, "acc": Buffer("acc", (strips * cfg.PW, cfg.VC * g.out_per_thread), dtype, "register"),
            "xin": segment_buffer(g, dtype), "wreg": Buffer("wreg", (g.taps, g.filter_words // g.taps), dtype,
                                                            "register")}
    c0 = Var("cb") * cfg.block_groups
    phases = []
    locals_ = [bufs["acc"], bufs["xin"], bufs["wreg"]]
    if cfg.halo:
        window, stage = Buffer("window", g.window_shape, dtype, "shared"), stage_buffer(g, dtype)
        bufs["window"] = window
        locals_ += [window, stage]
        phases += [For("tid", cfg.threads, tuple(window_copy(g, src, window, stage, c0, rnd)), "thread"), Barrier()]
    filters = (_narrow_filter_registers if g.narrow else _filter_registers)(g, bufs["wreg"], rnd)
    compute = thread_coords(g, c0) + filters
    for rho_h in range(g.h.classes):
        for rho_w in range(g.w.classes):
            compute += _gather_row(g, bufs, rnd, rho_h, rho_w, out)
    phases.append(For("tid", cfg.threads, tuple(compute), "thread"))
    # One grid axis, the channel blocks fastest: the blocks that run side by side share a spatial tile and read
    # neighbouring channels of the same pixels, so each pixel's channels come from DRAM as whole lines at once.  (A
    # block reads its channels' 32 or 64 bytes of each pixel; with the spatial tiles fastest, a pixel's other channels
    # were read by blocks far apart in time, each fetch a partial line: the H100 measured 9-53 % of the roofline.)
    cbs = g.channel_blocks
    block = tuple([Assign("cb", Var("bid") % cbs), Assign("blk", Var("bid") // cbs)] + block_coords(g, Var("blk"))
                  + phases)
    grid = (g.spatial_tiles * cbs,)
    body = (For("bid", grid[0], block, "grid", axis=0),)
    params = [Buffer(src, (p.N * g.src_depth * g.h.src_size * g.w.src_size * g.src_channels,), p.dtype),
              Buffer(w, (p.K * g.taps * p.Cg,), p.dtype)]
    if p.has_bias:
        params.append(Buffer("bias", (p.K,), p.dtype))
    params.append(Buffer(out, (p.N * g.out_depth * g.h.out_size * g.w.out_size * g.groups * g.out_per_group,),
                         p.dtype, role="out"))
    name = f"{'narrow_groups' if g.narrow else 'depthwise'}_{p.direction}"
    return Kernel(name, tuple(params), tuple(locals_), body, grid, cfg.threads)


# --- backward-weight -----------------------------------------------------------------------------------------------

def _dy_strip(g: Geometry, dyr: Buffer, oh, rnd):
    """dyr[p, v * opt + j] = dy[bn, bd, oh, ow_p, (cg + v) * Kg + j0 + j] for the strip's pixels (0 past the output):
    the thread's opt = out_per_thread outputs of each of its groups, from j0 = gs * opt where group_split threads
    share a group's (depthwise: Kg = m, all of them)."""
    p_, cfg, kg, opt = g.problem, g.cfg, g.out_per_group, g.out_per_thread
    share = Var("gs") * opt if cfg.group_split > 1 else 0
    # (one run of VC * opt channels where each thread has all of its groups' outputs; else one per group)
    runs = [(0, cfg.VC * opt)] if opt == kg else [(v, opt) for v in range(cfg.VC)]
    out = []
    for p in range(cfg.PW):
        ow = Var("bw") * g.w.block_out + Var("tw") * cfg.PW + p
        pix = ([oh < g.h.out_size] if g.h.ragged else []) + ([ow < g.w.out_size] if g.w.ragged else [])
        pixel = (((Var("bn") * g.out_depth + Var("bd")) * g.h.out_size + oh) * g.w.out_size + ow) * p_.K
        for v0, width in runs:
            base = pixel + (Var("cg") + v0) * kg + share
            first = v0 * opt  # (dyr's column of the run's first value)
            vec = vector_width(p_.dtype, width, p_.K) if opt == kg or opt % 4 == 0 else 1
            for c in range(0, width, vec):
                conds = pix + channel_ok(g, v0 + c // opt)  # (the pixel, and the group of the run's element c)
                if vec > 1:
                    out.append(VectorLoad(tuple(dyr[p, first + c + i] for i in range(vec)), "dy", base + c,
                                          all_of(conds)))
                    if rnd:
                        out += [dyr.store((p, first + c + i), rounded(dyr[p, first + c + i], rnd)) for i in range(vec)]
                else:
                    value = rounded(Load("dy", (base + c,)), rnd)
                    out.append(dyr.store((p, first + c), select(all_of(conds), value, ZERO) if conds else value))
    return out


def _weight_strips(g: Geometry, bufs, rnd):
    """Thread tid's strips of the current tile, accumulated into dw's registers: acc[tap, (v * opt + j) * Cg + s] +=
    x[source s of group cg + v] * dy[output j of the thread's share of that group]."""
    cfg, opt, src = g.cfg, g.out_per_thread, g.src_per_group
    acc, xin, dyr = bufs["acc"], bufs["xin"], bufs["dyr"]
    qh = Var("th") * cfg.PH + Var("ph")

    def product(tap, p, u):
        return [acc.store((tap, (v * opt + j) * src + s), xin[u, v * src + s] * dyr[p, v * opt + j], accumulate=True)
                for v in range(cfg.VC) for j in range(opt) for s in range(src)]

    loads = _dy_strip(g, dyr, Var("bh") * g.h.block_out + qh, rnd)
    rows = filter_rows(g, "x", bufs.get("window"), xin, rnd, g.h.runs[0], g.w.runs[0], qh, product)
    return [For("ph", cfg.PH, tuple(loads + rows), "serial")]


def dw_name(g: Geometry) -> str:
    """The name of backward-weight's output parameter: dw, or its float32 workspace where 16-bit blocks split."""
    return "dw" + WIDE_SUFFIX if g.problem.dtype in HALF_DTYPES and g.cfg.split_k > 1 else "dw"


def _reduce_and_store(g: Geometry, acc: Buffer, red: Buffer, c0):
    """The block's threads' dw registers summed over the pixel threads through shared memory, then stored (atomic
    adds with split_k > 1).  Output o of the block is dw[k, tap, s] of its block_groups groups, in dw's own order
    (K, taps, Cg): source s fastest, then tap, then the group's output k (neighbouring threads store neighbours).
    Its registers are those of the threads whose lane holds its group and whose share holds k."""
    cfg, taps, src, kg, opt = g.cfg, g.taps, g.src_per_group, g.out_per_group, g.out_per_thread
    row, outputs = g.filter_words, cfg.block_groups * kg * taps * src
    tid = Var("tid")
    per_tap = row // taps
    spill = unroll("i", taps * per_tap, [red.store((tid, Var("i")), acc[Var("i") // per_tap, Var("i") % per_tap])])
    o = tid + Var("e") * cfg.threads
    s, tap, kk = o % src, (o // src) % taps, o // (src * taps)
    group, k = kk // kg, kk % kg
    lane = (group // cfg.VC) * cfg.group_split + (k // opt if cfg.group_split > 1 else 0)  # (its thread's tc)
    col = tap * per_tap + ((group % cfg.VC) * opt + (k % opt if opt < kg else k)) * src + s
    total = [Assign("dw_sum", ZERO),
             For("tp", cfg.TW * cfg.TH, (Assign("dw_sum", Var("dw_sum") + red[Var("tp") * cfg.TC + lane, col]),),
                 "serial")]
    store = Store(dw_name(g), ((((c0 + group) * kg + k) * taps + tap) * src + s,), Var("dw_sum"),
                  "atomic" if cfg.split_k > 1 else False)
    conds = ([o < outputs] if outputs % cfg.threads else []) + \
        ([c0 + group < g.groups] if g.groups % cfg.block_groups else [])
    body = total + [store]
    sums = [For("e", cdiv(outputs, cfg.threads), (If(all_of(conds), tuple(body)),) if conds else tuple(body),
                "serial")]
    return [For("tid", cfg.threads, tuple(spill), "thread"), Barrier(), For("tid", cfg.threads, tuple(sums), "thread")]


def weight_kernel(g: Geometry, rnd) -> Kernel:
    p, cfg = g.problem, g.cfg
    dtype = compute_dtype(p.dtype)
    per_tap = g.filter_words // g.taps  # (a tap's accumulators: VC groups x the thread's outputs x sources)
    acc = Buffer("acc", (g.taps, per_tap), dtype, "register")
    bufs = {"acc": acc, "xin": segment_buffer(g, dtype), "dyr": Buffer("dyr", (cfg.PW, g.dy_words), dtype, "register")}
    red = Buffer("red", (cfg.threads, g.reduction_row), dtype, "shared")
    locals_ = [acc, bufs["xin"], bufs["dyr"], red]
    c0 = Var("blk") * cfg.block_groups
    tile_phases = []
    if cfg.halo:
        window, stage = Buffer("window", g.window_shape, dtype, "shared"), stage_buffer(g, dtype)
        bufs["window"] = window
        locals_ += [window, stage]
        tile_phases += [For("tid", cfg.threads, tuple(window_copy(g, "x", window, stage, c0, rnd)), "thread"),
                        Barrier()]
    tile_phases.append(For("tid", cfg.threads, tuple(thread_coords(g, c0) + _weight_strips(g, bufs, rnd)), "thread"))
    if cfg.halo:
        tile_phases.append(Barrier())  # the next tile's copy overwrites the window
    tiles, per = g.spatial_tiles, cdiv(g.spatial_tiles, cfg.split_k)
    first = Var("cb") * per
    count = per if cfg.split_k == 1 else minimum(per, tiles - first)
    zero = unroll("i", g.taps * per_tap, [acc.store((Var("i") // per_tap, Var("i") % per_tap), ZERO)])
    block = ([For("tid", cfg.threads, tuple(zero), "thread"),
              For("tile", count, tuple(block_coords(g, Var("tile")) + tile_phases), "serial", start=first)]
             + _reduce_and_store(g, acc, red, c0))
    grid = (g.channel_blocks, cfg.split_k)
    body = (For("blk", grid[0], (For("cb", grid[1], tuple(block), "grid", axis=1),), "grid", axis=0),)
    params = (Buffer("x", (p.N * g.src_depth * g.h.src_size * g.w.src_size * p.C,), p.dtype),
              Buffer("dy", (p.N * g.out_depth * g.h.out_size * g.w.out_size * p.K,), p.dtype),
              Buffer(dw_name(g), (p.K * g.taps * p.Cg,), "float32" if dw_name(g) != "dw" else p.dtype, role="out"))
    return Kernel("depthwise_bwd_weight", params, tuple(locals_), body, grid, cfg.threads)
