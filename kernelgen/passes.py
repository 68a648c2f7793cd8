"""Rewrite passes: small pure functions Kernel -> Kernel.

The pipeline a target runs is `lower(kernel, target)` at the bottom.  Each pass keeps the IR's
meaning; the renderers only print what the passes leave.

Every pass walks the IR iteratively (ir_walk.rewrite_stmts and map_expr: explicit stacks, no Python
recursion), so no expression depth or statement nesting needs a raised recursion limit, and memoises
per node object, so a pass costs time linear in the size of the IR.  Common-subexpression elimination, the
pipeline's last pass, lives in kernelgen.cse (imported here, so passes.eliminate_common_subexpressions still works).
"""
from __future__ import annotations

import operator
from dataclasses import replace

from . import compile_profile
from .cse import assignment_counts, eliminate_common_subexpressions
from .ir import (AsyncCopy, Assign, BinOp, Call, Const, Expr, For, If, Kernel, Load, Pipeline, Select, Store,
                 TensorCopy, Var, WarpgroupMma)
from .ir_walk import (Descend, bodies, expr_children, map_expr, map_stmt_exprs, rewrite_stmts, stmt_exprs,
                      walk_stmts, with_bodies)


_FOLD = {"+": operator.add, "-": operator.sub, "*": operator.mul, "//": operator.floordiv,
         "%": operator.mod, "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
         "==": operator.eq, "!=": operator.ne, "and": lambda a, b: a and b, "or": lambda a, b: a or b}


def _is(e, value):
    return isinstance(e, Const) and not isinstance(e.value, bool) and e.value == value


