"""Where a converted torch ResNet-18's training step spends its host time (issue 31): cProfile over steps of
kernelgen.torch.bench's model after its warm-up, the top functions by own time.  `python scripts/profile_torch_step.py
[--steps N] [--mode fp32|bf16]`, on the GPU machine (gpu_torch_interop.sh installs kernelgen as this needs)."""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from kernelgen.torch import bench


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--mode", default="fp32")
    args = ap.parse_args(argv)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    data = bench.batches(4, 128)
    theirs, ours = bench.models()
    for name, model in (("kernelgen", ours), ("torch", theirs)):
        t = time.perf_counter()
        bench.train(model, data, 3, args.mode)
        print(f"{name}: warm-up {time.perf_counter() - t:.1f} s")
        prof = cProfile.Profile()
        _, times = prof.runcall(bench.train, model, data, args.steps, args.mode, timed_from=0)
        print(f"{name}: {1e3 * sorted(times)[len(times) // 2]:.2f} ms a step under cProfile")
        pstats.Stats(prof).sort_stats("tottime").print_stats(30 if name == "kernelgen" else 12)


if __name__ == "__main__":
    main()
