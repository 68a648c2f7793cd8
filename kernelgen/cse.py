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

from .ir import AsyncCopy, Assign, Kernel, Load, Store, TensorCopy, Var, VectorLoad
from .ir_walk import (Descend, bodies, expr_children, rewrite_stmts, stmt_exprs, walk_stmts, with_bodies,
                      with_children, with_stmt_exprs)

from .cse_classes import (_Classes, _Qual, _Rec, _Slot, _VAR, _counted, _counted_roots, assignment_counts)  # noqa: F401


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
