"""The depthwise template's fitted ranking model: what the tuner measured of its configs (the tuned database's
"tried" lists of depthwise entries) fitted as perf_model fits the GEMM variants - log time against features of a
(problem, config), centred per problem (ridge least squares, rows weighted towards each problem's fastest), plus
each training config's residual, which corrects the same config's score on nearby problems (perf_model.fit_model) -
so that it ranks the configs of a problem nobody tuned.

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
from kernelgen.tuning.depthwise_model_predict import FITTED, features, model_path, models_for, to_json
from kernelgen.tuning.perf_model import WITHIN, Group, fit_model, loo_records, summary, training_groups
from kernelgen.tuning.perf_model_predict import target_of

RIDGE = 3.0


def groups_of(entries: dict, target: Target, dtype="float32") -> list[Group]:
    """The training groups of one tensor dtype: each depthwise entry's measured depthwise candidates (at least two)
    at the precision that dtype's model is fitted on (FITTED)."""
    def keep(e):
        return database.precision_of(e) == FITTED[dtype] and e.get("variant") == depthwise.NAME \
            and e.get("problem", {}).get("dtype") == dtype

    def measured(e):
        return [(depthwise.NAME, DepthwiseConfig.parse(t["config"]), float(t["ms"])) for t in e.get("tried", ())
                if t.get("variant") == depthwise.NAME and t.get("ms", 0) > 0 and is_depthwise_config(t["config"])]
    return training_groups(entries, keep, measured, lambda problem, _, config: features(problem, config, target))


def default_slowdowns(groups, target: Target, precision="fp32") -> list[float]:
    """The cost-model default's measured time over the best, on the problems whose tune measured the default."""
    out = []
    for g in groups:
        default = depthwise.default_config(g.problem, target, precision)
        ms = [m for (_, c), m in zip(g.candidates, g.ms) if c == default]
        if ms:
            out.append(ms[0] / float(g.ms.min()))
    return out


def loo(groups, target: Target, precision: str, ridge=RIDGE) -> dict:
    """The leave-one-out result of one dtype's groups: its summary, per direction, the cost-model default's, and every
    problem's record."""
    records = loo_records(groups, ridge)
    defaults = default_slowdowns(groups, target, precision)
    return {"summary": summary(records),
            "directions": {d: summary([r for r in records if r["direction"] == d])
                           for d in sorted({r["direction"] for r in records})},
            "default": {"problems": len(defaults), "within_10pct": float(np.mean(np.array(defaults) <= WITHIN)),
                        "geomean_slowdown": float(math.exp(np.mean(np.log(defaults))))} if defaults else {},
            "records": records}


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
    groups = {dtype: groups_of(entries, target, dtype) for dtype in FITTED}
    groups = {dtype: g for dtype, g in groups.items() if len(g) >= 2}
    if args.action == "fit":
        out = Path(args.out) if args.out else model_path(device)
        models = {dtype: fit_model(g, FITTED[dtype], args.ridge) for dtype, g in groups.items()}
        fitted_on = {"database": Path(args.db).name, "ridge": args.ridge,
                     "problems": {dtype: len(g) for dtype, g in groups.items()}}
        out.write_text(json.dumps(to_json(models, device, fitted_on), indent=1) + "\n")
        models_for.cache_clear()
        fitted = ", ".join(f"{dtype} ({len(g)} problems)" for dtype, g in groups.items())
        print(f"depthwise_model fit: {fitted} of {device} -> {out}")
        return 0
    result = {dtype: loo(g, target, FITTED[dtype], args.ridge) for dtype, g in groups.items()}
    for dtype, r in result.items():
        for name, s in [("all", r["summary"])] + list(r["directions"].items()) + [("default", r["default"])]:
            if s:
                print(f"{dtype:8} {name:10} problems {s['problems']:3}  within 10 %: {s['within_10pct']:.0%}  "
                      f"geo-mean slowdown {s['geomean_slowdown']:.3f}" + (f"  worst {s['worst']:.2f}" if "worst" in s
                                                                         else ""))
    if args.out:
        Path(args.out).write_text(json.dumps({"device": device, "ridge": args.ridge, "within": WITHIN, **result},
                                             indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
