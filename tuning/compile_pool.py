"""Compiling kernels in worker processes: what the tuner's and the benchmark's process pools run, and
compile_plans, the pool that kernelgen.precompile and the first-call autotuner compile plans in.

A worker renders and compiles one plan's kernel into the shared disk cache (numba compiles one kernel per process
at a time and holds the GIL, so a pool of processes is what compiles a table's kernels side by side); the parent
then only loads them.  Below the tuner, the bench, the autotuner and precompile, which import it.

compile_plans' workers are spawned (CUDA cannot be forked) and run under the settings of the caller - every
setting that changes a kernel's key or how it is planned, and the cache directory - so each computes the key the
caller computed (checked: a kernel compiled under another key would be compiled again at its first call).
"""
from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from kernelgen import compile_profile, planner, settings
from kernelgen.runtime.cache import KERNELS, key_digest


def compile_one(args):
    """Worker: render + compile one candidate into the shared disk cache (no launch)."""
    problem, variant, cfg, *precision = args  # precision: a tensor-core plan's ("fp16", ...); else the variant's own
    t = time.perf_counter()
    try:
        compile_launcher(planner.get_launcher(planner.Plan(problem, variant, cfg, "cuda", *precision)), problem.dtype)
        return None, time.perf_counter() - t
    except Exception as e:  # recorded by the parent; the tune goes on
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}"
                            for f in traceback.extract_tb(e.__traceback__)[:-4:-1])  # innermost frames
        return f"compile: {type(e).__name__}: {str(e)[:200]} (at {where})", time.perf_counter() - t


def compile_launcher(launcher, dtype="float32"):
    """Compile the launcher's kernel for its signature: 1D C-contiguous arrays of the problem's `dtype` (float16
    for float16 storage), TMA tensor maps as uint64 words (the simulator's dispatcher compiles nothing); numba
    reports registers and local memory only for a compiled overload."""
    from numba import from_dtype, uint64
    maps = {spec[0] for spec in launcher.tensor_maps}
    arr, wide = from_dtype(np.dtype(dtype))[::1], from_dtype(np.dtype(np.float32))[::1]
    if hasattr(launcher.kernel, "compile"):  # a widened output is the launcher's float32 workspace (runtime/launch.py)
        with compile_profile.stage("numba"):
            launcher.kernel.compile(tuple(uint64[::1] if name in maps else wide if name in launcher.widened else arr
                                          for name in launcher.params))


@dataclass
class PrecompileReport:
    kernels: int = 0      # distinct kernels among the calls (an empty problem has none)
    cached: int = 0       # of those, already compiled in the disk cache: loaded, not compiled
    compiled: int = 0     # compiled now (in the workers, or here with workers=0)
    workers: int = 0      # worker processes used
    seconds: float = 0.0
    errors: list = field(default_factory=list)  # "kernel: error" per kernel that failed (its call compiles it)
    failed: set = field(default_factory=set)  # the cache digests (runtime.cache.key_digest) of those kernels


def compile_plans(plans, workers=None) -> PrecompileReport:
    """precompile's second half, for plans already made (a recording's, say)."""
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 0):
        raise ValueError(f"workers must be None or an int >= 0, got {workers!r}")
    start = time.perf_counter()
    unique = {}
    for plan in plans:
        if plan is not None:  # (a recorded empty problem)
            unique.setdefault(key_digest(plan.key()), plan)
    todo = {digest: plan for digest, plan in unique.items() if not _compiled_on_disk(digest)}
    report = PrecompileReport(kernels=len(unique), cached=len(unique) - len(todo))
    failed = set()
    if todo:
        jobs = [(digest, plan, _worker_settings()) for digest, plan in todo.items()]
        results, report.workers = _compile_jobs(jobs, workers)
        for i, ((digest, plan, _), (error, seconds)) in enumerate(zip(jobs, results)):
            if i and report.workers:  # (what compiled here recorded its stages as it ran)
                compile_profile.record(plan.problem.key(), "workers", seconds)
            if error:
                failed.add(digest)
                report.errors.append(f"{plan.problem.key()} {plan.variant}: {error}")
        report.compiled = len(todo) - len(failed)
        report.failed = failed
    for digest, plan in unique.items():
        if digest not in failed:
            with compile_profile.kernel_scope(plan.problem.key()):  # loads numba's cached code
                compile_launcher(planner.get_launcher(plan), _signature_dtype(plan))
    report.seconds = time.perf_counter() - start
    return report