def _simplify(e):
    """One local algebraic rewrite (applied bottom-up by fold_expr)."""
    if isinstance(e, BinOp):
        a, b, op = e.a, e.b, e.op
        if isinstance(a, Const) and isinstance(b, Const):
            if op in ("//", "%") and b.value == 0:
                return e
            return Const(_FOLD[op](a.value, b.value))
        if op == "+":
            if _is(a, 0):
                return b
            if _is(b, 0):
                return a
            # (x + c1) + c2 -> x + (c1 + c2): keeps unrolled index math to one add
            if isinstance(b, Const) and isinstance(a, BinOp) and a.op == "+" and isinstance(a.b, Const):
                return _simplify(BinOp("+", a.a, Const(a.b.value + b.value)))
        if op == "-" and _is(b, 0):
            return a
        if op == "-" and isinstance(b, Const) and not isinstance(b.value, bool):
            return _simplify(BinOp("+", a, Const(-b.value)))
        if op == "*":
            if _is(a, 0) or _is(b, 0):
                if isinstance(a, Const) and isinstance(a.value, int) or isinstance(b, Const) and isinstance(b.value, int):
                    return Const(0)
            if _is(a, 1):
                return b
            if _is(b, 1):
                return a
        if op == "//" and _is(b, 1):
            return a
        # (x + c) // m and (x + c) % m with m | c: exact for floor division, any sign of x
        if op in ("//", "%") and isinstance(b, Const) and isinstance(b.value, int) and b.value > 0 \
                and isinstance(a, BinOp) and a.op == "+" and isinstance(a.b, Const) and isinstance(a.b.value, int) \
                and a.b.value % b.value == 0:
            if op == "%":
                return _simplify(BinOp("%", a.a, b))
            return _simplify(BinOp("+", _simplify(BinOp("//", a.a, b)), Const(a.b.value // b.value)))
        if op == "%" and _is(b, 1):
            return Const(0)
        if op == "and":
            if isinstance(a, Const):
                return b if a.value else Const(False)
            if isinstance(b, Const):
                return a if b.value else Const(False)
        if op == "or":
            if isinstance(a, Const):
                return Const(True) if a.value else b
            if isinstance(b, Const):
                return Const(True) if b.value else a
    if isinstance(e, Call) and all(isinstance(a, Const) for a in e.args) and e.fn in ("min", "max"):
        return Const((min if e.fn == "min" else max)(*(a.value for a in e.args)))
    if isinstance(e, Select) and isinstance(e.cond, Const):
        return e.a if e.cond.value else e.b
    return e


def fold_expr(e, memo=None):
    """e constant-folded and simplified bottom-up (_simplify at every node); `memo` as map_expr's."""
    return map_expr(e, _simplify, memo)


def _fold_stmts(stmts, memo=None):
    memo = {} if memo is None else memo
    fold = lambda e: map_expr(e, _simplify, memo)

    def enter(s):
        if isinstance(s, Pipeline):
            return Descend(bodies(s), lambda new: (with_bodies(s, new),))
        if isinstance(s, For):
            ext = fold(s.extent) if isinstance(s.extent, Expr) else s.extent
            if isinstance(ext, Const):
                ext = ext.value
            if ext == 0:
                return ()
            return Descend((s.body,), lambda new: (replace(s, extent=ext, body=new[0]),))
        if isinstance(s, If):
            cond = fold(s.cond)
            if isinstance(cond, Const):
                return Descend((s.body if cond.value else s.orelse,), lambda new: new[0])
            return Descend((s.body, s.orelse), lambda new: (If(cond, new[0], new[1]),))
        return (map_stmt_exprs(s, fold),)
    return rewrite_stmts(stmts, enter)


def fold_constants(kernel: Kernel, memo=None) -> Kernel:
    """Constant-fold and simplify every expression; drop dead branches and empty loops.  memo: fold_expr's,
    shared by the foldings of one lowering."""
    return replace(kernel, body=_fold_stmts(kernel.body, memo))


def substitute(stmts, name, value):
    """Replace Var(name) by an expression everywhere in a statement list."""
    memo = {}
    fn = lambda n: value if isinstance(n, Var) and n.name == name else n
    sub = lambda e: map_expr(e, fn, memo)
    return tuple(map_stmt_exprs(s, sub) for s in stmts)


def _unroll_stmts(stmts, fold_memo=None):
    fold_memo = {} if fold_memo is None else fold_memo

    def enter(s):
        if isinstance(s, For):
            def finish(new):
                body = new[0]
                if s.binding == "unroll" and isinstance(s.extent, int) and isinstance(s.start, int):
                    out = []
                    for i in range(s.start, s.start + s.extent):
                        out.extend(_fold_stmts(substitute(body, s.var, Const(i)), fold_memo))
                    return out
                return (replace(s, body=body),)
            return Descend((s.body,), finish)
        if isinstance(s, (If, Pipeline)):
            return Descend(bodies(s), lambda new: (with_bodies(s, new),))
        return (s,)
    return rewrite_stmts(stmts, enter)


def unroll(kernel: Kernel, memo=None) -> Kernel:
    """Expand every `unroll` loop with constant bounds into straight-line code (memo: as fold_constants')."""
    return replace(kernel, body=_unroll_stmts(kernel.body, memo))


def demote_unroll(kernel: Kernel) -> Kernel:
    """Turn `unroll` loops into serial ones (CPU: smaller code, faster compile, LLVM unrolls anyway)."""
    def enter(s):
        if isinstance(s, For):
            binding = "serial" if s.binding == "unroll" else s.binding
            return Descend((s.body,), lambda new: (replace(s, body=new[0], binding=binding),))
        lists = bodies(s)
        return Descend(lists, lambda new: (with_bodies(s, new),)) if lists else (s,)
    return replace(kernel, body=rewrite_stmts(kernel.body, enter))


def _strides(shape):
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def _remapping(remap, leaf):
    """A rewrite_stmts `enter` that maps every expression through `remap`, descending into loops and branches
    (their conditions remapped), and hands each other statement, remapped, to `leaf` -> its replacements."""
    def enter(s):
        if isinstance(s, (For, Pipeline)):
            return Descend(bodies(s), lambda new: (with_bodies(s, new),))
        if isinstance(s, If):
            cond = remap(s.cond)
            return Descend((s.body, s.orelse), lambda new: (If(cond, new[0], new[1]),))
        return leaf(map_stmt_exprs(s, remap))
    return enter


def flatten_buffers(kernel: Kernel, scopes=("global", "shared"), memo=None) -> Kernel:
    """Multi-dim indices -> one linear index with constant row-major strides (1D arrays are
    cheaper to index in numba than N-D ones: no per-dim bounds/stride bookkeeping).  memo: as fold_constants'."""
    bufs = {b.name: b for b in kernel.params + kernel.locals if b.scope in scopes}
    fold_memo, remap_memo = {} if memo is None else memo, {}

    def linear(name, index):
        lin = Const(0)
        for i, st in zip(index, _strides(bufs[name].shape)):
            lin = lin + i * Const(st)
        return (map_expr(lin, _simplify, fold_memo),)

    def rewrite(e):
        if isinstance(e, Load) and e.buf in bufs and len(e.index) != 1:
            return Load(e.buf, linear(e.buf, e.index))
        return e
    remap = lambda e: map_expr(e, rewrite, remap_memo)

    def leaf(s):
        if isinstance(s, Store) and s.buf in bufs and len(s.index) != 1:
            s = replace(s, index=linear(s.buf, s.index))
        if isinstance(s, AsyncCopy):
            s = replace(s, dst_index=linear(s.dst, s.dst_index) if len(s.dst_index) != 1 else s.dst_index,
                        src_index=linear(s.src, s.src_index) if len(s.src_index) != 1 else s.src_index)
        if isinstance(s, WarpgroupMma):
            s = replace(s, a_index=linear(s.a, s.a_index) if len(s.a_index) != 1 else s.a_index,
                        b_index=linear(s.b, s.b_index) if len(s.b_index) != 1 else s.b_index)
        if isinstance(s, TensorCopy) and len(s.dst_index) != 1:
            s = replace(s, dst_index=linear(s.dst, s.dst_index))
        return (s,)

    flat = lambda b: replace(b, shape=(b.size,)) if b.name in bufs else b
    return replace(kernel, params=tuple(map(flat, kernel.params)), locals=tuple(map(flat, kernel.locals)),
                   body=rewrite_stmts(kernel.body, _remapping(remap, leaf)),
                   meta={**kernel.meta, "logical_shapes": {n: b.shape for n, b in bufs.items()}})


def scalarize_registers(kernel: Kernel) -> Kernel:
    """Register buffers indexed only by constants become named scalars, so NVVM keeps them in
    registers instead of a local-memory array (the single most important CUDA lowering step)."""
    regs = {b.name for b in kernel.locals if b.scope == "register"}
    dynamic = set()
    seen = set()  # ids of the expression nodes scanned (the kernel keeps them alive)
    for s in walk_stmts(kernel.body):
        stack = stmt_exprs(s)
        while stack:
            e = stack.pop()
            if id(e) in seen:
                continue
            seen.add(id(e))
            if isinstance(e, Load) and e.buf in regs and not all(isinstance(i, Const) for i in e.index):
                dynamic.add(e.buf)
            stack.extend(expr_children(e))
        if isinstance(s, Store) and s.buf in regs and not all(isinstance(i, Const) for i in s.index):
            dynamic.add(s.buf)
    scalar = regs - dynamic
    name = lambda buf, index: "_".join([buf] + [str(i.value) for i in index])
    memo = {}

    def rewrite(e):
        if isinstance(e, Load) and e.buf in scalar:
            return Var(name(e.buf, e.index))
        return e
    remap = lambda e: map_expr(e, rewrite, memo)

    def leaf(s):
        if isinstance(s, Store) and s.buf in scalar:
            v = name(s.buf, s.index)
            s = Assign(v, Var(v) + s.value if s.accumulate else s.value)
        return (s,)

    return replace(kernel, body=rewrite_stmts(kernel.body, _remapping(remap, leaf)),
                   locals=tuple(b for b in kernel.locals if b.name not in scalar),
                   meta={**kernel.meta, "scalarized_registers": sorted(scalar)})


def lower(kernel: Kernel, target: str) -> Kernel:
    """The pass pipeline for a target ('cuda' or 'cpu'), each pass a stage of kernelgen.profile_compile."""
    memo = {}  # fold_expr's results, by node: shared by every folding below
    k = _pass(fold_constants, kernel, memo)
    if target == "cuda":
        k = _pass(scalarize_registers, _pass(fold_constants, _pass(unroll, k, memo), memo))
    else:
        k = _pass(demote_unroll, k)
    k = _pass(fold_constants, _pass(flatten_buffers, k, memo=memo), memo)
    return _pass(eliminate_common_subexpressions, _pass(propagate_constants, k, memo))


def _pass(fn, *args, **kwargs):
    with compile_profile.stage("pass:" + fn.__name__):
        return fn(*args, **kwargs)


def propagate_constants(kernel: Kernel, memo=None) -> Kernel:
    """Scalars bound exactly once, to a constant, are replaced by it (e.g. the unit dims' offsets of a
    2D problem seen as 3D), and their assignments dropped (then folded; memo: as fold_constants')."""
    counts = assignment_counts(kernel.body)
    consts = {}
    for st in walk_stmts(kernel.body):
        if isinstance(st, Assign) and counts.get(st.var) == 1 and isinstance(st.value, Const):
            consts[st.var] = st.value
    if not consts:
        return kernel
    sub_memo = {}
    fn = lambda n: consts.get(n.name, n) if isinstance(n, Var) else n
    sub = lambda e: map_expr(e, fn, sub_memo)

    def enter(st):
        if isinstance(st, Assign) and st.var in consts:
            return ()
        if isinstance(st, For):
            head = map_stmt_exprs(replace(st, body=()), sub)
            return Descend((st.body,), lambda new: (replace(head, body=new[0]),))
        if isinstance(st, If):
            cond = sub(st.cond)
            return Descend((st.body, st.orelse), lambda new: (If(cond, new[0], new[1]),))
        if isinstance(st, Pipeline):
            return Descend(bodies(st), lambda new: (with_bodies(st, new),))
        return (map_stmt_exprs(st, sub),)

    return fold_constants(replace(kernel, body=rewrite_stmts(kernel.body, enter)), memo)
