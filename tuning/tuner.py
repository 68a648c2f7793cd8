"""`python -m kernelgen tune TABLE`: find the fastest verified kernel per problem, offline.

For each problem of the table: enumerate variants x configs, prune by resource limits before
compiling anything, compile the survivors in parallel worker processes (they fill the shared disk
cache; the parent then only loads), run each candidate on random data, reject it unless it matches
the float64 reference, time it with CUDA events over rotating inputs, and record the winner in the
tuned database.  Progress goes to tqdm; the database is saved after every problem, so an
interrupted tune resumes where it stopped.  A candidate that fails to compile, launch or verify is
recorded and skipped.

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
"""
from __future__ import annotations

import argparse
import os
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from kernelgen import settings
from kernelgen.planner import check_precision
from kernelgen.storage import PRECISIONS

from . import database
from .shapes import load_table, storage_dtype
from .timing import Rotation, time_cuda

MAX_SHARED = 48 * 1024   # numba's static shared arrays are capped at 48 KiB per block
MAX_REGS_EST = 255
# Local memory a candidate may use and still be picked.  A few spilled words per thread stay in L1: the
# pipelined 64 x 64 Winograd tiles spill 8-56 B and were still the fastest measured on 10 of 22 problems
# (2026-11-23 Winograd tune, H100); the 96 B min_blocks TF32 tile that first showed spills was slower.
MAX_LOCAL_BYTES = 64

# Block shapes worth trying (BM, BN, BK, TM, TN); pipelining and split-K are layered on top.
TILES = [(128, 64, 8, 8, 4), (128, 128, 8, 8, 8), (64, 64, 8, 4, 4), (128, 32, 8, 8, 2), (64, 128, 8, 4, 8),
         (256, 64, 8, 8, 4)]
WIDE_TILES = TILES + [(64, 32, 8, 4, 4), (128, 64, 16, 8, 4), (32, 64, 8, 4, 4), (256, 32, 8, 8, 4)]
SM_COUNT = 132
# shared-row padding: 0, or 4 floats, which spreads the transposed tile store over all 32 banks and
# keeps rows 16-byte aligned for the vectorised fragment loads
SMEM_PADS = (0, 4)
# Relative error (against the float64 reference) a candidate may show and still be timed.  fp32: summation
# order only.  The tensor-core precisions round the operands (measured ~1e-4 TF32, 3e-4 fp16, 1e-3 bf16:
# README), so their bounds are the issue's: 1e-3 for TF32, 1e-2 for the 16-bit formats.
MAX_REL_ERR = {"fp32": 1e-4, "tf32": 1e-3, "fp16": 1e-2, "bf16": 1e-2}


def estimated_registers(cfg):
    """Accumulators + fragments + staging + index invariants + ~40 for addresses and loop state."""
    from kernelgen.templates.tiled_gemm import _cdiv
    ea, eb = _cdiv(cfg.BM * cfg.BK, cfg.threads), _cdiv(cfg.BK * cfg.BN, cfg.threads)
    return cfg.TM * cfg.TN + cfg.TM + cfg.TN + cfg.stages * (ea + eb) + 4 * (ea + eb) + 40


def fits(cfg):
    smem = 4 * cfg.stages * cfg.BK * (cfg.BM + cfg.BN + 2 * cfg.smem_pad)
    return 32 <= cfg.threads <= 1024 and smem <= MAX_SHARED and estimated_registers(cfg) <= MAX_REGS_EST


