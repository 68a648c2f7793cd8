"""`python -m kernelgen bench TABLE [--compare torch]`: kernelgen vs cuDNN per problem, same run.

For every layer of a shape table and every direction (fwd, bwd_data, bwd_weight) this builds
kernelgen's kernel, checks its output against the comparator (or the float64 reference when
there is none), times both with CUDA events and writes a JSON report, a Markdown table and,
with matplotlib, a PNG plot.  cuDNN runs through torch with channels_last tensors and TF32 off, or, with
--precision tf32 (kernelgen's tensor-core kernels), with torch's TF32 switches on: like against like.
With --precision fp16 both run on the same float16 channels-last tensors (shapes.storage_dtype); with bf16
cuDNN runs on bfloat16 copies while kernelgen reads and writes float32 (it takes no bfloat16 arrays).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from kernelgen import settings
from kernelgen.planner import get_launcher, make_plan
from kernelgen.storage import PRECISIONS
from kernelgen.templates.config import TileConfig

from .shapes import load_table, storage_dtype
from .timing import Rotation, time_side_by_side

FP32_PEAK = 67e12     # H100 SXM fp32 FMA peak (shared/GPU.md)
TF32_PEAK = 396e12    # H100 SXM dense TF32 tensor-core peak (shared/GPU.md)
FP16_PEAK = 2 * TF32_PEAK  # dense FP16 / BF16 tensor-core peak: twice TF32's (NVIDIA's H100 SXM datasheet)
PEAKS = {"fp32": FP32_PEAK, "tf32": TF32_PEAK, "fp16": FP16_PEAK, "bf16": FP16_PEAK}
CUDNN_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}  # the 16-bit precisions' cuDNN comparator
HBM_BW = 3.0e12       # measured device-to-device copy, read + write

DIRECTIONS = ("fwd", "bwd_data", "bwd_weight")


def git_commit():
    if settings.get("commit"):  # the device machine gets a copy of the tree without .git
        return settings.get("commit")
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def floor_ms(p, precision="fp32"):
    """max(FLOPs / peak, compulsory bytes / bandwidth): no kernel runs much faster (bytes of p.dtype)."""
    nbytes = np.dtype(p.dtype).itemsize * (np.prod(p.x_shape) + np.prod(p.w_shape) + np.prod(p.y_shape))
    return max(p.flops / PEAKS[precision], nbytes / HBM_BW) * 1e3


def kernel_resources(launcher, threads):
    """Registers, local memory and shared memory of the compiled kernel, and the occupancy they allow."""
    k = launcher.kernel
    one = lambda v: next(iter(v.values())) if isinstance(v, dict) else v  # one overload per kernel
    try:
        regs = int(one(k.get_regs_per_thread()))
        local = int(one(k.get_local_mem_per_thread()))
        smem = int(one(k.get_shared_mem_per_block()))
    except Exception:  # simulator or an older numba: no resource queries
        return {}
    blocks = min(32, 2048 // threads, 65536 // max(1, regs * threads),
                 (228 * 1024) // max(1, smem + 1024))
    return {"registers": regs, "local_bytes": local, "shared_bytes": smem, "blocks_per_sm": blocks,
            "occupancy": round(blocks * threads / 2048, 3)}


# --- torch/cuDNN side -------------------------------------------------------------------------------

class TorchConv:
    """cuDNN through torch: NCHW-logical tensors in channels_last memory, TF32 off unless tf32=True.
    dtype "float16" / "bfloat16": cuDNN runs on 16-bit copies of the inputs (its own fp16/bf16 kernels,
    16-bit inputs and outputs).  kernelgen's tensors are in its storage dtype (shapes.storage_dtype): at
    fp16 float16, the very tensors cuDNN reads; at bf16 float32 (kernelgen takes no bfloat16 arrays), from
    which cuDNN's bfloat16 copies are made."""

    def __init__(self, tf32=False, dtype=None):
        import torch
        torch.backends.cudnn.allow_tf32 = tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        self.tf32 = tf32
        self.dtype = getattr(torch, dtype) if dtype else None
        torch.backends.cudnn.benchmark = True
        self.torch = torch

    def nhwc(self, shape, gen, storage="float32"):
        """A random NHWC tensor of `shape` for kernelgen, contiguous, of dtype `storage`, and cuDNN's NCHW
        channels_last view of its own input (self.dtype, else float32): the same memory where the two dtypes
        agree (float32 for fp32/tf32, float16 for fp16), else a converted copy of the same float32 values."""
        torch = self.torch
        t = torch.randn(shape, device="cuda", generator=gen)
        c = t if self.dtype is None else t.to(self.dtype)
        k = c if c.dtype == getattr(torch, storage) else t.to(getattr(torch, storage))
        return k, c.permute(0, 3, 1, 2)

    def op(self, layer, direction, x, w, dy):
        """A zero-argument callable running cuDNN for this direction (inputs as NCHW views)."""
        F, torch = self.torch.nn.functional, self.torch
        s, p, d, g = layer.stride, layer.padding, layer.dilation, layer.groups
        if layer.transposed:  # deconv forward (timed only for "fwd")
            return lambda: F.conv_transpose2d(dy, w, stride=s, padding=p, output_padding=layer.output_padding,
                                              dilation=d, groups=g)
        if direction == "fwd":
            return lambda: F.conv2d(x, w, stride=s, padding=p, dilation=d, groups=g)
        mask = [direction == "bwd_data", direction == "bwd_weight", False]
        return lambda: torch.ops.aten.convolution_backward(dy, x, w, None, [s, s], [p, p], [d, d], False, [0, 0],
                                                           g, mask)


