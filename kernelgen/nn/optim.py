"""Optimisers: SGD (momentum, weight decay) and Adam / AdamW, updating parameters in place."""
from __future__ import annotations

import numpy as np


class SGD:
    def __init__(self, params, lr=0.1, momentum=0.0, weight_decay=0.0):
        self.params, self.lr, self.momentum, self.wd = list(params), lr, momentum, weight_decay
        self.velocity = [np.zeros_like(p.data) for p in self.params]

    def step(self):
        for p, v in zip(self.params, self.velocity):
            if p.grad is None:
                continue
            g = p.grad + self.wd * p.data
            v *= self.momentum
            v += g
            p.data -= (self.lr * v).astype(p.data.dtype)

    def zero_grad(self):
        for p in self.params:
            p.grad = None


class Adam(SGD):
    """Adam; decoupled=True is AdamW (weight decay applied to the weights, not the gradient)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=False):
        super().__init__(params, lr, 0.0, weight_decay)
        self.b1, self.b2, self.eps, self.decoupled, self.t = betas[0], betas[1], eps, decoupled, 0
        self.m = [np.zeros_like(p.data) for p in self.params]

    def step(self):
        self.t += 1
        for p, m, v in zip(self.params, self.m, self.velocity):
            if p.grad is None:
                continue
            g = p.grad if self.decoupled else p.grad + self.wd * p.data
            m *= self.b1
            m += (1 - self.b1) * g
            v *= self.b2
            v += (1 - self.b2) * g * g
            mhat, vhat = m / (1 - self.b1 ** self.t), v / (1 - self.b2 ** self.t)
            update = self.lr * (mhat / (np.sqrt(vhat) + self.eps) + (self.wd * p.data if self.decoupled else 0))
            p.data -= update.astype(p.data.dtype)
