"""GPU: where the host time of a converted ResNet-18 CIFAR step goes (issue 31), measured by timers wrapped around
kernelgen's functions (inclusive ms per step and calls per step), not by cProfile (whose per-call cost inflates a
Python path of many small calls).  kernelgen.torch.bench's model and steps, precompiled as the bench does; the step's
forward, backward and optimiser step timed apart.  `python scripts/host_breakdown.py [--modes bf16,fp32]
[--steps 20] [--out host_breakdown.json]`."""
from __future__ import annotations

import argparse
import functools
import importlib
import json
import time
from collections import defaultdict

import torch

TOTALS: dict = defaultdict(float)
COUNTS: dict = defaultdict(int)

TARGETS = [  # (module, attribute path): each wrapped where its callers look it up
    ("kernelgen.torch.ops", "conv_impl"), ("kernelgen.torch.ops", "conv_backward_data_impl"),
    ("kernelgen.torch.ops", "conv_backward_weight_impl"), ("kernelgen.torch.ops", "channels_last"),
    ("kernelgen.torch.ops", "channels_first"), ("kernelgen.torch.ops", "_where"),
    ("kernelgen.torch.modules", "_Conv._conv_forward"), ("kernelgen.torch.functional", "_conv"),
    ("kernelgen.torch.functional", "_precision"), ("kernelgen.torch.functional", "_cast"),
    ("kernelgen.torch.ops", "apply_conv"), ("kernelgen.torch.ops", "_conv_backward"),
    ("kernelgen.torch.direct", "run"), ("kernelgen.torch.direct", "key"), ("kernelgen.torch.direct", "keep"),
    ("kernelgen.api", "conv"), ("kernelgen.api", "conv_backward_data"), ("kernelgen.api", "conv_backward_weight"),
    ("kernelgen.api", "signature"),
    ("kernelgen.runtime.cuda_call", "CudaRoute.__call__"), ("kernelgen.runtime.cuda_call", "CudaRoute._checked"),
    ("kernelgen.runtime.cuda_call", "CudaRoute._output"), ("kernelgen.runtime.cuda_call", "CudaRoute.launch"),
    ("kernelgen.runtime.cuda_call", "pointer_size"), ("kernelgen.runtime.cuda_call", "run_cuda"),
    ("kernelgen.runtime.launch", "Launcher.launch_pointers"), ("kernelgen.runtime.launch", "Launcher.program"),
    ("kernelgen.runtime.launch", "Launcher._derived_pointers"), ("kernelgen.runtime.launch", "Launcher._call"),
    ("kernelgen.runtime.launch", "Launcher._call_widened"), ("kernelgen.runtime.launch", "capture_state"),
    ("kernelgen.runtime.launch", "ring_for"), ("kernelgen.runtime.program", "LaunchProgram.run"),
    ("kernelgen.runtime.driver", "_FastLaunch.__call__"), ("kernelgen.runtime.driver", "_FastLaunch.launch_addresses"),
]


def _timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTALS[name] += time.perf_counter() - start
            COUNTS[name] += 1
    return wrapper


def instrument():
    for module_name, path in TARGETS:
        owner = importlib.import_module(module_name)
        *outer, attr = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        fn = getattr(owner, attr, None)
        if fn is not None:
            setattr(owner, attr, _timed(path, fn))


def _phases(model, opt, mode):
    """One step, its forward, backward and optimiser step each timed (host time: no synchronisation inside)."""
    def step(x, labels):
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode == "bf16"):
            loss = torch.nn.functional.cross_entropy(model(x), labels)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        TOTALS["step: forward"] += t1 - t0
        TOTALS["step: backward"] += t2 - t1
        TOTALS["step: optimiser"] += t3 - t2
        return loss
    return step


def measure(name, model, data, mode, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    step = _phases(model, opt, mode)
    for i in range(5):
        step(*data[i % len(data)])
    torch.cuda.synchronize()
    TOTALS.clear()
    COUNTS.clear()
    start = time.perf_counter()
    for i in range(steps):
        step(*data[i % len(data)])
        torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / steps
    rows = {k: {"ms_per_step": round(1e3 * v / steps, 3), "calls_per_step": COUNTS.get(k, 0) / steps}
            for k, v in sorted(TOTALS.items(), key=lambda kv: -kv[1])}
    return {"model": name, "mode": mode, "step_ms": round(1e3 * wall, 3), "parts": rows}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="bf16,fp32")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="host_breakdown.json")
    args = ap.parse_args(argv)
    import kernelgen.torch as kt
    from kernelgen.torch.bench import batches, models
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    data = batches(4, 128)
    results = []
    for mode in args.modes.split(","):
        theirs, ours = models()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode == "bf16"):
            kt.precompile(ours, (128, 3, 32, 32))
        results.append(measure("torch", theirs, data, mode, args.steps))
        if mode == args.modes.split(",")[0]:
            instrument()
        results.append(measure("kernelgen", ours, data, mode, args.steps))
        results.append(measure("torch", theirs, data, mode, args.steps))  # (torch again, with the wrappers in)
        for r in results[-3:]:
            print(json.dumps(r, indent=1), flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
