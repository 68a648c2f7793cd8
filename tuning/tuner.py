"""`python -m kernelgen tune TABLE`: find the fastest verified kernel per problem, offline.

For each problem of the table: enumerate variants x configs, prune by resource limits before
compiling anything, compile the survivors in parallel worker processes (they fill the shared disk
cache; the parent then only loads), run each candidate on random data, reject it unless it matches
the float64 reference, time it with CUDA events over rotating inputs, and record the winner in the
tuned database.  Progress goes to tqdm; the database is saved after every problem, so an
interrupted tune resumes where it stopped.  A candidate that fails to compile, launch or verify is
recorded and skipped.

Each variant says what to try (its config_space, through the Variant protocol of templates/variant.py) on the
Target in effect: the GPU the tune runs on.
`--precision tf32|fp16|bf16` tunes the tensor-core implicit GEMM (templates/implicit_gemm_tc.py) instead:
its CUDA_TC_TILES x swizzle 1/2 x split-K (backward-weight; the others where blocks are fewer than SMs) with two
stages, plus its default config, the config a database already holds, and for TF32 forward the TMA_TILES,
compiled and timed at that precision, verified within that precision's error bound, and recorded under
the problem key + "_" + precision (database.entry_key), which the tensor-core plans of kernelgen.api read.
fp16 tunes the float16-storage problems (shapes.storage_dtype: float16 inputs and outputs, the tensors
`python -m kernelgen bench --precision fp16` and kernelgen.conv on float16 arrays run; the problem key holds
the dtype), verified against the float64 reference of those very float16 inputs; float16 outputs take no
split-K.  tf32 and bf16 tune float32-storage problems.
The default, fp32, tunes the fp32 variants into the bare problem keys as it always did.
Depthwise problems (groups == C > 1, which the planner always runs on templates/depthwise.py) are tuned over that
template's DepthwiseConfigs only, at every precision; the planner reads the exact entry (no nearest neighbour).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from multiprocessing import get_context

import numpy as np
from tqdm import tqdm

from kernelgen import planner, reference, settings
from kernelgen.storage import PRECISIONS, poisoned, random_storage, stored_values
from kernelgen.target import Target, device_name, target_for
from kernelgen.templates import TENSOR_CORE_VARIANTS, candidates as variant_candidates, depthwise, implicit_gemm, \
    implicit_gemm_tc, winograd_wgrad
from kernelgen.templates.tile_space import TILES, WIDE_TILES

from . import bench, database
from .compile_pool import compile_launcher as _compile, compile_one as _compile_one
from .shapes import check_tunable, load_table, storage_dtype
from .timing import Rotation, time_cuda

# Local memory a candidate may use and still be picked.  A few spilled words per thread stay in L1: the
# pipelined 64 x 64 Winograd tiles spill 8-56 B and were still the fastest measured on 10 of 22 problems
# (2026-11-23 Winograd tune, H100); the 96 B min_blocks TF32 tile that first showed spills was slower.
MAX_LOCAL_BYTES = 64
# Relative error (against the float64 reference) a candidate may show and still be timed.  fp32: summation
# order only.  The tensor-core precisions round the operands (measured ~1e-4 TF32, 3e-4 fp16, 1e-3 bf16:
# README), so their bounds are the issue's: 1e-3 for TF32, 1e-2 for the 16-bit formats.
# configs a depthwise tune tries per `keep` of the GEMM variants: its block shapes are many (hundreds per problem)
# and its cost model (templates/depthwise.py) has not been fitted to measurements yet
DEPTHWISE_KEEP_FACTOR = 3
MAX_REL_ERR = {"fp32": 1e-4, "tf32": 1e-3, "fp16": 1e-2, "bf16": 1e-2}


def planned_depthwise(problem, precision="fp32") -> bool:
    """Does the planner run this problem on the depthwise template whatever the database says (groups == C > 1
    where it applies: planner.make_plan)?  Then a tune tries depthwise configs only (a GEMM variant's would never
    be planned) at every precision.  Narrow groups (Cg > 1) are not: the planner takes the direct template or the
    GEMM variants by measurement or cost model, so their tune tries both."""
    return problem.groups > 1 and problem.Cg == 1 and depthwise.VARIANT.applies(problem, precision)


def depthwise_candidates(problem, precision, keep=None, tuned=None, target: Target | None = None):
    """("depthwise", DepthwiseConfig) pairs: its config_space, DEPTHWISE_KEEP_FACTOR x `keep` of them (its cost model
    is a guess until measured, so a tune casts a wider net), plus the planner's untuned default and `tuned`, a
    config a database already holds (a re-tune never loses to either)."""
    target = target or target_for("cuda")
    v = depthwise.VARIANT
    cfgs = v.config_space(problem, target, precision, keep=keep and keep * DEPTHWISE_KEEP_FACTOR)
    for extra in (v.default_config(problem, target, precision), tuned):
        if extra is not None and extra not in cfgs and v.accepts(problem, extra, precision):
            cfgs.append(extra)
    return [(v.name, c) for c in as_planned(problem, cfgs, target)]


def as_planned(problem, configs, target: Target) -> list:
    """Depthwise configs as the planner runs them (templates/depthwise.with_shared_rows: share_rows where it applies
    and fits), without repeats: a tune times the kernel a plan of its entry will run."""
    out = []
    for cfg in configs:
        cfg = depthwise.with_shared_rows(problem, cfg, target)
        if cfg not in out:
            out.append(cfg)
    return out


def col2im_candidates(problem, precision, keep=None, target: Target | None = None):
    """(variant, config) pairs of the col2im backward-data (TileConfig.col2im) where the planner's rule may take it
    (implicit_gemm.col2im_suits): the tiles a tune of the same GEMM as a 1x1 forward tries (implicit_gemm.col2im_gemm;
    `keep` of them), with col2im=1 - no split, no TMA boxes - so a tune's entry weighs it against the other
    variants' configs.  [] elsewhere."""
    if not implicit_gemm.col2im_suits(problem):
        return []
    target = target or target_for("cuda")
    v = implicit_gemm.VARIANT if precision == "fp32" else implicit_gemm_tc.VARIANT
    out = []
    for cfg in v.config_space(implicit_gemm.col2im_gemm(problem), target, precision, keep=keep):
        pair = (v.name, replace(cfg, col2im=1, split_k=1))
        if not (cfg.tma or cfg.wgmma) and v.accepts(problem, pair[1], precision) and pair not in out:
            out.append(pair)
    return out


