"""The schedule context of one tiled-GEMM kernel: the facts every part of templates/tiled_gemm.py's schedule shares
(sizes, thread and block coordinates, the reduction's extent, the shared tiles, the inner product, the per-thread
registers), derived once from (view, config, precision) and frozen.

The parts read it: gemm_layout (where operands live in shared memory), gemm_staging (global -> registers ->
shared, cp.async and the per-thread invariants), gemm_compute (the inner product and its epilogue) and
gemm_pipelines (one k-loop per TileConfig.pipeline).
"""
from __future__ import annotations

from dataclasses import dataclass

from kernelgen.ir import Buffer, Call, Const, Var, compute_dtype
from kernelgen.templates.gemm_compute import make_compute
from kernelgen.templates.gemm_layout import TileLayout, tile_layout


def _cdiv(a, b):
    return -(-a // b)


@dataclass(frozen=True)
class BlockContext:
    """Block-uniform values a view may use: grid-z index g, first row m0 and first column n0."""
    g: object
    m0: object
    n0: object


@dataclass(frozen=True)
class GemmSchedule:
    """name, view (the GemmView), cfg (the TileConfig), precision: as tiled_gemm got them.

    compute: the inner product (gemm_compute.make_compute); layout: the shared tiles (gemm_layout.TileLayout).
    NT: the threads that compute (and copy, except tma=2's producer warp); nkt: BK slices of the whole reduction;
    EA, EB: the elements of a slice of A / B each thread copies.  tid; g: the GEMM (grid z, past the split); split:
    the split-K index (None without split-K); m0, n0: the block's first row and column; ctx: those for the view.
    The block's slices: k_lo .. k_lo + k_extent (an int, or an Expr of the block for per-block reductions),
    clipped at k_end; ragged: the last split has fewer slices, so each is guarded.  inv_a, inv_b: per-thread
    invariant registers by name (sorted); ra, rb: the staging registers of a slice."""
    name: str
    view: object
    cfg: object
    precision: str
    compute: object
    layout: TileLayout
    NT: int
    nkt: int
    EA: int
    EB: int
    tid: Var
    g: object
    split: object
    m0: object
    n0: object
    ctx: BlockContext
    k_lo: object
    k_extent: object
    k_end: object
    ragged: bool
    inv_a: dict
    inv_b: dict
    ra: Buffer
    rb: Buffer

    @property
    def As(self):
        return self.layout.As

    @property
    def Bs(self):
        return self.layout.Bs


def make_schedule(name, view, cfg, precision) -> GemmSchedule:
    """The context of a validated config (the inner product's own rules on the precision raise here)."""
    NT = cfg.threads - cfg.producer_threads  # the threads that compute (tma=2 adds a warp that only copies)
    SK, BK = cfg.split_k, cfg.BK
    dt = compute_dtype(view.dtype)  # shared tiles and registers: float32 for float16 storage
    nkt = _cdiv(view.K, BK)
    kt_per_split = _cdiv(nkt, SK)
    EA, EB = _cdiv(cfg.BM * BK, NT), _cdiv(BK * cfg.BN, NT)
    compute = make_compute(cfg, dt, precision, view.dtype)
    tid, bm, bn, bz = Var("tid"), Var("bm"), Var("bn"), Var("bz")
    g = bz // SK if SK > 1 else bz
    split = bz % SK if SK > 1 else None  # which part of the reduction this block adds
    m0, n0 = bm * cfg.BM, bn * cfg.BN
    ctx = BlockContext(g, m0, n0)
    k_lo = split * kt_per_split if SK > 1 else Const(0)
    k_extent = kt_per_split if SK > 1 else nkt
    if view.k_tiles is not None:  # the reduction length depends on the block (pipelines that allow it: requires)
        k_extent = view.k_tiles(ctx)
    k_end = Call("min", (k_lo + k_extent, Const(nkt))) if SK > 1 and nkt % SK else k_lo + k_extent
    # the gather addresses of per-thread copies; TMA copies (tma=1) take block coordinates and need none
    names_a = [] if cfg.tma else sorted(view.a.invariant(Var("_m"), Var("_g")).keys())
    names_b = [] if cfg.tma else sorted(view.b.invariant(Var("_n"), Var("_g")).keys())
    inv_a = {n: Buffer(f"ia_{n}", (EA,), "int64", "register") for n in names_a}
    inv_b = {n: Buffer(f"ib_{n}", (EB,), "int64", "register") for n in names_b}
    ra, rb = Buffer("ra", (EA,), dt, "register"), Buffer("rb", (EB,), dt, "register")
    return GemmSchedule(name, view, cfg, precision, compute, tile_layout(cfg, view, dt, NT, tid), NT, nkt, EA, EB,
                        tid, g, split, m0, n0, ctx, k_lo, k_extent, k_end, bool(SK > 1 and nkt % SK), inv_a, inv_b,
                        ra, rb)
