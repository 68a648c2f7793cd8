"""GPU: where a kernelgen.nn ResNet-18 CIFAR training step spends its host time: cProfile over a few steps after
warm-up (batch 128; --amp: kernelgen.nn.amp fp16 with a GradScaler), the top functions by own time.  Prints the
table; the step's wall time beside it tells whether the step is host-bound."""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--amp", action="store_true")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args(argv)
    from numba import cuda

    from kernelgen.nn import amp
    from kernelgen.nn import functional as F
    from kernelgen.nn.models import resnet18
    from kernelgen.nn.optim import SGD
    from kernelgen.nn.tensor import Tensor
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((args.batch, 32, 32, 3)).astype(np.float32)).to("cuda")
    y = Tensor(rng.integers(0, 10, args.batch)).to("cuda").data
    model = resnet18(10, stem="cifar").to("cuda")
    opt = SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    scaler = amp.GradScaler(enabled=args.amp)

    def step():
        opt.zero_grad()
        with amp.autocast("fp16" if args.amp else "fp32"):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    for _ in range(4):
        step()
    cuda.synchronize()
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    for _ in range(args.steps):
        step()
    cuda.synchronize()
    prof.disable()
    print(f"{(time.perf_counter() - t) / args.steps * 1e3:.2f} ms a step (profiled), amp={args.amp}")
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
