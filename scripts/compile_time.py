#!/usr/bin/env python
"""Compile time of the CUDA kernels of a ResNet-18 CIFAR training step, per numba pass, without a GPU (issue 27).

    python scripts/compile_time.py                      # every kernel once, numba speedups on: table + JSON
    python scripts/compile_time.py --limit 3 --repeat 3 # the first 3 kernels, the min of 3 compiles each
    python scripts/compile_time.py --speedups both      # each kernel without, then with kernelgen.numba_speedups
    python scripts/compile_time.py --profile            # and a cProfile of the compiles (top functions, .prof)
    python scripts/compile_time.py --no-fresh-names     # sources as printed before kernelgen.fresh_names (issue 27)
    python scripts/compile_time.py --skip get_call_type,generic  # speedups on but those (PATCHES' names) left out
    python scripts/compile_time.py --transform operators     # prototype a generated-code change on a private copy
    python scripts/compile_time.py --experiment call_type_memo_shared --skip get_call_type   # a numba-internal one

The kernels are the conv problems of tuning/tables/resnet18_cifar.json in fwd, bwd_data and bwd_weight, fp32,
planned as on an H100 (kernelgen.planner.make_plan(problem, "cuda") reading the shipped H100 database; --untuned:
the cost model's configs, as on the H200, which has no database), every code setting at its default.  Each plan's
CUDA module is rendered (uncached), imported from a temporary file and its KERNEL's Python function compiled by
numba.cuda.compiler.compile_cuda for sm_90, as numba's dispatcher does on a kernel's first launch: typing, SSA,
lowering to LLVM.  --ptx also runs NVVM (needs libnvvm: the GPU machine); ptxas and the module load are not timed.

Stages (seconds, per kernel; with --repeat, each stage's min over the repeats, as the machine may be shared):
frontend (bytecode to IR, the untyped rewrites), ssa (ReconstructSSA), typing (type inference), post_typing
(the typed rewrites), lower_sav (Lower._find_singly_assigned_variable), lower_body (Lower.lower_function_body),
lower_rest (the rest of NativeLowering), total (the whole compile_cuda call), nvvm (--ptx; not in the total).
--json writes every kernel's stages, numba's own per-pass times and digests of its LLVM IR and PTX, with numba's
counters in names renumbered; it runs under PYTHONHASHSEED=0 (numba orders allocas by sets of names), so digests
of two runs compare.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import cProfile
import hashlib
import importlib.util
import json
import os
import pstats
import re
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
STAGES = ("frontend", "ssa", "typing", "post_typing", "lower_sav", "lower_body", "lower_rest", "total", "nvvm")
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
    llvm: set = field(default_factory=set)      # llvm_digest of each compile's LLVM IR (one, unless it varies)
    ptx: set = field(default_factory=set)       # llvm_digest of each compile's PTX (--ptx)

    def add(self, stages, passes):
        for into, new in ((self.stages, stages), (self.passes, passes)):
            for k, v in new.items():
                into[k] = min(into.get(k, v), v)


@contextlib.contextmanager
def as_h100(tuned=True):
    """make_plan as on an H100: a GPU present, the H100 database's device (tuned=False: a device without a shipped
    database, such as the H200: the cost model's configs), sm_90; code settings at defaults."""
    with mock.patch.object(planner, "gpu_present", lambda: True), \
            mock.patch.object(planner, "tuned_device", lambda: H100 if tuned else "sm_90_untuned"), \
            mock.patch.object(planner, "device_key", lambda backend: "sm_90" if backend == "cuda" else backend), \
            settings.scope(**{s.name: s.default for s in settings.CODE_SETTINGS}):
        yield


