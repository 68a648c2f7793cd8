"""What kernelgen.nn.bench_step measures beside a side's timed steps: timing steps, the kernels a step runs
(torch.profiler), and a new batch size's first steps."""
from __future__ import annotations

import statistics
import time


def median_step(step, warmup, steps, sync):
    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    sync()
    first = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t)
    return first, times


def kernel_profile(step, sync, steps):
    """torch.profiler (CUPTI: every kernel of the process, numba's launches too) over `steps` more steps: each
    kernel name's ms a step and launches a step, the largest first, and their sum (the step's kernel time)."""
    from torch.profiler import ProfilerActivity, profile
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        sync()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
        if us and e.key and not e.key.startswith(("aten::", "autograd", "Optimizer", "cuda", "Memcpy", "Memset")):
            rows.append([e.key[:100], e.count / steps, us / steps / 1e3])
    rows.sort(key=lambda r: -r[2])
    kinds = {}
    for key, _, ms in rows:
        kind = _kernel_kind(key)
        kinds[kind] = kinds.get(kind, 0.0) + ms
    return {"kernels_ms": sum(r[2] for r in rows), "by_kind_ms": kinds, "rows": rows}


def _kernel_kind(name):
    """kernelgen's kernels by what they do: its convolutions by direction (their cache names), nn's other ops;
    everything else (PyTorch's) "other"."""
    if "kernelgen_cache::" in name:
        return "conv bwd_weight" if "bwd_weight" in name else "conv bwd_data" if "bwd_data" in name else "conv fwd"
    return "nn ops" if "kernelgen::nn::" in name else "other"


def _print_kernels(name, prof, top=18):
    kinds = ", ".join(f"{k} {ms:.2f}" for k, ms in sorted(prof["by_kind_ms"].items(), key=lambda kv: -kv[1]))
    print(f"== {name}: kernels {prof['kernels_ms']:.2f} ms a step ({kinds})")
    for key, count, ms in prof["rows"][:top]:
        print(f"  {ms:7.3f} ms  x{count:<5g} {key}")


def _new_batch_steps(step, n, seconds, sync, profile=False, control_seconds=0.0):
    """A new batch size's first step, then steps on it for `seconds` (its own kernels compiling in the background
    meanwhile, runtime.batch_fallback): the first step's seconds, the median of the next 5, each step's ms, and
    the time the batch cost beyond its steady step (the median of the last 5): sum(step - steady).  profile: the
    5 steps after the first under cProfile (printed: where a step on borrowed kernels spends its host time).
    control_seconds: then as many more seconds of steps on it, a control: what the window cost beyond the
    control's mean step (new_batch_extra_vs_control_s).  A steady step of 5 counts every slow stretch of 40 s
    (the clocks', the host's) as the new batch's; the control's mean counts such stretches on both sides."""
    if profile:
        import cProfile
        import pstats
        first, _ = median_step(step, 1, 0, sync)
        prof = cProfile.Profile()
        _, five = prof.runcall(median_step, step, 0, 5, sync)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    else:
        first, five = median_step(step, 1, 5, sync)
    times = [first] + list(five)
    times += _steps_for(step, seconds, sync)
    steady = statistics.median(times[-5:])
    result = {"new_batch": n, "new_batch_first_step_s": first, "new_batch_step_ms": 1e3 * statistics.median(five),
              "new_batch_steady_step_ms": 1e3 * steady, "new_batch_extra_s": sum(t - steady for t in times),
              "new_batch_steps_ms": [round(1e3 * t, 2) for t in times]}
    if control_seconds > 0:
        control = _steps_for(step, control_seconds, sync)
        mean = statistics.fmean(control)
        result.update(new_batch_control_step_ms=1e3 * mean, new_batch_control_steps=len(control),
                      new_batch_extra_vs_control_s=sum(times) - len(times) * mean)
    return result


def _steps_for(step, seconds, sync) -> list:
    """Each step's seconds, stepping for `seconds`."""
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t)
    return times
