"""Rewrite passes: small pure functions Kernel -> Kernel.

The pipeline a target runs is `lower(kernel, target)` at the bottom.  Each pass keeps the IR's
meaning; the renderers only print what the passes leave.

Every pass walks the IR iteratively (ir_walk.rewrite_stmts and map_expr: explicit stacks, no Python
recursion), so no expression depth or statement nesting needs a raised recursion limit, and memoises
per node object, so a pass costs time linear in the size of the IR.  Common-subexpression elimination
hash-conses expressions into classes and updates its counts incrementally (see _cse_block).
"""
from __future__ import annotations

import heapq
import operator
from dataclasses import replace

from fractions import Fraction

from .ir import (AsyncCopy, Assign, BinOp, Call, Const, Expr, For, If, Kernel, Load, Mma, Pipeline, Select, Store,
                 TensorCopy, Var, VectorLoad, WarpgroupMma, WarpgroupWait)
from .ir_walk import (Descend, bodies, expr_children, map_expr, map_stmt_exprs, rewrite_stmts, stmt_exprs,
                      walk_stmts, with_bodies, with_children, with_stmt_exprs)

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

    def enter(s):
        if isinstance(s, (For, Pipeline)):
            return Descend(bodies(s), lambda new: (with_bodies(s, new),))
        if isinstance(s, If):
            cond = remap(s.cond)
            return Descend((s.body, s.orelse), lambda new: (If(cond, new[0], new[1]),))
        s = map_stmt_exprs(s, remap)
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
                   body=rewrite_stmts(kernel.body, enter),
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

    def enter(s):
        if isinstance(s, (For, Pipeline)):
            return Descend(bodies(s), lambda new: (with_bodies(s, new),))
        if isinstance(s, If):
            cond = remap(s.cond)
            return Descend((s.body, s.orelse), lambda new: (If(cond, new[0], new[1]),))
        s = map_stmt_exprs(s, remap)
        if isinstance(s, Store) and s.buf in scalar:
            v = name(s.buf, s.index)
            s = Assign(v, Var(v) + s.value if s.accumulate else s.value)
        return (s,)

    return replace(kernel, body=rewrite_stmts(kernel.body, enter),
                   locals=tuple(b for b in kernel.locals if b.name not in scalar),
                   meta={**kernel.meta, "scalarized_registers": sorted(scalar)})


def lower(kernel: Kernel, target: str) -> Kernel:
    """The pass pipeline for a target ('cuda' or 'cpu')."""
    memo = {}  # fold_expr's results, by node: shared by every folding below
    k = fold_constants(kernel, memo)
    if target == "cuda":
        k = scalarize_registers(fold_constants(unroll(k, memo), memo))
    else:
        k = demote_unroll(k)
    k = fold_constants(flatten_buffers(k, memo=memo), memo)
    return eliminate_common_subexpressions(propagate_constants(k, memo))


def _assigned(stmts, out=None):
    """Names (re)bound anywhere in a statement list: Assign targets and loop variables (a loop's count 2)."""
    out = {} if out is None else out
    for s in walk_stmts(stmts):
        if isinstance(s, Assign):
            out[s.var] = out.get(s.var, 0) + 1
        elif isinstance(s, For):
            out[s.var] = out.get(s.var, 0) + 2
        elif isinstance(s, Pipeline):  # its loop variable and stage index, like a loop's
            for v in (s.var, s.stage):
                out[v] = out.get(v, 0) + 2
        elif isinstance(s, (Mma, VectorLoad, WarpgroupMma, WarpgroupWait)):  # rebind accumulator / destination scalars
            for e in (s.dst if isinstance(s, VectorLoad) else s.acc):
                if isinstance(e, Var):
                    out[e.name] = out.get(e.name, 0) + 1
    return out


def propagate_constants(kernel: Kernel, memo=None) -> Kernel:
    """Scalars bound exactly once, to a constant, are replaced by it (e.g. the unit dims' offsets of a
    2D problem seen as 3D), and their assignments dropped (then folded; memo: as fold_constants')."""
    counts = _assigned(kernel.body)
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


