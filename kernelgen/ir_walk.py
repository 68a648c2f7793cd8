"""Generic traversal of the IR (kernelgen.ir), used by the passes and the renderers: rebuild expressions and
statements bottom-up, walk statement trees, collect the variables and loads of an expression.

Every walk here is iterative (an explicit stack, never Python recursion), so neither a deep expression nor deeply
nested statements need a raised recursion limit; and an expression walk visits each node object once per call (a
subtree that several parents share is rebuilt once), so it is linear in the size of the IR.
"""
from __future__ import annotations

from dataclasses import replace

from .ir import (AsyncCopy, Assign, BinOp, Call, Const, Expr, For, If, Load, MbarrierExpect, MbarrierInit, MbarrierWait,
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


def with_bodies(s, new):
    """s with its nested statement lists (in bodies(s) order) replaced by `new`."""
    if isinstance(s, For):
        return replace(s, body=new[0])
    if isinstance(s, If):
        return replace(s, body=new[0], orelse=new[1])
    if isinstance(s, Pipeline):
        return replace(s, produce=new[0], consume=new[1], finish=new[2])
    return s


def map_bodies(s, fn):
    """s with each nested statement list replaced by fn(list) (s itself if it nests none)."""
    if isinstance(s, For):
        return replace(s, body=fn(s.body))
    if isinstance(s, If):
        return replace(s, body=fn(s.body), orelse=fn(s.orelse))
    if isinstance(s, Pipeline):
        return replace(s, produce=fn(s.produce), consume=fn(s.consume), finish=fn(s.finish))
    return s


# --- expressions ---------------------------------------------------------------------------------------------------

def expr_children(e):
    """The sub-expressions of e, in the order the printers and map_expr visit them."""
    if isinstance(e, BinOp):
        return (e.a, e.b)
    if isinstance(e, Load):
        return e.index
    if isinstance(e, Call):
        return e.args
    if isinstance(e, Select):
        return (e.cond, e.a, e.b)
    return ()


def with_children(e, kids):
    """e rebuilt over new children (in expr_children order)."""
    if isinstance(e, BinOp):
        return BinOp(e.op, kids[0], kids[1])
    if isinstance(e, Load):
        return Load(e.buf, tuple(kids))
    if isinstance(e, Call):
        return Call(e.fn, tuple(kids))
    if isinstance(e, Select):
        return Select(kids[0], kids[1], kids[2])
    return e


def map_expr(e, fn, memo=None):
    """Rebuild expression bottom-up, applying fn to every node after its children.

    fn must be a function of the node alone: a node object that several parents share is mapped once.  `memo`
    (a dict, id(node) -> (node, result)) shares those results between calls with the same fn, e.g. over every
    expression of a kernel.  A node whose children map to themselves is passed to fn as is (not copied)."""
    memo = {} if memo is None else memo
    hit = memo.get(id(e))
    if hit is not None:
        return hit[1]
    get = memo.get
    stack = [e]
    push, pop = stack.append, stack.pop
    while stack:
        n = stack[-1]
        i = id(n)
        if i in memo:
            pop()
            continue
        t = n.__class__
        if t is BinOp:  # the common case, unrolled
            a, b = n.a, n.b
            ra, rb = get(id(a)), get(id(b))
            if ra is None or rb is None:
                if rb is None:
                    push(b)
                if ra is None:
                    push(a)
                continue
            ra, rb = ra[1], rb[1]
            n2 = n if ra is a and rb is b else BinOp(n.op, ra, rb)
        elif t is Var or t is Const:
            n2 = n
        else:
            kids = expr_children(n)
            if kids:
                todo = [k for k in kids if id(k) not in memo]
                if todo:
                    todo.reverse()  # the leftmost child first, as a recursive walk would
                    stack.extend(todo)
                    continue
                new = [memo[id(k)][1] for k in kids]
                n2 = with_children(n, new) if any(x is not k for x, k in zip(new, kids)) else n
            else:
                n2 = n
        pop()
        memo[i] = (n, fn(n2))
    return memo[id(e)][1]


def stmt_exprs(s):
    """Every expression map_stmt_exprs maps in s itself (not in its nested statements), in a fixed order."""
    if isinstance(s, Assign):
        return [s.value]
    if isinstance(s, Store):
        return list(s.index) + [s.value] + ([] if s.pair is None else [s.pair])
    if isinstance(s, For):
        return [x for x in (s.extent, s.start) if isinstance(x, Expr)]
    if isinstance(s, If):
        return [s.cond]
    if isinstance(s, Mma):
        return list(s.acc) + list(s.a) + list(s.b)
    if isinstance(s, VectorLoad):
        return list(s.dst) + [s.index, s.cond]
    if isinstance(s, AsyncCopy):
        return list(s.dst_index) + list(s.src_index) + [s.cond]
    if isinstance(s, WarpgroupMma):
        return list(s.acc) + list(s.a_index) + list(s.b_index)
    if isinstance(s, WarpgroupWait):
        return list(s.acc)
    if isinstance(s, TensorCopy):
        return list(s.dst_index) + list(s.coords) + list(s.offsets) + [s.bar_index]
    if isinstance(s, (MbarrierInit, MbarrierExpect)):
        return [s.index]
    if isinstance(s, MbarrierWait):
        return [s.index, s.parity]
    if isinstance(s, Pipeline):
        return [] if isinstance(s.count, int) else [s.count]
    return []


def with_stmt_exprs(s, exprs):
    """s with the expressions stmt_exprs(s) lists replaced by `exprs` (same order); nested statements kept."""
    if not exprs:
        return s
    if isinstance(s, Assign):
        return Assign(s.var, exprs[0])
    if isinstance(s, Store):
        n = len(s.index)
        return Store(s.buf, tuple(exprs[:n]), exprs[n], s.accumulate, None if s.pair is None else exprs[n + 1])
    if isinstance(s, For):
        ext = exprs[0] if isinstance(s.extent, Expr) else s.extent
        start = exprs[-1] if isinstance(s.start, Expr) else s.start
        return For(s.var, ext, s.body, s.binding, s.axis, start)
    if isinstance(s, If):
        return If(exprs[0], s.body, s.orelse)
    if isinstance(s, Mma):
        a, b = len(s.acc), len(s.acc) + len(s.a)
        return Mma(tuple(exprs[:a]), tuple(exprs[a:b]), tuple(exprs[b:]), s.shape, s.dtype)
    if isinstance(s, VectorLoad):
        return VectorLoad(tuple(exprs[:-2]), s.buf, exprs[-2], exprs[-1])
    if isinstance(s, AsyncCopy):
        n = len(s.dst_index)
        return AsyncCopy(s.dst, tuple(exprs[:n]), s.src, tuple(exprs[n:-1]), exprs[-1], s.width)
    if isinstance(s, WarpgroupMma):
        a, b = len(s.acc), len(s.acc) + len(s.a_index)
        return replace(s, acc=tuple(exprs[:a]), a_index=tuple(exprs[a:b]), b_index=tuple(exprs[b:]))
    if isinstance(s, WarpgroupWait):
        return WarpgroupWait(s.pending, tuple(exprs))
    if isinstance(s, TensorCopy):
        a, b = len(s.dst_index), len(s.dst_index) + len(s.coords)
        return TensorCopy(s.dst, tuple(exprs[:a]), s.tmap, tuple(exprs[a:b]), tuple(exprs[b:-1]), s.bar, exprs[-1])
    if isinstance(s, (MbarrierInit, MbarrierExpect)):
        return type(s)(s.bar, exprs[0], s.count if isinstance(s, MbarrierInit) else s.nbytes)
    if isinstance(s, MbarrierWait):
        return MbarrierWait(s.bar, exprs[0], exprs[1])
    if isinstance(s, Pipeline):
        return replace(s, count=exprs[0])
    return s


# --- statements ----------------------------------------------------------------------------------------------------

class Descend(tuple):
    """What a rewrite_stmts `enter` returns for a statement whose nested lists must be rewritten first:
    Descend((lists, finish)); finish(rewritten lists) returns the statements that replace it."""

    def __new__(cls, lists, finish):
        return tuple.__new__(cls, (tuple(lists), finish))


_END = object()


def rewrite_stmts(stmts, enter, block=None):
    """Rewrite a statement list bottom-up without recursion.  enter(s) returns the statements replacing s (a list or
    tuple: s's nested lists are not visited), or Descend(lists, finish): each of `lists` is rewritten first (in
    order, depth first, as nested recursive calls would), then finish(rewritten lists) gives s's replacement.
    block(statements) -> tuple, if given, post-processes every rewritten list, `stmts` included."""
    finish_block = tuple if block is None else block
    root = []
    # a frame: [iterator over a list's statements, its output, the owner that waits for it]; an owner:
    # [the lists to rewrite, their results so far, finish, the output list the replacement goes to]
    stack = [[iter(stmts), root, None]]
    while stack:
        frame = stack[-1]
        s = next(frame[0], _END)
        if s is not _END:
            r = enter(s)
            if r.__class__ is not Descend:
                frame[1].extend(r)
                continue
            lists, finish = r
            if not lists:
                frame[1].extend(finish(()))
                continue
            owner = [lists, [], finish, frame[1]]
            stack.append([iter(lists[0]), [], owner])
            continue
        stack.pop()
        done = finish_block(frame[1])
        owner = frame[2]
        if owner is None:
            return done
        owner[1].append(done)
        if len(owner[1]) < len(owner[0]):
            stack.append([iter(owner[0][len(owner[1])]), [], owner])
        else:
            owner[3].extend(owner[2](tuple(owner[1])))
    return tuple(root)


def map_stmt_exprs(s, fn):
    """Apply an expression rewrite to every expression in a statement tree."""
    def enter(st):
        own = stmt_exprs(st)
        new = [fn(e) for e in own] if own else own
        lists = bodies(st)
        if not lists:
            return (with_stmt_exprs(st, new),)
        return Descend(lists, lambda done: (with_bodies(with_stmt_exprs(st, new), done),))
    if not isinstance(s, (For, If, Pipeline)):  # no nested statements: no walk
        own = stmt_exprs(s)
        return with_stmt_exprs(s, [fn(e) for e in own]) if own else s
    return rewrite_stmts((s,), enter)[0]


def walk_stmts(stmts):
    """Every statement in `stmts`, loop and branch bodies included (pre-order)."""
    stack = [iter(stmts)]
    while stack:
        s = next(stack[-1], _END)
        if s is _END:
            stack.pop()
            continue
        yield s
        lists = bodies(s)
        if lists:
            stack.append(iter([st for body in lists for st in body]))


def unrolled_statements(stmts) -> int:
    """How many statements `stmts` hold once the `unroll` pass has expanded every unroll loop of constant bounds
    (counted, not expanded: a measure of the code numba will compile, cheap to take before rendering)."""
    count = 0
    for s in stmts:
        inner = sum(unrolled_statements(body) for body in bodies(s))
        if isinstance(s, For) and s.binding == "unroll" and isinstance(s.extent, int):
            count += max(0, s.extent) * inner  # (the loop itself goes; start only shifts the indices)
        else:
            count += 1 + inner
    return count


def expr_vars(e, out=None):
    """The names of the variables e reads (a set; added to `out` if given)."""
    out = set() if out is None else out
    seen = set()
    stack = [e]
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if isinstance(n, Var):
            out.add(n.name)
        else:
            stack.extend(expr_children(n))
    return out


def expr_loads(e):
    """True if the expression reads any buffer."""
    seen = set()
    stack = [e]
    while stack:
        n = stack.pop()
        if isinstance(n, Load):
            return True
        if id(n) not in seen:
            seen.add(id(n))
            stack.extend(expr_children(n))
    return False
