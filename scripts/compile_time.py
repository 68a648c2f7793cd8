#!/usr/bin/env python
"""Compile time of the CUDA kernels of a ResNet-18 CIFAR training step, per numba pass, without a GPU (issue 27).

    python scripts/compile_time.py                      # every kernel once, numba speedups on: table + JSON
    python scripts/compile_time.py --limit 3 --repeat 3 # the first 3 kernels, the min of 3 compiles each
    python scripts/compile_time.py --speedups both      # each kernel without, then with kernelgen.numba_speedups
    python scripts/compile_time.py --profile            # and a cProfile of the compiles (top functions, .prof)
    python scripts/compile_time.py --transform ssa      # prototype a generated-code change on a private copy

The kernels are the conv problems of tuning/tables/resnet18_cifar.json in fwd, bwd_data and bwd_weight, fp32,
planned as on an H100 (kernelgen.planner.make_plan(problem, "cuda") reading the shipped H100 database), every
code setting at its default.  Each plan's CUDA module is rendered (uncached), imported from a temporary file and
its KERNEL's Python function compiled by numba.cuda.compiler.compile_cuda for sm_90, as numba's dispatcher does
on a kernel's first launch: typing, SSA, lowering to LLVM.  NVVM, ptxas and the module load (~10% of a cold step
on the H200) need the GPU machine and are not timed here.

Stages (seconds, per kernel; with --repeat, each stage's min over the repeats, as the machine may be shared):
frontend (bytecode to IR, the untyped rewrites), ssa (ReconstructSSA), typing (type inference), post_typing
(the typed rewrites), lower_sav (Lower._find_singly_assigned_variable), lower_body (Lower.lower_function_body),
lower_rest (the rest of NativeLowering), total (the whole compile_cuda call).  --json writes every kernel's
stages and numba's own per-pass times.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib.util
import io
import json
import pstats
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

from numba import types
from numba.cuda import lowering
from numba.cuda.compiler import compile_cuda

from kernelgen import numba_speedups, planner, settings
from kernelgen.render_cuda import render_cuda
from kernelgen.tuning.shapes import load_table

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "tuning" / "tables" / "resnet18_cifar.json"
DIRECTIONS = ("fwd", "bwd_data", "bwd_weight")
H100 = "sm_90_NVIDIA H100 80GB HBM3"  # the shipped database's device key
CC = (9, 0)
STAGES = ("frontend", "ssa", "typing", "post_typing", "lower_sav", "lower_body", "lower_rest", "total")
# numba-cuda's pass names that end a stage (passes before reconstruct_ssa are the frontend)
_SSA, _TYPING, _LOWERING = "reconstruct_ssa", "nopython_type_inference", "cuda_native_lowering"
# Lower's methods timed inside NativeLowering
_LOWER_PARTS = {"lower_sav": "_find_singly_assigned_variable", "lower_body": "lower_function_body"}


@dataclass
class Kernel:
    name: str     # layer:direction
    variant: str
    config: str
    source: str   # the rendered module, uncached
    dtypes: dict  # parameter name -> dtype of its 1-D array

    @property
    def lines(self) -> int:
        return self.source.count("\n")


@dataclass
class Timing:
    kernel: Kernel
    stages: dict = field(default_factory=dict)  # stage -> min seconds over the repeats
    passes: dict = field(default_factory=dict)  # numba pass -> min seconds over the repeats

    def add(self, stages, passes):
        for into, new in ((self.stages, stages), (self.passes, passes)):
            for k, v in new.items():
                into[k] = min(into.get(k, v), v)


@contextlib.contextmanager
def as_h100():
    """make_plan as on an H100: a GPU present, the H100 database's device, sm_90; code settings at defaults."""
    with mock.patch.object(planner, "gpu_present", lambda: True), \
            mock.patch.object(planner, "tuned_device", lambda: H100), \
            mock.patch.object(planner, "device_key", lambda backend: "sm_90" if backend == "cuda" else backend), \
            settings.scope(**{s.name: s.default for s in settings.CODE_SETTINGS}):
        yield


def plan_kernels(table=TABLE, limit=None, match=None) -> list:
    """The table's kernels in layer order, each direction in turn (only names containing `match`)."""
    _, layers = load_table(table)
    out = []
    with as_h100():
        for layer in layers:
            for direction in DIRECTIONS:
                name = f"{layer.name}:{direction}"
                if match and match not in name:
                    continue
                plan = planner.make_plan(layer.problem(direction), "cuda")
                ir_kernel = plan.kernel_ir()
                source = render_cuda(ir_kernel, cache=False)
                dtypes = {b.name: b.dtype for b in ir_kernel.params}
                out.append(Kernel(name, plan.variant, str(plan.config), source, dtypes))
                if limit and len(out) >= limit:
                    return out
    return out