# --- common subexpression elimination ---------------------------------------------------------------
#
# What the pass does (the rule that fixes its output): in every statement list, innermost lists first, repeatedly
# name the largest (_size) pure subexpression that the list's statements and the statements one level down
# evaluate at least twice (ties: the first met, walking the statements in order and each expression node first),
# whose variables are bound once, before the list, or by an assignment of the list itself; the name's assignment
# goes right before the first statement that mentions the expression at any depth, and the expression is replaced
# by the name everywhere in the list, at any depth.  A candidate whose variables are assigned at or after that
# statement ends the list's naming.
#
# How (linear time): expressions are hash-consed into classes (_Classes: structurally equal expressions, as
# dataclass equality sees them, share a class), counted once per list, and a list with a candidate gets a mutable
# tree of occurrence records (_Rec) over every expression it holds; naming a class replaces its records, drops the
# counts of their subtrees and re-classes their ancestors, so each step costs what it removes, not a recount.

_BIN, _CALL, _SEL, _LOAD, _VAR, _CONST = range(6)


def _kind(e):
    if isinstance(e, BinOp):
        return _BIN, e.op
    if isinstance(e, Load):
        return _LOAD, e.buf
    if isinstance(e, Var):
        return _VAR, e.name
    if isinstance(e, Const):
        return _CONST, e.value
    if isinstance(e, Call):
        return _CALL, e.fn
    if isinstance(e, Select):
        return _SEL, None
    raise TypeError(f"not an IR expression: {e!r}")


def _stmt_exprs(s):
    """The expressions a statement evaluates itself (not those of nested bodies)."""
    return [e for e, counted in zip(stmt_exprs(s), _counted(s)) if counted]


def _counted(s):
    """Which of stmt_exprs(s) the CSE counts: not the operands a statement writes (accumulators, destinations), not
    a pipeline's length."""
    n = len(stmt_exprs(s))
    if isinstance(s, (Mma, WarpgroupWait, Pipeline)):
        return [False] * n
    if isinstance(s, VectorLoad):
        return [False] * len(s.dst) + [True, True]
    if isinstance(s, WarpgroupMma):
        return [False] * len(s.acc) + [True] * (n - len(s.acc))
    return [True] * n


class _Classes:
    """Hash-consed expressions: structurally equal expressions share one class id (keyed by kind, attribute and the
    children's classes; constants by value, as the dataclasses compare).  Per class: its key, _size, whether it reads
    a buffer the kernel writes, whether the CSE may name it (countable) or something under it (dense)."""

    def __init__(self, written):
        self.written = written
        self.index = {}  # key -> class
        self.memo = {}  # id(node) -> (node, class): the node kept alive, so that its id stays its own
        self.key, self.size, self.countable, self.dense = [], [], [], []
        self._rw = []

    def intern(self, kind, attr, kids):
        key = (kind, attr, kids)
        c = self.index.get(key)
        if c is None:
            c = self.index[key] = len(self.key)
            size, rw = self.size, self._rw
            if kind == _LOAD:
                s, r = 1, attr in self.written or any(rw[k] for k in kids)
            elif kind >= _VAR:
                s, r = 0, False
            else:
                s, r = 1 + sum(size[k] for k in kids), any(rw[k] for k in kids)
            ok = s >= 3 and kind != _LOAD and not r
            self.key.append(key)
            size.append(s)
            rw.append(r)
            self.countable.append(ok)
            self.dense.append(ok or any(self.dense[k] for k in kids))
        return c

    def of(self, e):
        """The class of expression e (classes its whole tree, once per node object)."""
        memo = self.memo
        hit = memo.get(id(e))
        if hit is not None:
            return hit[1]
        get, intern = memo.get, self.intern
        stack = [e]
        while stack:
            n = stack[-1]
            i = id(n)
            if i in memo:
                stack.pop()
                continue
            t = n.__class__
            if t is BinOp:  # the common case, unrolled
                ra, rb = get(id(n.a)), get(id(n.b))
                if ra is None or rb is None:
                    if rb is None:
                        stack.append(n.b)
                    if ra is None:
                        stack.append(n.a)
                    continue
                c = intern(_BIN, n.op, (ra[1], rb[1]))
            elif t is Var:
                c = intern(_VAR, n.name, ())
            elif t is Const:
                c = intern(_CONST, n.value, ())
            else:
                kids = expr_children(n)
                todo = [k for k in kids if id(k) not in memo]
                if todo:
                    stack.extend(todo)
                    continue
                c = intern(*_kind(n), tuple(memo[id(k)][1] for k in kids))
            stack.pop()
            memo[i] = (n, c)
        return memo[id(e)][1]

    def names(self, c):
        """The variables class c reads."""
        out, seen, stack = set(), set(), [c]
        while stack:
            c = stack.pop()
            if c not in seen:
                seen.add(c)
                kind, attr, kids = self.key[c]
                if kind == _VAR:
                    out.add(attr)
                stack.extend(kids)
        return out


