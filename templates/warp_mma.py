"""The tensor-core inner product of the tiled-GEMM schedule: warps of m16n8k8 TF32 MMAs, or of
m16n8k16 fp16 / bf16 MMAs.

tiled_gemm stages each BK-deep slice of A and B in shared memory (k-major, values already rounded
to TF32 / fp16 / bf16 there, once per element, kept as float32).  Here the block tile is split among
warps: warp (wm, wn) owns the WM x WN sub-tile at (wm * WM, wn * WN), i.e. MT x NT = (WM / 16) x (WN / 8)
MMA tiles, and keeps their accumulators in registers, 4 per MMA tile per lane.  Per 8-deep step of the slice a lane loads
its A fragments (4 per m-tile) and B fragments (2 per n-tile) from shared memory in the PTX layout
(kernelgen/mma_layout.py) and issues MT x NT MMAs; every A fragment is reused NT times, every B
fragment MT times.  Fragment loads and MMAs are separate thread phases (no barrier between them:
warps never read each other's registers) so the CPU, which runs the lanes of a warp one after
another, sees every lane's fragments before any lane's MMA.

fp16 / bf16: the fragments are loaded exactly as for TF32, two 8-deep steps at a time, and one m16n8k16
MMA consumes the fragments of both steps (mma_layout.py explains why the TF32 layout feeds it unchanged);
BK must then be a multiple of 16.

Two shared layouts (TileConfig.swizzle): k-major As[k][m], Bs[k][n] with one scalar load per fragment
register (the first version), or swizzled rows along k, As[m][k], Bs[n][k], where each lane reads the
fragments of a whole slice as one 64/128-bit vector per row (compute_swizzled).
"""
from __future__ import annotations

from ..ir import Assign, Buffer, Call, Const, For, If, Mma, Var, all_of