def plan_kernels(table=TABLE, limit=None, match=None, shard=(0, 1), tuned=True, fresh=True) -> list:
    """The table's kernels in layer order, each direction in turn: only names containing `match`, of those every
    shard[1]-th from the shard[0]-th, the first `limit` of those.  fresh: rendered as shipped (False: without
    kernelgen.fresh_names, the names the IR has)."""
    _, layers = load_table(table)
    out, index = [], -1
    with as_h100(tuned):
        for layer in layers:
            for direction in DIRECTIONS:
                name = f"{layer.name}:{direction}"
                if match and match not in name:
                    continue
                index += 1
                if index % shard[1] != shard[0]:
                    continue
                plan = planner.make_plan(layer.problem(direction), "cuda")
                ir_kernel = plan.kernel_ir()
                source = render_cuda(ir_kernel, cache=False, fresh=fresh)
                dtypes = {b.name: b.dtype for b in ir_kernel.params}
                out.append(Kernel(name, plan.variant, str(plan.config), source, dtypes))
                if limit and len(out) >= limit:
                    return out
    return out


def load_module(source: str, directory: Path, name: str):
    """A rendered module, imported from a file as the kernel cache imports its entries."""
    path = directory / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def argtypes_of(module, dtypes: dict) -> tuple:
    """numba's types of the module's PARAMS (1-D C arrays; names not among the IR's, TMA tensor maps, uint64)."""
    return tuple(types.Array(getattr(types, dtypes.get(p, "uint64")), 1, "C") for p in module.PARAMS)


def compile_kernel(pyfunc, argtypes):
    """compile_cuda as numba-cuda's dispatcher calls it for a kernel (cuda.jit's defaults) for sm_90."""
    return compile_cuda(pyfunc, types.void, argtypes, debug=False, lineinfo=False, forceinline=False,
                        fastmath=False, nvvm_options={"fastmath": False, "opt": 3}, cc=CC)