class _Rec:
    """One occurrence of an expression node in a statement list under CSE: its class now, the node it was built
    from, its children's records; pos (root, pre-order index) where the list's count sees it, else None."""
    __slots__ = ("cls", "node", "kids", "parent", "slot", "pos", "depth", "changed")


class _Slot:
    """A statement of the list under CSE: an original one (its statement tree, with the records of its expressions),
    or a new assignment (name, record of the value).  key orders the slots (new ones get keys in between)."""
    __slots__ = ("key", "tree", "name", "value")


def _counted_roots(s):
    """What a list's count sees of its statement s: s's own expressions, then those of the statements one level down."""
    roots = _stmt_exprs(s)
    for body in bodies(s):
        for inner in body:
            roots += _stmt_exprs(inner)
    return roots


class _CSE:
    """The state of one eliminate_common_subexpressions run: the expression classes and the name counter."""

    def __init__(self, written, prefix="_e"):
        self.C = _Classes(written)
        self.prefix = prefix
        self.counter = 0

    def block(self, stmts):
        """One statement list, its nested lists already done: count, and name if some class qualifies."""
        C = self.C
        countable, dense, keys = C.countable, C.dense, C.key
        counts = {}
        for s in stmts:
            for e in _counted_roots(s):
                stack = [C.of(e)]
                while stack:
                    c = stack.pop()
                    if dense[c]:
                        if countable[c]:
                            counts[c] = counts.get(c, 0) + 1
                        stack.extend(keys[c][2])
        repeated = [c for c, n in counts.items() if n >= 2]
        if not repeated:
            return tuple(stmts)
        assigned = _assigned(stmts)
        first_def = {}
        for i, s in enumerate(stmts):
            if isinstance(s, Assign) and s.var not in first_def:
                first_def[s.var] = i
        qual = _Qual(C, assigned, first_def)
        candidates = [c for c in repeated if qual(c)]
        if not candidates:
            return tuple(stmts)
        return self._name(stmts, candidates, qual)

    def _name(self, stmts, candidates, qual):
        """Name the candidates of a statement list the way the rule above says (see the comment there)."""
        C = self.C
        countable, size, keys = C.countable, C.size, C.key
        occ = {}  # countable class -> its live records (any depth)
        counts = {}  # countable class -> its live records that the count sees
        fpos = {}  # class -> (position, record) of its first counted record (a cache)

        def track(r):
            c = r.cls
            if countable[c]:
                occ.setdefault(c, set()).add(r)
                if r.pos is not None:
                    counts[c] = counts.get(c, 0) + 1
                    fpos.pop(c, None)

        def untrack(r):
            c = r.cls
            if countable[c]:
                occ[c].discard(r)
                if r.pos is not None:
                    counts[c] -= 1
                    fpos.pop(c, None)

        hot = {c: True for c in candidates}  # class -> holds a candidate: only those records can ever change

        def is_hot(c):
            if c in hot:
                return hot[c]
            stack = [c]
            while stack:
                d = stack[-1]
                kids = keys[d][2]
                todo = [k for k in kids if k not in hot]
                if todo:
                    stack.extend(todo)
                    continue
                stack.pop()
                hot[d] = any(hot[k] for k in kids)
            return hot[c]

        def records(e, slot, root):
            """The record tree of expression e (root: its index among the counted roots of the slot, or None).  A
            subtree without a candidate never changes (no class becomes a candidate later but those re-classed
            above a named one): one frozen record stands for it."""
            top = None
            pre = 0
            stack = [(e, None)]
            while stack:
                n, parent = stack.pop()
                r = _Rec()
                r.cls, r.node, r.kids, r.parent, r.slot, r.changed = C.of(n), n, [], parent, slot, False
                r.depth = 0 if parent is None else parent.depth + 1
                if parent is None:
                    top = r
                else:
                    parent.kids.append(r)
                if is_hot(r.cls):
                    r.pos = None if root is None else (root, pre)
                    pre += 1
                    track(r)
                    for k in reversed(expr_children(n)):
                        stack.append((k, r))
                else:
                    r.pos = None
            return top

        def slot_tree(s, slot):
            """[statement, records of stmt_exprs, [[subtrees of each nested list]]] over the whole statement."""
            counter = [0]

            def make(st, level):
                roots = []
                for e, counted in zip(stmt_exprs(st), _counted(st)):
                    root = None
                    if counted and level <= 1:
                        root, counter[0] = counter[0], counter[0] + 1
                    roots.append(records(e, slot, root))
                return [st, roots, [[None] * len(body) for body in bodies(st)]]
            # the statement, then the statements one level down in order (their counted roots follow the statement's),
            # then everything deeper
            top = make(s, 0)
            stack = []
            for li, body in enumerate(bodies(s)):
                for si, st in enumerate(body):
                    top[2][li][si] = make(st, 1)
                    stack.append(top[2][li][si])
            while stack:
                node = stack.pop()
                for li, body in enumerate(bodies(node[0])):
                    for si, st in enumerate(body):
                        node[2][li][si] = make(st, 2)
                        stack.append(node[2][li][si])
            return top

        order = []
        for i, s in enumerate(stmts):
            slot = _Slot()
            slot.key, slot.name, slot.value = i, None, None
            slot.tree = slot_tree(s, slot)
            order.append(slot)
        first_slot = {v: order[i] for v, i in qual.first_def.items()}

        def first(c):
            hit = fpos.get(c)
            if hit is None:
                best = None
                for r in occ[c]:
                    if r.pos is not None:
                        k = (r.slot.key, r.pos[0], r.pos[1])
                        if best is None or k < best[0]:
                            best = (k, r)
                hit = fpos[c] = best
            return hit

        groups, sizes = {}, []

        def offer(c):
            s = size[c]
            if s not in groups:
                groups[s] = set()
                heapq.heappush(sizes, -s)
            groups[s].add(c)

        for c in candidates:
            offer(c)
        while sizes:
            T = -sizes[0]
            members = [c for c in groups[T] if counts.get(c, 0) >= 2 and qual(c)]
            if not members:
                heapq.heappop(sizes)
                del groups[T]
                continue
            groups[T] = set(members)
            X = min(members, key=lambda c: first(c)[0])
            rep = first(X)[1]
            name = f"{self.prefix}{self.counter}"
            self.counter += 1
            at = min((r.slot for r in occ[X]), key=lambda sl: sl.key)
            defined = [first_slot[v].key for v in C.names(X) if v in first_slot]
            if defined and max(defined) >= at.key:
                break
            # the assignment, right before `at`
            new = _Slot()
            new.name, new.tree = name, None
            i = order.index(at)
            new.key = Fraction(order[i - 1].key + at.key, 2) if i else at.key - 1
            order.insert(i, new)
            first_slot[name] = new
            qual.bind(name)
            value = self._copy(rep, new)
            # every occurrence of X becomes the name; their ancestors change class
            var, vc = Var(name), C.intern(_VAR, name, ())
            above = set()
            for r in list(occ[X]):
                untrack(r)
                stack = list(r.kids)
                while stack:
                    k = stack.pop()
                    untrack(k)
                    stack.extend(k.kids)
                r.cls, r.node, r.kids, r.changed = vc, var, [], True
                p = r.parent
                while p is not None and p not in above:
                    above.add(p)
                    p = p.parent
            for a in sorted(above, key=lambda r: -r.depth):
                kind, attr, _ = keys[a.cls]
                untrack(a)
                a.cls = C.intern(kind, attr, tuple(k.cls for k in a.kids))
                a.changed = True
                track(a)
                if countable[a.cls]:
                    offer(a.cls)
            stack = [value]
            while stack:
                r = stack.pop()
                track(r)
                stack.extend(r.kids)
            new.value = value
        return self._rebuild(order)

    @staticmethod
    def _copy(rep, slot):
        """A copy of record rep's tree, counted at the top of `slot`."""
        pre = 0
        top = None
        stack = [(rep, None)]
        while stack:
            r, parent = stack.pop()
            c = _Rec()
            c.cls, c.node, c.kids, c.parent, c.slot, c.changed = r.cls, r.node, [], parent, slot, r.changed
            c.pos, c.depth = (0, pre), 0 if parent is None else parent.depth + 1
            pre += 1
            if parent is None:
                top = c
            else:
                parent.kids.append(c)
            for k in reversed(r.kids):
                stack.append((k, c))
        return top

    @staticmethod
    def _expr(top):
        """The expression a record tree stands for now."""
        if not top.changed:
            return top.node
        done = {}
        stack = [top]
        while stack:
            r = stack[-1]
            todo = [k for k in r.kids if k.changed and id(k) not in done]
            if todo:
                stack.extend(todo)
                continue
            stack.pop()
            if r.kids:
                done[id(r)] = with_children(r.node, [done[id(k)] if k.changed else k.node for k in r.kids])
            else:
                done[id(r)] = r.node
        return done[id(top)]

    def _rebuild(self, order):
        out = []
        for slot in order:
            if slot.tree is None:
                out.append(Assign(slot.name, self._expr(slot.value)))
                continue
            # post-order over the statement tree
            result = {}
            stack = [slot.tree]
            while stack:
                node = stack[-1]
                todo = [child for body in node[2] for child in body if id(child) not in result]
                if todo:
                    stack.extend(todo)
                    continue
                stack.pop()
                st, roots, subs = node
                changed = any(r.changed for r in roots)
                new_bodies = []
                for body, sub in zip(bodies(st), subs):
                    new = tuple(result[id(child)] for child in sub)
                    changed = changed or any(a is not b for a, b in zip(new, body))
                    new_bodies.append(new)
                if changed:
                    st = with_stmt_exprs(st, [self._expr(r) for r in roots])
                    st = with_bodies(st, new_bodies) if new_bodies else st
                result[id(node)] = st
            out.append(result[id(slot.tree)])
        return tuple(out)


