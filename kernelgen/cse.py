"""Common-subexpression elimination (the last pass of passes.lower): repeated index arithmetic computed once and named.

What the pass does (the rule that fixes its output): in every statement list, innermost lists first, repeatedly
name the largest (size) pure subexpression that the list's statements and the statements one level down
evaluate at least twice (ties: the first met, walking the statements in order and each expression node first),
whose variables are bound once, before the list, or by an assignment of the list itself; the name's assignment
goes right before the first statement that mentions the expression at any depth, and the expression is replaced
by the name everywhere in the list, at any depth.  A candidate whose variables are assigned at or after that
statement ends the list's naming.

How (linear time): expressions are hash-consed into classes (_Classes: structurally equal expressions, as
dataclass equality sees them, share a class), counted once per list, and a list with a candidate gets a mutable
tree of occurrence records (_Rec) over every expression it holds; naming a class replaces its records, drops the
counts of their subtrees and re-classes their ancestors, so each step costs what it removes, not a recount
(_ListNaming).
"""
from __future__ import annotations

import heapq
from dataclasses import replace
from fractions import Fraction

from .ir import (AsyncCopy, Assign, BinOp, Call, Const, For, Kernel, Load, Mma, Pipeline, Select, Store, TensorCopy,
                 Var, VectorLoad, WarpgroupMma, WarpgroupWait)
from .ir_walk import (Descend, bodies, expr_children, rewrite_stmts, stmt_exprs, walk_stmts, with_bodies,
                      with_children, with_stmt_exprs)

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


class _CSE:
    """The state of one eliminate_common_subexpressions run: the expression classes and the name counter."""

    def __init__(self, written, prefix="_e"):
        self.C = _Classes(written)
        self.prefix = prefix
        self.counter = 0

    def new_name(self):
        """The next name of the run (a name drawn but not bound stays used: the numbering is part of the output)."""
        name = f"{self.prefix}{self.counter}"
        self.counter += 1
        return name

    def block(self, stmts):
        """One statement list, its nested lists already done: count, and name if some class qualifies."""
        repeated = self._repeated(stmts)
        if not repeated:
            return tuple(stmts)
        assigned = assignment_counts(stmts)
        first_def = {}
        for i, s in enumerate(stmts):
            if isinstance(s, Assign) and s.var not in first_def:
                first_def[s.var] = i
        qual = _Qual(self.C, assigned, first_def)
        candidates = [c for c in repeated if qual(c)]
        if not candidates:
            return tuple(stmts)
        return _ListNaming(self, stmts, candidates, qual).run()

    def _repeated(self, stmts):
        """The countable classes the list's count sees at least twice."""
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
        return [c for c, n in counts.items() if n >= 2]