def bench_problem(layer, direction, torch_conv, rotations=3, repeat=20, config=None, algo=None, precision="fp32"):
    """Time one (layer, direction) for kernelgen and, when given, cuDNN; check kernelgen's output.  kernelgen
    runs on tensors of storage_dtype(precision) (float16 at fp16: the tensors cuDNN reads) into an output of
    that dtype; its error against cuDNN is taken in float32."""
    from numba import cuda
    torch = torch_conv.torch
    p = layer.problem(direction, storage_dtype(precision))
    plan = make_plan(p, "cuda", algo, config, precision)
    t0 = time.perf_counter()
    launcher = get_launcher(plan)
    gen = torch.Generator(device="cuda").manual_seed(0)
    sets, views = [], []
    for _ in range(rotations):
        x, xv = torch_conv.nhwc(p.x_shape, gen, p.dtype)
        w, wv = torch_conv.nhwc(p.w_shape, gen, p.dtype)
        dy, dyv = torch_conv.nhwc(p.y_shape, gen, p.dtype)
        out = torch.empty(p.output_shape, device="cuda", dtype=getattr(torch, p.dtype))
        names = {"fwd": {"x": x, "w": w}, "bwd_data": {"dy": dy, "w": w}, "bwd_weight": {"x": x, "dy": dy}}
        args = {n: cuda.as_cuda_array(t.reshape(-1)) for n, t in names[p.direction].items()}
        args[launcher.outputs[0]] = cuda.as_cuda_array(out.reshape(-1))
        sets.append(args)
        views.append((xv, wv, dyv, out))
    launcher(sets[0])
    cuda.synchronize()
    compile_s = time.perf_counter() - t0
    # correctness against cuDNN (same precision setting) on the first input set
    xv, wv, dyv, out = views[0]
    ref_fn = torch_conv.op(layer, "fwd" if layer.transposed else direction, xv, wv, dyv)
    ref = ref_fn()
    if isinstance(ref, tuple):
        ref = ref[0] if direction in ("bwd_data",) else ref[1]
    ref_nhwc = ref.permute(0, 2, 3, 1).float()
    rel = float((out.float() - ref_nhwc).norm() / ref_nhwc.norm())
    rot = Rotation(sets)
    trot = Rotation([torch_conv.op(layer, "fwd" if layer.transposed else direction, *v[:3]) for v in views])
    kg_ms, cudnn_ms = time_side_by_side([lambda: launcher(rot()), lambda: trot()()], repeat=repeat)
    row = {"layer": layer.name, "shape": layer.label(), "direction": "deconv" if layer.transposed else direction,
           "variant": plan.variant, "config": str(plan.config), "kernelgen_ms": kg_ms, "cudnn_ms": cudnn_ms,
           "kernelgen_tflops": p.flops / kg_ms / 1e9, "cudnn_tflops": p.flops / cudnn_ms / 1e9,
           "ratio": cudnn_ms / kg_ms, "rel_err_vs_cudnn": rel, "floor_ms": floor_ms(p, precision),
           "pct_of_floor": floor_ms(p, precision) / kg_ms, "first_call_s": compile_s, "precision": precision, "dtype": p.dtype,
           "pct_of_peak": p.flops / kg_ms / 1e9 / (PEAKS[precision] / 1e12),
           **kernel_resources(launcher, launcher.threads)}
    return row


def _applies(problem, algo):
    """A forced variant is benched only on the problems it can compute (one algo list, many tables)."""
    if algo is None:
        return True
    from kernelgen.templates import computes, get_variant
    return computes(get_variant(algo), problem)


