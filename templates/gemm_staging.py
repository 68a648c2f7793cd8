"""Staging of the tiled-GEMM schedule: how a BK-deep slice of A and B moves from global memory into the shared tiles
(gemm_layout), per thread, for the pipelines that copy with their own threads (TMA copies are tma_schedule's).

* invariants: the per-thread index math of the lines (A rows / B columns) a thread copies, hoisted into registers
  before the k-loop;
* fetch + commit: global -> staging registers -> shared, split in two so a pipeline can issue the loads of the next
  slice before the products of this one and store them after (register double buffer);
* issue: global -> shared without staging registers (cp.async), zeros where an element's predicate fails;
* round_landed: the TF32 rounding of words cp.async landed, for the warpgroup MMAs (which would truncate them).
"""
from __future__ import annotations

from kernelgen.ir import AsyncCopy, Call, Comment, Const, If, VectorLoad, select
from kernelgen.storage import stored_exactly


def invariants(s):
    """Statements of the first thread phase: the view's per-line invariants of each element the thread copies."""
    view, lay = s.view, s.layout
    out = [Comment("per-thread invariants: index math that does not change along k")]
    for e in range(0, s.EA, 4 if lay.vectorized(True) else 1):  # a chunk's 4 elements share a line
        row, _, _ = lay.line_of(e, True)
        vals = view.a.invariant(s.m0 + row, s.g)
        out += [s.inv_a[n].store(e, vals[n]) for n in s.inv_a]
    for e in range(0, s.EB, 4 if lay.vectorized(False) else 1):
        _, col, _ = lay.line_of(e, False)
        vals = view.b.invariant(s.n0 + col, s.g)
        out += [s.inv_b[n].store(e, vals[n]) for n in s.inv_b]
    return out


def _divided(s, is_a):
    """Do the threads divide the elements of A's (B's) slice?  Else each element is guarded by its in_tile."""
    return (s.cfg.BM if is_a else s.cfg.BN) * s.cfg.BK % s.NT == 0


def _guarded(s, st, in_tile, is_a):
    return st if _divided(s, is_a) else If(in_tile, (st,))


def _elements(s, is_a, kt):
    """(e, row, col, in_tile, predicate, source Load) of each element (each 4-element chunk where vectorized) of
    this thread's share of slice kt of A or B; lines past a partial last tile read nothing."""
    cfg, lay = s.cfg, s.layout
    op = lay.operand(is_a)
    E, inv = (s.EA, s.inv_a) if is_a else (s.EB, s.inv_b)
    lines, base, bound = (cfg.BM, s.m0, s.view.M) if is_a else (cfg.BN, s.n0, s.view.N)
    for e in range(0, E, 4 if lay.vectorized(is_a) else 1):
        row, col, in_tile = lay.line_of(e, is_a)
        line, k = (row, col) if is_a else (col, row)
        pred, val = op.element({n: inv[n][e] for n in inv}, kt * cfg.BK + k, kt, k, *([s.ctx] if op.context else []))
        if bound % lines:  # a partial last tile: lines past the end must not be read
            pred = (base + line < bound) & pred
        yield e, row, col, in_tile, pred, val


def fetch(s, kt):
    """Global -> staging registers for slice kt: one VectorLoad per 4-element chunk where the operand allows it,
    else one guarded scalar load per element."""
    out = []
    for is_a in (True, False):
        reg, vec = (s.ra if is_a else s.rb), s.layout.vectorized(is_a)
        for e, _, _, in_tile, pred, val in _elements(s, is_a, kt):
            if vec:
                st = VectorLoad(tuple(reg[e + w] for w in range(4)), val.buf, val.index[0], pred)
            else:
                st = reg.store(e, select(pred, val, Const(0.0)))
            out.append(_guarded(s, st, in_tile, is_a))
    return out


def _staged(s, value):
    """A staged element as the inner product reads it: the tensor cores' operands rounded to TF32 / fp16 / bf16
    here, once per element, not once per fragment use; float16 / bfloat16 storage staged as fp16 / bf16 operands is
    already exact (two conversions saved per element)."""
    rounds = s.cfg.tensor_core and not stored_exactly(s.view.dtype, s.precision)
    return Call(s.precision, (value,)) if rounds else value


def commit(s, stage):
    """Staging registers -> shared stage `stage`."""
    out = []
    for is_a, E, reg, buf in ((True, s.EA, s.ra, s.As), (False, s.EB, s.rb, s.Bs)):
        for e in range(E):
            row, col, in_tile = s.layout.line_of(e, is_a)
            st = buf.store(s.layout.shared_at(e, row, col, is_a, stage), _staged(s, reg[e]))
            out.append(_guarded(s, st, in_tile, is_a))
    return out


def issue(s, kt, stage):
    """Global -> shared for slice kt without staging registers (async_copy): one 16-byte AsyncCopy per 4-element
    chunk of a vectorized operand (its shared chunk is 4 consecutive words), else one 4-byte copy per element;
    zeros where the element's predicate fails."""
    out = []
    for is_a, buf in ((True, s.As), (False, s.Bs)):
        width = 4 if s.layout.vectorized(is_a) else 1
        for e, row, col, in_tile, pred, val in _elements(s, is_a, kt):
            st = AsyncCopy(buf.name, s.layout.shared_at(e, row, col, is_a, stage), val.buf, val.index, pred, width)
            out.append(_guarded(s, st, in_tile, is_a))
    return out


def round_landed(s, stage):
    """TF32-round in place the words this thread's copies put in `stage`: wgmma reads float32 operands by
    truncation (up to 2^-10 relative each, biased toward zero), which measured past the issue's 1e-3 on some
    data; rounded words truncate exactly.  Only the copying thread touches them, before the barrier."""
    out = []
    for is_a, E, buf in ((True, s.EA, s.As), (False, s.EB, s.Bs)):
        width = 4 if s.layout.vectorized(is_a) else 1
        for e in range(0, E, width):
            row, col, in_tile = s.layout.line_of(e, is_a)
            stage_, word = s.layout.shared_at(e, row, col, is_a, stage)
            sts = [buf.store((stage_, word + w), Call("tf32", (buf[stage_, word + w],))) for w in range(width)]
            out += sts if _divided(s, is_a) else [If(in_tile, tuple(sts))]
    return out


def staging_registers(s):
    """The staging registers, where the pipeline has them (copies by cp.async or TMA need none)."""
    return () if s.cfg.async_copy or s.cfg.tma else (s.ra, s.rb)
