"""Where a TMA launcher's call goes (H100): the whole call, its rounding kernels alone, the conv kernel alone, and
the host time of a call, for tuned TF32 rows of the gpu_md table.  Each timed figure is the median of CUDA-event
timed calls (tuning.timing.time_cuda), as the bench times them.

    python scripts/launch_cost.py [--layers r50_3x3_14,...] [--directions fwd,bwd_data] [--out launch_cost.json]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="r18_c256_8,r18_c512_4,r50_3x3_14,r50_3x3_7")
    ap.add_argument("--directions", default="fwd,bwd_data")
    ap.add_argument("--out", default="launch_cost.json")
    ap.add_argument("--profile", action="store_true", help="cProfile the first row's calls (host time by function)")
    args = ap.parse_args(argv)
    from numba import cuda

    from kernelgen.api import get_launcher, make_plan
    from kernelgen.runtime.driver import pointer_size
    from kernelgen.tuning.shapes import load_table
    from kernelgen.tuning.timing import time_cuda
    from kernelgen.tuning.tuner import random_inputs
    _, layers = load_table("gpu_md")
    rows = []
    for layer in layers:
        if layer.name not in args.layers.split(","):
            continue
        for d in args.directions.split(","):
            p = layer.problem(d)
            launcher = get_launcher(make_plan(p, "cuda", precision="tf32"))
            inputs = {k: cuda.to_device(v.reshape(-1)) for k, v in random_inputs(p, np.random.default_rng(0)).items()}
            inputs[launcher.outputs[0]] = cuda.device_array(int(np.prod(p.output_shape)), np.float32)
            launcher(inputs)
            launcher(inputs)  # the fast route from here on
            row = {"layer": layer.name, "dir": d, "config": str(make_plan(p, "cuda", precision="tf32").config),
                   "call_us": 1e3 * time_cuda(lambda: launcher(inputs), repeat=50)}
            # back to back: 20 calls between two events, so the GPU never waits for the host (its time per call)
            row["call_gpu_us"] = 1e3 * time_cuda(lambda: [launcher(inputs) for _ in range(20)], repeat=10) / 20
            if launcher.tensor_maps:
                ptr_sizes = [pointer_size(inputs[n], n) for n in launcher.caller_params]
                derived = launcher._derived_pointers(ptr_sizes, None)
                row["round_us"] = 1e3 * time_cuda(lambda: launcher._derived_pointers(ptr_sizes, None), repeat=50)
                row["conv_us"] = 1e3 * time_cuda(lambda: launcher._fast(derived, 4, 0), repeat=50)
                row["round_gpu_us"] = 1e3 * time_cuda(
                    lambda: [launcher._derived_pointers(ptr_sizes, None) for _ in range(20)], repeat=10) / 20
                row["conv_gpu_us"] = 1e3 * time_cuda(lambda: [launcher._fast(derived, 4, 0) for _ in range(20)],
                                                     repeat=10) / 20
            cuda.synchronize()
            t = time.perf_counter()
            for _ in range(200):
                launcher(inputs)
            row["host_us"] = (time.perf_counter() - t) / 200 * 1e6  # the queue backs up: host time per call
            cuda.synchronize()
            if args.profile and not rows:  # where the first row's host time goes
                import cProfile
                import pstats
                prof = cProfile.Profile()
                prof.runcall(lambda: [launcher(inputs) for _ in range(300)])
                cuda.synchronize()
                pstats.Stats(prof).sort_stats("tottime").print_stats(14)
            print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
            rows.append(row)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
