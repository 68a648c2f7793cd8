"""Small models and the float64-checked comparison the distributed tests share: no convolution, so a rank's
process starts and steps in a second (the host Linear is NumPy)."""
from __future__ import annotations

import numpy as np

from kernelgen.nn import BatchNorm2d, Linear, Module, SGD, Tensor
from kernelgen.nn import functional as F


class TinyNet(Module):
    """Linear on each pixel, batch norm + ReLU over (N, H, W), flatten, Linear head."""

    def __init__(self, seed=0, c_in=3, width=5, classes=4):
        rng = np.random.default_rng(seed)
        self.l0 = Linear(c_in, width, rng=rng)
        self.bn = BatchNorm2d(width)
        self.mid = Linear(width, width, rng=rng)
        self.head = Linear(4 * width, classes, rng=rng)

    def forward(self, x):
        return self.head(F.flatten(self.mid(self.bn.forward_relu(self.l0(x)))))


def batch(seed=1, n=8, classes=4):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 2, 2, 3)).astype(np.float32), rng.integers(0, classes, n).astype(np.int64)


def sgd_step(model, x, y, lr=0.1):
    """One SGD step on (x, y); returns the model's state after it and the gradients it used."""
    opt = SGD(model.parameters(), lr=lr)
    loss = F.cross_entropy(model(Tensor(x)), y)
    loss.backward()
    grads = [np.array(p.grad, copy=True) for p in model.parameters()]
    opt.step()
    return getattr(model, "module", model).state_dict(), grads


def assert_state_close(got, want, rtol=1e-5):
    """Every array within rtol of the reference's scale (max |value|, at least 1e-2: a bias that batch norm
    makes irrelevant stays ~1e-10 in both runs, where a relative error means nothing)."""
    assert set(got) == set(want)
    for k, w in want.items():
        scale = max(float(np.abs(w).max()), 1e-2)
        err = float(np.abs(np.asarray(got[k], np.float64) - w).max())
        assert err <= rtol * scale, f"{k}: max error {err:.3g} > {rtol} x {scale:.3g}"


def assert_grads_close(got, want, rtol=1e-5):
    """Each gradient within rtol of the largest gradient's scale: the bias before a batch norm has a true gradient
    of 0, which both sides compute as rounding noise (~1e-7 of the others)."""
    scale = max(float(np.abs(w).max()) for w in want)
    for k, (g, w) in enumerate(zip(got, want)):
        err = float(np.abs(np.asarray(g, np.float64) - w).max())
        assert err <= rtol * scale, f"gradient {k}: max error {err:.3g} > {rtol} x {scale:.3g}"