class _ListNaming:
    """The naming of one statement list's candidates, the way the module's rule says: the list as slots of record
    trees, the live records and counted records of each countable class, and the candidates by size."""

    def __init__(self, cse, stmts, candidates, qual):
        self.cse, self.C, self.qual = cse, cse.C, qual
        self.occ = {}  # countable class -> its live records (any depth)
        self.counts = {}  # countable class -> its live records that the count sees
        self.fpos = {}  # class -> (position, record) of its first counted record (a cache)
        self.hot = {c: True for c in candidates}  # class -> holds a candidate: only those records can ever change
        self.order = []  # the slots, in statement order
        for i, s in enumerate(stmts):
            slot = _Slot()
            slot.key, slot.name, slot.value = i, None, None
            slot.tree = self._slot_tree(s, slot)
            self.order.append(slot)
        self.first_slot = {v: self.order[i] for v, i in qual.first_def.items()}
        self.groups, self.sizes = {}, []  # size -> classes offered; a max-heap of the sizes (negated)
        for c in candidates:
            self._offer(c)

    def run(self):
        """Name the largest first-met qualifying class until none is left (or one is bound too late); the new list."""
        while True:
            X = self._next_class()
            if X is None:
                break
            rep = self._first(X)[1]
            name = self.cse.new_name()
            at = min((r.slot for r in self.occ[X]), key=lambda sl: sl.key)
            defined = [self.first_slot[v].key for v in self.C.names(X) if v in self.first_slot]
            if defined and max(defined) >= at.key:
                break
            new = self._insert_assignment(name, at)
            self.qual.bind(name)
            value = _copy(rep, new)  # before the replacement below rewrites rep
            self._replace(X, name)
            self._track_tree(value)
            new.value = value
        return _rebuild(self.order)

    # --- counting: which records are live and which the count sees ---

    def _track(self, r):
        c = r.cls
        if self.C.countable[c]:
            self.occ.setdefault(c, set()).add(r)
            if r.pos is not None:
                self.counts[c] = self.counts.get(c, 0) + 1
                self.fpos.pop(c, None)

    def _untrack(self, r):
        c = r.cls
        if self.C.countable[c]:
            self.occ[c].discard(r)
            if r.pos is not None:
                self.counts[c] -= 1
                self.fpos.pop(c, None)

    def _track_tree(self, top):
        """Track every record of the tree under top."""
        stack = [top]
        while stack:
            r = stack.pop()
            self._track(r)
            stack.extend(r.kids)

    def _is_hot(self, c):
        """Whether class c holds a candidate (memoised in self.hot)."""
        hot, keys = self.hot, self.C.key
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

    # --- the record trees ---

    def _records(self, e, slot, root):
        """The record tree of expression e (root: its index among the counted roots of the slot, or None).  A
        subtree without a candidate never changes (no class becomes a candidate later but those re-classed
        above a named one): one frozen record stands for it."""
        C = self.C
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
            if self._is_hot(r.cls):
                r.pos = None if root is None else (root, pre)
                pre += 1
                self._track(r)
                for k in reversed(expr_children(n)):
                    stack.append((k, r))
            else:
                r.pos = None
        return top

    def _slot_tree(self, s, slot):
        """[statement, records of stmt_exprs, [[subtrees of each nested list]]] over the whole statement."""
        counter = [0]

        def make(st, level):
            roots = []
            for e, counted in zip(stmt_exprs(st), _counted(st)):
                root = None
                if counted and level <= 1:
                    root, counter[0] = counter[0], counter[0] + 1
                roots.append(self._records(e, slot, root))
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

    # --- choosing the next class ---

    def _first(self, c):
        """(position, record) of class c's first counted record."""
        hit = self.fpos.get(c)
        if hit is None:
            best = None
            for r in self.occ[c]:
                if r.pos is not None:
                    k = (r.slot.key, r.pos[0], r.pos[1])
                    if best is None or k < best[0]:
                        best = (k, r)
            hit = self.fpos[c] = best
        return hit

    def _offer(self, c):
        """Make class c a candidate to check when its size comes up."""
        s = self.C.size[c]
        if s not in self.groups:
            self.groups[s] = set()
            heapq.heappush(self.sizes, -s)
        self.groups[s].add(c)

    def _next_class(self):
        """The first-met class of the largest size that still repeats and qualifies, or None."""
        groups, sizes, counts, qual = self.groups, self.sizes, self.counts, self.qual
        while sizes:
            T = -sizes[0]
            members = [c for c in groups[T] if counts.get(c, 0) >= 2 and qual(c)]
            if not members:
                heapq.heappop(sizes)
                del groups[T]
                continue
            groups[T] = set(members)
            return min(members, key=lambda c: self._first(c)[0])
        return None

    # --- naming a class ---

    def _insert_assignment(self, name, at):
        """A new slot for the assignment of `name`, right before slot `at`."""
        order = self.order
        new = _Slot()
        new.name, new.tree = name, None
        i = order.index(at)
        new.key = Fraction(order[i - 1].key + at.key, 2) if i else at.key - 1
        order.insert(i, new)
        self.first_slot[name] = new
        return new

    def _replace(self, X, name):
        """Every occurrence of class X becomes Var(name); their ancestors change class (and are offered)."""
        C = self.C
        var, vc = Var(name), C.intern(_VAR, name, ())
        above = set()
        for r in list(self.occ[X]):
            self._untrack(r)
            stack = list(r.kids)
            while stack:
                k = stack.pop()
                self._untrack(k)
                stack.extend(k.kids)
            r.cls, r.node, r.kids, r.changed = vc, var, [], True
            p = r.parent
            while p is not None and p not in above:
                above.add(p)
                p = p.parent
        for a in sorted(above, key=lambda r: -r.depth):
            kind, attr, _ = C.key[a.cls]
            self._untrack(a)
            a.cls = C.intern(kind, attr, tuple(k.cls for k in a.kids))
            a.changed = True
            self._track(a)
            if C.countable[a.cls]:
                self._offer(a.cls)


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


def _rebuild(order):
    """The statement list the slots stand for now (unchanged statements kept as they were)."""
    out = []
    for slot in order:
        if slot.tree is None:
            out.append(Assign(slot.name, _expr(slot.value)))
        else:
            out.append(_rebuild_stmt(slot.tree))
    return tuple(out)


def _rebuild_stmt(tree):
    """The statement a slot's statement tree stands for now (post-order over the tree)."""
    result = {}
    stack = [tree]
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
            st = with_stmt_exprs(st, [_expr(r) for r in roots])
            st = with_bodies(st, new_bodies) if new_bodies else st
        result[id(node)] = st
    return result[id(tree)]


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