@contextlib.contextmanager
def timed_lower_parts(seconds: dict):
    """Lower's methods of _LOWER_PARTS (whichever is installed now) wrapped to add their time into `seconds`."""
    def timed(stage, fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[stage] = seconds.get(stage, 0.0) + time.perf_counter() - t
        return wrapper

    with contextlib.ExitStack() as stack:
        for stage, method in _LOWER_PARTS.items():
            stack.enter_context(mock.patch.object(lowering.Lower, method, timed(stage, getattr(lowering.Lower, method))))
        yield


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


def time_one(kernel: Kernel, directory: Path, transform=None, ptx=False):
    """(stages, passes, compile result, PTX or None) of one compile of the kernel's module (after `transform` of its
    text); ptx: NVVM's PTX for sm_90a too (libnvvm: the GPU machine), its seconds the stage nvvm."""
    source = transform(kernel.source) if transform else kernel.source
    module = load_module(source, directory, "kg_" + kernel.name.replace(":", "_"))
    argtypes = argtypes_of(module, kernel.dtypes)
    parts = {}
    with timed_lower_parts(parts):
        t = time.perf_counter()
        cres = compile_kernel(module.KERNEL.py_func, argtypes)
        total = time.perf_counter() - t
    stages, passes = stages_of(cres.metadata["pipeline_times"], parts, total)
    text = None
    if ptx:
        t = time.perf_counter()
        text = cres.library.get_asm_str(cc=(*CC, "a"))
        stages["nvvm"] = time.perf_counter() - t
    return stages, passes, cres, text


_COUNTED = re.compile(r"(\$|_cudapy_[sl]mem_)\d+|B\d+v\d+")  # numba's per-process counters in names (vN: B<len>vN)


def llvm_digest(text: str) -> str:
    """sha256 of LLVM IR with numba's counters in names (the function's $N and vN, shared arrays' numbers)
    renumbered by first appearance, so that two compiles of one kernel in one process compare."""
    seen = {}
    text = _COUNTED.sub(lambda m: (m.group(1) or "v") + str(seen.setdefault(m.group(0), len(seen))), text)
    return hashlib.sha256(text.encode()).hexdigest()


def warm_up(directory: Path):
    """One small compile first: numba's one-time set-up (typing and target contexts, the registries) is not any
    kernel's cost."""
    source = ("from numba import cuda\nfrom kernelgen.cuda_index import add32, uidx\nPARAMS = ('a',)\n"
              "@cuda.jit\ndef warm(a):\n    a[uidx(add32(cuda.threadIdx.x, 1))] = 1.0\nKERNEL = warm\n")
    module = load_module(source, directory, "kg_warm_up")
    compile_kernel(module.KERNEL.py_func, argtypes_of(module, {"a": "float32"}))


@contextlib.contextmanager
def speedups(on: bool, skip=()):
    """kernelgen.numba_speedups installed (on; but the PATCHES named in skip) or not for the block; the previous
    state after it.  A skipped patch may be refused (an experiment has replaced its method): that is no error."""
    was = numba_speedups.installed()
    if on:
        numba_speedups.install()
        numba_speedups.uninstall(skip)
        missing = {p.name for p in numba_speedups.PATCHES} - set(skip) - numba_speedups.installed_names()
        if missing:
            raise SystemExit(f"kernelgen.numba_speedups.install() refused {sorted(missing)} on this numba-cuda "
                             "(run with logging at DEBUG)")
    else:
        numba_speedups.uninstall()
    try:
        yield
    finally:
        (numba_speedups.install if was else numba_speedups.uninstall)()


# --- prototypes of numba-internal changes (--experiment: patches for the run, to measure what they would save) ---
# (the per-compile call-type memo, the intrinsic cache first and the quiet SSA logger were prototyped here and ship
# in kernelgen.numba_speedups: --skip get_call_type / generic / _logger measures each one's share)

def _call_type_memo_shared():
    """BaseFunction.get_call_type memoised on (function type, argument types, the flags' values) for the CUDA
    typing context: across kernels (the shipped memo is per compile).  Needs --skip get_call_type."""
    from numba.core.types import functions
    from numba.cuda.core import targetconfig
    from numba.cuda.descriptor import cuda_target
    original = functions.BaseFunction.get_call_type
    memo, fingerprints = {}, {}
    typing_context = cuda_target.typing_context

    def get_call_type(self, context, args, kws):
        if context is not typing_context or kws:
            return original(self, context, args, kws)
        flags = targetconfig.ConfigStack.top_or_none()
        fp = fingerprints.get(id(flags))
        if fp is None or fp[0] is not flags:
            fp = fingerprints[id(flags)] = (flags, repr(flags))
        key = (self, args, fp[1])
        sig = memo.get(key)
        if sig is None:
            sig = memo[key] = original(self, context, args, kws)
        return sig
    return mock.patch.object(functions.BaseFunction, "get_call_type", get_call_type)


EXPERIMENTS = {"call_type_memo_shared": _call_type_memo_shared}
EXPERIMENT_REPLACES = {"call_type_memo_shared": "get_call_type"}  # experiment -> the numba_speedups patch it needs off


# --- prototypes of generated-code changes (text transforms of a private copy of the rendered source) -----------

_OPERATORS = {"add32": ast.Add, "sub32": ast.Sub, "mul32": ast.Mult, "floordiv32": ast.FloorDiv, "mod32": ast.Mod,
              "udiv32": ast.FloorDiv, "umod32": ast.Mod}


class _Operators(ast.NodeTransformer):
    """add32(a, b) -> (a + b) etc., uidx(a) -> a: numba's int64 operators instead of the 32-bit intrinsics (other
    PTX: this measures what typing and lowering operators cost instead)."""

    def visit_Call(self, node):
        self.generic_visit(node)
        name = node.func.id if isinstance(node.func, ast.Name) else None
        if name in _OPERATORS and len(node.args) == 2:
            return ast.BinOp(node.args[0], _OPERATORS[name](), node.args[1])
        if name == "uidx" and len(node.args) == 1:
            return node.args[0]
        return node


def _stores(nodes, name) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store)
               for node in nodes for n in ast.walk(node))


def _jumps(nodes) -> bool:
    return any(isinstance(n, (ast.Break, ast.Continue, ast.Return)) for node in nodes for n in ast.walk(node))


def _rename_loads(nodes, name, new):
    for node in nodes:
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load):
                n.id = new