def winograd_wgrad_candidates(problem, keep=None, target: Target | None = None):
    """(variant, config) pairs of the Winograd backward-weight where the planner's rule takes it (winograd_wgrad.suits:
    the template is opt-in, no automatic candidate): its config_space (states and splits), `keep` of them, so a tune's
    entry weighs it against the GEMM variants (and the rule then leaves the problem to that entry).  [] elsewhere."""
    if not winograd_wgrad.suits(problem):
        return []
    return [(winograd_wgrad.NAME, c) for c in winograd_wgrad.VARIANT.config_space(problem, target or target_for("cuda"),
                                                                                   keep=keep)]


def candidates(problem, variants=None, tiles=TILES, keep=None, target: Target | None = None):
    """(variant, config) pairs of an fp32 tune: each variant's config_space on the target (default: the one in
    effect, the GPU this runs on); with `keep`, about that many per variant, the cheapest under its cost model - a
    tune spends its time where a winner is likely.  tiles: the GEMM variants' block shapes.  A problem the planner
    runs on the depthwise template gets depthwise_candidates."""
    target = target or target_for("cuda")
    if planned_depthwise(problem) and (not variants or depthwise.NAME in variants):
        return depthwise_candidates(problem, "fp32", keep, target=target)
    out = []
    for v in variant_candidates(problem):
        if not variants or v.name in variants:
            cfgs = v.config_space(problem, target, "fp32", keep=keep, tiles=tiles)
            out += [(v.name, c) for c in (as_planned(problem, cfgs, target) if v.name == depthwise.NAME else cfgs)]
    if not variants or implicit_gemm.NAME in variants:
        out += col2im_candidates(problem, "fp32", keep, target)
    if not variants or winograd_wgrad.NAME in variants:
        out += winograd_wgrad_candidates(problem, keep, target)
    return out


def tc_candidates(problem, precision, keep=None, tuned=None, target: Target | None = None):
    """(variant, config) pairs of a tensor-core tune at `precision`: each tensor-core variant's config_space where
    it computes the problem; `tuned`, the config a database already holds for the problem, is tried too (a re-tune
    never loses to it).  A problem the planner runs on the depthwise template at `precision` gets
    depthwise_candidates instead (`tuned` then a depthwise config); narrow groups get both."""
    target = target or target_for("cuda")
    if planned_depthwise(problem, precision):
        return depthwise_candidates(problem, precision, keep, tuned, target)
    out = []
    for v in TENSOR_CORE_VARIANTS.values():
        if v.applies(problem, precision):
            cfgs = v.config_space(problem, target, precision, keep=keep)
            if tuned is not None and tuned not in cfgs and v.accepts(problem, tuned, precision):
                cfgs.append(tuned)
            out += [(v.name, c) for c in cfgs]
    out += col2im_candidates(problem, precision, keep, target)
    if problem.Cg > 1 and depthwise.VARIANT.applies(problem, precision):
        out += depthwise_candidates(problem, precision, keep, tuned, target)
    return out


