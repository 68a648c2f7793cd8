"""Operand layout and addressing of the tiled-GEMM schedule: where a stage of A (BM x BK) and B (BK x BN) lives in
shared memory, and which of its elements each thread copies there.

Five layouts, chosen by the config:

* k-major, As[k][m] and Bs[k][n] with rows padded by smem_pad: the fp32 register tile (and the first tensor-core
  tiles), which reads a row of A and a row of B per k step;
* swizzled rows along k (swizzle=1, tensor cores): As[m][k], Bs[n][k], the 16-byte chunks of a row rotated per row
  group (warp_mma.swizzled_col), so a lane reads its fragments of a slice as vectors;
* interleaved (swizzle=2): as 1, with A's rows g and g + 8 of each MMA tile interleaved word by word
  (warp_mma.interleaved_col);
* core matrices (warpgroup MMAs fed by cp.async): warpgroup_mma.core_word, flat per stage;
* 128-byte swizzled rows (warpgroup MMAs fed by TMA), as the tensor copies write them (tma_schedule.swizzled_row).

Ownership: thread tid copies elements tid + e NT (e < EA of A, e < EB of B) of a slice, walking the operand's
contiguous axis fastest so global loads coalesce.  Where shared rows run along k, a thread instead takes 4
consecutive k of one line (a 16-byte chunk): `chunked` operands are contiguous along m / n, `vectorized` ones along
k (one 16-byte global load per chunk).
"""
from __future__ import annotations

from dataclasses import dataclass

from kernelgen.ir import Buffer
from kernelgen.templates.tma_schedule import ROW, swizzled_row
from kernelgen.templates.warp_mma import interleaved_col, interleaved_row_words, pair_row, swizzled_col
from kernelgen.templates.warpgroup_mma import core_word, tile_words


def check_swizzle(cfg):
    """The swizzled layouts' rules (TileConfig.validate): fragments are read as 64/128-bit vectors of a BK-word row,
    which only the tensor-core fragment loads do, and the rotation leaves no room for padding."""
    if cfg.swizzle == 2 and cfg.BK not in (8, 16):
        raise ValueError(f"TileConfig: swizzle=2 (interleaved A rows) needs BK 8 or 16, got {cfg}")
    if cfg.swizzle and (not cfg.tensor_core or cfg.smem_pad or cfg.BK not in (8, 16, 32)):
        raise ValueError(f"TileConfig: swizzle needs a tensor-core tile, smem_pad=0 and BK in (8, 16, 32); "
                         f"got {cfg}")


def shared_bytes(cfg):
    """Shared memory of the A and B stages of a tensor-core or fp32 config (float32 words; the warpgroup layout
    pads its core matrices)."""
    if cfg.tensor_core and cfg.wgmma:
        rows = (cfg.BM + cfg.BN) * ROW if cfg.tma else tile_words(cfg.BM, cfg.BK) + tile_words(cfg.BN, cfg.BK)
        return 4 * cfg.stages * rows
    return 4 * cfg.stages * (cfg.BM + cfg.BN) * cfg.BK


def _tile_coords(idx, rows, cols, fast_is_col):
    """Element idx of a rows x cols tile -> (row, col), walking the contiguous axis fastest."""
    if fast_is_col:
        return idx // cols, idx % cols
    return idx % rows, idx // rows


