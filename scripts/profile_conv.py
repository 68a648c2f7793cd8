"""Run one gpu_md layer's convolution a few times, for a profiler (ncu) to look at.  Not a benchmark.

    python scripts/profile_conv.py LAYER DIRECTION [--precision tf32] [--set FIELD=V,...] [--torch] [--calls 3]

--set replaces fields of the plan's config (as `bench --set`); --torch runs cuDNN's convolution instead
(TF32 on for --precision tf32), so the same profiler command shows what cuDNN launches for the layer.
"""
from __future__ import annotations

import argparse

import numpy as np


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("layer")
    ap.add_argument("direction", choices=("fwd", "bwd_data", "bwd_weight"))
    ap.add_argument("--precision", default="tf32")
    ap.add_argument("--set", default="")
    ap.add_argument("--torch", action="store_true")
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args(argv)
    from numba import cuda

    from kernelgen.api import get_launcher, make_plan
    from kernelgen.tuning.bench import TorchConv, set_fields
    from kernelgen.tuning.shapes import load_table
    layer = {l.name: l for l in load_table("gpu_md")[1]}[args.layer]
    p = layer.problem(args.direction)
    if args.torch:
        tc = TorchConv(tf32=args.precision == "tf32")
        gen = tc.torch.Generator(device="cuda").manual_seed(0)
        x, xv = tc.nhwc(p.x_shape, gen)
        w, wv = tc.nhwc(p.w_shape, gen)
        dy, dyv = tc.nhwc(p.y_shape, gen)
        op = tc.op(layer, args.direction, xv, wv, dyv)
        for _ in range(args.calls):
            op()
        tc.torch.cuda.synchronize()
        return 0
    plan = set_fields(make_plan(p, "cuda", precision=args.precision), args.set or None)
    if isinstance(plan, str):
        raise SystemExit(plan)
    print(plan.config, flush=True)
    launcher = get_launcher(plan)
    rng = np.random.default_rng(0)
    shapes = {"x": p.x_shape, "w": p.w_shape, "dy": p.y_shape}
    args_ = {n: cuda.to_device(rng.standard_normal(int(np.prod(shapes[n]))).astype(np.float32))
             for n in launcher.params if n != launcher.outputs[0]}
    args_[launcher.outputs[0]] = cuda.device_array(int(np.prod(p.output_shape)), np.float32)
    for _ in range(args.calls):
        launcher(args_)
    cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
