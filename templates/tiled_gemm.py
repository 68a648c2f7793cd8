"""The tiled-GEMM schedule shared by every GEMM-shaped variant.

A variant supplies a GemmView (what C[m, n] = sum_k A[m, k] * B[k, n] means for its problem:
how to gather an A or B element and where C goes); this module decides how it runs: block
tiles staged through shared memory, per-thread register tiles, per-thread index invariants
hoisted into registers before the reduction loop.  TVM's compute/schedule split, in one function.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from ..ir import (Assign, AsyncCommit, AsyncCopy, AsyncProxyFence, AsyncWait, Barrier, Buffer, Call, Comment, Const, For,
                  If, Kernel, Var, VectorLoad, all_of, compute_dtype, select)

from .config import TileConfig
from .warp_mma import WarpMma, interleaved_col, interleaved_row_words, pair_row, swizzled_col
from .tma_schedule import ROW, swizzled_row, tma_pipeline, tma_specialised_pipeline
from .warpgroup_mma import WarpgroupGemm, core_word, tile_words


@dataclass
class Operand:
    """How to gather one GEMM operand tile element.

    fast:      which tile axis is contiguous in memory ("k", or "mn" = the operand's m or n axis);
               threads walk it fastest so global loads coalesce.
    invariant: line index (m for A, n for B) -> {name: int Expr}, computed once per thread.
    element:   (inv: {name: Expr}, kk: Expr, k_tile: Expr, k_col: Expr) -> (predicate, value Expr).
    """
    fast: str
    invariant: Callable
    element: Callable
    context: bool = False  # element() also gets a BlockContext (variants that need the block's position)
    # element(kk) for kk % 4 == 0 is a Load whose index is a multiple of 4, and kk .. kk + 3 are the next
    # addresses under the same predicate (one tap, one bounds test): read as one VectorLoad
    vector: bool = False


@dataclass(frozen=True)
class BlockContext:
    """Block-uniform values a view may use: grid-z index g, first row m0 and first column n0."""
    g: object
    m0: object
    n0: object


@dataclass
class GemmView:
    M: int
    N: int
    K: int
    groups: int          # independent GEMMs, one per grid-z slice
    a: Operand
    b: Operand
    store: Callable      # (m, n, g, value, split) -> list of statements; split: the split-K index or None
    params: tuple        # global Buffers, in kernel-argument order
    dtype: str = "float32"
    doc: str = ""
    meta: dict = field(default_factory=dict)
    k_tiles: Callable | None = None  # (BlockContext) -> Expr: a per-block count of BK slices (ConvV2)
    # (cfg, BlockContext) -> tma_schedule.TmaOperands: the operands as TMA boxes (TileConfig.tma); raises ValueError
    # naming what the problem lacks
    tma: Callable | None = None
    # store(m, n + 1) writes the element after store(m, n)'s (a channels-last output, n its channel), so an
    # epilogue may write the two as one Store with a pair
    pairs: bool = False


def _cdiv(a, b):
    return -(-a // b)


def _tile_coords(idx, rows, cols, fast_is_col):
    """Element idx of a rows x cols tile -> (row, col), walking the contiguous axis fastest."""
    if fast_is_col:
        return idx // cols, idx % cols
    return idx % rows, idx // rows


def shared_limit(cfg):
    """Bytes of shared memory a block of this config may use: 48 KiB of static shared arrays, or, for the
    warpgroup-MMA tiles (sm_90 only), 227 KiB of dynamic shared memory (render_cuda switches to a dynamic
    array past 48 KiB and the launcher opts the kernel in)."""
    return 227 * 1024 if cfg.wgmma else 48 * 1024


def shared_bytes(cfg):
    """Shared memory of the A and B stages of a tensor-core or fp32 config (float32 words; the warpgroup layout
    pads its core matrices)."""
    if cfg.tensor_core and cfg.wgmma:
        rows = (cfg.BM + cfg.BN) * ROW if cfg.tma else tile_words(cfg.BM, cfg.BK) + tile_words(cfg.BN, cfg.BK)
        return 4 * cfg.stages * rows
    return 4 * cfg.stages * (cfg.BM + cfg.BN) * cfg.BK


def tiled_gemm(name: str, view: GemmView, cfg: TileConfig, precision: str = "tf32") -> Kernel:
    """precision: the tensor-core operand format ("tf32", "fp16", "bf16"); fp32 configs ignore it."""
    cfg.validate()
    if cfg.state_groups != 1:
        raise ValueError(f"config: state_groups is a Winograd schedule field; {name} needs 1, got {cfg}")
    BM, BN, BK, TM, TN = cfg.BM, cfg.BN, cfg.BK, cfg.TM, cfg.TN
    NT = cfg.threads - cfg.producer_threads  # the threads that compute (tma=2 adds a warp that only copies)
    SK = cfg.split_k
    dt = compute_dtype(view.dtype)  # shared tiles and registers: float32 for float16 storage
    nkt = _cdiv(view.K, BK)
    kt_per_split = _cdiv(nkt, SK)
    EA, EB = _cdiv(BM * BK, NT), _cdiv(BK * BN, NT)
    # shared tiles are k-major so the compute phase reads a row of A and a row of B per k step; the swizzled
    # tensor-core layout stores rows along k instead, so a lane reads its fragments as vectors
    S = cfg.stages
    if cfg.async_copy and view.dtype != "float32":
        raise ValueError(f"config: async_copy copies float32 words into float32 shared tiles; {name} stores "
                         f"{view.dtype} (use async_copy=0), got {cfg}")
    limit, need = shared_limit(cfg), shared_bytes(cfg)
    if need > limit:
        raise ValueError(f"config: {S} stages of {BM + BN} x {BK} float32 need {need} bytes of shared memory, over "
                         f"the {limit} a block may have; got {cfg}")
    # tensor cores: warps of MMAs; asynchronous copies bypass the staging registers, so operands are rounded
    # where fragments are loaded
    wg = cfg.tensor_core and cfg.wgmma  # warpgroups reading shared memory (warpgroup_mma.py)
    if wg:
        wmma = WarpgroupGemm(cfg, dt, precision, view.dtype)
    else:
        wmma = WarpMma(cfg, dt, precision, round_fragments=bool(cfg.async_copy)) if cfg.tensor_core else None
    swz = wmma is not None and cfg.swizzle  # rows along k, chunks rotated (warp_mma.swizzled_col)
    ilv = swz and cfg.swizzle == 2  # A's rows g, g + 8 interleaved (warp_mma.interleaved_col)
    along_k = swz or wg  # shared rows run along k: operands are staged in 16-byte chunks of k
    if wg and cfg.tma:  # 128-byte swizzled rows (32 float32 or 64 float16), as the tensor copies write them
        row, tile_dt = swizzled_row(view.dtype), view.dtype  # float16 operands land as they are stored
        As = Buffer("As", (S, BM * row), tile_dt, "shared")
        Bs = Buffer("Bs", (S, BN * row), tile_dt, "shared")
    elif wg:  # core matrices (warpgroup_mma.core_word), flat per stage
        As = Buffer("As", (S, tile_words(BM, BK)), dt, "shared")
        Bs = Buffer("Bs", (S, tile_words(BN, BK)), dt, "shared")
    elif swz:
        As = Buffer("As", (S, BM // 2, interleaved_row_words(BK)) if ilv else (S, BM, BK), dt, "shared")
        Bs = Buffer("Bs", (S, BN, BK), dt, "shared")
    else:
        As = Buffer("As", (S, BK, BM + cfg.smem_pad), dt, "shared")
        Bs = Buffer("Bs", (S, BK, BN + cfg.smem_pad), dt, "shared")
    acc = Buffer("acc", (TM, TN), dt, "register")
    a_frag = Buffer("a_frag", (TM,), dt, "register")
    b_frag = Buffer("b_frag", (TN,), dt, "register")
    tid, bm, bn, bz = Var("tid"), Var("bm"), Var("bn"), Var("bz")
    g = bz // SK if SK > 1 else bz
    split = bz % SK if SK > 1 else None  # which part of the reduction this block adds
    m0, n0 = bm * BM, bn * BN
    ctx = BlockContext(g, m0, n0)

    # --- per-thread invariants of the lines (A rows / B columns) this thread loads ---------------
    def chunked(operand, is_a):
        lines = BM if is_a else BN
        return along_k and operand.fast != "k" and (lines * BK) % (4 * NT) == 0

    def vectorized(operand, is_a):
        """A k-contiguous operand in the swizzled layout (shared rows along k too): each thread takes 4
        consecutive k of one line, one 16-byte global load (ir.VectorLoad) and, unless A is interleaved, one
        16-byte shared store."""
        lines = BM if is_a else BN
        return along_k and operand.fast == "k" and operand.vector and (lines * BK) % (4 * NT) == 0

    def chunk_of(operand, e, is_a):
        """(line, q): the line and the 16-byte chunk along k (k = 4 q + e % 4) of element e of a thread that
        takes 4 consecutive k of one line (chunked or vectorized operands)."""
        u = tid + (e // 4) * NT
        if chunked(operand, is_a):
            # swizzled layout, operand contiguous along m/n: lanes still walk m/n fastest (coalesced global
            # loads) but each thread takes 4 consecutive k of one line, i.e. one 16-byte chunk of a shared row
            # (one STS.128, and the rotation puts the 8 lanes of a store phase in 8 distinct chunks)
            lines = BM if is_a else BN
            return u % lines, u // lines
        if wg:  # 8 lanes take chunk q of 8 consecutive lines: 128 contiguous bytes of a core-matrix column
            C = BK // 4
            return u % 8 + 8 * (u // (8 * C)), (u // 8) % C
        return u // (BK // 4), u % (BK // 4)  # vectorized: 4 threads per 16-wide row of k, a warp 8 lines x 64 B

    def line_of(operand, e, rows, cols, is_a):
        lines = rows if is_a else cols  # the tile's m (A) or n (B) extent
        if chunked(operand, is_a) or vectorized(operand, is_a):
            (line, q), in_tile = chunk_of(operand, e, is_a), tid + (e // 4) * NT < lines * BK // 4
            k = q * 4 + e % 4
            return (line, k, in_tile) if is_a else (k, line, in_tile)
        idx = tid + e * NT
        r, c = _tile_coords(idx, rows, cols, operand.fast == "k" if is_a else operand.fast != "k")
        return r, c, idx < rows * cols

    # the gather addresses of per-thread copies; TMA copies (tma=1) take block coordinates and need none
    inv_names_a = [] if cfg.tma else sorted(view.a.invariant(Var("_m"), Var("_g")).keys())
    inv_names_b = [] if cfg.tma else sorted(view.b.invariant(Var("_n"), Var("_g")).keys())
    inv_a = {n: Buffer(f"ia_{n}", (EA,), "int64", "register") for n in inv_names_a}
    inv_b = {n: Buffer(f"ib_{n}", (EB,), "int64", "register") for n in inv_names_b}

    prologue = [Comment("per-thread invariants: index math that does not change along k")]
    for e in range(0, EA, 4 if vectorized(view.a, True) else 1):  # a chunk's 4 elements share a line
        row, _, _ = line_of(view.a, e, BM, BK, True)
        vals = view.a.invariant(m0 + row, g)
        prologue += [inv_a[n].store(e, vals[n]) for n in inv_names_a]
    for e in range(0, EB, 4 if vectorized(view.b, False) else 1):
        _, col, _ = line_of(view.b, e, BK, BN, False)
        vals = view.b.invariant(n0 + col, g)
        prologue += [inv_b[n].store(e, vals[n]) for n in inv_names_b]
    prologue += wmma.zero() if wmma else [acc.store((i, j), Const(0.0)) for i in range(TM) for j in range(TN)]

    # --- move one BK-deep slice of A and B: global -> staging registers -> shared -------------------
    # Split in two halves so that with stages=2 the global loads of slice kt+1 are issued before the
    # outer products of slice kt and land in shared memory after them: load latency hides behind math.
    ra = Buffer("ra", (EA,), dt, "register")
    rb = Buffer("rb", (EB,), dt, "register")

    def fetch_operand(op, is_a, kt):
        """Global -> staging registers for one operand: one VectorLoad per 4-element chunk where the operand
        allows it, else one guarded scalar load per element."""
        rows, cols, E, reg = (BM, BK, EA, ra) if is_a else (BK, BN, EB, rb)
        inv, names = (inv_a, inv_names_a) if is_a else (inv_b, inv_names_b)
        lines, base, bound = (BM, m0, view.M) if is_a else (BN, n0, view.N)
        vec = vectorized(op, is_a)
        out = []
        for e in range(0, E, 4 if vec else 1):
            row, col, in_tile = line_of(op, e, rows, cols, is_a)
            line, k = (row, col) if is_a else (col, row)
            pred, val = op.element({n: inv[n][e] for n in names}, kt * BK + k, kt, k, *([ctx] if op.context else []))
            if bound % lines:  # a partial last tile: lines past the end must not be read
                pred = (base + line < bound) & pred
            if vec:
                st = VectorLoad(tuple(reg[e + w] for w in range(4)), val.buf, val.index[0], pred)
            else:
                st = reg.store(e, select(pred, val, Const(0.0)))
            out.append(st if (rows * cols) % NT == 0 else If(in_tile, (st,)))
        return out

    def fetch(kt):
        return fetch_operand(view.a, True, kt) + fetch_operand(view.b, False, kt)

    # the tensor-core path rounds to TF32 / fp16 / bf16 here, once per staged element, not once per fragment use;
    # float16 storage staged as fp16 operands is already exact (two conversions saved per element)
    rounds = wmma and not (view.dtype == "float16" and precision == "fp16")
    staged = (lambda v: Call(precision, (v,))) if rounds else (lambda v: v)

    def shared_col(operand, e, line, k, is_a):
        """Swizzled column of (line, k); for chunked operands from the chunk index directly (k = 4 q + e % 4),
        so the four stores of a chunk are visibly `base + j` and NVVM merges them into one STS.128."""
        if chunked(operand, is_a) or vectorized(operand, is_a):
            q = chunk_of(operand, e, is_a)[1]
            C = BK // 4
            return ((q + (line % 8) // (8 // C)) % C) * 4 + e % 4
        return swizzled_col(line, k, BK)

    def shared_at(e, row, col, is_a, stage):
        """Where element e (tile position row, col) of this thread's share of A or B goes in shared memory."""
        if wg:
            op, line, k = (view.a, row, col) if is_a else (view.b, col, row)
            q, w = (chunk_of(op, e, is_a)[1], e % 4) if chunked(op, is_a) or vectorized(op, is_a) else (k // 4, k % 4)
            return (stage, core_word(line, q, w, BK))
        if not is_a:
            return (stage, col, shared_col(view.b, e, col, row, False)) if swz else (stage, row, col)
        if ilv:
            return (stage, pair_row(row), interleaved_col(col, (row % 16) // 8))
        return (stage, row, shared_col(view.a, e, row, col, True)) if swz else (stage, col, row)

    def commit(stage):
        out = []
        for e in range(EA):
            row, col, in_tile = line_of(view.a, e, BM, BK, True)
            st = As.store(shared_at(e, row, col, True, stage), staged(ra[e]))
            out.append(st if (BM * BK) % NT == 0 else If(in_tile, (st,)))
        for e in range(EB):
            row, col, in_tile = line_of(view.b, e, BK, BN, False)
            st = Bs.store(shared_at(e, row, col, False, stage), staged(rb[e]))
            out.append(st if (BK * BN) % NT == 0 else If(in_tile, (st,)))
        return out

    def issue(kt, stage):
        """Global -> shared for slice kt without staging registers (async_copy): one 16-byte AsyncCopy per
        4-element chunk of a vectorized operand (its shared chunk is 4 consecutive words), else one 4-byte
        copy per element; zeros where the element's predicate fails."""
        out = []
        for op, is_a in ((view.a, True), (view.b, False)):
            rows, cols, E = (BM, BK, EA) if is_a else (BK, BN, EB)
            inv, names = (inv_a, inv_names_a) if is_a else (inv_b, inv_names_b)
            lines, base, bound, buf = (BM, m0, view.M, As) if is_a else (BN, n0, view.N, Bs)
            vec = vectorized(op, is_a)
            for e in range(0, E, 4 if vec else 1):
                row, col, in_tile = line_of(op, e, rows, cols, is_a)
                line, k = (row, col) if is_a else (col, row)
                pred, val = op.element({n: inv[n][e] for n in names}, kt * BK + k, kt, k,
                                       *([ctx] if op.context else []))
                if bound % lines:
                    pred = (base + line < bound) & pred
                st = AsyncCopy(buf.name, shared_at(e, row, col, is_a, stage), val.buf, val.index, pred,
                               4 if vec else 1)
                out.append(st if (rows * cols) % NT == 0 else If(in_tile, (st,)))
        return out

    def round_landed(stage):
        """TF32-round in place the words this thread's copies put in `stage`: wgmma reads float32 operands by
        truncation (up to 2^-10 relative each, biased toward zero), which measured past the issue's 1e-3 on
        some data; rounded words truncate exactly.  Only the copying thread touches them, before the barrier."""
        out = []
        for op, is_a in ((view.a, True), (view.b, False)):
            rows, cols, E, buf = (BM, BK, EA, As) if is_a else (BK, BN, EB, Bs)
            width = 4 if vectorized(op, is_a) else 1
            for e in range(0, E, width):
                row, col, in_tile = line_of(op, e, rows, cols, is_a)
                stage_, word = shared_at(e, row, col, is_a, stage)
                sts = [buf.store((stage_, word + w), Call("tf32", (buf[stage_, word + w],))) for w in range(width)]
                out += sts if (rows * cols) % NT == 0 else [If(in_tile, tuple(sts))]
        return out

    # --- register-tiled outer products ----------------------------------------------------------
    ty, tx = Var("ty"), Var("tx")
    thread_xy = [Assign("ty", tid // (BN // TN)), Assign("tx", tid % (BN // TN))]
    kk = Var("kk")
    def compute(cur):
        return [For("kk", BK, tuple(
        [a_frag.store(i, As[cur, kk, ty * TM + i]) for i in range(TM)]
        + [b_frag.store(j, Bs[cur, kk, tx * TN + j]) for j in range(TN)]
        + [acc.store((i, j), a_frag[i] * b_frag[j], accumulate=True) for i in range(TM) for j in range(TN)]
        ), "unroll")]

    # --- epilogue: guarded stores through the view ----------------------------------------------
    epilogue = list(thread_xy) if not wmma else wmma.epilogue(tid, view, m0, n0, g, split)
    for i in range(TM if not wmma else 0):
        for j in range(TN):
            m, n = m0 + ty * TM + i, n0 + tx * TN + j
            guard = all_of(([m < view.M] if view.M % BM else []) + ([n < view.N] if view.N % BN else []))
            epilogue.append(If(guard, tuple(view.store(m, n, g, acc[i, j], split))))

    k_lo = split * kt_per_split if SK > 1 else Const(0)
    k_extent = kt_per_split if SK > 1 else nkt
    if view.k_tiles is not None:  # the reduction length depends on the block
        if SK > 1 or S > 1 and not cfg.tma:
            raise ValueError(f"TileConfig: a per-block reduction needs split_k=1 and stages=1 (or tma), got {cfg}")
        k_extent = view.k_tiles(ctx)
    k_end = Call("min", (k_lo + k_extent, Const(nkt))) if SK > 1 and nkt % SK else k_lo + k_extent
    kt = Var("kt")
    ragged = SK > 1 and nkt % SK  # the last split has fewer slices: guard each one
    tma_locals, tma_params, tma_maps = (), (), ()
    if cfg.tma:
        if view.tma is None:
            raise ValueError(f"config: tma={cfg.tma} needs a GEMM view whose operands are TMA boxes (implicit-GEMM "
                             f"forward or backward-data); {name} has none, got {cfg}")
        if nkt % SK:  # a box past the last slice would read real pixels at a tap the filter does not have
            raise ValueError(f"config: tma={cfg.tma} needs split_k to divide the {nkt} slices of {BK}, got {cfg}")
        ops = view.tma(cfg, ctx)
        if SK > 1:  # each split copies its own run of slices; the schedule counts from 0
            ops = replace(ops, a_box=lambda kt, box=ops.a_box: box(k_lo + kt),
                          b_box=lambda kt, box=ops.b_box: box(k_lo + kt))
        schedule = tma_specialised_pipeline if cfg.tma == 2 else tma_pipeline
        tma_prologue, kloop, tma_locals = schedule(ops, cfg, k_extent, wmma, As, Bs, NT, tid)
        prologue = prologue + tma_prologue
        tma_params, tma_maps = ops.params(), (ops.a, ops.b)
    elif cfg.async_copy:
        # S-stage pipeline (CUTLASS's multistage): S - 1 slices are in flight while one is computed.  Per slice:
        # wait until this thread's copies of slice kt have landed, one barrier (everyone's have landed, and
        # everyone has finished computing slice kt - 1, whose stage the next copies overwrite), issue slice
        # kt + S - 1, compute slice kt.  Every iteration commits a group, empty past the end, so that "all
        # but the S - 2 newest groups" is always slice kt.  Unrolled by S: every stage index is a constant.
        def one_slice(kt, stage):
            nxt = kt + (S - 1)
            # warpgroup MMAs read shared memory through the async proxy: each thread rounds its landed copies
            # to TF32 and fences them
            landed = (AsyncWait(S - 2), *round_landed(stage), AsyncProxyFence()) if wg else (AsyncWait(S - 2),)
            body = (For("tid", NT, landed, "thread"), Barrier(),
                    For("tid", NT, (Comment(f"copy slice + {S - 1} into stage {(stage + S - 1) % S}"),
                                    If(nxt < k_end, tuple(issue(nxt, (stage + S - 1) % S))), AsyncCommit()),
                        "thread"),
                    *wmma.compute(tid, NT, As, Bs, stage))
            return (If(kt < nkt, body),) if ragged else body
        kp = Var("kp")
        kloop = [For("kp", k_extent // S, sum((one_slice(k_lo + kp * S + r, r) for r in range(S)), ()), "serial")]
        kloop += [st for r in range(k_extent % S) for st in one_slice(k_lo + (k_extent // S) * S + r, r)]
        kloop += [For("tid", NT, (AsyncWait(0),), "thread")]  # nothing is in flight when the block ends
        prefetch = [Comment(f"the first {S - 1} slices: global -> shared, asynchronously")]
        for s_ in range(S - 1):
            prefetch += [If(k_lo + s_ < k_end, tuple(issue(k_lo + s_, s_))), AsyncCommit()]
        prologue = prologue + prefetch
    elif S == 1:
        kloop_body = (For("tid", NT, tuple([Comment("stage A and B: global -> shared")] + fetch(kt) + commit(0)),
                          "thread"), Barrier(),
                      *(wmma.compute(tid, NT, As, Bs, 0) if wmma else [For("tid", NT, tuple(thread_xy + compute(0)),
                                                                           "thread")]),
                      Barrier())
        kloop = [For("kt", k_extent, (If(kt < nkt, kloop_body),) if ragged else kloop_body, "serial", start=k_lo)]
    else:
        # One barrier per slice: slice j computes from stage j % 2 while slice j + 1 fills the other.
        # The loop is unrolled by two so that every shared-memory address has a constant stage offset.
        def one_slice(kt, stage):
            nxt = kt + 1
            if wmma:  # the MMA steps are thread phases of their own; staging registers carry across them
                body = (For("tid", NT, (Comment("prefetch the next slice into registers"),
                                        If(nxt < k_end, tuple(fetch(nxt)))), "thread"),
                        *wmma.compute(tid, NT, As, Bs, stage),
                        For("tid", NT, (If(nxt < k_end, tuple(commit(1 - stage))),), "thread"), Barrier())
                return (If(kt < nkt, body),) if ragged else body
            body = (For("tid", NT, tuple(
                thread_xy + [Comment("prefetch the next slice into registers"), If(nxt < k_end, tuple(fetch(nxt)))]
                + compute(stage) + [If(nxt < k_end, tuple(commit(1 - stage)))]), "thread"), Barrier())
            return (If(kt < nkt, body),) if ragged else body
        kp = Var("kp")
        kloop = [For("kp", k_extent // 2, one_slice(k_lo + kp * 2, 0) + one_slice(k_lo + kp * 2 + 1, 1), "serial")]
        if k_extent % 2:
            kloop += list(one_slice(k_lo + (k_extent - 1), 0))
        prefetch = [Comment("first slice: global -> shared")] + fetch(k_lo) + commit(0)
        prologue = prologue + ([If(k_lo < nkt, tuple(prefetch))] if ragged else prefetch)
    block = tuple([For("tid", NT, tuple(prologue), "thread"), Barrier()] + kloop
                  + [For("tid", NT, tuple(epilogue), "thread")])
    grid = (_cdiv(view.M, BM), _cdiv(view.N, BN), view.groups * SK)
    body = (For("bm", grid[0], (For("bn", grid[1], (For("bz", grid[2], block, "grid", axis=2),), "grid", axis=1),),
                "grid", axis=0),)
    staging = () if cfg.async_copy or cfg.tma else (ra, rb)
    locals_ = (As, Bs) + (wmma.locals if wmma else (acc, a_frag, b_frag)) + staging + tuple(inv_a.values()) \
        + tuple(inv_b.values()) + tma_locals
    meta = {"doc": view.doc, "config": str(cfg), "zero_output": SK > 1, "precision": precision if wmma else "fp32",
            "work": view.M * view.N * view.K * view.groups, **view.meta}
    if tma_maps:  # the launcher encodes these from the arrays they name (render_base.launch_constants)
        meta["tensor_maps"] = tma_maps
    if cfg.min_blocks or cfg.tma:  # CUDA launch bounds (render_cuda): (threads per block, min blocks per SM);
        # a TMA tile's block must launch whatever ptxas allocates (288 threads: at most 224 registers each)
        meta["launch_bounds"] = (cfg.threads, max(1, cfg.min_blocks))
    return Kernel(name, tuple(view.params) + tma_params, locals_, body, grid, cfg.threads, meta)
