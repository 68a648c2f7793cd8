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

import contextlib
import multiprocessing
import os
import queue
import sys
import threading
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from kernelgen import compile_profile, planner, settings
from kernelgen.ir_walk import unrolled_statements
from kernelgen.runtime.cache import KERNELS, key_digest
from kernelgen.storage import numpy_dtype


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
    arr, wide = from_dtype(numpy_dtype(dtype))[::1], from_dtype(np.dtype(np.float32))[::1]
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


def compile_plans(plans, workers=None, pool=None) -> PrecompileReport:
    """precompile's second half, for plans already made (a recording's, say).  Each kernel is loaded here as soon
    as its worker has compiled it (and those already on disk while the workers run), not after the last one.
    pool: an executor started earlier (pool_on_demand), used in place of a new one (and left running)."""
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 0):
        raise ValueError(f"workers must be None or an int >= 0, got {workers!r}")
    start = time.perf_counter()
    unique, todo = _unique_and_todo(plans)
    report = PrecompileReport(kernels=len(unique), cached=len(unique) - len(todo))
    cached = [plan for digest, plan in unique.items() if digest not in todo]
    if todo:
        jobs = [(digest, plan, _worker_settings(), compile_profile.active()) for digest, plan in todo.items()]
        report.workers, results = _compile_jobs(jobs, workers, pool)
        for (digest, plan, *_), (error, seconds, stages), here in results:
            if not here:  # (what compiled here recorded its stages as it ran)
                _record_worker_stages(plan.problem.key(), seconds, stages)
            if error:
                report.failed.add(digest)
                report.errors.append(f"{plan.problem.key()} {plan.variant}: {error}")
            else:
                _load(plan)
            while cached:  # the kernels on disk load after this process's own compile, while the workers run
                _load(cached.pop())
        report.compiled = len(todo) - len(report.failed)
    for plan in cached:
        _load(plan)
    report.seconds = time.perf_counter() - start
    return report


def _unique_and_todo(plans):
    """({digest: plan} of the plans, one per kernel; those of them whose kernel is not compiled on disk)."""
    unique = {}
    for plan in plans:
        if plan is not None:  # (a recorded empty problem)
            unique.setdefault(key_digest(plan.key()), plan)
    return unique, {digest: plan for digest, plan in unique.items() if not KERNELS.compiled_on_disk(digest)}


def _load(plan):
    """This process's launcher for a plan whose kernel is compiled on disk (numba loads its cached code)."""
    with compile_profile.kernel_scope(plan.problem.key()):
        compile_launcher(planner.get_launcher(plan), _signature_dtype(plan))


def _record_worker_stages(kernel, seconds, stages):
    """A worker's seconds on `kernel` in the active profile: its own stages as "workers:STAGE" (when the caller
    profiles, the worker does too), the rest of its time (settings, planning checks) as "workers"."""
    for name, s in stages.items():
        compile_profile.record(kernel, f"workers:{name}", s)
    compile_profile.record(kernel, "workers", max(0.0, seconds - sum(stages.values())))


class PoolOnDemand:
    """A compile pool started by the first plan shown to it (see) whose kernel is not in the disk cache: its
    workers (an interpreter and numba's imports each, ~2 s) then start while the caller goes on tracing.  While
    every plan so far is on disk it starts none: a step whose kernels are all cached only loads them, and 16
    interpreters importing numba beside it would slow that down.  `pool`: the executor, or None (none needed yet,
    or fewer than 2 idle CPUs, where a pool would not pay)."""

    def __init__(self):
        self.pool = None
        self._asked = set()  # id() of the plans asked about (a traced step records each plan several times)
        self._cpus = None

    def see(self, plan):
        if self.pool is not None or plan is None or id(plan) in self._asked:
            return
        self._asked.add(id(plan))
        if KERNELS.compiled_on_disk(key_digest(plan.key())):
            return
        self._cpus = _idle_cpus() if self._cpus is None else self._cpus
        if self._cpus >= 2:
            self.pool = ProcessPoolExecutor(self._cpus, mp_context=get_context("spawn"))
            _start_workers(self.pool, self._cpus)


