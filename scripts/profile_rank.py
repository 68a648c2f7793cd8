#!/usr/bin/env python
"""cProfile of one rank of a kernelgen.distributed job: where the host's time goes per step (issue 32).

    python -m kernelgen.distributed --nproc-per-node 2 scripts/profile_rank.py kernelgen.distributed.bench speed --out OUT

Each rank runs the module as `python -m` would, under cProfile, and writes $PROFILE_DIR/rank<RANK>.prof and a
table of the functions with the most cumulative time under the step (rank<RANK>.txt).
"""
import cProfile
import os
import pstats
import runpy
import sys

if __name__ == "__main__":
    out, rank = os.environ.get("PROFILE_DIR", "."), os.environ.get("RANK", "0")
    module, sys.argv = sys.argv[1], sys.argv[1:]
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"rank{rank}.prof")
    profiler = cProfile.Profile()
    try:
        profiler.runcall(runpy.run_module, module, run_name="__main__", alter_sys=True)
    finally:
        profiler.dump_stats(path)
        with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
            stats = pstats.Stats(path, stream=f)
            stats.sort_stats("cumulative").print_stats(90)
            stats.sort_stats("tottime").print_stats(40)