def swizzled_col(line, k, BK):
    """Column of element k of shared row `line` in the swizzled tile layout (TileConfig.swizzle): rows of BK
    words along k, cut into C = BK / 4 chunks of 16 bytes; the chunks of row `line` are rotated by
    f(line) = (line // (8 / C)) % C, which differs between the rows that share a 128-byte line of banks.
    Rotation (not XOR) keeps it +, //, %; within a chunk the order is unchanged, so a lane's 2 or 4
    consecutive k stay one aligned vector."""
    C = BK // 4
    # (line // (8 / C)) % C written through line % 8, so that the passes fold a row offset that is a multiple
    # of 8 away ((x + 8 c) % 8 -> x % 8): for most staging stores the rotation is then a per-thread constant
    return ((k // 4 + (line % 8) // (8 // C)) % C) * 4 + k % 4


def pair_row(row):
    """Shared row of A's row `row` in the interleaved layout (TileConfig.swizzle=2): rows g and g + 8 of a
    16-row MMA tile share one row of 2 BK words."""
    return (row // 16) * 8 + row % 8


def interleaved_col(k, x):
    """Word of A[row, k] in its pair row, x = 0 for row g, 1 for row g + 8: position 2 k + x, so the words a
    lane reads for k = V t .. V t + V - 1 of both rows are 2 V consecutive words in the order of the MMA's
    A fragment registers (a0 a1 a2 a3 = (g, k) (g + 8, k) (g, k + 1) (g + 8, k + 1)): LDS.128 lands each
    step's fragment in place.  Bank conflicts are avoided by the row length (interleaved_row_words), not a
    rotation, so every load address is a per-lane base plus a constant."""
    return 2 * k + x


def interleaved_row_words(BK):
    """Pair-row length: 2 BK words, + 4 for BK 16 so that the pair rows g, g + 1 of a quarter-warp's
    LDS.128 phase start 4 banks apart (conflict-free); BK 8's two pair rows already fill one bank line."""
    return 2 * BK + (4 if BK == 16 else 0)


def lane_columns(g, t, V):
    """(Assigns, col(w)): the swizzled column of k = V t + w in any fragment row g + 8 q, with the rotation
    folded into per-lane constants (f(row) depends only on g there), so the V loads of a row are
    `base + w` and NVVM can make them one vector load.  Equal to swizzled_col (checked in the tests)."""
    if V == 4:
        return [Assign("lcol", ((t + g // 2) % 4) * 4)], lambda w: Var("lcol") + w
    if V == 2:
        return [Assign("lcol", ((t // 2 + g // 4) % 2) * 4 + (t % 2) * 2)], lambda w: Var("lcol") + w
    if V == 8:
        return ([Assign("lcol0", ((t * 2 + g) % 8) * 4), Assign("lcol1", ((t * 2 + 1 + g) % 8) * 4)],
                lambda w: Var(f"lcol{w // 4}") + w % 4)
    raise ValueError(f"swizzled fragments: BK must be 8, 16 or 32, got {4 * V}")


class WarpMma:
    def __init__(self, cfg, dtype, precision="tf32", round_fragments=False):
        """round_fragments: shared tiles hold unrounded operands (asynchronous copies); round each fragment
        element to the MMA's format when it is loaded."""
        if precision != "tf32" and cfg.BK % 16:
            raise ValueError(f"config: precision={precision!r} (m16n8k16 MMAs) needs BK a multiple of 16, got {cfg}")
        self.cfg, self.precision, self.round = cfg, precision, round_fragments
        self.pair = precision != "tf32"  # one m16n8k16 per two 8-deep steps
        self.MT, self.NT = cfg.WM // 16, cfg.WN // 8
        self.warps_n = cfg.BN // cfg.WN
        self.acc = Buffer("acc", (self.MT, self.NT, 4), dtype, "register")
        self.swizzle = bool(cfg.swizzle)
        if self.pair and not self.swizzle:  # both steps' fragments, [.., step, register]
            self.a_frag = Buffer("a_frag", (self.MT, 2, 4), dtype, "register")
            self.b_frag = Buffer("b_frag", (self.NT, 2, 2), dtype, "register")
        elif self.swizzle:  # a lane's words of the whole slice: V = BK / 4 consecutive k per row
            V = cfg.BK // 4
            self.a_frag = Buffer("a_frag", (self.MT, 2, V), dtype, "register")
            self.b_frag = Buffer("b_frag", (self.NT, V), dtype, "register")
        else:
            self.a_frag = Buffer("a_frag", (self.MT, 4), dtype, "register")
            self.b_frag = Buffer("b_frag", (self.NT, 2), dtype, "register")
        self.locals = (self.acc, self.a_frag, self.b_frag)

    def operand(self, value):
        """A fragment element as the MMA uses it (rounded here when the shared tiles are not)."""
        return Call(self.precision, (value,)) if self.round else value

    def coords(self, tid):
        """Warp position in the block tile and the lane's (group, thread-in-group) as scalars."""
        lane = Var("lane")
        return [Assign("lane", tid % 32), Assign("wm", tid // 32 // self.warps_n),
                Assign("wn", tid // 32 % self.warps_n), Assign("lg", lane // 4), Assign("lt", lane % 4)]

    def zero(self):
        return [self.acc.store((i, j, r), Const(0.0))
                for i in range(self.MT) for j in range(self.NT) for r in range(4)]

    def compute(self, tid, NT_threads, As, Bs, stage):
        """Thread phases computing acc += As[stage] x Bs[stage] (one BK slice)."""
        if self.swizzle:
            return self.compute_swizzled(tid, NT_threads, As, Bs, stage)
        if self.pair:
            return self.compute_pairs(tid, NT_threads, As, Bs, stage)
        cfg, MT, NT = self.cfg, self.MT, self.NT
        wm, wn, g, t, ks, i, j = (Var(n) for n in ("wm", "wn", "lg", "lt", "ks", "mt", "nt"))
        k0 = ks * 8 + t
        row0, col0 = wm * cfg.WM + i * 16 + g, wn * cfg.WN + j * 8 + g
        loads = [For("mt", MT, tuple(self.a_frag.store((i, r), As[stage, k0 + 4 * (r // 2), row0 + 8 * (r % 2)])
                                     for r in range(4)), "unroll"),
                 For("nt", NT, tuple(self.b_frag.store((j, r), Bs[stage, k0 + 4 * r, col0]) for r in range(2)),
                     "unroll")]
        mma = Mma(tuple(self.acc[i, j, r] for r in range(4)), tuple(self.a_frag[i, r] for r in range(4)),
                  tuple(self.b_frag[j, r] for r in range(2)))
        steps = (For("tid", NT_threads, tuple(self.coords(tid) + loads), "thread"),
                 For("tid", NT_threads, (For("mt", MT, (For("nt", NT, (mma,), "unroll"),), "unroll"),), "thread"))
        return [For("ks", cfg.BK // 8, steps, "unroll")]

    def compute_pairs(self, tid, NT_threads, As, Bs, stage):
        """The k-major layout for fp16 / bf16: per 16-deep step ks, the TF32 fragments of its 8-deep steps
        2 ks + s (s = 0, 1), then one m16n8k16 per MMA tile."""
        cfg, MT, NT = self.cfg, self.MT, self.NT
        wm, wn, g, t, ks, i, j = (Var(n) for n in ("wm", "wn", "lg", "lt", "ks", "mt", "nt"))
        row0, col0 = wm * cfg.WM + i * 16 + g, wn * cfg.WN + j * 8 + g
        k0 = lambda s: ks * 16 + s * 8 + t
        loads = [For("mt", MT, tuple(self.a_frag.store((i, s, r), As[stage, k0(s) + 4 * (r // 2), row0 + 8 * (r % 2)])
                                     for s in range(2) for r in range(4)), "unroll"),
                 For("nt", NT, tuple(self.b_frag.store((j, s, r), Bs[stage, k0(s) + 4 * r, col0])
                                     for s in range(2) for r in range(2)), "unroll")]
        mma = Mma(tuple(self.acc[i, j, r] for r in range(4)),
                  tuple(self.a_frag[i, s, r] for s in range(2) for r in range(4)),
                  tuple(self.b_frag[j, s, r] for s in range(2) for r in range(2)), "m16n8k16", self.precision)
        steps = (For("tid", NT_threads, tuple(self.coords(tid) + loads), "thread"),
                 For("tid", NT_threads, (For("mt", MT, (For("nt", NT, (mma,), "unroll"),), "unroll"),), "thread"))
        return [For("ks", cfg.BK // 16, steps, "unroll")]

    def compute_swizzled(self, tid, NT_threads, As, Bs, stage):
        """The swizzled layout: As[stage][m][k], Bs[stage][n][k].  k is a reduction index, so the MMA's k
        slots may stand for any k as long as A and B agree: slot (t, h) of k-step ks (A register 2h + x,
        B register h) is k = V t + 2 ks + h, V = BK / 4.  A lane's k for the whole slice are then the V
        consecutive k = V t .. V t + V - 1 of each of its rows (A rows g, g + 8 of each m-tile, B row g of
        each n-tile): one 64/128-bit load per row (BK 8/16; two 128-bit for BK 32), instead of one scalar
        load per fragment register.  The rotation of the row's chunks is a per-lane constant here (rows
        g + multiples of 8), so every load is `row base + lane constant + j`."""
        cfg, MT, NT, V = self.cfg, self.MT, self.NT, self.cfg.BK // 4
        wm, wn, g, t, i, j = (Var(n) for n in ("wm", "wn", "lg", "lt", "mt", "nt"))
        ks = Var("ks")
        setup, col = lane_columns(g, t, V)
        loads = []
        if cfg.swizzle == 2:  # interleaved A: the lane's 2 V words of pair row prow start at interleaved_col(V t, 0)
            setup = setup + [Assign("acol", interleaved_col(V * t, 0))]
            for i_ in range(MT):
                prow = (wm * (cfg.WM // 16) + i_) * 8 + g  # pair_row of rows g, g + 8 of m-tile i_
                loads += [self.a_frag.store((i_, x, w), self.operand(As[stage, prow, Var("acol") + interleaved_col(w, x)]))
                          for w in range(V) for x in range(2)]
        else:
            for i_ in range(MT):
                for x in range(2):
                    row = wm * cfg.WM + (i_ * 16 + 8 * x) + g
                    loads += [self.a_frag.store((i_, x, w), self.operand(As[stage, row, col(w)])) for w in range(V)]
        for j_ in range(NT):
            line = wn * cfg.WN + j_ * 8 + g
            loads += [self.b_frag.store((j_, w), self.operand(Bs[stage, line, col(w)])) for w in range(V)]
        if self.pair:  # 16-bit: one MMA per two steps, 2 ks and 2 ks + 1
            mma = Mma(tuple(self.acc[i, j, r] for r in range(4)),
                      tuple(self.a_frag[i, r % 2, ks * 4 + s * 2 + r // 2] for s in range(2) for r in range(4)),
                      tuple(self.b_frag[j, ks * 4 + s * 2 + r] for s in range(2) for r in range(2)),
                      "m16n8k16", self.precision)
        else:
            mma = Mma(tuple(self.acc[i, j, r] for r in range(4)),
                      tuple(self.a_frag[i, r % 2, ks * 2 + r // 2] for r in range(4)),
                      tuple(self.b_frag[j, ks * 2 + r] for r in range(2)))
        steps = cfg.BK // (16 if self.pair else 8)
        return [For("tid", NT_threads, tuple(self.coords(tid) + setup + loads), "thread"),
                For("tid", NT_threads, (For("ks", steps, (For("mt", MT, (For("nt", NT, (mma,), "unroll"),),
                                                                       "unroll"),), "unroll"),), "thread")]

    def epilogue(self, tid, view, m0, n0, g_, split):
        """Guarded stores of the accumulators through the view: acc[i, j, r] is D[g + 8 (r // 2), 2 t + r % 2]
        of MMA tile (i, j)."""
        cfg = self.cfg
        wm, wn, g, t = Var("wm"), Var("wn"), Var("lg"), Var("lt")
        out = self.coords(tid)
        for i in range(self.MT):
            for j in range(self.NT):
                for r in range(4):
                    m = m0 + wm * cfg.WM + (i * 16 + 8 * (r // 2)) + g
                    n = n0 + wn * cfg.WN + (j * 8 + r % 2) + t * 2
                    guard = all_of(([m < view.M] if view.M % cfg.BM else []) + ([n < view.N] if view.N % cfg.BN else []))
                    out.append(If(guard, tuple(view.store(m, n, g_, self.acc[i, j, r], split))))
        return out