class _Qual:
    """Which classes the CSE may name in a list: every variable bound once, before the list or by one of its own
    assignments (memoised per class; names the CSE binds qualify)."""

    def __init__(self, classes, assigned, first_def):
        self.C, self.assigned, self.first_def = classes, assigned, first_def
        self.memo = {}

    def bind(self, name):
        self.assigned[name] = 1
        self.first_def[name] = None

    def __call__(self, c):
        memo = self.memo
        if c in memo:
            return memo[c]
        keys = self.C.key
        stack = [c]
        while stack:
            d = stack[-1]
            kind, attr, kids = keys[d]
            todo = [k for k in kids if k not in memo]
            if todo:
                stack.extend(todo)
                continue
            stack.pop()
            if kind == _VAR:
                n = self.assigned.get(attr, 0)
                memo[d] = not (n > 1 or (attr in self.assigned and attr not in self.first_def))
            else:
                memo[d] = all(memo[k] for k in kids)
        return memo[c]


def eliminate_common_subexpressions(kernel: Kernel) -> Kernel:
    """Readable, cheaper source: repeated index arithmetic is computed once and named."""
    stmts = list(walk_stmts(kernel.body))
    written = frozenset([s.buf for s in stmts if isinstance(s, Store)]
                        + [d.buf for s in stmts if isinstance(s, VectorLoad) for d in s.dst if isinstance(d, Load)]
                        + [s.dst for s in stmts if isinstance(s, (AsyncCopy, TensorCopy))])
    cse = _CSE(written)

    def enter(s):
        lists = bodies(s)
        return Descend(lists, lambda new: (with_bodies(s, new),)) if lists else (s,)
    return replace(kernel, body=rewrite_stmts(kernel.body, enter, cse.block))
