"""Probe: fp16 TMA tiles on one forward problem with 128 output channels, error per 64-column half of the
output (which n rows of B a wrong result comes from), per config; a TF32 control.  Prints one line per config."""
from __future__ import annotations

import sys

import numpy as np
from numba import cuda

from kernelgen import reference as ref
from kernelgen.api import get_launcher, make_plan
from kernelgen.problem import make_problem
from kernelgen.templates.config import TileConfig


def run(cfg, precision, C=64, K=128, rng=np.random.default_rng(0)):
    dt = np.float16 if precision == "fp16" else np.float32
    xs, ws = (4, 16, 16, C), (K, 3, 3, C)
    x, w = rng.standard_normal(xs).astype(dt), rng.standard_normal(ws).astype(dt)
    p = make_problem("fwd", xs, ws, padding=1, dtype=np.dtype(dt).name)
    launcher = get_launcher(make_plan(p, "cuda", config=cfg, precision=precision))
    y = cuda.to_device(np.full(int(np.prod(p.y_shape)), np.nan, dt))
    launcher({"x": cuda.to_device(x.ravel()), "w": cuda.to_device(w.ravel()), "y": y})
    got = y.copy_to_host().reshape(p.y_shape).astype(np.float64)
    want = ref.conv_forward(x.astype(np.float64), w.astype(np.float64), padding=1)
    err = lambda sl: np.linalg.norm(got[..., sl] - want[..., sl]) / np.linalg.norm(want[..., sl])
    halves = [err(slice(h, h + 64)) for h in range(0, K, 64)]
    rows = np.linalg.norm((got - want).reshape(-1, K), axis=1) / np.linalg.norm(want.reshape(-1, K), axis=1)
    bad = np.nonzero(rows > 1e-2)[0]
    return halves, bad


def main():
    T = lambda **kw: TileConfig(**{"BK": 64, "WM": 64, "wgmma": 1, "tma": 1, **kw})
    cases = [("fp16", T(BM=128, BN=128, WN=128, stages=6), 64),
             ("fp16", T(BM=128, BN=128, WN=128, stages=3), 64),
             ("fp16", T(BM=128, BN=128, WN=128, stages=2), 64),
             ("fp16", T(BM=128, BN=128, WN=64, stages=4), 64),
             ("fp16", T(BM=64, BN=128, WN=128, stages=4), 64),
             ("fp16", T(BM=64, BN=128, WN=128, stages=2, tma=2), 64),
             ("fp16", T(BM=128, BN=64, WN=64, stages=8), 64),
             ("fp16", T(BM=128, BN=128, WN=128, stages=6), 128),
             ("fp16", T(BM=64, BN=256, WN=256, stages=3), 64),
             ("fp16", T(BM=256, BN=128, WM=128, WN=128, stages=4, tma=2), 64),
             ("tf32", T(BK=32, BM=128, BN=128, WN=128, stages=6), 64)]
    from kernelgen import settings
    if "--no-drain" in sys.argv:  # the schedule before PERF_NOTES #43 (a code setting: its own cache entries)
        settings.set("tma_drain_each_round", False)
        cases = cases[1:2] + cases[7:8]
    elif "--failing" in sys.argv:
        cases = cases[1:2] + cases[7:8]
    for precision, cfg, C in cases:
        try:
            halves, bad = run(cfg, precision, C, K=256 if cfg.BN == 256 else 128)
            print(f"{precision} C={C} {cfg}: rel err per 64 columns {' '.join(f'{h:.1e}' for h in halves)}; "
                  f"{len(bad)} bad pixels, first {bad[:8].tolist()}", flush=True)
        except Exception as e:
            print(f"{precision} C={C} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
