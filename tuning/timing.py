"""GPU timing with CUDA events: warm-up, then the median of many timed calls.

Both kernelgen and the comparator are timed by the same function in the same run, each call
rotating over several input sets so that a working set that fits in L2 does not flatter either.
"""
from __future__ import annotations

import statistics
import time

from kernelgen import settings


def time_cuda(fn, *, warmup=3, repeat=20):
    """Median milliseconds of fn() on the default stream."""
    from numba import cuda
    if settings.get("cuda_simulator"):  # the simulator has no events; it is synchronous
        return time_host(fn, warmup=1, repeat=min(repeat, 3))
    for _ in range(warmup):
        fn()
    cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = cuda.event(), cuda.event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cuda.event_elapsed_time(start, end))
    return statistics.median(times)


def time_side_by_side(fns, *, rounds=3, repeat=20, timer=None):
    """Milliseconds of each fn: timed in alternating rounds (a, b, a, b, ...), each round a median of
    `repeat` calls (`timer`, default time_cuda), and each fn's best round kept.  On the shared H100 the
    speed of one kernel drifts by up to 2x within minutes; alternating makes a drift slow both sides of a
    comparison, not one, and the best round is the one least disturbed."""
    timer = timer or time_cuda
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], timer(fn, repeat=repeat))
    return best


def time_host(fn, *, warmup=1, repeat=5):
    """Median milliseconds of a synchronous (CPU) call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


class Rotation:
    """Cycle through n prepared argument sets: rotation() returns the next one."""

    def __init__(self, sets):
        self.sets, self.i = list(sets), 0

    def __call__(self):
        s = self.sets[self.i % len(self.sets)]
        self.i += 1
        return s
