"""Compiling candidates in worker processes: what the tuner's and the benchmark's process pools run.

A worker renders and compiles one plan's kernel into the shared disk cache (numba compiles one kernel per process
at a time and holds the GIL, so a pool of processes is what compiles a table's kernels side by side); the parent
then only loads them.  Below both the tuner and the bench, which import it.
"""
from __future__ import annotations

import time
import traceback
from pathlib import Path

import numpy as np

from kernelgen import planner


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
        launcher.kernel.compile(tuple(uint64[::1] if name in maps else wide if name in launcher.widened else arr
                                      for name in launcher.params))