def _compile_jobs(jobs, workers):
    """compile_job's result for each job, and the number of worker processes used: the first job compiles here
    while the pool compiles the others (this process would only wait otherwise), in min(the others, CPUs)
    workers (`workers` if given; 0: every job here)."""
    rest = jobs[1:]
    n = min(len(rest), _idle_cpus()) if workers is None else min(workers, len(rest))
    if n < 1:
        return [compile_job(job) for job in jobs], 0
    try:
        with ProcessPoolExecutor(n, mp_context=_pool_context([plan for _, plan, _ in jobs])) as pool:
            pending = pool.map(compile_job, rest)  # (submitted now; the workers start on them at once)
            here = compile_job(jobs[0])
            return [here] + list(pending), n
    except BrokenProcessPool as e:  # a worker died (killed, out of memory): those calls compile for themselves
        return [(None, 0.0)] + [(f"BrokenProcessPool: {e}", 0.0)] * len(rest), n


def _idle_cpus() -> int:
    """CPUs a pool could have (workers=None): all of them, or none where the machine is already busy (as many other
    runnable processes as CPUs): there a pool only adds its processes' start-up to the same CPU time (measured: the
    demo's three kernels 6 % slower in a pool on a 2-CPU machine at load 3.7), while on idle CPUs it is the
    difference (the cold demo 5.5-6.4 s with the pool against 8.3-9.5 s without, idle 2-CPU machine)."""
    cpus = os.cpu_count() or 1
    return 0 if _other_runnable() >= cpus else cpus


def _other_runnable() -> float:
    """Processes runnable now besides this one: Linux's instantaneous count (/proc/loadavg's "running/total"), not
    the 1-minute load average, which still counts a finished run's work for a minute after it; elsewhere that
    average; 0 where neither exists (Windows)."""
    try:
        with open("/proc/loadavg") as f:
            return int(f.read().split()[3].split("/")[0]) - 1
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0


def _pool_context(plans):
    """How the workers start.  Spawned (a fresh interpreter each: CUDA cannot be used across a fork) unless every
    kernel is a CPU one and this process runs one thread, where they are forked from this process after numba
    has set up its CPU target here: each worker then starts compiling at once instead of first importing
    kernelgen and numba and setting up that target again (~1 s of CPU each).  With other threads running - Python
    threads, or the native ones of numba's parallel threading layer once a parallel kernel has run - a fork could
    copy a lock one of them holds, so then they are spawned too."""
    parallel = sys.modules.get("numba.np.ufunc.parallel")
    if not any(plan.backend == "cuda" for plan in plans) and threading.active_count() == 1 and \
            not getattr(parallel, "_is_initialized", False) and "fork" in multiprocessing.get_all_start_methods():
        _warm_numba_cpu()
        return get_context("fork")
    return get_context("spawn")


def _warm_numba_cpu():
    """numba's CPU target set up in this process (what its first compile or cache load does anyway)."""
    import numba  # (not at the top: numba is slow to import, and kernelgen imports it only where it compiles)
    import numpy as np
    numba.njit(_identity)(np.zeros(1, np.float32))


def _identity(a):
    return a


def _worker_settings() -> dict:
    """The caller's value of every setting a kernel's key or its plan depends on, and the cache directory: the
    workers run under exactly these (a scope), whatever their environment says."""
    values = {s.name: settings.get(s.name) for s in settings.CALL_SETTINGS}
    values["cache_dir"] = str(KERNELS.directory)
    return values


def _signature_dtype(plan) -> str:
    """The element type the kernel's arrays have when it runs: float16 storage reaches a CPU kernel as its
    uint16 bits (arrays.cpu_kernel_arg)."""
    dtype = plan.problem.dtype
    return "uint16" if plan.backend != "cuda" and dtype == "float16" else dtype


def _compiled_on_disk(digest: str) -> bool:
    """Does the disk cache hold this kernel's module and numba's compiled code for it (its index file)?"""
    directory = KERNELS.directory
    return (directory / f"kg_{digest}.py").exists() and \
        any((directory / "__pycache__").glob(f"kg_{digest}.*.nbi"))


def compile_job(job):
    """Worker (or here, for workers=0): render and compile one kernel into the disk cache under the caller's
    settings.  Returns (None, or the error as one line with the innermost frames; its seconds)."""
    digest, plan, values = job
    start = time.perf_counter()
    try:
        with settings.scope(**values):
            if key_digest(plan.key()) != digest:
                return "the worker computes another cache key than the caller (a setting not passed on?)", 0.0
            with compile_profile.kernel_scope(plan.problem.key()):
                compile_launcher(planner.get_launcher(plan), _signature_dtype(plan))
        return None, time.perf_counter() - start
    except Exception as e:  # reported by the parent, whose call then compiles (and raises) itself
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}"
                            for f in traceback.extract_tb(e.__traceback__)[:-4:-1])
        return f"{type(e).__name__}: {str(e)[:200]} (at {where})", time.perf_counter() - start