def parse_overrides(text):
    """'swizzle=2,stages=1' -> {'swizzle': 2, 'stages': 1}: integer TileConfig fields only."""
    fields = {f.name for f in dataclasses.fields(TileConfig)}
    out = {}
    for item in filter(None, text.split(",")):
        key, _, val = item.partition("=")
        if key not in fields or not val.lstrip("-").isdigit():
            raise ValueError(f"--set: expected FIELD=INTEGER with FIELD one of {sorted(fields)}, got {item!r}")
        out[key] = int(val)
    return out


def set_fields(plan, text):
    """The plan with --set's fields replaced in its config (text None: unchanged), or the reason it cannot be."""
    if not text:
        return plan
    try:
        return make_plan(plan.problem, "cuda", plan.variant, dataclasses.replace(plan.config, **parse_overrides(text)),
                         plan.precision)
    except ValueError as e:
        return f"--set {text}: {e}"


def precompile(plans, workers=None):
    """Compile every plan's kernel in parallel worker processes (they fill the disk cache), so the
    timed loop only loads; numba compiles one kernel per process at a time.  Returns each plan's
    compile error (None where it compiled): the timed loop skips those rather than compile them again."""
    import os
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from .tuner import _compile_one
    from kernelgen.runtime.cache import cache_dir
    settings.export_default("cache_dir", str(cache_dir()))
    with ProcessPoolExecutor(workers or min(16, os.cpu_count() or 1), mp_context=get_context("spawn")) as pool:
        # the precision too: without it a tensor-core plan would precompile its variant's default (TF32) kernel;
        # the problem carries the storage dtype, so an fp16 plan's kernel is compiled for float16 arrays
        jobs = [(p.problem, p.variant, p.config, p.precision) for p in plans]
        errors = [e for e, _ in pool.map(_compile_one, jobs)]
    for plan, e in zip(plans, errors):
        if e:
            print(f"precompile: {plan.problem.key()} {plan.config}: {e}")
    return errors


def geomean(vals):
    vals = [v for v in vals if v and v > 0]
    return math.exp(sum(map(math.log, vals)) / len(vals)) if vals else float("nan")


def run_label(row):
    """What a row's run forced: its variant (--algo) and its config fields (--set), "" for neither."""
    return " ".join(filter(None, (row.get("forced"), row.get("set"))))


def summary(rows):
    """Geo-mean ratio per direction (and per forced variant / --set alternative, when the run had several)."""
    out = {}
    for a in sorted({run_label(x) for x in rows}):
        for d in DIRECTIONS + ("deconv",):
            r = [x["ratio"] for x in rows if x["direction"] == d and "ratio" in x and run_label(x) == a]
            if r:
                out[f"{d} [{a}]" if a else d] = {"geomean_ratio": geomean(r), "n": len(r)}
    return out


def markdown(rows, summ):
    head = ("| layer | dir | variant / config | kernelgen TFLOP/s | cuDNN TFLOP/s | ratio | regs | smem B | local B | occ | "
            "% peak | % floor | rel err |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['layer']} | {r['direction']} | FAILED: {r['error'][:60]} | | | | | | | | | | |")
            continue
        lines.append(f"| {r['layer']} | {r['direction']} | {r['variant']} {r['config']} | {r['kernelgen_tflops']:.1f} | "
                     f"{r['cudnn_tflops']:.1f} | {r['ratio']:.2f} | {r.get('registers', '')} | "
                     f"{r.get('shared_bytes', '')} | {r.get('local_bytes', '')} | {r.get('occupancy', '')} | "
                     f"{100 * r.get('pct_of_peak', 0):.0f}% | {100 * r['pct_of_floor']:.0f}% | "
                     f"{r['rel_err_vs_cudnn']:.1e} |")
    lines.append("")
    precision = next((r["precision"] for r in rows if "precision" in r), "fp32")  # (failed rows have none)
    cudnn = f"cuDNN in {CUDNN_DTYPES[precision]}" if precision in CUDNN_DTYPES else \
        f"cuDNN with TF32 {'on' if precision == 'tf32' else 'off'}"
    lines.append(f"precision {precision}: kernelgen on {storage_dtype(precision)} tensors; % peak is of "
                 f"{PEAKS[precision] / 1e12:.0f} TFLOP/s; {cudnn}")
    for d, s in summ.items():
        lines.append(f"- geo-mean ratio (cuDNN time / kernelgen time), {d}: **{s['geomean_ratio']:.3f}** over {s['n']}")
    return "\n".join(lines)


