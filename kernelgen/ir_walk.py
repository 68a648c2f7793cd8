"""Generic traversal of the IR (kernelgen.ir), used by the passes and the renderers: rebuild expressions and
statements bottom-up, walk statement trees, collect the variables and loads of an expression."""
from __future__ import annotations

from dataclasses import replace

from .ir import (AsyncCopy, Assign, BinOp, Call, Expr, For, If, Load, MbarrierExpect, MbarrierInit, MbarrierWait,
                 Mma, Pipeline, Select, Store, TensorCopy, Var, VectorLoad, WarpgroupMma, WarpgroupWait)


def bodies(s):
    """The statement lists nested in s: a loop's body, a branch's two arms, a pipeline's sides and finish."""
    if isinstance(s, For):
        return (s.body,)
    if isinstance(s, If):
        return (s.body, s.orelse)
    if isinstance(s, Pipeline):
        return (s.produce, s.consume, s.finish)
    return ()


def map_bodies(s, fn):
    """s with each nested statement list replaced by fn(list) (s itself if it nests none)."""
    if isinstance(s, For):
        return replace(s, body=fn(s.body))
    if isinstance(s, If):
        return replace(s, body=fn(s.body), orelse=fn(s.orelse))
    if isinstance(s, Pipeline):
        return replace(s, produce=fn(s.produce), consume=fn(s.consume), finish=fn(s.finish))
    return s


def map_expr(e, fn):
    """Rebuild expression bottom-up, applying fn to every node after its children."""
    if isinstance(e, BinOp):
        e = BinOp(e.op, map_expr(e.a, fn), map_expr(e.b, fn))
    elif isinstance(e, Call):
        e = Call(e.fn, tuple(map_expr(a, fn) for a in e.args))
    elif isinstance(e, Select):
        e = Select(map_expr(e.cond, fn), map_expr(e.a, fn), map_expr(e.b, fn))
    elif isinstance(e, Load):
        e = Load(e.buf, tuple(map_expr(i, fn) for i in e.index))
    return fn(e)


def map_stmt_exprs(s, fn):
    """Apply an expression rewrite to every expression in a statement tree."""
    if isinstance(s, Assign):
        return Assign(s.var, fn(s.value))
    if isinstance(s, Store):
        return Store(s.buf, tuple(fn(i) for i in s.index), fn(s.value), s.accumulate,
                     None if s.pair is None else fn(s.pair))
    if isinstance(s, For):
        ext = fn(s.extent) if isinstance(s.extent, Expr) else s.extent
        start = fn(s.start) if isinstance(s.start, Expr) else s.start
        return For(s.var, ext, tuple(map_stmt_exprs(b, fn) for b in s.body), s.binding, s.axis, start)
    if isinstance(s, If):
        return If(fn(s.cond), tuple(map_stmt_exprs(b, fn) for b in s.body),
                  tuple(map_stmt_exprs(b, fn) for b in s.orelse))
    if isinstance(s, Mma):
        return Mma(tuple(map(fn, s.acc)), tuple(map(fn, s.a)), tuple(map(fn, s.b)), s.shape, s.dtype)
    if isinstance(s, VectorLoad):
        return VectorLoad(tuple(map(fn, s.dst)), s.buf, fn(s.index), fn(s.cond))
    if isinstance(s, AsyncCopy):
        return AsyncCopy(s.dst, tuple(map(fn, s.dst_index)), s.src, tuple(map(fn, s.src_index)), fn(s.cond), s.width)
    if isinstance(s, WarpgroupMma):
        return replace(s, acc=tuple(map(fn, s.acc)), a_index=tuple(map(fn, s.a_index)),
                       b_index=tuple(map(fn, s.b_index)))
    if isinstance(s, WarpgroupWait):
        return WarpgroupWait(s.pending, tuple(map(fn, s.acc)))
    if isinstance(s, TensorCopy):
        return TensorCopy(s.dst, tuple(map(fn, s.dst_index)), s.tmap, tuple(map(fn, s.coords)),
                          tuple(map(fn, s.offsets)), s.bar, fn(s.bar_index))
    if isinstance(s, (MbarrierInit, MbarrierExpect)):
        return type(s)(s.bar, fn(s.index), s.count if isinstance(s, MbarrierInit) else s.nbytes)
    if isinstance(s, MbarrierWait):
        return MbarrierWait(s.bar, fn(s.index), fn(s.parity))
    if isinstance(s, Pipeline):
        s = replace(s, count=s.count if isinstance(s.count, int) else fn(s.count))
        return map_bodies(s, lambda body: tuple(map_stmt_exprs(b, fn) for b in body))
    return s


def walk_stmts(stmts):
    """Every statement in `stmts`, loop and branch bodies included (pre-order)."""
    for s in stmts:
        yield s
        for body in bodies(s):
            yield from walk_stmts(body)


def expr_vars(e, out=None):
    out = set() if out is None else out
    if isinstance(e, Var):
        out.add(e.name)
    elif isinstance(e, BinOp):
        expr_vars(e.a, out), expr_vars(e.b, out)
    elif isinstance(e, Call):
        for a in e.args:
            expr_vars(a, out)
    elif isinstance(e, Select):
        expr_vars(e.cond, out), expr_vars(e.a, out), expr_vars(e.b, out)
    elif isinstance(e, Load):
        for i in e.index:
            expr_vars(i, out)
    return out


def expr_loads(e):
    """True if the expression reads any buffer."""
    found = []
    map_expr(e, lambda n: (found.append(n) if isinstance(n, Load) else None) or n)
    return bool(found)
