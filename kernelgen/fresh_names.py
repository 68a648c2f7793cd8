"""Fresh variable names for re-assignments in generated CUDA source (issue 27).

An unrolled k-loop body assigns the same fragment, accumulator and index names again and again.  numba's SSA
reconstruction renames every such "violator" itself, and its cost grows with their number (and each one's uses);
typing then works through the versions.  Giving each of those assignments a new name in the source instead leaves
numba nothing to rename in straight-line code: scripts/compile_time.py measured -14 % of a ResNet-18 step's CUDA
compile time (`--transform fresh_names`, H200 host), with identical PTX.

The rule (the one measured): in each statement list, an assignment `name = ...` followed later in the same list by
another `name = ...`, with no other store of `name` and no break / continue / return between, gets a fresh name,
as do the loads of `name` from there up to and including the next assignment's value.  So only a list's last plain
assignment of a name keeps it: the value that reaches code after the list (an enclosing loop's next iteration, the
code after an `if`, the end of the kernel) is still under the name that code reads.  Loop-carried variables and
anything assigned under a branch or by tuple unpacking keep their names.  numba gives straight-line
re-assignments distinct SSA versions anyway, so the compiled code is the same.

The source is edited in place by position (the AST finds the names), so comments and layout survive.
"""
from __future__ import annotations

import ast
from collections import defaultdict

_JUMPS = (ast.Break, ast.Continue, ast.Return)
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp,
           ast.GeneratorExp, ast.ClassDef)


def fresh_names(source: str) -> str:
    """`source` with every function's straight-line re-assignments renamed (see the module's docstring)."""
    tree = ast.parse(source)
    edits = []  # (line, column, end column, new name): positions in UTF-8 bytes, as ast gives them
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            taken = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {a.arg for a in ast.walk(node.args)
                                                                                if isinstance(a, ast.arg)}
            renamer = _Renamer(taken, {name for n in ast.walk(node) if isinstance(n, (ast.Global, ast.Nonlocal))
                                       for name in n.names})
            renamer.suite(node.body)
            edits += renamer.edits
    return _apply(source, edits) if edits else source


class _Renamer:
    """Renames within one function; fresh names are `<name>__v<N>`, N counting up, skipping names in use."""

    def __init__(self, taken, keep):
        self.taken = taken
        self.keep = keep  # global / nonlocal names: never renamed
        self.count = 0
        self.edits = []

    def fresh(self, name):
        while True:
            self.count += 1
            new = f"{name}__v{self.count}"
            if new not in self.taken:
                self.taken.add(new)
                return new

    def rename(self, nodes, new):
        self.edits += [(n.lineno, n.col_offset, n.end_col_offset, new) for n in nodes]

    def suite(self, stmts):
        """One statement list, in one pass: `pending[name]` is the last plain assignment of name still eligible
        for a fresh name, with the loads of name seen since it (renamed with it if another plain assignment of
        name comes before any other store of name or any jump)."""
        pending = {}  # name -> [the Name node assigned, loads of it since]
        for stmt in stmts:
            for field in ("body", "orelse", "finalbody"):  # nested lists first, each on its own
                inner = getattr(stmt, field, None)
                if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                    self.suite(inner)
            for handler in getattr(stmt, "handlers", ()):
                self.suite(handler.body)
            target = _plain_target(stmt)
            if target is not None and target.id in self.keep:
                target = None
            loads, stores, jumps = _uses(stmt.value if target is not None else stmt)
            for name, nodes in loads.items():
                if name in pending:
                    pending[name][1] += nodes
            if target is not None and target.id in pending:
                assigned, seen = pending.pop(target.id)
                self.rename([assigned] + seen, self.fresh(target.id))
            for name in stores:
                pending.pop(name, None)
            if jumps:
                pending.clear()
            if target is not None:
                pending[target.id] = [target, []]


def _plain_target(stmt):
    """The Name of `name = value` (one target, a plain name), else None."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
        return stmt.targets[0]
    return None


def _uses(node):
    """({name: [load nodes]}, {stored names}, any jump) anywhere in node."""
    loads, stores, jumps = defaultdict(list), set(), False
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            if isinstance(n.ctx, ast.Load):
                loads[n.id].append(n)
            else:  # Store or Del
                stores.add(n.id)
        elif isinstance(n, _JUMPS):
            jumps = True
        elif isinstance(n, (ast.Global, ast.Nonlocal)):  # (never generated) a name other scopes see: keep it
            stores.update(n.names)
        elif isinstance(n, _SCOPES):  # (never generated) a closure reads its names when called, not here
            stores.update(m.id for m in ast.walk(n) if isinstance(m, ast.Name))
    return loads, stores, jumps


def _apply(source, edits):
    lines = source.splitlines(keepends=True)
    by_line = defaultdict(list)
    for line, col, end, new in edits:
        by_line[line].append((col, end, new))
    for line, spans in by_line.items():
        text = lines[line - 1].encode()
        for col, end, new in sorted(spans, reverse=True):  # right to left: earlier columns stay valid
            text = text[:col] + new.encode() + text[end:]
        lines[line - 1] = text.decode()
    return "".join(lines)