def _reference_job(args):
    """Worker: the float64 reference for a problem's seeded random inputs (overlaps GPU timing)."""
    problem, seed = args
    t = time.perf_counter()
    return reference_output(problem, random_inputs(problem, np.random.default_rng(seed))), time.perf_counter() - t


def reference_output(problem, inputs):
    inputs = {n: stored_values(a, problem.dtype) for n, a in inputs.items()}
    kw = dict(stride=problem.stride[3 - problem.ndim:], padding=problem.padding[3 - problem.ndim:],
              dilation=problem.dilation[3 - problem.ndim:], groups=problem.groups)
    if problem.direction == "fwd":
        return reference.conv_forward(inputs["x"], inputs["w"], **kw)
    if problem.direction == "bwd_data":
        return reference.conv_backward_data(inputs["dy"], inputs["w"], problem.x_shape, **kw)
    return reference.conv_backward_weight(inputs["x"], inputs["dy"], problem.w_shape, **kw)


def random_inputs(problem, rng):
    """Standard-normal inputs of the problem's direction in problem.dtype (float16 for float16 storage: the
    float64 reference is then computed from these exact float16 values)."""
    shapes = {"fwd": {"x": problem.x_shape, "w": problem.w_shape},
              "bwd_data": {"dy": problem.y_shape, "w": problem.w_shape},
              "bwd_weight": {"x": problem.x_shape, "dy": problem.y_shape}}[problem.direction]
    return {n: random_storage(rng, s, problem.dtype) for n, s in shapes.items()}


def device_sets(host_inputs, rotations=3):
    """Device copies of the inputs as they are (their dtype kept), rotated so that L2 does not flatter (made once
    per problem)."""
    from numba import cuda
    return [{n: cuda.to_device((a if i == 0 else np.roll(a, i)).reshape(-1)) for n, a in host_inputs.items()}
            for i in range(rotations)]