def _single_assignment(suite, counter):
    """In each statement list: a name assigned again later in the same list (nothing between assigning it, and no
    jump out between) gets a fresh name for this assignment and the uses up to the next one, so only a suite's last
    assignment keeps the name (what reaches later code or the next loop iteration): fewer SSA violators."""
    for i, stmt in enumerate(suite):
        for field_name in ("body", "orelse"):
            inner = getattr(stmt, field_name, None)
            if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                _single_assignment(inner, counter)
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
            continue
        name = stmt.targets[0].id
        for j in range(i + 1, len(suite)):
            nxt = suite[j]
            if isinstance(nxt, ast.Assign) and len(nxt.targets) == 1 and isinstance(nxt.targets[0], ast.Name) \
                    and nxt.targets[0].id == name:
                between = suite[i + 1:j]
                if not _stores(between, name) and not _jumps(between):
                    counter[0] += 1
                    new = f"{name}__v{counter[0]}"
                    stmt.targets[0].id = new
                    _rename_loads(between + [nxt.value], name, new)
                break


def _transform_ast(source, change):
    tree = ast.parse(source)
    change(tree)
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n"


def _fresh_names_prototype(source):
    """The prototype of kernelgen.fresh_names, which render_cuda now applies (tests/ir/test_fresh_names.py checks
    it renames the same assignments): on a --no-fresh-names source it is what was measured."""
    def change(tree):
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                _single_assignment(node.body, [0])
    return _transform_ast(source, change)


TRANSFORMS = {"fresh_names": _fresh_names_prototype, "operators": lambda s: _transform_ast(s, _Operators().visit),
              "unparse": lambda s: _transform_ast(s, lambda tree: None)}  # the control: ast.unparse alone


# --- measuring and reporting --------------------------------------------------------------------------------------

def measure(kernels, modes, repeat, transform=None, profiler=None, ptx=False, progress=True, skip=()):
    """{mode: [Timing per kernel]}, each mode ("off" / "on": numba speedups, but those named in skip) compiled
    `repeat` times per kernel, the modes alternating so that a shared machine's load falls on both alike."""
    out = {mode: [Timing(k) for k in kernels] for mode in modes}
    with tempfile.TemporaryDirectory(prefix="kg_compile_time_") as tmp:
        directory = Path(tmp)
        sys.path.insert(0, tmp)  # (the modules import nothing of each other; numba's caching locator wants a path)
        try:
            warm_up(directory)
            for i, kernel in enumerate(kernels):
                for _ in range(repeat):
                    for mode in modes:
                        with speedups(mode == "on", skip):
                            if profiler:
                                profiler.enable()
                            stages, passes, cres, text = time_one(kernel, directory, transform, ptx)
                            if profiler:
                                profiler.disable()
                        out[mode][i].add(stages, passes)
                        out[mode][i].llvm.add(llvm_digest(cres.library.get_llvm_str()))
                        if text is not None:
                            out[mode][i].ptx.add(llvm_digest(text))
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
    out = {"table": str(args.table), "untuned": args.untuned, "repeat": args.repeat, "transform": args.transform,
           "fresh_names": not args.no_fresh_names, "skip": args.skip,
           "experiment": args.experiment, "cc": list(CC),
           "numba": numba.__version__, "numba_cuda": numba_cuda.__version__, "python": sys.version.split()[0],
           "modes": {}}
    for mode, timings in results.items():
        out["modes"][mode] = {
            "sum": {s: sum(t.stages[s] for t in timings) for s in STAGES},
            "kernels": [{"kernel": t.kernel.name, "variant": t.kernel.variant, "config": t.kernel.config,
                         "lines": t.kernel.lines, "stages": t.stages, "passes": t.passes,
                         "llvm_sha256": sorted(t.llvm), "ptx_sha256": sorted(t.ptx)} for t in timings]}
    return out


