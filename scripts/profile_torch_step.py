"""GPU: where a converted ResNet-18 CIFAR step (kernelgen.torch.bench's, batch 128) spends its time: torch.profiler
over a few steps after warm-up, kernels by total CUDA time and the step's wall time, for torch's model and the
converted one (MODE fp32 or bf16).  Prints tables; writes $OUT/profile_<mode>.json (per-kernel totals)."""
from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kernelgen.torch.bench import batches, models, train


def main(mode="bf16", steps=5):
    torch.backends.cudnn.benchmark = True
    data = batches(4, 128)
    out = {}
    for name, model in zip(("torch", "kernelgen"), models()):
        train(model, data, 8, mode)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            train(model, data, steps, mode)
            wall = (time.perf_counter() - start) / steps
        rows = []
        for e in prof.key_averages():
            cuda_us = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
            if cuda_us and e.key and not e.key.startswith(("aten::", "autograd", "Optimizer", "cudaLaunch")):
                rows.append((e.key[:90], e.count // steps, cuda_us / steps / 1e3))
        rows.sort(key=lambda r: -r[2])
        gpu = sum(r[2] for r in rows)
        print(f"== {name} {mode}: wall {wall * 1e3:.2f} ms/step, kernels {gpu:.2f} ms/step")
        for key, count, ms in rows[:25]:
            print(f"  {ms:7.3f} ms  x{count:<3} {key}")
        out[name] = {"wall_ms": wall * 1e3, "kernels_ms": gpu, "rows": rows}
    with open(os.path.join(os.environ.get("OUT", "."), f"profile_{mode}.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(*(sys.argv[1:2] or ["bf16"]))
