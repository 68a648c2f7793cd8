"""Tensor: an array with reverse-mode autograd, micrograd-style.

Every op records its inputs and a closure that turns the output's gradient into the inputs'
gradients; backward() walks the graph in reverse topological order.  Data is a NumPy array
(channels-last, like kernelgen); convolutions run through kernelgen's kernels.
"""
from __future__ import annotations

import contextlib

import numpy as np

_grad_enabled = True


@contextlib.contextmanager
def no_grad():
    """Build no graph inside (evaluation, optimiser updates)."""
    global _grad_enabled
    prev, _grad_enabled = _grad_enabled, False
    try:
        yield
    finally:
        _grad_enabled = prev


class Tensor:
    def __init__(self, data, requires_grad=False, _parents=(), _backward=None):
        self.data = np.asarray(data)
        self.grad = None
        self.requires_grad = requires_grad
        self._parents = _parents
        self._backward = _backward

    @classmethod
    def from_op(cls, data, parents, backward):
        """The result of an op: part of the graph only if some input needs a gradient."""
        track = _grad_enabled and any(p.requires_grad for p in parents)
        return cls(data, track, parents if track else (), backward if track else None)

    shape = property(lambda self: self.data.shape)
    dtype = property(lambda self: self.data.dtype)

    def __repr__(self):
        return f"Tensor(shape={self.shape}, dtype={self.dtype}, requires_grad={self.requires_grad})"

    def numpy(self):
        return self.data

    def item(self):
        return float(self.data)

    def _accumulate(self, g):
        self.grad = g if self.grad is None else self.grad + g

    def backward(self, grad=None):
        if grad is None:
            if self.data.size != 1:
                raise ValueError(f"backward() without a gradient needs a scalar tensor, got shape {self.shape}")
            grad = np.ones_like(self.data)
        order, seen = [], set()

        def visit(t):
            if id(t) not in seen:
                seen.add(id(t))
                for p in t._parents:
                    visit(p)
                order.append(t)

        visit(self)
        self._accumulate(grad)
        for t in reversed(order):
            if t._backward is not None and t.grad is not None:
                for parent, g in zip(t._parents, t._backward(t.grad)):
                    if parent.requires_grad and g is not None:
                        parent._accumulate(g)
                if t is not self:
                    t.grad = None  # intermediates are freed as soon as backward is past them
        return self

    # a few operators, so models read naturally
    def __add__(self, other):
        from .functional import add
        return add(self, other)

    def reshape(self, *shape):
        from .functional import reshape
        return reshape(self, shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape)