def print_profile(profiler, path, top=30):
    profiler.dump_stats(path)
    for key in ("cumulative", "tottime"):
        print(f"\n--- profile by {key} (all of it: {path}) ---", flush=True)
        pstats.Stats(profiler, stream=sys.stdout).sort_stats(key).print_stats(top)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", type=Path, default=TABLE, help="a shape table (default: resnet18_cifar)")
    ap.add_argument("--limit", type=int, default=None, help="the first N kernels only")
    ap.add_argument("--match", default=None, help="only kernels whose layer:direction contains this text")
    ap.add_argument("--shard", default="0/1", metavar="I/N", help="every N-th kernel from the I-th (parallel runs)")
    ap.add_argument("--untuned", action="store_true", help="plan without the H100 database (as on the H200)")
    ap.add_argument("--repeat", type=int, default=1, help="compiles per kernel; each stage's min is reported")
    ap.add_argument("--speedups", choices=("on", "off", "both"), default="on",
                    help="kernelgen.numba_speedups installed, not, or each kernel both ways (default on)")
    ap.add_argument("--transform", choices=sorted(TRANSFORMS), default=None,
                    help="compile a transformed copy of each rendered source (a prototype; see TRANSFORMS)")
    ap.add_argument("--experiment", default="", metavar="A,B",
                    help=f"numba-internal prototypes patched in for the run: {', '.join(EXPERIMENTS)}")
    ap.add_argument("--no-fresh-names", action="store_true",
                    help="render without kernelgen.fresh_names (the sources before issue 27's renaming)")
    ap.add_argument("--skip", default="", metavar="A,B",
                    help="with speedups on, leave these kernelgen.numba_speedups.PATCHES (by name) out: "
                         + ", ".join(p.name for p in numba_speedups.PATCHES))
    ap.add_argument("--ptx", action="store_true", help="NVVM's PTX too: its time, its digest (needs libnvvm)")
    ap.add_argument("--profile", nargs="?", const="compile_time.prof", default=None, metavar="PATH",
                    help="cProfile the compiles: top functions printed, stats to PATH (compile_time.prof)")
    ap.add_argument("--json", type=Path, default=Path("compile_time.json"), help="where to write the JSON")
    args = ap.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        ap.error(f"--limit must be at least 1, got {args.limit}")
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1, got {args.repeat}")
    experiments = [e for e in args.experiment.split(",") if e]
    unknown = [e for e in experiments if e not in EXPERIMENTS]
    if unknown:
        ap.error(f"--experiment: unknown {unknown}; known: {', '.join(EXPERIMENTS)}")
    skip = tuple(n for n in args.skip.split(",") if n)
    names = {p.name for p in numba_speedups.PATCHES}
    if set(skip) - names:
        ap.error(f"--skip: unknown {sorted(set(skip) - names)}; known: {', '.join(sorted(names))}")
    for name in experiments:
        if args.speedups != "off" and EXPERIMENT_REPLACES[name] not in skip:
            ap.error(f"--experiment {name} replaces what the patch {EXPERIMENT_REPLACES[name]} does: "
                     f"add --skip {EXPERIMENT_REPLACES[name]} (or --speedups off)")
    try:
        shard = tuple(int(v) for v in args.shard.split("/"))
        assert len(shard) == 2 and 0 <= shard[0] < shard[1]
    except (ValueError, AssertionError):
        ap.error(f"--shard must be I/N with 0 <= I < N, got {args.shard!r}")
    if os.environ.get("PYTHONHASHSEED") != "0":  # numba's allocas follow set orders: llvm_sha256 compares only so
        os.execve(sys.executable, [sys.executable, __file__, *(sys.argv[1:] if argv is None else argv)],
                  {**os.environ, "PYTHONHASHSEED": "0"})
    t = time.perf_counter()
    kernels = plan_kernels(args.table, args.limit, args.match, shard, not args.untuned, not args.no_fresh_names)
    print(f"{len(kernels)} kernels planned and rendered in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    modes = ("off", "on") if args.speedups == "both" else (args.speedups,)
    profiler = cProfile.Profile() if args.profile else None
    with contextlib.ExitStack() as patches:
        for name in experiments:
            patches.enter_context(EXPERIMENTS[name]())
        results = measure(kernels, modes, args.repeat, TRANSFORMS.get(args.transform), profiler, args.ptx, skip=skip)
    for mode, timings in results.items():
        print(f"\nnumba speedups {mode}" + (f" but {args.skip}" if skip and mode == "on" else "") +
              (", names as the IR's (--no-fresh-names)" if args.no_fresh_names else "") +
              (f", transform {args.transform}" if args.transform else "") +
              (f", experiments {args.experiment}" if experiments else "") +
              f" (seconds; min of {args.repeat})")
        print(table(timings))
    args.json.write_text(json.dumps(report(results, args), indent=1))
    print(f"\nJSON: {args.json}")
    if profiler:
        print_profile(profiler, args.profile)


if __name__ == "__main__":
    main()