def load_function(source: str, directory: Path, name: str):
    """The KERNEL's Python function and its argument types of a rendered module, imported from a file (as the
    kernel cache imports its entries).  Parameters not among the IR's (TMA tensor maps) are uint64 arrays."""
    path = directory / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def argtypes_of(module, dtypes: dict) -> tuple:
    return tuple(types.Array(getattr(types, dtypes.get(p, "uint64")), 1, "C") for p in module.PARAMS)


def compile_kernel(pyfunc, argtypes):
    """compile_cuda as numba-cuda's dispatcher calls it for a kernel (cuda.jit's defaults) for sm_90."""
    return compile_cuda(pyfunc, types.void, argtypes, debug=False, lineinfo=False, forceinline=False,
                        fastmath=False, nvvm_options={"fastmath": False, "opt": 3}, cc=CC)


@contextlib.contextmanager
def timed_lower_parts(seconds: dict):
    """Lower's methods of _LOWER_PARTS (whichever is installed now) wrapped to add their time into `seconds`."""
    saved = {stage: getattr(lowering.Lower, method) for stage, method in _LOWER_PARTS.items()}
    own = {stage for stage, method in _LOWER_PARTS.items() if method in lowering.Lower.__dict__}  # not inherited

    def timed(stage, fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[stage] = seconds.get(stage, 0.0) + time.perf_counter() - t
        return wrapper

    for stage, method in _LOWER_PARTS.items():
        setattr(lowering.Lower, method, timed(stage, saved[stage]))
    try:
        yield
    finally:
        for stage, method in _LOWER_PARTS.items():
            if stage in own:
                setattr(lowering.Lower, method, saved[stage])
            else:
                delattr(lowering.Lower, method)


def stages_of(pipeline_times: dict, parts: dict, total: float):
    """(stage -> seconds, numba pass -> seconds) from compile_cuda's metadata["pipeline_times"]."""
    passes = {}
    for per_pass in pipeline_times.values():
        for key, t in per_pass.items():
            name = key.split("_", 1)[1]  # "<index>_<pass name>"
            passes[name] = passes.get(name, 0.0) + t.init + t.run + t.finalize
    stages = dict.fromkeys(STAGES, 0.0)
    stage = "frontend"
    for name, seconds in passes.items():
        if name == _SSA:
            stage = "ssa"
        elif name == _TYPING:
            stage = "typing"
        elif stage == "typing" or name == _LOWERING:
            stage = "lower_rest" if name == _LOWERING else "post_typing"
        stages[stage] += seconds
        if stage == "ssa":
            stage = "frontend"  # the dead-branch prune after it belongs with the frontend
    stages.update({k: parts.get(k, 0.0) for k in _LOWER_PARTS})
    stages["lower_rest"] -= sum(parts.get(k, 0.0) for k in _LOWER_PARTS)
    stages["total"] = total
    return stages, passes


def time_one(kernel: Kernel, directory: Path, transform=None):
    """(stages, passes, compile result) of one compile of the kernel's module (after `transform` of its text)."""
    source = transform(kernel.source) if transform else kernel.source
    module = load_function(source, directory, "kg_" + kernel.name.replace(":", "_"))
    argtypes = argtypes_of(module, kernel.dtypes)
    parts = {}
    with timed_lower_parts(parts):
        t = time.perf_counter()
        cres = compile_kernel(module.KERNEL.py_func, argtypes)
        total = time.perf_counter() - t
    stages, passes = stages_of(cres.metadata["pipeline_times"], parts, total)
    return stages, passes, cres


def warm_up(directory: Path):
    """One small compile first: numba's one-time set-up (typing and target contexts, the registries) is not any
    kernel's cost."""
    source = ("from numba import cuda\nfrom kernelgen.cuda_index import add32, uidx\nPARAMS = ('a',)\n"
              "@cuda.jit\ndef warm(a):\n    a[uidx(add32(cuda.threadIdx.x, 1))] = 1.0\nKERNEL = warm\n")
    module = load_function(source, directory, "kg_warm_up")
    compile_kernel(module.KERNEL.py_func, argtypes_of(module, {"a": "float32"}))


@contextlib.contextmanager
def speedups(on: bool):
    """kernelgen.numba_speedups installed (on) or not for the block; the previous state after it."""
    was = numba_speedups.installed()
    if on:
        if not numba_speedups.install():
            raise SystemExit("kernelgen.numba_speedups.install() refused this numba-cuda (run with logging at DEBUG)")
    else:
        numba_speedups.uninstall()
    try:
        yield
    finally:
        (numba_speedups.install if was else numba_speedups.uninstall)()


# --- prototypes of generated-code changes (text transforms of a private copy of the rendered source) -----------

TRANSFORMS = {}


# --- measuring and reporting --------------------------------------------------------------------------------------

def measure(kernels, modes, repeat, transform=None, profiler=None, progress=True):
    """{mode: [Timing per kernel]}, each mode ("off" / "on": numba speedups) compiled `repeat` times per kernel,
    the modes alternating so that a shared machine's load falls on both alike."""
    out = {mode: [Timing(k) for k in kernels] for mode in modes}
    with tempfile.TemporaryDirectory(prefix="kg_compile_time_") as tmp:
        directory = Path(tmp)
        sys.path.insert(0, tmp)  # (the modules import nothing of each other; numba's caching locator wants a path)
        try:
            warm_up(directory)
            for i, kernel in enumerate(kernels):
                for _ in range(repeat):
                    for mode in modes:
                        with speedups(mode == "on"):
                            if profiler:
                                profiler.enable()
                            stages, passes, _ = time_one(kernel, directory, transform)
                            if profiler:
                                profiler.disable()
                        out[mode][i].add(stages, passes)
                if progress:
                    row = "  ".join(f"{m} {out[m][i].stages['total']:.2f}s" for m in modes)
                    print(f"[{i + 1}/{len(kernels)}] {kernel.name} ({kernel.lines} lines): {row}", file=sys.stderr,
                          flush=True)
        finally:
            sys.path.remove(tmp)
    return out


def table(timings) -> str:
    """A text table: kernel, variant, source lines, seconds per stage, total; a sum row."""
    head = f"{'kernel':<22} {'variant':<13} {'lines':>5} " + " ".join(f"{s:>11}" for s in STAGES)
    rows = [head, "-" * len(head)]
    for t in timings:
        k = t.kernel
        rows.append(f"{k.name:<22} {k.variant:<13} {k.lines:>5} " + " ".join(f"{t.stages[s]:>11.3f}" for s in STAGES))
    sums = {s: sum(t.stages[s] for t in timings) for s in STAGES}
    lines = sum(t.kernel.lines for t in timings)
    rows.append(f"{'sum':<22} {'':<13} {lines:>5} " + " ".join(f"{sums[s]:>11.3f}" for s in STAGES))
    return "\n".join(rows)


def report(results, args) -> dict:
    import numba
    import numba_cuda
    out = {"table": str(args.table), "repeat": args.repeat, "transform": args.transform, "cc": list(CC),
           "numba": numba.__version__, "numba_cuda": numba_cuda.__version__, "python": sys.version.split()[0],
           "modes": {}}
    for mode, timings in results.items():
        out["modes"][mode] = {
            "sum": {s: sum(t.stages[s] for t in timings) for s in STAGES},
            "kernels": [{"kernel": t.kernel.name, "variant": t.kernel.variant, "config": t.kernel.config,
                         "lines": t.kernel.lines, "stages": t.stages, "passes": t.passes} for t in timings]}
    return out


def print_profile(profiler, path, top=30):
    profiler.dump_stats(path)
    for key in ("cumulative", "tottime"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(top)
        print(f"\n--- profile, by {key} (all of it: {path}) ---")
        print(text.getvalue().split("\n", 6)[-1][:20000])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", type=Path, default=TABLE, help="a shape table (default: resnet18_cifar)")
    ap.add_argument("--limit", type=int, default=None, help="the first N kernels only")
    ap.add_argument("--match", default=None, help="only kernels whose layer:direction contains this text")
    ap.add_argument("--repeat", type=int, default=1, help="compiles per kernel; each stage's min is reported")
    ap.add_argument("--speedups", choices=("on", "off", "both"), default="on",
                    help="kernelgen.numba_speedups installed, not, or each kernel both ways (default on)")
    ap.add_argument("--transform", choices=sorted(TRANSFORMS), default=None,
                    help="compile a transformed copy of each rendered source (a prototype; see TRANSFORMS)")
    ap.add_argument("--profile", nargs="?", const="compile_time.prof", default=None, metavar="PATH",
                    help="cProfile the compiles: top functions printed, stats to PATH (compile_time.prof)")
    ap.add_argument("--json", type=Path, default=Path("compile_time.json"), help="where to write the JSON")
    args = ap.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        ap.error(f"--limit must be at least 1, got {args.limit}")
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1, got {args.repeat}")
    t = time.perf_counter()
    kernels = plan_kernels(args.table, args.limit, args.match)
    print(f"{len(kernels)} kernels planned and rendered in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    modes = ("off", "on") if args.speedups == "both" else (args.speedups,)
    profiler = cProfile.Profile() if args.profile else None
    results = measure(kernels, modes, args.repeat, TRANSFORMS.get(args.transform), profiler)
    for mode, timings in results.items():
        print(f"\nnumba speedups {mode}" + (f", transform {args.transform}" if args.transform else "") +
              f" (seconds; min of {args.repeat})")
        print(table(timings))
    args.json.write_text(json.dumps(report(results, args), indent=1))
    print(f"\nJSON: {args.json}")
    if profiler:
        print_profile(profiler, args.profile)


if __name__ == "__main__":
    main()
