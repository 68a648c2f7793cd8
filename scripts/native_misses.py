"""GPU: which convolutions of a converted ResNet-18 CIFAR step call back from C++ into Python (kernelgen/torch/native.py)
in a steady state, and which of their addresses moved: per (module, slot), the calls back over --steps steps and,
for each part of the key (stream, the inputs' addresses, the output's), how many distinct values it took.
`python scripts/native_misses.py [--mode bf16] [--steps 40] [--out native_misses.json]`."""
from __future__ import annotations

import argparse
import collections
import json

import torch


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="bf16")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default="native_misses.json")
    args = ap.parse_args(argv)
    import kernelgen.torch as kt
    from kernelgen.torch import native
    from kernelgen.torch.bench import batches, models, train
    torch.backends.cudnn.benchmark = True
    _, ours = models()
    data = batches(4, 128)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.mode == "bf16"):
        kt.precompile(ours, (128, 3, 32, 32))
    train(ours, data, 8, args.mode)  # warm-up
    native.TRACE = []
    train(ours, data, args.steps, args.mode)
    trace, native.TRACE = native.TRACE, None
    names = {}
    for name, module in ours.named_modules():
        for plan in native.plans_of(module).values():
            if isinstance(plan, native.NativePlan):
                names[plan.id] = name
    by_slot = collections.defaultdict(list)
    for plan_id, slot, key in trace:
        by_slot[(names.get(plan_id, plan_id), slot)].append(key)
    rows = [{"module": m, "slot": ["fwd", "bwd_data", "bwd_weight"][s], "calls_back": len(keys),
             "distinct_values": [len({k[i] for k in keys}) for i in range(5)]}
            for (m, s), keys in sorted(by_slot.items(), key=lambda kv: -len(kv[1]))]
    for r in rows:
        print(r, flush=True)
    print("total", len(trace), "over", args.steps, "steps;", native.fallbacks())
    with open(args.out, "w") as f:
        json.dump({"mode": args.mode, "steps": args.steps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