def plot(rows, path, precision="fp32"):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in rows if "ratio" in r]
    labels = [f"{r['layer']}:{r['direction']}" for r in ok]
    fig, ax = plt.subplots(figsize=(max(8, len(ok) * 0.35), 5))
    xs = np.arange(len(ok))
    ax.bar(xs - 0.2, [r["kernelgen_tflops"] for r in ok], 0.4, label="kernelgen")
    ax.bar(xs + 0.2, [r["cudnn_tflops"] for r in ok], 0.4, label=f"cuDNN {precision}")
    ax.set_xticks(xs, labels, rotation=90, fontsize=7)
    ax.set_ylabel("effective TFLOP/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m kernelgen bench", description=__doc__.splitlines()[0])
    ap.add_argument("table", help="shape table name (e.g. gpu_md) or JSON path")
    ap.add_argument("--compare", default="torch", choices=["torch"], help="comparator (cuDNN through torch)")
    ap.add_argument("--directions", default="fwd,bwd_data,bwd_weight")
    ap.add_argument("--layers", default="", help="comma-separated layer names (default: all)")
    ap.add_argument("--algo", default=None, help="force a variant; several, comma-separated, are benched "
                    "side by side on the problems each applies to")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--precision", default="fp32", choices=PRECISIONS,
                    help="kernelgen precision; tf32 also turns torch's TF32 switches on for cuDNN, fp16/bf16 run "
                         "cuDNN on float16/bfloat16 channels-last copies")
    ap.add_argument("--set", action="append", default=None, metavar="FIELD=VALUE,...",
                    help="tile-config fields replaced in every plan's config, e.g. swizzle=2; given several times, "
                         "each is one alternative and all are benched side by side per problem (an A/B run in one "
                         "process: this machine moves by up to 2x per row between processes)")
    ap.add_argument("--out", default="bench.json", help="JSON report path (.md and .png written beside it)")
    args = ap.parse_args(argv)
    from kernelgen.planner import gpu_present
    if not gpu_present():
        print("bench needs a CUDA GPU (numba.cuda.is_available() is False); nothing to do")
        return 1
    name, layers = load_table(args.table)
    if args.layers:
        keep = set(args.layers.split(","))
        layers = [l for l in layers if l.name in keep]
    dirs = args.directions.split(",")
    tc = TorchConv(tf32=args.precision == "tf32", dtype=CUDNN_DTYPES.get(args.precision))
    from tqdm import tqdm
    rows = []
    algos = args.algo.split(",") if args.algo else [None]
    dtype = storage_dtype(args.precision)
    jobs = [(l, d, a) for l in layers for d in dirs if not (l.transposed and d != "fwd") for a in algos
            if _applies(l.problem(d, dtype), a)]
    alternatives = args.set or [None]
    for text in filter(None, alternatives):
        parse_overrides(text)  # a typo fails here, before anything compiles
    jobs = [(l, d, a, alt) for l, d, a in jobs for alt in alternatives]
    plans = [set_fields(make_plan(l.problem(d, dtype), "cuda", a, precision=args.precision), alt)
             for l, d, a, alt in jobs]
    runnable = [i for i, p in enumerate(plans) if not isinstance(p, str)]
    for i, error in zip(runnable, precompile([plans[i] for i in runnable])):
        if error:
            plans[i] = error
    for (layer, d, a, alt), plan in tqdm(list(zip(jobs, plans)), desc="bench", unit="problem"):
        label = {"forced": a} if a else {}
        label |= {"set": alt} if alt else {}
        if isinstance(plan, str):  # the alternative does not fit this plan's config (swizzle=2 at BK 32, say), or
            # its kernel failed to compile in precompile (a second in-process compile would only fail again)
            rows.append({"layer": layer.name, "direction": d, **label, "error": plan})
            continue
        try:
            # an alternative is the plan's own variant with the replaced config (a tuned plan's variant included)
            rows.append(bench_problem(layer, d, tc, repeat=args.repeat, config=plan.config if alt else None,
                                      algo=plan.variant if alt else a, precision=args.precision) | label)
        except Exception as e:  # record and go on: one bad kernel must not hide the rest of the table
            rows.append({"layer": layer.name, "direction": d, **label, "error": f"{type(e).__name__}: {e}"})
    from numba import cuda
    summ = summary(rows)
    report = {"table": name, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "device": cuda.get_current_device().name.decode() if isinstance(cuda.get_current_device().name, bytes)
              else str(cuda.get_current_device().name), "commit": git_commit(), "host": platform.node(),
              "torch": tc.torch.__version__, "cudnn": tc.torch.backends.cudnn.version(), "tf32": tc.tf32,
              "precision": args.precision, "dtype": dtype,
              "rows": rows, "summary": summ}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    md = markdown(rows, summ)
    out.with_suffix(".md").write_text(md + "\n")
    try:
        plot(rows, out.with_suffix(".png"), args.precision)
    except ImportError:
        pass
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
