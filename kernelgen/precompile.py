"""Compiling a set of calls' kernels before they run, in a process pool, into the disk cache (issue 27).

numba compiles one kernel at a time per process and holds the GIL while it does, so a network's first step
compiles its kernels one after another.  `precompile(calls)` plans every call here (validating each: a bad
call is refused before any work), sends the kernels the disk cache does not hold yet to worker processes
(tuning/compile_pool.compile_launcher, as the tuner's workers compile), and then loads them here, so the
calls themselves load instead of compiling - in this process and in any later one that shares the cache.

`recording()` collects the plans of the kernelgen calls made inside it without running them (each call
returns a zero-filled output of the right shape and kind): what `Module.precompile` runs a training step
under to find its forward, backward-data and backward-weight convolutions.

How the plans are compiled side by side (the workers, their settings, their start method) is
tuning/compile_pool.compile_plans, which the first-call autotuner (tuning/autotune.py) uses too.
"""
from __future__ import annotations

import contextlib

from kernelgen import api
from kernelgen.tuning.compile_pool import PrecompileReport, compile_plans  # noqa: F401 (re-exported)


@contextlib.contextmanager
def recording(on_plan=None):
    """`with recording() as plans:` - kernelgen calls in this thread (or task) are validated and planned, their
    plans appended to `plans`, and they return zero-filled outputs instead of running any kernel.  on_plan: called
    with each plan as it is recorded (compile_pool.PoolOnDemand.see starts the compile workers at the first one
    not on disk)."""
    plans = [] if on_plan is None else _Recording(on_plan)
    token = api.RECORDING.set(plans)
    try:
        yield plans
    finally:
        api.RECORDING.reset(token)


class _Recording(list):
    """The recorded plans, each shown to on_plan as it is appended."""

    def __init__(self, on_plan):
        super().__init__()
        self.on_plan = on_plan

    def append(self, plan):
        super().append(plan)
        self.on_plan(plan)


def plan_calls(calls) -> list:
    """The plans of `calls`: each (op, args) or (op, args, kwargs), op a kernelgen op or its name; each
    validated as the call itself would be (ValueError / TypeError naming calls[i] and the argument)."""
    plans = []
    for i, entry in enumerate(calls):
        if not isinstance(entry, (tuple, list)) or len(entry) not in (2, 3) or not isinstance(entry[1], (tuple, list)) \
                or (len(entry) == 3 and not isinstance(entry[2], dict)):
            raise TypeError(f"calls[{i}] must be (op, args) or (op, args, kwargs) with args a tuple and kwargs a "
                            f"dict, got {entry!r:.80}")
        op, args, kwargs = entry[0], entry[1], entry[2] if len(entry) == 3 else {}
        try:
            prep = api.planned_call(op, args, kwargs).prep
        except (TypeError, ValueError) as e:
            raise type(e)(f"calls[{i}]: {e}") from None
        if prep.plan is not None:
            plans.append(prep.plan)
    return plans


def precompile(calls, workers=None) -> PrecompileReport:
    """Compile the kernels of `calls` (see plan_calls) into the disk cache - the first here, the others in
    `workers` processes meanwhile (None: one per kernel, at most one per CPU, none where the machine's load
    average already fills its CPUs; 0: all here, one after another) - then load them here.  Returns what was
    done; a kernel that failed to compile is listed in .errors and left for its call (which raises)."""
    return compile_plans(plan_calls(calls), workers)
