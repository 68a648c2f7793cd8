"""Which link of the planner's resolution chain decides each problem of a shape table (kernelgen.planner: config=,
tuned, nearest tuned, model, untuned sm_90 TMA tile, default), and what it picks.

    python scripts/plan_links.py unseen [--precision tf32] [--model on|off|auto] [--json out.json]

Offline (no GPU) it plans for the `target` setting's GPU with the model on (--model on, the default here); the
tuned-database links need a GPU.  On the GPU machine, run it beside `python -m kernelgen bench TABLE` with
KERNELGEN_MODEL=on / off to see which rows the model changed.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys

from kernelgen import settings
from kernelgen.planner import make_plan
from kernelgen.storage import PRECISIONS
from kernelgen.tuning.shapes import load_table, storage_dtype


def links(table, precision, directions):
    _, layers = load_table(table)
    dtype = storage_dtype(precision)
    for layer in layers:
        for d in directions:
            try:
                p = layer.problem(d, dtype)
                plan = make_plan(p, "cuda", precision=precision)
            except ValueError as e:  # a direction the layer has not (a grouped deconv, say)
                yield {"layer": layer.name, "direction": d, "error": str(e)}
                continue
            yield {"layer": layer.name, "direction": d, "problem": p.key(), "variant": plan.variant,
                   "config": str(plan.config), "decided_by": plan.decided_by, "reason": plan.reason}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table")
    ap.add_argument("--precision", default="fp32", choices=PRECISIONS)
    ap.add_argument("--model", default="on", choices=["on", "off", "auto"])
    ap.add_argument("--directions", default="fwd,bwd_data,bwd_weight")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    with settings.scope(model=args.model):
        rows = list(links(args.table, args.precision, args.directions.split(",")))
    for r in rows:
        if "error" in r:
            print(f"{r['layer']:28} {r['direction']:10} -- {r['error'][:80]}")
        else:
            print(f"{r['layer']:28} {r['direction']:10} {r['decided_by'][:40]:40} {r['variant']:16} {r['config']}")
    counts = collections.Counter(r["decided_by"].split(" ")[0] for r in rows if "error" not in r)
    print("links:", dict(counts))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
