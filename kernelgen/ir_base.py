"""The IR's base: expressions (Expr and its node classes, with the helpers that build them) and Stmt, the base
of every statement.  kernelgen/ir.py (the statements, buffers and kernels) and kernelgen/ir_async.py (the
asynchronous statements) both build on these, and kernelgen.ir re-exports them: import them from there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import numpy as np


class Expr:
    """Base class of expressions; operator overloads build BinOp trees."""

    def _bin(self, op, other, swap=False):
        other = as_expr(other)
        return BinOp(op, other, self) if swap else BinOp(op, self, other)

    __add__ = lambda s, o: s._bin("+", o)
    __radd__ = lambda s, o: s._bin("+", o, True)
    __sub__ = lambda s, o: s._bin("-", o)
    __rsub__ = lambda s, o: s._bin("-", o, True)
    __mul__ = lambda s, o: s._bin("*", o)
    __rmul__ = lambda s, o: s._bin("*", o, True)
    __floordiv__ = lambda s, o: s._bin("//", o)
    __mod__ = lambda s, o: s._bin("%", o)
    __lt__ = lambda s, o: s._bin("<", o)
    __le__ = lambda s, o: s._bin("<=", o)
    __gt__ = lambda s, o: s._bin(">", o)
    __ge__ = lambda s, o: s._bin(">=", o)
    __and__ = lambda s, o: s._bin("and", o)
    __or__ = lambda s, o: s._bin("or", o)

    def eq(self, other):
        return self._bin("==", other)

    def ne(self, other):
        return self._bin("!=", other)


@dataclass(frozen=True)
class Const(Expr):
    value: object  # int, float or bool


@dataclass(frozen=True)
class Var(Expr):
    name: str


@dataclass(frozen=True)
class BinOp(Expr):
    op: str
    a: Expr
    b: Expr


@dataclass(frozen=True)
class Call(Expr):
    """A pure math function: min, max, exp, ..."""
    fn: str
    args: Tuple[Expr, ...]


@dataclass(frozen=True)
class Select(Expr):
    """cond ? a : b, lazily evaluated (a load in `a` is not performed when cond is false)."""
    cond: Expr
    a: Expr
    b: Expr


@dataclass(frozen=True)
class Load(Expr):
    buf: str
    index: Tuple[Expr, ...]


def as_expr(v):
    if isinstance(v, Expr):
        return v
    if isinstance(v, (bool, int, float)):
        return Const(v)
    if isinstance(v, np.integer):
        return Const(int(v))
    if isinstance(v, np.floating):
        return Const(float(v))
    raise TypeError(f"cannot use {v!r} as an IR expression")


def minimum(a, b):
    return Call("min", (as_expr(a), as_expr(b)))


def maximum(a, b):
    return Call("max", (as_expr(a), as_expr(b)))


def select(cond, a, b):
    return Select(as_expr(cond), as_expr(a), as_expr(b))


def all_of(conds):
    conds = [as_expr(c) for c in conds]
    if not conds:
        return Const(True)
    out = conds[0]
    for c in conds[1:]:
        out = out & c
    return out


class Stmt:
    pass