def split_choices(problem, bm, bn, bk):
    """split-K factors that give the grid about one or two waves of blocks (backward-weight only)."""
    if problem.direction != "bwd_weight":
        return [1]
    from kernelgen.templates.tiled_gemm import _cdiv
    taps = int(np.prod(problem.filter_size))
    blocks = _cdiv(problem.Kg, bm) * _cdiv(taps * problem.Cg, bn) * problem.groups
    k_tiles = _cdiv(problem.N * int(np.prod(problem.out_size)), bk)
    h = max(1, min(128, k_tiles // 8, -(-2 * SM_COUNT // blocks)))
    return sorted({h, max(1, min(k_tiles // 8, 2 * h))})


def candidate_configs(problem, tiles=TILES):
    from kernelgen.templates.config import TileConfig
    out = []
    for bm, bn, bk, tm, tn in tiles:
        for stages in (1, 2):
            for pad in SMEM_PADS:
                for sk in split_choices(problem, bm, bn, bk):
                    cfg = TileConfig(bm, bn, bk, tm, tn, split_k=sk, smem_pad=pad, stages=stages)
                    if fits(cfg):
                        out.append(cfg)
    return out


def candidates(problem, variants=None, tiles=TILES, keep=None):
    """(variant, config) pairs to try; with `keep`, only that many per variant, the cheapest under
    the cost model (templates.estimated_cost) - a tune spends its time where a winner is likely."""
    from kernelgen.templates import CUDA_TILES, candidates as variant_candidates, config_ok, estimated_cost
    vs = [v for v in variant_candidates(problem) if not variants or v.NAME in variants]
    out = []
    for v in vs:
        own = getattr(v, "candidate_configs", None)  # a variant with its own schedule space (Winograd)
        cfgs = own(problem) if own else [c for c in candidate_configs(problem, tiles) if config_ok(v, problem, c)]
        if keep:
            def cost(c):
                tile = (c.BM, c.BN, c.BK, c.TM, c.TN)
                return estimated_cost(problem, tile, c.split_k) if tile in CUDA_TILES else float("inf")
            cfgs = sorted(cfgs, key=cost)[:keep]
        out += [(v.NAME, c) for c in cfgs]
    return out


def tc_cost(problem, cfg):
    """Model time of a tensor-core config: waves of blocks x padded MMA work per block x the tile's SASS
    issue cost per MMA (implicit_gemm_tc.ISSUE_COST) - the terms its default_config weighs, split-K included."""
    from kernelgen.templates import gemm_shape, implicit_gemm_tc
    from kernelgen.templates.tiled_gemm import _cdiv
    M, N, K, G = gemm_shape(problem)
    blocks = _cdiv(M, cfg.BM) * _cdiv(N, cfg.BN) * G * cfg.split_k
    depth = _cdiv(_cdiv(K, cfg.split_k), cfg.BK) * cfg.BK
    costs = implicit_gemm_tc.ISSUE_COST
    issue = costs.get((cfg.BM, cfg.BN), max(costs.values()))  # a tile not yet measured: assumed the worst
    return _cdiv(blocks, SM_COUNT) * cfg.BM * cfg.BN * depth * issue


def tc_gemm_shape(problem):
    """(M, N, K, groups) of the tensor-core template's GEMM: a strided backward-data runs as KS-deconv's classes."""
    from kernelgen.templates import gemm_shape, ks_deconv
    return ks_deconv.ks_shape(problem) if ks_deconv.applies(problem) else gemm_shape(problem)


def tc_split_choices(problem, bm, bn, bk, divides=False, waves=(1, 2)):
    """split-K factors of a tensor-core tile: backward-weight's (split_choices); for the other directions 1, and
    where the tile leaves SMs idle (fewer blocks than SMs: the small maps of deep layers) the factors that fill
    about `waves` waves, each split keeping >= 4 slices.  divides: only factors that divide the slices (TMA boxes
    must not run past the filter), the nearest such to each target.  A float16 output: 1 only (split-K adds
    partial sums into the output atomically, which needs float32: kernelgen.storage.check_split_k)."""
    if problem.dtype == "float16":
        return [1]
    if problem.direction == "bwd_weight":
        return split_choices(problem, bm, bn, bk)
    from kernelgen.templates.tiled_gemm import _cdiv
    M, N, K, G = tc_gemm_shape(problem)
    blocks, k_tiles = _cdiv(M, bm) * _cdiv(N, bn) * G, _cdiv(K, bk)
    if blocks >= SM_COUNT:
        return [1]
    usable = [s for s in range(2, k_tiles // 4 + 1) if not divides or k_tiles % s == 0]
    targets = [_cdiv(w * SM_COUNT, blocks) for w in waves]
    return sorted({1} | {min(usable, key=lambda s: abs(s - t)) for t in targets if usable})


# TMA-fed warpgroup tiles (TileConfig.tma; forward at stride 1 and backward-data, channels a multiple of 32):
# (BM, BN, WM, WN, stages, tma).  The two measured best on the H100 (PERF_NOTES #38: 128 x 128 with 6 stages,
# 256 x 128 warp-specialised), and a 64-wide one for grids with few blocks.
TMA_TILES = ((128, 128, 64, 128, 6, 1), (128, 64, 64, 64, 8, 1), (256, 128, 128, 128, 4, 2))


# fp16 (float16 arrays, BK 64: the same 128-byte rows) adds a 128 x 256 tile (its MMAs take half the time of
# TF32's, so wider tiles, fewer bytes of shared memory read per MMA, may pay) and the 128 x 64 tile warp-specialised
# (the first fp16 tune picked 128 x 64 x 8 stages on 9 of 15 forward rows), and the 128 x 128 one too (no drain per
# round there: PERF_NOTES #44)
TMA_TILES_FP16 = TMA_TILES + ((128, 256, 64, 256, 4, 2), (128, 64, 64, 64, 8, 2), (128, 128, 64, 128, 6, 2))
# fp16 takes no split-K (float16 outputs): where 128 x 128 tiles leave SMs idle (r50_3x3_7: 52 blocks), one-warpgroup
# tiles of 64 rows give the grid twice or four times the blocks
TMA_TILES_SMALL_GRID = ((64, 128, 64, 128, 6, 2), (64, 64, 64, 64, 8, 2))
# a reduction of a few slices (the 1x1 layers: r50_1x1_56 forward is one 64-deep fp16 slice) has nothing to keep in
# flight: 2 stages leave shared memory for 2-3 blocks per SM, whose loads and stores overlap, where the 6-8 stage
# tiles run one block per SM, load, multiply and store in turn
TMA_TILES_SHORT = ((128, 128, 64, 128, 2, 1), (128, 64, 64, 64, 2, 1))


# fp16 backward-data TMA tiles read w as stored (TileConfig.b_mn, PERF_NOTES #49) wherever its rows allow, in place
# of the flipped copy: on the H100 the MN-major descriptor reading matched float64 and every gpu_md row ran faster
# with it (geo-mean 0.778 -> 0.941 of cuDNN, BENCHMARKS.md 2026-11-25).  False tunes the flipped-copy tiles instead.
B_MN_WHERE_ALLOWED = True


def tma_candidate_configs(problem, precision):
    """The TMA tiles, each also split to fill about one wave where it leaves SMs idle (an even split:
    tc_split_choices; never for float16 outputs), where the TMA boxes build (implicit_gemm_tc.tma_unmet):
    TF32 on float32 arrays, fp16 on float16 arrays."""
    from kernelgen.templates import implicit_gemm_tc
    from kernelgen.templates.config import TileConfig
    from kernelgen.templates.tma_schedule import swizzled_row
    if (precision, problem.dtype) not in (("tf32", "float32"), ("fp16", "float16")) or implicit_gemm_tc.tma_unmet(problem):
        return []
    bk = swizzled_row(problem.dtype)
    tiles = TMA_TILES if precision == "tf32" else TMA_TILES_FP16
    m, n, k, groups = tc_gemm_shape(problem)
    if precision == "fp16" and -(-m // 128) * -(-n // 128) * groups < SM_COUNT:
        tiles = tiles + TMA_TILES_SMALL_GRID
    if -(-k // bk) <= 4:
        tiles = tiles + TMA_TILES_SHORT
    if n <= 32:  # few GEMM columns (the stem's backward-data: C = 3): only the narrowest wgmma that holds them
        bn = -(-n // 8) * 8
        tiles = tuple((128, bn, 64, bn, 8, tma) for tma in (1, 2))
    b_mn = B_MN_WHERE_ALLOWED and precision == "fp16" and problem.direction == "bwd_data" \
        and problem.C % 8 == 0  # rows of w as stored: a multiple of 16 bytes
    return [TileConfig(bm, bn, bk, split_k=sk, stages=st, WM=wm, WN=wn, wgmma=1, tma=tma,
                       b_mn=int(b_mn and bn % 64 == 0 and wn % 64 == 0))
            for bm, bn, wm, wn, st, tma in tiles
            for sk in tc_split_choices(problem, bm, bn, bk, divides=True, waves=(1,))]


# fp16 without a tuned entry on an sm_90 GPU (kernelgen.api): over the 30 fp16 forward / backward-data problems of
# the shipped H100 database whose tunes tried TMA tiles, this one reached 0.89 of the tuned kernel's speed
# (geo-mean, worst 0.68), mma.sync's cost-model default (implicit_gemm_tc.default_config) 0.375
UNTUNED_TMA_TILE_FP16 = (128, 64, 64, 64, 8, 2)


def untuned_tma_config(problem, precision):
    """The TMA tile for an fp16 problem no tune has seen: UNTUNED_TMA_TILE_FP16, with w read as stored where
    tma_candidate_configs would, or None where that tile does not take the problem (no TMA view, or a GEMM of
    32 columns or fewer, whose narrow tiles only a tune picks)."""
    if precision != "fp16":
        return None
    shape = lambda c: (c.BM, c.BN, c.WM, c.WN, c.stages, c.tma)
    return next((c for c in tma_candidate_configs(problem, precision) if shape(c) == UNTUNED_TMA_TILE_FP16), None)


def tc_candidate_configs(problem, precision, keep=None):
    """Tensor-core configs to try at `precision`: the template's default first, then BK of the CUDA default (16)
    and twice it x CUDA_TC_TILES x split-K (tc_split_choices) x swizzle 1 and 2, two stages, each kept only where
    the template accepts it (swizzle 2 needs BK 8 or 16; fp16/bf16 need BK % 16 == 0).  With `keep`, the default
    and the keep - 1 cheapest others under tc_cost (a tune never loses to the default).  Then, for TF32 forward
    and backward-data problems the TMA tiles take, every tma_candidate_configs (tc_cost does not model them)."""
    from kernelgen.templates import implicit_gemm_tc
    from kernelgen.templates.config import CUDA_TC_DEFAULT, TileConfig
    default = implicit_gemm_tc.default_config(problem, "cuda", precision)
    out = [default]
    # twice the default depth too: half the barriers per MMA and twice the math to hide each slice's loads
    # behind (the H100 runs after #26 point at latency), for twice the staging registers
    for bk in (CUDA_TC_DEFAULT.BK, 2 * CUDA_TC_DEFAULT.BK):
        for bm, bn, wm, wn in implicit_gemm_tc.CUDA_TC_TILES:
            for sk in tc_split_choices(problem, bm, bn, bk):
                for swizzle in (1, 2):
                    cfg = TileConfig(bm, bn, bk, split_k=sk, stages=2, WM=wm, WN=wn, swizzle=swizzle)
                    if cfg not in out and implicit_gemm_tc.accepts(cfg, precision):
                        out.append(cfg)
    if keep:
        out = out[:1] + sorted(out[1:], key=lambda c: tc_cost(problem, c))[:keep - 1]
    return out + [c for c in tma_candidate_configs(problem, precision) if implicit_gemm_tc.accepts(c, precision)]


def tc_candidates(problem, precision, keep=None, tuned=None):
    """(variant, config) pairs of a tensor-core tune: the one tensor-core variant, where it computes; `tuned`, the
    config a database already holds for the problem, is tried too (a re-tune never loses to it)."""
    from kernelgen.templates import computes, implicit_gemm_tc
    if not computes(implicit_gemm_tc, problem):
        return []
    cfgs = tc_candidate_configs(problem, precision, keep)
    if tuned is not None and tuned not in cfgs:
        cfgs.append(tuned)
    return [(implicit_gemm_tc.NAME, c) for c in cfgs if tc_fits_storage(problem, c)]


def tc_fits_storage(problem, cfg):
    """Can a tensor-core config compute the problem's storage dtype (float16: no split-K, no float32 async
    copies), as kernelgen.api's plans check?"""
    from kernelgen.storage import check_split_k
    from kernelgen.templates import implicit_gemm_tc
    try:
        check_split_k(problem.dtype, cfg)
    except ValueError:
        return False
    return implicit_gemm_tc.config_ok(problem, cfg)


def _compile_one(args):
    """Worker: render + compile one candidate into the shared disk cache (no launch)."""
    problem, variant, cfg, *precision = args  # precision: a tensor-core plan's ("fp16", ...); else the variant's own
    from kernelgen.planner import Plan, get_launcher
    t = time.perf_counter()
    try:
        _compile(get_launcher(Plan(problem, variant, cfg, "cuda", *precision)), problem.dtype)
        return None, time.perf_counter() - t
    except Exception as e:  # recorded by the parent; the tune goes on
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}"
                            for f in traceback.extract_tb(e.__traceback__)[:-4:-1])  # innermost frames
        return f"compile: {type(e).__name__}: {str(e)[:200]} (at {where})", time.perf_counter() - t


def _compile(launcher, dtype="float32"):
    """Compile the launcher's kernel for its signature: 1D C-contiguous arrays of the problem's `dtype` (float16
    for float16 storage), TMA tensor maps as uint64 words (the simulator's dispatcher compiles nothing); numba
    reports registers and local memory only for a compiled overload."""
    from numba import from_dtype, uint64
    maps = {spec[0] for spec in launcher.tensor_maps}
    arr = from_dtype(np.dtype(dtype))[::1]
    if hasattr(launcher.kernel, "compile"):
        launcher.kernel.compile(tuple(uint64[::1] if name in maps else arr for name in launcher.params))


def _reference_job(args):
    """Worker: the float64 reference for a problem's seeded random inputs (overlaps GPU timing)."""
    problem, seed = args
    t = time.perf_counter()
    return reference_output(problem, random_inputs(problem, np.random.default_rng(seed))), time.perf_counter() - t


def reference_output(problem, inputs):
    from kernelgen import reference as R
    kw = dict(stride=problem.stride[3 - problem.ndim:], padding=problem.padding[3 - problem.ndim:],
              dilation=problem.dilation[3 - problem.ndim:], groups=problem.groups)
    if problem.direction == "fwd":
        return R.conv_forward(inputs["x"], inputs["w"], **kw)
    if problem.direction == "bwd_data":
        return R.conv_backward_data(inputs["dy"], inputs["w"], problem.x_shape, **kw)
    return R.conv_backward_weight(inputs["x"], inputs["dy"], problem.w_shape, **kw)


def random_inputs(problem, rng):
    """Standard-normal inputs of the problem's direction in problem.dtype (float16 for float16 storage: the
    float64 reference is then computed from these exact float16 values)."""
    shapes = {"fwd": {"x": problem.x_shape, "w": problem.w_shape},
              "bwd_data": {"dy": problem.y_shape, "w": problem.w_shape},
              "bwd_weight": {"x": problem.x_shape, "dy": problem.y_shape}}[problem.direction]
    return {n: rng.standard_normal(s, dtype=np.float32).astype(problem.dtype, copy=False) for n, s in shapes.items()}


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
    from numba import cuda
    from kernelgen.planner import Plan, get_launcher
    from kernelgen.tuning.bench import kernel_resources
    launcher = get_launcher(Plan(problem, variant, cfg, "cuda", precision))
    _compile(launcher, problem.dtype)  # before it, the resource query finds no overload and reports nothing
    local = kernel_resources(launcher, launcher.threads).get("local_bytes", 0)
    if local > MAX_LOCAL_BYTES:
        raise ValueError(f"uses {local} B of local memory per thread (more than {MAX_LOCAL_BYTES})")
    out = cuda.to_device(np.full(int(np.prod(problem.output_shape)), np.nan, problem.dtype))  # poisoned
    sets = [{**s, launcher.outputs[0]: out} for s in sets]
    launcher(sets[0])
    err = check_result(out.copy_to_host().reshape(ref.shape), ref, precision)
    rot = Rotation(sets)
    return time_cuda(lambda: launcher(rot()), repeat=repeat), err, local


def device_name():
    from numba import cuda
    d = cuda.get_current_device()
    name = getattr(d, "name", "simulator")
    name = name.decode() if isinstance(name, bytes) else str(name)
    return "sm_%d%d" % d.compute_capability + "_" + name


def tune(table, *, db_path=None, workers=None, variants=None, limit=None, directions=("fwd", "bwd_data", "bwd_weight"),
         time_budget=None, tiles=TILES, keep=12, precision="fp32"):
    """Every problem's compile and reference jobs are queued up front, in problem order, so the
    worker pool compiles problem i+1.. while the parent times problem i on the GPU.  precision: "fp32"
    (the fp32 variants, `variants` and `tiles` choosing among them) or "tf32" / "fp16" / "bf16" (the
    tensor-core variant's tc_candidates; entries keyed per precision).  The problems are the table's on tensors
    of storage_dtype(precision): float16 for fp16, float32 otherwise."""
    check_precision(precision)  # before any work: a typo must not cost a table's compile jobs
    from tqdm import tqdm
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
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
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
            cands = candidates(p, variants, tiles, keep) if precision == "fp32" else \
                tc_candidates(p, precision, keep, database.tuned_config(p, dev, "implicit_gemm_tc", precision))
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
            if best is not None:
                entries[database.entry_key(p, precision)] = database.entry(p, best[0], best[1], best[2], tried,
                                                                           precision)
                database.save(db_path, entries, dev)
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
    ap.add_argument("--precision", default="fp32", choices=PRECISIONS,
                    help="fp32: the fp32 variants (default); tf32/fp16/bf16: the tensor-core variant's tiles, "
                         "recorded per precision (fp16 on float16 tensors, the others on float32)")
    args = ap.parse_args(argv)
    from kernelgen.planner import gpu_present
    if not gpu_present():
        print("tune needs a CUDA GPU; nothing to do")
        return 1
    t = time.perf_counter()
    path, entries, failures = tune(args.table, db_path=args.db, workers=args.workers, limit=args.limit,
                                   time_budget=args.time_budget, directions=tuple(args.directions.split(",")),
                                   keep=args.keep or None, precision=args.precision)
    print(f"database {path}: {len(entries)} entries, {len(failures)} rejected candidates, "
          f"{time.perf_counter() - t:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
