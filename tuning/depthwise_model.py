"""The depthwise template's fitted ranking model: what the tuner measured of its configs (the tuned database's
"tried" lists of depthwise entries) fitted as perf_model fits the GEMM variants - log time against features of a
(problem, config), centred per problem (ridge least squares, rows weighted towards each problem's fastest) - so that
it ranks the configs of a problem nobody tuned.

The features are the template's own cost-model terms (templates/depthwise.py's model_terms: traffic in whole
sectors, resident blocks, waves, the last wave's fill) and its knobs (block shape, channel vector, register strip,
window in shared memory, split).  The model is fitted on tuning/tables/depthwise_train.json (ConvNeXt-T, ShuffleNetV2,
MobileNetV3-L, MnasNet, Xception layers); the depthwise bench table (MobileNetV2, EfficientNet-B0) is never tuned,
so its bench measures the model on layers it has not seen.  The planner's depthwise chain consults it between the
tuned entry and the cost-model default (kernelgen.planner._depthwise_plan, through depthwise_model_predict: the
features, the file, the pick).

    python -m kernelgen.tuning.depthwise_model fit   # fit on the shipped database, write the model file
    python -m kernelgen.tuning.depthwise_model loo   # leave-one-problem-out: its pick against the tuned best
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from kernelgen.target import Target
from kernelgen.templates import depthwise
from kernelgen.templates.depthwise_config import DepthwiseConfig, is_depthwise_config
from kernelgen.tuning import database
from kernelgen.tuning.depthwise_model_predict import FORMAT, NAMES, coef_for, features, model_path
from kernelgen.tuning.perf_model import WITHIN, Group, fit_groups, summary
from kernelgen.tuning.perf_model_predict import target_of

RIDGE = 3.0

def groups_of(entries: dict, target: Target) -> list[Group]:
    """The training groups: each fp32 depthwise entry's measured depthwise candidates (at least
    two)."""
    out = []
    for key in sorted(entries):
        e = entries[key]
        if database.precision_of(e) != "fp32" or e.get("variant") != depthwise.NAME:
            continue
        rows = [(DepthwiseConfig.parse(t["config"]), float(t["ms"])) for t in e.get("tried", ())
                if t.get("variant") == depthwise.NAME and t.get("ms", 0) > 0 and is_depthwise_config(t["config"])]
        if len(rows) < 2:
            continue
        problem = database.problem_of(e)
        X = np.stack([features(problem, c, target) for c, _ in rows])
        out.append(Group(key, problem, tuple((depthwise.NAME, c) for c, _ in rows), X,
                         np.array([ms for _, ms in rows])))
    return out


def loo_records(groups, ridge=RIDGE) -> list[dict]:
    """For each problem, fitted on all the others: its pick among that problem's measured configs against the best,
    and the cost-model default's (where the tune measured it) against the same best."""
    out = []
    for i, g in enumerate(groups):
        coef = fit_groups(groups[:i] + groups[i + 1:], ridge)
        pick, best = int(np.argmin(g.X @ coef)), int(np.argmin(g.ms))
        out.append({"problem": g.key, "direction": g.problem.direction, "picked": str(g.candidates[pick][1]),
                    "best": str(g.candidates[best][1]), "ms_picked": float(g.ms[pick]), "ms_best": float(g.ms[best]),
                    "slowdown": float(g.ms[pick] / g.ms[best]), "candidates": len(g.ms)})
    return out


def default_slowdowns(groups, target: Target) -> list[float]:
    """The cost-model default's measured time over the best, on the problems whose tune measured the default."""
    out = []
    for g in groups:
        default = depthwise.default_config(g.problem, target)
        ms = [m for (_, c), m in zip(g.candidates, g.ms) if c == default]
        if ms:
            out.append(ms[0] / float(g.ms.min()))
    return out


def main(argv=None):
    """`python -m kernelgen.tuning.depthwise_model fit|loo [--db FILE] [--out FILE]`."""
    shipped = sorted(p for p in database.SHIPPED.glob("*.json") if not p.name.startswith(("model_", "depthwise_")))
    ap = argparse.ArgumentParser(prog="python -m kernelgen.tuning.depthwise_model", description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["fit", "loo"])
    ap.add_argument("--db", default=str(shipped[0]) if shipped else None, help="the tuned database to fit on")
    ap.add_argument("--out", default=None, help="fit: the model file; loo: a JSON file of the per-problem result")
    ap.add_argument("--ridge", type=float, default=RIDGE)
    args = ap.parse_args(argv)
    data = database.read_database(Path(args.db), "db")
    device, entries = data.get("device", ""), data["entries"]
    target = target_of(device)
    if target is None:
        print(f"depthwise_model: device {device!r} of {args.db} is none of kernelgen.target's KNOWN_TARGETS",
              file=sys.stderr)
        return 2
    groups = groups_of(entries, target)
    if args.action == "fit":
        out = Path(args.out) if args.out else model_path(device)
        coef = fit_groups(groups, args.ridge)
        out.write_text(json.dumps({"format": FORMAT, "device": device, "features": list(NAMES),
                                   "coef": coef.tolist(), "fitted_on": {"database": Path(args.db).name,
                                                                       "ridge": args.ridge, "problems": len(groups)}},
                                  indent=1) + "\n")
        coef_for.cache_clear()
        print(f"depthwise_model fit: {len(groups)} problems of {device} -> {out}")
        return 0
    records = loo_records(groups, args.ridge)
    defaults = default_slowdowns(groups, target)
    result = {"summary": summary(records), "directions": {d: summary([r for r in records if r["direction"] == d])
                                                           for d in sorted({r["direction"] for r in records})},
              "default": {"problems": len(defaults), "within_10pct": float(np.mean(np.array(defaults) <= WITHIN)),
                          "geomean_slowdown": float(math.exp(np.mean(np.log(defaults))))} if defaults else {},
              "records": records}
    for name, s in [("all", result["summary"])] + list(result["directions"].items()) + [("default", result["default"])]:
        if s:
            print(f"{name:10} problems {s['problems']:3}  within 10 %: {s['within_10pct']:.0%}  geo-mean slowdown "
                  f"{s['geomean_slowdown']:.3f}" + (f"  worst {s['worst']:.2f}" if "worst" in s else ""))
    if args.out:
        Path(args.out).write_text(json.dumps({"device": device, "ridge": args.ridge, "within": WITHIN, **result},
                                             indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