@dataclass(frozen=True)
class TileLayout:
    """The shared tiles As, Bs (stage first) of one schedule and the addressing of their elements.  wg: warpgroup
    core matrices or TMA rows; swz: rows along k with rotated chunks; ilv: A interleaved (swizzle=2); along_k:
    operands staged in 16-byte chunks of k (swz or wg)."""
    cfg: object
    view: object  # the GemmView: which axis of each operand is contiguous (Operand.fast, .vector)
    NT: int       # the threads that copy (the compute threads)
    tid: object
    wg: bool
    swz: bool
    ilv: bool
    As: Buffer
    Bs: Buffer

    @property
    def along_k(self):
        return self.swz or self.wg

    def operand(self, is_a):
        return self.view.a if is_a else self.view.b

    def chunked(self, is_a):
        """Contiguous along m / n, staged along k: lanes still walk m / n fastest (coalesced global loads) but each
        thread takes 4 consecutive k of one line, one 16-byte chunk of a shared row (one STS.128, and the rotation
        puts the 8 lanes of a store phase in 8 distinct chunks)."""
        lines = self.cfg.BM if is_a else self.cfg.BN
        return self.along_k and self.operand(is_a).fast != "k" and (lines * self.cfg.BK) % (4 * self.NT) == 0

    def vectorized(self, is_a):
        """A k-contiguous operand in a layout along k: each thread takes 4 consecutive k of one line, one 16-byte
        global load (ir.VectorLoad) and, unless A is interleaved, one 16-byte shared store."""
        op, lines = self.operand(is_a), self.cfg.BM if is_a else self.cfg.BN
        return self.along_k and op.fast == "k" and op.vector and (lines * self.cfg.BK) % (4 * self.NT) == 0

    def chunk_of(self, e, is_a):
        """(line, q): the line and the 16-byte chunk along k (k = 4 q + e % 4) of element e of a thread that takes
        4 consecutive k of one line (chunked or vectorized operands)."""
        BK, NT = self.cfg.BK, self.NT
        u = self.tid + (e // 4) * NT
        if self.chunked(is_a):
            lines = self.cfg.BM if is_a else self.cfg.BN
            return u % lines, u // lines
        if self.wg:  # 8 lanes take chunk q of 8 consecutive lines: 128 contiguous bytes of a core-matrix column
            C = BK // 4
            return u % 8 + 8 * (u // (8 * C)), (u // 8) % C
        return u // (BK // 4), u % (BK // 4)  # vectorized: 4 threads per 16-wide row of k, a warp 8 lines x 64 B

    def line_of(self, e, is_a):
        """(row, col, in_tile): the tile position of this thread's element e of A (BM x BK) or B (BK x BN), and
        whether it exists (the last element index may run past a tile the threads do not divide)."""
        cfg, NT = self.cfg, self.NT
        rows, cols = (cfg.BM, cfg.BK) if is_a else (cfg.BK, cfg.BN)
        lines = rows if is_a else cols  # the tile's m (A) or n (B) extent
        if self.chunked(is_a) or self.vectorized(is_a):
            (line, q), in_tile = self.chunk_of(e, is_a), self.tid + (e // 4) * NT < lines * cfg.BK // 4
            k = q * 4 + e % 4
            return (line, k, in_tile) if is_a else (k, line, in_tile)
        idx = self.tid + e * NT
        fast = self.operand(is_a).fast
        r, c = _tile_coords(idx, rows, cols, fast == "k" if is_a else fast != "k")
        return r, c, idx < rows * cols

    def shared_col(self, e, line, k, is_a):
        """Swizzled column of (line, k); for chunked operands from the chunk index directly (k = 4 q + e % 4),
        so the four stores of a chunk are visibly `base + j` and NVVM merges them into one STS.128."""
        if self.chunked(is_a) or self.vectorized(is_a):
            q = self.chunk_of(e, is_a)[1]
            C = self.cfg.BK // 4
            return ((q + (line % 8) // (8 // C)) % C) * 4 + e % 4
        return swizzled_col(line, k, self.cfg.BK)

    def shared_at(self, e, row, col, is_a, stage):
        """Where element e (tile position row, col) of this thread's share of A or B goes in shared memory."""
        if self.wg:
            line, k = (row, col) if is_a else (col, row)
            split = self.chunked(is_a) or self.vectorized(is_a)
            q, w = (self.chunk_of(e, is_a)[1], e % 4) if split else (k // 4, k % 4)
            return (stage, core_word(line, q, w, self.cfg.BK))
        if not is_a:
            return (stage, col, self.shared_col(e, col, row, False)) if self.swz else (stage, row, col)
        if self.ilv:
            return (stage, pair_row(row), interleaved_col(col, (row % 16) // 8))
        return (stage, row, self.shared_col(e, row, col, True)) if self.swz else (stage, col, row)


def tile_layout(cfg, view, dt, NT, tid):
    """The layout a config asks for (dt: the shared tiles' dtype, float32 for float16 storage except under TMA)."""
    S, BM, BN, BK = cfg.stages, cfg.BM, cfg.BN, cfg.BK
    wg = bool(cfg.tensor_core and cfg.wgmma)  # warpgroups reading shared memory (warpgroup_mma.py)
    swz = bool(cfg.tensor_core and cfg.swizzle)  # rows along k, chunks rotated (warp_mma.swizzled_col)
    ilv = swz and cfg.swizzle == 2  # A's rows g, g + 8 interleaved (warp_mma.interleaved_col)
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
    return TileLayout(cfg, view, NT, tid, wg, swz, ilv, As, Bs)
