"""First-call autotuning on a shape table, then the bench against cuDNN with what it recorded (issue 25, GPU).

    python scripts/autotune_bench.py TABLE [--precision P] [--directions D] [--layers L] [--out-dir DIR]

For each problem of the table, as a user's first call would: plan it, compile the planner's pick (which an
untuned first call compiles too: timed apart), and where no tuned entry decides, run kernelgen.tuning.autotune on it
(the autotune_budget / autotune_candidates settings apply), recording the seconds it took - the tuning's own cost
- and which link decided before.  The entries go to the user's tuned database (the cache directory's tuned/,
never the shipped one: the held-out unseen table stays held out of the shipped database).  Then
`python -m kernelgen bench TABLE --compare torch` runs in this process, planning from those entries.
Writes DIR/autotune_<table>_<precision>.json (per-problem seconds) and DIR/bench_autotuned_<table>_<precision>.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from kernelgen import settings
from kernelgen.planner import gpu_present, make_plan
from kernelgen.tuning import autotune, bench
from kernelgen.tuning.compile_pool import compile_within
from kernelgen.tuning.shapes import load_table, storage_dtype


def tune_table(table, precision, directions, layers):
    """Per-problem first-call autotuning seconds over the table's problems (those a tuned entry decides: 0)."""
    _, rows = load_table(table)
    rows = [r for r in rows if not layers or r.name in layers]
    out = []
    with settings.scope(autotune=True):
        for layer in rows:
            for d in directions:
                if layer.transposed and d != "fwd":
                    continue
                plan = make_plan(layer.problem(d, storage_dtype(precision)), "cuda", precision=precision)
                start = time.perf_counter()
                compile_within([plan], 0)  # the pick's own compile, which an untuned first call pays too
                pick = time.perf_counter()
                tuned = autotune.autotune(plan) if autotune.wanted(plan) else plan
                out.append({"layer": layer.name, "direction": d, "decided_before": plan.decided_by,
                            "decided_after": tuned.decided_by, "seconds": time.perf_counter() - pick,
                            "pick_compile_seconds": pick - start,
                            "before": f"{plan.variant} {plan.config}", "after": f"{tuned.variant} {tuned.config}"})
                print(f"{layer.name:<28} {d:<10} {plan.decided_by[:22]:<22} -> {tuned.decided_by:<8} tuning "
                      f"{out[-1]['seconds']:5.1f} s (the pick's own compile {pick - start:5.1f} s)", flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--directions", default="fwd,bwd_data,bwd_weight")
    ap.add_argument("--layers", default="")
    ap.add_argument("--out-dir", default=".")
    args = ap.parse_args(argv)
    if not gpu_present():
        print("needs a CUDA GPU")
        return 1
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    layers = set(filter(None, args.layers.split(",")))
    tuned = tune_table(args.table, args.precision, args.directions.split(","), layers)
    times = [r["seconds"] for r in tuned if r["decided_before"] not in autotune.DECIDED]
    summary = {"problems": len(tuned), "autotuned": len(times), "median_s": statistics.median(times) if times else 0,
               "max_s": max(times, default=0), "budget_s": settings.get("autotune_budget"),
               "candidates": settings.get("autotune_candidates")}
    print(json.dumps(summary))
    (out / f"autotune_{args.table}_{args.precision}.json").write_text(json.dumps({"summary": summary, "rows": tuned},
                                                                                   indent=1))
    return bench.main([args.table, "--compare", "torch", "--precision", args.precision, "--directions",
                       args.directions, *(["--layers", args.layers] if args.layers else []),
                       "--out", str(out / f"bench_autotuned_{args.table}_{args.precision}.json")])


if __name__ == "__main__":
    raise SystemExit(main())
