"""Where a converted torch ResNet-18's training step spends its host time (issue 31): cProfile over steps of
kernelgen.torch.bench's model after its warm-up, the top functions by own time.  `python scripts/profile_torch_step.py
[--steps N] [--mode fp32|bf16]`, on the GPU machine (gpu_torch_interop.sh installs kernelgen as this needs)."""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import kernelgen.torch as kt
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
        if name == "kernelgen":  # its step's kernels compiled side by side, as the bench's warm-up does
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.mode == "bf16"):
                kt.precompile(model, (128, 3, 32, 32))
        bench.train(model, data, 3, args.mode)
        gpu_ms = _gpu_ms_per_step(model, data, args.mode)
        print(f"{name}: warm-up {time.perf_counter() - t:.1f} s")
        prof = cProfile.Profile()
        _, times = prof.runcall(bench.train, model, data, args.steps, args.mode, timed_from=0)
        print(f"{name}: {1e3 * sorted(times)[len(times) // 2]:.2f} ms a step under cProfile; without it, "
              f"{gpu_ms[1]:.2f} ms a step (10 steps queued with no sync between them; the host queued them at "
              f"{gpu_ms[0]:.2f} ms a step)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(30 if name == "kernelgen" else 12)


def _gpu_ms_per_step(model, data, mode, steps=10):
    """(host ms a step, wall ms a step): the steps queued back to back with no host sync between them (the loss read
    once at the end).  The host's time is until its last step is queued; the wall time until the GPU finished it.
    Where the two are close, the step is bound by its host (or the GPU's queue filled: then the host's time is the
    wall time less a few steps)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for step in range(steps):
        x, labels = data[step % len(data)]
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode == "bf16"):
            loss = torch.nn.functional.cross_entropy(model(x), labels)
        loss.backward()
        opt.step()
    queued = time.perf_counter() - t
    loss.item()
    return queued * 1e3 / steps, (time.perf_counter() - t) * 1e3 / steps


if __name__ == "__main__":
    main()