def check_result(got, ref, precision="fp32"):
    """The relative error of `got` (float32 or float16) against the float64 reference, computed in float64;
    raises unless it is finite and within MAX_REL_ERR[precision]."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    if not np.isfinite(err) or err > MAX_REL_ERR[precision]:
        raise ValueError(f"wrong result: relative error {err:.2e}")
    return err


def measure(problem, variant, cfg, sets, ref, repeat=10, precision="fp32"):
    """(ms, rel_err, local bytes per thread) of one candidate planned at `precision`, or raises if it fails
    to run or verify, or spills more than MAX_LOCAL_BYTES."""
    from numba import cuda  # optional: numba-cuda
    launcher = planner.get_launcher(planner.Plan(problem, variant, cfg, "cuda", precision))
    _compile(launcher, problem.dtype)  # before it, the resource query finds no overload and reports nothing
    local = bench.kernel_resources(launcher, launcher.threads).get("local_bytes", 0)
    if local > MAX_LOCAL_BYTES:
        raise ValueError(f"uses {local} B of local memory per thread (more than {MAX_LOCAL_BYTES})")
    out = cuda.to_device(poisoned(int(np.prod(problem.output_shape)), problem.dtype))
    sets = [{**s, launcher.outputs[0]: out} for s in sets]
    launcher(sets[0])
    err = check_result(stored_values(out.copy_to_host(), problem.dtype).reshape(ref.shape), ref, precision)
    rot = Rotation(sets)
    return time_cuda(lambda: launcher(rot()), repeat=repeat), err, local


def tune(table, *, db_path=None, workers=None, variants=None, limit=None, directions=("fwd", "bwd_data", "bwd_weight"),
         time_budget=None, tiles=TILES, keep=12, precision="fp32"):
    """Every problem's compile and reference jobs are queued up front, in problem order, so the
    worker pool compiles problem i+1.. while the parent times problem i on the GPU.  precision: "fp32"
    (the fp32 variants, `variants` and `tiles` choosing among them) or "tf32" / "fp16" / "bf16" (the
    tensor-core variant's tc_candidates; entries keyed per precision).  The problems are the table's on tensors
    of storage_dtype(precision): float16 for fp16, float32 otherwise."""
    planner.check_precision(precision)  # before any work: a typo must not cost a table's compile jobs
    check_tunable(table)  # the held-out unseen table is benched, never tuned
    name, layers = load_table(table)
    dtype = storage_dtype(precision)
    problems = []
    for layer in layers:
        for d in directions:
            p = layer.problem(d, dtype)
            if p not in problems:
                problems.append(p)
    problems = problems[:limit] if limit else problems
    # every worker process must see the same disk cache as this one; one BLAS thread per worker
    settings.export_default("cache_dir", str(database.user_db_dir().parent))
    settings.cap_worker_blas_threads(1)
    dev = device_name()
    db_path = db_path or database.user_db_dir() / database.db_name(dev)
    entries = database.load(db_path)
    todo = [p for p in problems if database.entry_key(p, precision) not in entries]
    at = "" if precision == "fp32" else f" at {precision}"
    print(f"tune {name}{at}: {len(problems)} problems, {len(problems) - len(todo)} already in {db_path}")
    workers = workers or min(16, os.cpu_count() or 1)
    failures, phases = [], {"wait": 0.0, "measure": 0.0}
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        t_start = time.perf_counter()
        jobs = []
        for i, p in enumerate(todo):
            held = database.tuned_config(p, dev, depthwise.NAME if planned_depthwise(p, precision)
                                         else implicit_gemm_tc.NAME, precision)
            cands = candidates(p, variants, tiles, keep) if precision == "fp32" else \
                tc_candidates(p, precision, keep, held)
            ref_job = pool.submit(_reference_job, (p, i))
            jobs.append((p, i, cands, ref_job, [pool.submit(_compile_one, (p, v, c, precision)) for v, c in cands]))
        for p, seed, cands, ref_job, futures in tqdm(jobs, desc="tune", unit="problem"):
            if time_budget and time.perf_counter() - t_start > time_budget:
                print(f"time budget of {time_budget} s spent: stopping (rerun to resume)")
                for *_, rj, fs in jobs:
                    for f in [rj, *fs]:
                        f.cancel()
                break
            t = time.perf_counter()
            ref, _ = ref_job.result()
            compiled = [f.result() for f in futures]
            phases["wait"] += time.perf_counter() - t
            t = time.perf_counter()
            sets = device_sets(random_inputs(p, np.random.default_rng(seed)))
            best, tried = None, []
            for (v, c), (err, _) in zip(cands, compiled):
                if err is None:
                    try:
                        ms, rel, local = measure(p, v, c, sets, ref, precision=precision)
                        tried.append({"variant": v, "config": str(c), "ms": ms, **({"local_bytes": local} if local else {})})
                        if best is None or ms < best[2]:
                            best = (v, c, ms)
                        continue
                    except Exception as e:
                        err = f"run: {type(e).__name__}: {str(e)[:200]}"
                tried.append({"variant": v, "config": str(c), "error": err})
                failures.append((p.key(), str(c), err))
            phases["measure"] += time.perf_counter() - t
            if best is not None:  # recorded under the database's lock: what others wrote since the start is kept
                entries[database.entry_key(p, precision)] = new = database.entry(p, best[0], best[1], best[2], tried,
                                                                                 precision)
                database.record(p, dev, new, precision, path=db_path)
    print(f"tune {name}: parent waited {phases['wait']:.0f} s for workers, measured for {phases['measure']:.0f} s")
    database.entries_for.cache_clear()
    return db_path, entries, failures


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m kernelgen tune", description=__doc__.splitlines()[0])
    ap.add_argument("table", help="shape table name (e.g. resnet18_cifar) or JSON path")
    ap.add_argument("--db", default=None, help="database path (default: the user's tuned dir)")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--directions", default="fwd,bwd_data,bwd_weight")
    ap.add_argument("--limit", type=int, default=None, help="tune only the first N problems")
    ap.add_argument("--time-budget", type=float, default=None, help="seconds; stop starting new problems after it")
    ap.add_argument("--keep", type=int, default=12, help="configs tried per variant, cheapest by the cost model "
                    "(0: all)")
    ap.add_argument("--tiles", default="default", choices=("default", "wide"),
                    help="fp32 block shapes: default (TILES) or wide (WIDE_TILES: also 64x32, 128x64 with BK 16, 32x64 "
                         "and 256x32); with --keep 0 a tune tries every config of them")
    ap.add_argument("--precision", default="fp32", choices=PRECISIONS,
                    help="fp32: the fp32 variants (default); tf32/fp16/bf16: the tensor-core variant's tiles, "
                         "recorded per precision (fp16 on float16 tensors, the others on float32)")
    args = ap.parse_args(argv)
    try:
        check_tunable(args.table)
    except ValueError as e:
        print(f"python -m kernelgen tune: {e}", file=sys.stderr)
        return 2
    if not planner.gpu_present():
        print("tune needs a CUDA GPU; nothing to do")
        return 1
    t = time.perf_counter()
    path, entries, failures = tune(args.table, db_path=args.db, workers=args.workers, limit=args.limit,
                                   time_budget=args.time_budget, directions=tuple(args.directions.split(",")),
                                   tiles=WIDE_TILES if args.tiles == "wide" else TILES, keep=args.keep or None,
                                   precision=args.precision)
    print(f"database {path}: {len(entries)} entries, {len(failures)} rejected candidates, "
          f"{time.perf_counter() - t:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
