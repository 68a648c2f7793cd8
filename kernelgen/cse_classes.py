"""The expression classes of the common-subexpression pass (kernelgen/cse.py): hash-consing (_Classes: structurally
equal expressions share a class), the occurrence records a statement list's naming works on (_Rec, _Slot, _Qual),
and what the pass counts (assignment_counts, _counted)."""
from __future__ import annotations

from .ir import (Assign, BinOp, Call, Const, For, Load, Mma, Pipeline, Select, Var, VectorLoad, WarpgroupMma,
                 WarpgroupWait)
from .ir_walk import bodies, expr_children, stmt_exprs, walk_stmts

_BIN, _CALL, _SEL, _LOAD, _VAR, _CONST = range(6)


def assignment_counts(stmts, out=None):
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


def _counted_roots(s):
    """What a list's count sees of its statement s: s's own expressions, then those of the statements one level down."""
    roots = _stmt_exprs(s)
    for body in bodies(s):
        for inner in body:
            roots += _stmt_exprs(inner)
    return roots


class _Classes:
    """Hash-consed expressions: structurally equal expressions share one class id (keyed by kind, attribute and the
    children's classes; constants by value, as the dataclasses compare).  Per class: its key, size, whether it reads
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
