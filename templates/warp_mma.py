"""The tensor-core inner product of the tiled-GEMM schedule: warps of m16n8k8 TF32 MMAs.

tiled_gemm stages each BK-deep slice of A and B in shared memory (k-major, values already rounded
to TF32 there, once per element).  Here the block tile is split among warps: warp (wm, wn) owns the
WM x WN sub-tile at (wm * WM, wn * WN), i.e. MT x NT = (WM / 16) x (WN / 8) MMA tiles, and keeps
their accumulators in registers, 4 per MMA tile per lane.  Per 8-deep step of the slice a lane loads
its A fragments (4 per m-tile) and B fragments (2 per n-tile) from shared memory in the PTX layout
(kernelgen/mma_layout.py) and issues MT x NT MMAs; every A fragment is reused NT times, every B
fragment MT times.  Fragment loads and MMAs are separate thread phases (no barrier between them:
warps never read each other's registers) so the CPU, which runs the lanes of a warp one after
another, sees every lane's fragments before any lane's MMA.
"""
from __future__ import annotations

from ..ir import Assign, Buffer, Const, For, If, Mma, Var, all_of


class WarpMma:
    def __init__(self, cfg, dtype):
        self.cfg = cfg
        self.MT, self.NT = cfg.WM // 16, cfg.WN // 8
        self.warps_n = cfg.BN // cfg.WN
        self.acc = Buffer("acc", (self.MT, self.NT, 4), dtype, "register")
        self.a_frag = Buffer("a_frag", (self.MT, 4), dtype, "register")
        self.b_frag = Buffer("b_frag", (self.NT, 2), dtype, "register")
        self.locals = (self.acc, self.a_frag, self.b_frag)

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

    def epilogue(self, tid, view, m0, n0, g_, atomic):
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
                    out.append(If(guard, tuple(view.store(m, n, g_, self.acc[i, j, r], atomic))))
        return out
