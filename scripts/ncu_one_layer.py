#!/usr/bin/env python
"""One layer's kernel, kernelgen's and cuDNN's, inside a profiler range, for Nsight Compute (the GPU machine only).

    ncu --profile-from-start off --clock-control none --section SpeedOfLight ... \
        python scripts/ncu_one_layer.py --table gpu_md --layer r50_3x3_14 --direction bwd_weight --precision fp16

Each side runs once outside the range (compiling, cuDNN's algorithm search under cudnn.benchmark), then once inside
it (cudaProfilerStart / Stop), so ncu profiles exactly those launches: kernelgen's kernel (and its split-K
reduction or rounding, where it has them), then cuDNN's, on the same float16 (or float32) channels-last tensors.
"""
from __future__ import annotations

import argparse

import numpy as np


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", default="gpu_md")
    ap.add_argument("--layer", required=True)
    ap.add_argument("--direction", choices=["fwd", "bwd_data", "bwd_weight"], default="bwd_weight")
    ap.add_argument("--precision", choices=["fp32", "tf32", "fp16"], default="fp16")
    ap.add_argument("--config", action="append", default=[],
                    help="kernelgen's side runs this config instead of the planner's pick (a TileConfig or "
                    "DepthwiseConfig string; repeat it to profile several, one after another)")
    args = ap.parse_args(argv)

    import torch
    import kernelgen
    from kernelgen.tuning.shapes import load_table
    _, layers = load_table(args.table)
    layer = next(lay for lay in layers if lay.name == args.layer)
    x_shape, w_shape, kw = layer.shapes()
    dtype = torch.float16 if args.precision == "fp16" else torch.float32
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = args.precision == "tf32"
    rng = np.random.default_rng(0)
    x = torch.tensor(rng.standard_normal(x_shape), dtype=dtype, device="cuda")
    w = torch.tensor(rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:])), dtype=dtype, device="cuda")
    y = kernelgen.conv(x, w, precision=args.precision, **kw)
    dy = torch.tensor(rng.standard_normal(tuple(y.shape)), dtype=dtype, device="cuda")
    ours = {"fwd": lambda: kernelgen.conv(x, w, precision=args.precision, **kw),
            "bwd_data": lambda: kernelgen.conv_backward_data(dy, w, x_shape, precision=args.precision, **kw),
            "bwd_weight": lambda: kernelgen.conv_backward_weight(x, dy, w_shape, precision=args.precision, **kw)}
    nchw = lambda t: t.permute(0, 3, 1, 2)  # channels-last views: (N, C, H, W) shapes over NHWC memory
    tx, tw, tdy = nchw(x), nchw(w), nchw(dy)
    pair = lambda v: [v, v] if isinstance(v, int) else list(v)  # (aten's backward wants lists)
    pad, stride, dil, groups = pair(kw["padding"]), pair(kw["stride"]), pair(kw["dilation"]), kw["groups"]
    theirs = {"fwd": lambda: torch.nn.functional.conv2d(tx, tw, None, stride, pad, dil, groups),
              "bwd_data": lambda: torch.ops.aten.convolution_backward(
                  tdy, tx, tw, None, stride, pad, dil, False, [0, 0], groups, [True, False, False]),
              "bwd_weight": lambda: torch.ops.aten.convolution_backward(
                  tdy, tx, tw, None, stride, pad, dil, False, [0, 0], groups, [False, True, False])}
    op, op_args = {"fwd": (kernelgen.conv, (x, w)), "bwd_data": (kernelgen.conv_backward_data, (dy, w, x_shape)),
                   "bwd_weight": (kernelgen.conv_backward_weight, (x, dy, w_shape))}[args.direction]
    print("\n".join(str(kernelgen.explain(op, *op_args, precision=args.precision, **kw)).splitlines()[:8]), flush=True)
    runs = [_with_config(c, layer, args, x, w, dy) for c in args.config] or [ours[args.direction]]
    for run in runs + [theirs[args.direction]]:
        run()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for run in runs:
        run()
        torch.cuda.synchronize()
    theirs[args.direction]()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"profiled {args.layer} {args.direction} {args.precision}: kernelgen's launches, then cuDNN's")


def _with_config(text, layer, args, x, w, dy):
    """A call of the layer's kernel built for config `text`: the planner's Plan with that config, launched on the
    torch tensors' memory (flat views, no copies)."""
    import torch
    from kernelgen import planner
    from kernelgen.templates.config import TileConfig
    from kernelgen.templates.depthwise_config import DepthwiseConfig, is_depthwise_config
    from numba import cuda
    problem = layer.problem(args.direction, "float16" if args.precision == "fp16" else "float32")
    if is_depthwise_config(text):
        cfg, variant, precision = DepthwiseConfig.parse(text), "depthwise", ()
    else:
        cfg = TileConfig.parse(text)
        variant = "implicit_gemm_tc" if cfg.tensor_core else "implicit_gemm"
        precision = (args.precision,) if cfg.tensor_core else ()
    launcher = planner.get_launcher(planner.Plan(problem, variant, cfg, "cuda", *precision))
    out_name = launcher.outputs[0]
    tensors = {"x": x, "w": w, "dy": dy, "y": None, "dx": None, "dw": None}
    shape = {"fwd": dy.shape, "bwd_data": x.shape, "bwd_weight": w.shape}[args.direction]
    out = torch.empty(shape, dtype=x.dtype, device="cuda")  # (a widened output's float32 workspace is the launcher's)
    flat = {name: cuda.as_cuda_array((out if name == out_name else tensors[name]).reshape(-1))
            for name in launcher.caller_params}
    print(f"config {text}: {launcher.label or problem.key()}", flush=True)
    return lambda: launcher(flat)


if __name__ == "__main__":
    main()