@contextlib.contextmanager
def pool_on_demand():
    """`with pool_on_demand() as demand:` trace, showing each plan to demand.see, then compile_plans(plans,
    pool=demand.pool).  The pool is shut down on leaving, without waiting for what it was never given."""
    demand = PoolOnDemand()
    try:
        yield demand
    finally:
        if demand.pool is not None:
            demand.pool.shutdown(wait=False, cancel_futures=True)


def _compile_jobs(jobs, workers, pool=None):
    """(the number of worker processes, an iterator of (job, compile_job's result, compiled here?) in the order
    they finish).  The largest kernel compiles here (this process would only wait otherwise), the others in
    min(the others, CPUs) workers (`workers` if given; 0: every job here), largest first (_estimated_cost): a long
    kernel started last would finish last, alone."""
    rest = jobs[1:]
    cpus = pool._max_workers if pool is not None else _idle_cpus()
    n = min(len(rest), cpus) if workers is None else min(workers, len(rest))
    if n < 1:
        return 0, ((job, compile_job(job, here=True), True) for job in jobs)
    return n, _pooled(jobs, n, pool)


def _pooled(jobs, n, given=None):
    """_compile_jobs with a pool of n workers, started first (spawned: an interpreter and numba's imports each, while
    this process orders the jobs), or the `given` one (its workers started already)."""
    futures, done = {}, set()
    try:
        context = None if given is not None else _pool_context([plan for _, plan, *_ in jobs])
        with contextlib.nullcontext(given) if context is None else ProcessPoolExecutor(n, mp_context=context) as pool:
            if context is not None and context.get_start_method() != "fork":
                _start_workers(pool, n)
            jobs = sorted(jobs, key=_estimated_cost, reverse=True)
            futures.update((pool.submit(compile_job, job), job) for job in jobs[1:])
            yield jobs[0], compile_job(jobs[0], here=True), True
            waited = time.perf_counter()
            for future in as_completed(futures):  # (the time this process waits for each: its "wait" stage)
                result = future.result()  # (raises BrokenProcessPool where its worker died)
                done.add(future)
                compile_profile.record(futures[future][1].problem.key(), "wait", time.perf_counter() - waited)
                yield futures[future], result, False
                waited = time.perf_counter()
    except BrokenProcessPool as e:  # a worker died (killed, out of memory): those calls compile for themselves
        for future, job in futures.items():
            if future not in done:
                yield job, (f"BrokenProcessPool: {e}", 0.0, {}), False


def compile_within(plans, seconds, workers=None) -> tuple[set, set]:
    """First-call autotuning's compile (tuning/autotune.py): plans[0] - the call's own pick, which runs whatever the
    tuning finds - compiled here while the others compile side by side in workers (as compile_plans'), but within
    a deadline: once plans[0] is in and `seconds` have passed since the call, the workers still compiling are
    stopped (the pool terminated: numba and the kernel cache write each file whole, by rename, so a stopped
    compile leaves nothing half-written) and the candidates not in are left out.  Without idle CPUs the others
    compile here, in turn, while time is left.  Returns (the digests compiled, on disk; those that failed)."""
    deadline = time.perf_counter() + seconds
    unique, todo = _unique_and_todo(plans)
    ready, failed = set(unique) - set(todo), set()
    first, values = key_digest(plans[0].key()), _worker_settings()
    others = sorted(((d, p, values, False) for d, p in todo.items() if d != first), key=_estimated_cost,
                    reverse=True)  # (the longest first: started last, it would finish last, alone)
    n = min(len(others), _idle_cpus() if workers is None else workers)
    finished, pool = queue.SimpleQueue(), None
    if n > 0 and seconds > 0:
        pool = _pool_context(list(todo.values())).Pool(n)
        for job in others:
            pool.apply_async(compile_job, (job,), callback=lambda r, d=job[0]: finished.put((d, r[0])),
                             error_callback=lambda e, d=job[0]: finished.put((d, repr(e))))
    try:
        here = ([(first, todo[first])] if first in todo else []) + ([] if pool else [job[:2] for job in others])
        for digest, plan in here:
            if digest != first and time.perf_counter() >= deadline:
                break
            error = compile_job((digest, plan, values, False), here=True)[0]
            (failed if error else ready).add(digest)
        for _ in range(len(others) if pool else 0):
            digest, error = finished.get(timeout=max(0.0, deadline - time.perf_counter()))
            (failed if error else ready).add(digest)
    except queue.Empty:
        pass  # the deadline: the candidates still compiling are left out
    finally:
        if pool is not None:
            pool.terminate()
    return ready, failed


