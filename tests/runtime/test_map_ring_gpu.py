"""Tensor maps uploaded asynchronously through a ring of slots per stream (runtime/map_ring.py), on the GPU: a map
is encoded once while its slot holds it, a reused slot is encoded again, and TMA kernels fed from a ring far smaller
than their arrays' count still compute right (every slot reused several times, results against float64, outputs
poisoned)."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def test_a_slot_holds_its_map_until_the_ring_comes_round(monkeypatch):
    from kernelgen.runtime import map_ring
    monkeypatch.setattr(map_ring, "SLOTS", 3)
    ring = map_ring.MapRing(0)
    encodes = []

    def encode(value):
        def words():
            encodes.append(value)
            return np.full(16, value, np.uint64)
        return words
    first = ring.address("a", encode(1))
    assert ring.address("a", encode(1)) == first and encodes == [1]  # held: no second encode
    ring.address("b", encode(2)), ring.address("c", encode(3))
    assert ring.address("d", encode(4)) == first  # the fourth map takes the first slot back
    assert ring.address("a", encode(1)) != first and encodes == [1, 2, 3, 4, 1]
    from numba import cuda
    cuda.synchronize()
    assert ring.device.copy_to_host()[:, 0].tolist() == [4, 1, 3]  # each slot holds what was uploaded last


def test_tma_kernels_through_a_small_ring(monkeypatch, rng):
    """Six input arrays in turn through a TMA forward, three rounds, on a ring of 4 slots: each call encodes its
    maps again into a slot a few calls ago's kernel read; every result is right."""
    from numba import cuda

    from kernelgen import reference as ref
    from kernelgen.api import get_launcher, make_plan
    from kernelgen.problem import make_problem
    from kernelgen.runtime import map_ring
    from kernelgen.templates.config import TileConfig
    monkeypatch.setattr(map_ring, "SLOTS", 4)
    monkeypatch.setattr(map_ring, "_RINGS", {})
    p = make_problem("fwd", (2, 12, 12, 64), (64, 3, 3, 64), dtype="float16", padding=1)
    cfg = TileConfig(BM=128, BN=64, BK=64, WM=64, WN=64, stages=4, wgmma=1, tma=2)
    launcher = get_launcher(make_plan(p, "cuda", config=cfg, precision="fp16"))
    xs = [rng.standard_normal(p.x_shape).astype(np.float16) for _ in range(6)]
    w = rng.standard_normal(p.w_shape).astype(np.float16)
    d_xs, d_w = [cuda.to_device(x.ravel()) for x in xs], cuda.to_device(w.ravel())
    wants = [ref.conv_forward(x.astype(np.float64), w.astype(np.float64), padding=1) for x in xs]
    outs = [cuda.to_device(np.full(int(np.prod(p.y_shape)), np.nan, np.float16)) for _ in range(18)]
    for call in range(18):  # enqueued back to back: the ring's slots are rewritten while kernels are queued
        launcher({"x": d_xs[call % 6], "w": d_w, "y": outs[call]})
    for call in range(18):
        got = outs[call].copy_to_host().reshape(p.y_shape).astype(np.float64)
        want = wants[call % 6]
        assert np.isfinite(got).all()
        assert np.abs(got - want).max() <= 2e-3 * np.abs(want).max(), call
