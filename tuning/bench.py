"""`python -m kernelgen bench TABLE [--compare torch]`: kernelgen vs cuDNN per problem, same run.

For every layer of a shape table and every direction (fwd, bwd_data, bwd_weight) this builds
kernelgen's kernel, checks its output against the comparator (or the float64 reference when
there is none), times both with CUDA events and writes a JSON report, a Markdown table and,
with matplotlib, a PNG plot.  cuDNN runs through torch with channels-last tensors (NWC, NHWC or NDHWC memory:
the layer's 1, 2 or 3 spatial dims) and TF32 off, or, with --precision tf32 (kernelgen's tensor-core kernels),
with torch's TF32 switches on: like against like.
With --precision fp16 / bf16 both run on the same float16 / bfloat16 channels-last tensors (shapes.storage_dtype).
Depthwise layers (groups == C) are reported, but kept out of the geo-means: they have a line of their own.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import subprocess
import time
from concurrent.futures import ProcessPoolExecutor
from datetime import datetime, timezone
from multiprocessing import get_context
from pathlib import Path

import numpy as np
from tqdm import tqdm

from kernelgen import arrays, settings
from kernelgen.planner import get_launcher, gpu_present, make_plan
from kernelgen.runtime.cache import cache_dir
from kernelgen.storage import PRECISIONS, numpy_dtype
from kernelgen.templates import computes, get_variant

from .compile_pool import compile_one
from kernelgen.templates.config import TileConfig
from kernelgen.templates.depthwise_config import DepthwiseConfig

from kernelgen.tuning.shapes import load_table, storage_dtype
from kernelgen.tuning.plan_with import database_directory, shipped_from
from kernelgen.tuning.timing import Rotation, time_side_by_side

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
    nbytes = numpy_dtype(p.dtype).itemsize * (np.prod(p.x_shape) + np.prod(p.w_shape) + np.prod(p.y_shape))
    return max(p.flops / PEAKS[precision], nbytes / HBM_BW) * 1e3


def roofline_ms(p):
    """The memory roofline: x, w and y of p (input, filter, output; in p.dtype) each moved once at HBM_BW.  The
    bar of a memory-bound layer (a depthwise one does a handful of FMAs per byte), which the bench reports as a
    percentage per row for kernelgen and cuDNN alike."""
    nbytes = numpy_dtype(p.dtype).itemsize * (np.prod(p.x_shape) + np.prod(p.w_shape) + np.prod(p.y_shape))
    return float(nbytes / HBM_BW * 1e3)


ROOFLINE_MAP = 56 * 56  # the bar (60 % of the roofline) is for the layers of at least 56 x 56 input maps
ROOFLINE_BAR = 0.6


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
# Pure functions of torch tensors (any device), so that the CPU tests check them against the float64 reference.

def channels_first(t):
    """torch's logical (N, C, *spatial) view of a channels-last tensor (N, *spatial, C), in the same memory: a
    contiguous NHWC tensor is channels_last to torch, an NDHWC one channels_last_3d, an NWC one the 1D alike.
    A kernelgen weight (K, *filter, C // groups) becomes torch's (K, C // groups, *filter), a transposed layer's
    (C, *filter, K // groups) torch's conv_transpose weight (C, K // groups, *filter)."""
    return t.permute(0, t.ndim - 1, *range(1, t.ndim - 1))


def channels_last(t):
    """The channels-last (N, *spatial, C) view of torch's (N, C, *spatial) tensor: channels_first undone."""
    return t.permute(0, *range(2, t.ndim), 1)


def per_dim(value, dims):
    """A layer's stride / padding / dilation / output_padding (an int or one per dim) as the list torch takes."""
    return list(value) if isinstance(value, tuple) else [value] * dims


def torch_conv_call(torch, layer, direction, x, w, dy):
    """A zero-argument callable running torch's convolution of `layer` in `direction` on the channels_first views
    x, w, dy (conv1d / conv2d / conv3d by the layer's spatial dims; a transposed layer runs its deconvolution
    forward on dy, whatever the direction).  Backward directions return convolution_backward's tuple
    (torch_result picks the tensor)."""
    F, n, g = torch.nn.functional, layer.dims, layer.groups
    s, p, d = (per_dim(v, n) for v in (layer.stride, layer.padding, layer.dilation))
    if layer.transposed:
        deconv, op = getattr(F, f"conv_transpose{n}d"), per_dim(layer.output_padding, n)
        return lambda: deconv(dy, w, stride=s, padding=p, output_padding=op, dilation=d, groups=g)
    if direction == "fwd":
        conv = getattr(F, f"conv{n}d")
        return lambda: conv(x, w, stride=s, padding=p, dilation=d, groups=g)
    mask = [direction == "bwd_data", direction == "bwd_weight", False]
    return lambda: torch.ops.aten.convolution_backward(dy, x, w, None, s, p, d, False, [0] * n, g, mask)


def torch_result(result, direction):
    """The tensor kernelgen computes, channels-last, from what torch_conv_call's callable returned (dx or dw of
    convolution_backward's (dx, dw, db))."""
    if isinstance(result, tuple):
        result = result[0] if direction == "bwd_data" else result[1]
    return channels_last(result)


class TorchConv:
    """cuDNN through torch: channels-first-logical tensors in channels-last memory, TF32 off unless tf32=True.
    dtype "float16" / "bfloat16": cuDNN runs on 16-bit copies of the inputs (its own fp16/bf16 kernels,
    16-bit inputs and outputs).  kernelgen's tensors are in its storage dtype (shapes.storage_dtype): at
    fp16 / bf16 float16 / bfloat16, the very tensors cuDNN reads."""

    device = "cuda"

    def __init__(self, tf32=False, dtype=None, device="cuda"):
        import torch
        torch.backends.cudnn.allow_tf32 = tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        self.tf32 = tf32
        self.dtype = getattr(torch, dtype) if dtype else None
        self.device = device
        torch.backends.cudnn.benchmark = True
        self.torch = torch

    def nhwc(self, shape, gen, storage="float32"):
        """A random channels-last tensor of `shape` (NWC, NHWC or NDHWC) for kernelgen, contiguous, of dtype
        `storage`, and cuDNN's channels_first view of its own input (self.dtype, else float32): the same memory
        where the two dtypes agree (float32 for fp32/tf32, float16 for fp16), else a converted copy of the same
        float32 values."""
        torch = self.torch
        t = torch.randn(shape, device=self.device, generator=gen)
        c = t if self.dtype is None else t.to(self.dtype)
        k = c if c.dtype == getattr(torch, storage) else t.to(getattr(torch, storage))
        return k, channels_first(c)

    def op(self, layer, direction, x, w, dy):
        """A zero-argument callable running cuDNN for this direction (inputs as channels_first views)."""
        return torch_conv_call(self.torch, layer, direction, x, w, dy)


def _row_base(layer, direction, label):
    """The fields every row of `layer` has, a failed one too."""
    row = {"layer": layer.name, **({"net": layer.net} if layer.net else {}), "shape": layer.label(),
           "direction": "deconv" if layer.transposed else direction}
    return row | ({"depthwise": True} if layer.depthwise else {}) | label


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
    gen = torch.Generator(device=torch_conv.device).manual_seed(0)
    sets, views = [], []
    for _ in range(rotations):
        x, xv = torch_conv.nhwc(p.x_shape, gen, p.dtype)
        w, wv = torch_conv.nhwc(p.w_shape, gen, p.dtype)
        dy, dyv = torch_conv.nhwc(p.y_shape, gen, p.dtype)
        out = torch.empty(p.output_shape, device="cuda", dtype=getattr(torch, p.dtype))
        names = {"fwd": {"x": x, "w": w}, "bwd_data": {"dy": dy, "w": w}, "bwd_weight": {"x": x, "dy": dy}}
        args = {n: arrays.to_device_view(t.reshape(-1), n) for n, t in names[p.direction].items()}  # (bf16: bits)
        args[launcher.outputs[0]] = arrays.to_device_view(out.reshape(-1), "out")
        sets.append(args)
        views.append((xv, wv, dyv, out))
    launcher(sets[0])
    cuda.synchronize()
    compile_s = time.perf_counter() - t0
    # correctness against cuDNN (same precision setting) on the first input set
    xv, wv, dyv, out = views[0]
    ref = torch_result(torch_conv.op(layer, direction, xv, wv, dyv)(), direction).float()
    rel = float((out.float() - ref).norm() / ref.norm())
    rot = Rotation(sets)
    trot = Rotation([torch_conv.op(layer, direction, *v[:3]) for v in views])
    kg_ms, cudnn_ms = time_side_by_side([lambda: launcher(rot()), lambda: trot()()], repeat=repeat)
    return {**_row_base(layer, direction, {}),
            "variant": plan.variant, "config": str(plan.config), "kernelgen_ms": kg_ms, "cudnn_ms": cudnn_ms,
            "kernelgen_tflops": p.flops / kg_ms / 1e9, "cudnn_tflops": p.flops / cudnn_ms / 1e9,
            "ratio": cudnn_ms / kg_ms, "rel_err_vs_cudnn": rel, "floor_ms": floor_ms(p, precision),
            "pct_of_roofline": roofline_ms(p) / kg_ms, "cudnn_pct_of_roofline": roofline_ms(p) / cudnn_ms,
            "map": list(layer.spatial),
            "pct_of_floor": floor_ms(p, precision) / kg_ms, "first_call_s": compile_s, "precision": precision,
            "dtype": p.dtype, "pct_of_peak": p.flops / kg_ms / 1e9 / (PEAKS[precision] / 1e12),
            **kernel_resources(launcher, launcher.threads)}


def _applies(problem, algo, precision="fp32"):
    """A forced variant is benched only on the problems it can compute (one algo list, many tables): at its own first
    precision, or at the bench's (a float16 table's problems take precision="fp16", which the direct template
    computes; its first precision, fp32, refuses float16 tensors)."""
    if algo is None:
        return True
    variant = get_variant(algo)
    return computes(variant, problem) or (precision in variant.precisions and variant.applies(problem, precision))


def parse_overrides(text):
    """'swizzle=2,stages=1' -> {'swizzle': 2, 'stages': 1}: integer fields of TileConfig or DepthwiseConfig (a
    plan whose config lacks one is not benched under that alternative)."""
    fields = {f.name for f in dataclasses.fields(TileConfig)} | {f.name for f in dataclasses.fields(DepthwiseConfig)}
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
    except (ValueError, TypeError) as e:  # (TypeError: a field the plan's kind of config does not have)
        return f"--set {text}: {e}"


def precompile(plans, workers=None):
    """Compile every plan's kernel in parallel worker processes (they fill the disk cache), so the
    timed loop only loads; numba compiles one kernel per process at a time.  Returns each plan's
    compile error (None where it compiled): the timed loop skips those rather than compile them again."""
    # function-local on purpose: the tuner's measure() imports this module, and a module-level import of the tuner
    # here would make the two import each other at load time
    settings.export_default("cache_dir", str(cache_dir()))
    with ProcessPoolExecutor(workers or min(16, os.cpu_count() or 1), mp_context=get_context("spawn")) as pool:
        # the precision too: without it a tensor-core plan would precompile its variant's default (TF32) kernel;
        # the problem carries the storage dtype, so an fp16 plan's kernel is compiled for float16 arrays
        jobs = [(p.problem, p.variant, p.config, p.precision) for p in plans]
        errors = [e for e, _ in pool.map(compile_one, jobs)]
    for plan, e in zip(plans, errors):
        if e:
            print(f"precompile: {plan.problem.key()} {plan.config}: {e}")
    return errors


def geomean(vals):
    vals = [v for v in vals if v and v > 0]
    return math.exp(sum(map(math.log, vals)) / len(vals)) if vals else float("nan")


def run_label(row):
    """What a row's run forced: its variant (--algo), its config fields (--set) and the database it was planned
    with (--against), "" for none."""
    return " ".join(filter(None, (row.get("forced"), row.get("set"), row.get("planned_with"))))


def summary(rows):
    """Geo-mean ratio per direction (and per forced variant / --set alternative, when the run had several).
    Depthwise rows are left out of those and summed up apart, under "depthwise <direction>": cuDNN runs them with
    kernels of their own, which no GEMM-shaped variant here is meant to match (a later issue's)."""
    out = {}
    for depthwise in (False, True):
        for a in sorted({run_label(x) for x in rows}):
            for d in DIRECTIONS + ("deconv",):
                r = [x["ratio"] for x in rows if x["direction"] == d and "ratio" in x and run_label(x) == a
                     and x.get("depthwise", False) == depthwise]
                if r:
                    key = ("depthwise " if depthwise else "") + (f"{d} [{a}]" if a else d)
                    out[key] = {"geomean_ratio": geomean(r), "n": len(r)}
    return out


def roofline_lines(rows):
    """Markdown lines on the depthwise rows' % of the memory roofline per direction: the geo-mean of kernelgen's
    and cuDNN's, and kernelgen's lowest on the maps of ROOFLINE_MAP pixels or more (the issue's bar)."""
    lines = []
    for d in DIRECTIONS:
        r = [x for x in rows if x.get("depthwise") and x["direction"] == d and "pct_of_roofline" in x]
        if not r:
            continue
        large = [x["pct_of_roofline"] for x in r if math.prod(x.get("map", (0,))) >= ROOFLINE_MAP]
        low = (f"; lowest on maps of {ROOFLINE_MAP} pixels or more: {100 * min(large):.0f}% (bar "
               f"{100 * ROOFLINE_BAR:.0f}%)") if large else ""
        lines.append(f"- depthwise {d}, % of the {HBM_BW / 1e12:.1f} TB/s roofline (x, w, y once): geo-mean "
                     f"kernelgen {100 * geomean([x['pct_of_roofline'] for x in r]):.0f}%, cuDNN "
                     f"{100 * geomean([x['cudnn_pct_of_roofline'] for x in r]):.0f}%{low}")
    return lines


def _roofline_cell(r):
    """'kernelgen% (cuDNN%)' of the memory roofline, '' for a row measured before the field existed."""
    if "pct_of_roofline" not in r:
        return ""
    return f"{100 * r['pct_of_roofline']:.0f}% ({100 * r['cudnn_pct_of_roofline']:.0f}%)"


def markdown(rows, summ):
    head = ("| layer | dir | variant / config | kernelgen TFLOP/s | cuDNN TFLOP/s | ratio | % roofline (cuDNN) | regs | "
            "smem B | local B | occ | % peak | % floor | rel err |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        name = r["layer"] + (" (depthwise)" if r.get("depthwise") else "")
        if "error" in r:
            lines.append(f"| {name} | {r['direction']} | FAILED: {r['error'][:60]} | | | | | | | | | | | |")
            continue
        lines.append(f"| {name} | {r['direction']} | {r['variant']} {r['config']} | {r['kernelgen_tflops']:.1f} | "
                     f"{r['cudnn_tflops']:.1f} | {r['ratio']:.2f} | {_roofline_cell(r)} | {r.get('registers', '')} | "
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
        apart = " (not in the geo-means above)" if d.startswith("depthwise ") else ""
        lines.append(f"- geo-mean ratio (cuDNN time / kernelgen time), {d}: **{s['geomean_ratio']:.3f}** over "
                     f"{s['n']}{apart}")
    return "\n".join(lines + roofline_lines(rows))


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
                    "side by side on the problems each applies to; an empty name is the planner's own choice "
                    "(--algo winograd_wgrad, : that variant against the plan)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--precision", default="fp32", choices=PRECISIONS,
                    help="kernelgen precision; tf32 also turns torch's TF32 switches on for cuDNN, fp16/bf16 run "
                         "cuDNN on float16/bfloat16 channels-last copies")
    ap.add_argument("--set", action="append", default=None, metavar="FIELD=VALUE,...",
                    help="tile-config fields replaced in every plan's config, e.g. swizzle=2; given several times, "
                         "each is one alternative and all are benched side by side per problem (an A/B run in one "
                         "process: this machine moves by up to 2x per row between processes)")
    ap.add_argument("--against", action="append", default=None, metavar="DIR",
                    help="also plan every problem with the tuned database and model files in DIR (in place of the "
                         "shipped ones) and bench both plans side by side per problem: a merge or a refit, old "
                         "against new, in one process (tuning/plan_with.py)")
    ap.add_argument("--out", default="bench.json", help="JSON report path (.md and .png written beside it)")
    args = ap.parse_args(argv)
    if not gpu_present():
        print("bench needs a CUDA GPU (numba.cuda.is_available() is False); nothing to do")
        return 1
    name, layers = load_table(args.table)
    if args.layers:
        keep = set(args.layers.split(","))
        layers = [l for l in layers if l.name in keep]
    alternatives = args.set or [None]
    for text in filter(None, alternatives):
        parse_overrides(text)  # a typo fails here, before anything compiles
    for directory in args.against or []:
        try:
            database_directory(directory)  # a wrong path fails here, before anything compiles
        except ValueError as e:
            ap.error(str(e))
    tc = TorchConv(tf32=args.precision == "tf32", dtype=CUDNN_DTYPES.get(args.precision))
    algos = [a.strip() or None for a in args.algo.split(",")] if args.algo else [None]
    jobs, plans = plan_jobs(layers, args.directions.split(","), algos, alternatives, args.precision,
                            [None] + (args.against or []))
    rows = []
    for (layer, d, a, alt, source), plan in tqdm(list(zip(jobs, plans)), desc="bench", unit="problem"):
        label = {"forced": a} if a else {}
        label |= {"set": alt} if alt else {}
        label |= {"planned_with": Path(source).name} if source else {}
        if isinstance(plan, str):  # the alternative does not fit this plan's config (swizzle=2 at BK 32, say), or
            # its kernel failed to compile in precompile (a second in-process compile would only fail again)
            rows.append({**_row_base(layer, d, label), "error": plan})
            continue
        try:
            # an alternative is the plan's own variant with the replaced config (a tuned plan's variant included),
            # and a plan made with another database is run as planned
            given = bool(alt or source)
            rows.append(bench_problem(layer, d, tc, repeat=args.repeat, config=plan.config if given else None,
                                      algo=plan.variant if given else a, precision=args.precision) | label)
        except Exception as e:  # record and go on: one bad kernel must not hide the rest of the table
            rows.append({**_row_base(layer, d, label), "error": f"{type(e).__name__}: {e}"})
    print(write_report(name, rows, tc, args.precision, Path(args.out)))
    return 0


def plan_jobs(layers, directions, algos, alternatives, precision, sources=(None,)):
    """Every (layer, direction, forced variant, --set alternative, database directory) to bench - the directory
    None: the shipped database; each --against one: plans made with its files (plan_with.shipped_from) - and its
    plan, compiled in parallel beforehand; or, in the plan's place, why there is none (a problem kernelgen cannot
    plan, a config the alternative does not fit, a kernel that failed to compile), which the bench reports as a
    failed row.  A problem's jobs are neighbours, so its alternatives are timed one after the other."""
    dtype = storage_dtype(precision)
    jobs = [(l, d, a, alt, src) for l in layers for d in directions if not (l.transposed and d != "fwd")
            for a in algos if _applies(l.problem(d, dtype), a, precision) for alt in alternatives for src in sources]
    plans = [None] * len(jobs)
    for source in sources:
        with shipped_from(source) if source else contextlib.nullcontext():
            for i, (layer, d, a, alt, src) in enumerate(jobs):
                if src != source:
                    continue
                try:
                    plans[i] = set_fields(make_plan(layer.problem(d, dtype), "cuda", a, precision=precision), alt)
                except ValueError as e:
                    plans[i] = f"plan: {e}"
    first = {}  # each kernel compiled once: the two sources' plans of a problem are often the same
    for i, p in enumerate(plans):
        if not isinstance(p, str):
            first.setdefault(p.key(), i)
    errors = dict(zip(first, precompile([plans[i] for i in first.values()])))
    for i, p in enumerate(plans):
        if not isinstance(p, str) and errors[p.key()]:
            plans[i] = errors[p.key()]
    return jobs, plans


def write_report(name, rows, tc, precision, out):
    """The JSON report at `out`, its Markdown beside it (returned) and, with matplotlib, the plot."""
    from numba import cuda
    device = cuda.get_current_device().name
    summ = summary(rows)
    report = {"table": name, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "device": device.decode() if isinstance(device, bytes) else str(device), "commit": git_commit(),
              "host": platform.node(), "torch": tc.torch.__version__, "cudnn": tc.torch.backends.cudnn.version(),
              "tf32": tc.tf32, "precision": precision, "dtype": storage_dtype(precision), "rows": rows,
              "summary": summ}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    md = markdown(rows, summ)
    out.with_suffix(".md").write_text(md + "\n")
    try:
        plot(rows, out.with_suffix(".png"), precision)
    except ImportError:
        pass
    return md


if __name__ == "__main__":
    raise SystemExit(main())