_BACKGROUND = {"pool": None}
_BACKGROUND_LOCK = threading.Lock()


def compile_in_background(plan):
    """A Future of compile_job for the plan in a pool of background processes (spawned; every CPU but two, which
    the caller keeps running on meanwhile: a step on borrowed kernels costs more than its own until they are in,
    so the sooner they are, the less the new batch costs), shared by every caller."""
    digest = key_digest(plan.key())
    with _BACKGROUND_LOCK:
        if _BACKGROUND["pool"] is None:
            workers = max(1, (os.cpu_count() or 2) - 2)
            _BACKGROUND["pool"] = ProcessPoolExecutor(workers, mp_context=get_context("spawn"))
        return _BACKGROUND["pool"].submit(compile_job, (digest, plan, _worker_settings(), False))


def _start_workers(pool, n):
    """Each of a spawned pool's n workers started now, on _start_worker (a spawned pool starts one per task)."""
    for _ in range(n):
        pool.submit(_start_worker)


def _start_worker():
    """A worker's first task: the imports its compiles need (numba's CUDA target), made while the parent orders."""
    import numba.cuda  # noqa: F401
    return os.getpid()


def _estimated_cost(job) -> int:
    """What the job's kernel costs numba, roughly: its statements once unrolled (ir_walk.unrolled_statements,
    correlation 0.82 with the workers' seconds over ResNet-18's 35 kernels on the H100).  The IR is built here
    (milliseconds); rendering it here too would put every kernel's passes and printing (~14 s for those 35) in
    this one process, ahead of the workers."""
    _, plan, values, _ = job
    try:
        with settings.scope(**values):
            return unrolled_statements(plan.kernel_ir().body)
    except Exception:  # (its worker reports the error)
        return 0


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
    uint16 bits (arrays.cpu_kernel_arg), bfloat16 storage any kernel."""
    dtype = plan.problem.dtype
    return "uint16" if dtype == "bfloat16" or plan.backend != "cuda" and dtype == "float16" else dtype



def compile_job(job, here=False):
    """Worker (or `here`, in the caller's process): render and compile one kernel into the disk cache under the
    caller's settings.  Returns (None, or the error as one line with the innermost frames; its seconds; a worker's
    stages' seconds when the caller profiles (job[3]), else {}: here they go to the caller's profile as they run)."""
    digest, plan, values, profiled = job
    start = time.perf_counter()
    stages = {}
    try:
        with settings.scope(**values), \
                (compile_profile.profile_compile() if profiled and not here else contextlib.nullcontext()) as profile:
            if key_digest(plan.key()) != digest:
                return "the worker computes another cache key than the caller (a setting not passed on?)", 0.0, {}
            with compile_profile.kernel_scope(plan.problem.key()):
                compile_launcher(planner.get_launcher(plan), _signature_dtype(plan))
        if profile is not None:
            stages = profile.stages()
        return None, time.perf_counter() - start, stages
    except Exception as e:  # reported by the parent, whose call then compiles (and raises) itself
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}"
                            for f in traceback.extract_tb(e.__traceback__)[:-4:-1])
        return f"{type(e).__name__}: {str(e)[:200]} (at {where})", time.perf_counter() - start, stages
