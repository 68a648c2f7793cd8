"""A performance model fitted on what the tuner measured: every candidate a tune timed (the tuned database's
"tried" lists: problem, variant, config, ms) is a training row, per GPU and precision.

The model ranks the configs of one problem, so it is fitted within problems: log(ms) and the features
(tuning/perf_features.py) are centred per problem before a ridge least-squares fit (numpy only), which leaves
only what tells one config of a problem from another - the problem's own size cancels.  Rows are weighted towards
each problem's fastest candidates (a pick among the slow ones does not matter).  The fitted weights ship as
tuning/db/model_<device>.json; the planner ranks a variant's config space with them where no tuned entry answers
(kernelgen.planner), and falls through to the cost-model default where no model exists for the device and
precision, or its file is missing or unreadable (silently: a model is an optimisation, never an error).

    python -m kernelgen.tuning.perf_model fit   # fit on the shipped database, write tuning/db/model_<device>.json
    python -m kernelgen.tuning.perf_model loo   # leave-one-problem-out: the model's pick against the tuned best

The model itself, its file and the planner's link are tuning/perf_model_predict.py.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kernelgen.problem import ConvProblem
from kernelgen.target import Target
from kernelgen.templates.config import TileConfig
from kernelgen.tuning import database, shapes
from kernelgen.tuning.perf_features import VARIANT_NAMES, features
from kernelgen.tuning.perf_model_predict import (FORMAT, KEEP, Model, config_key, from_json,  # noqa: F401 (re-exported)
                                                 model_for, model_name, models_for, target_of, to_json)

RIDGE = 3.0        # on standardised features: the data are ~20-65 problems per precision
NEAR_BEST = 0.5    # weight exp(-(log ms - log best) / NEAR_BEST): candidates 2x the best count e^-1.4 as much
WITHIN = 1.10      # the bar: the pick's measured time within 10 % of the tuned best


@dataclass(frozen=True)
class Group:
    """One tuned problem's measured candidates: their variants, configs, feature rows and times."""
    key: str
    problem: ConvProblem
    candidates: tuple  # ((variant, TileConfig), ...)
    X: np.ndarray
    ms: np.ndarray


def _measured(entry):
    """(variant, TileConfig, ms) of every candidate of a database entry that ran; unreadable ones skipped."""
    for t in entry.get("tried", ()):
        if "ms" not in t or t.get("variant") not in VARIANT_NAMES or not t["ms"] > 0:
            continue
        try:
            yield t["variant"], TileConfig.parse(t["config"]), float(t["ms"])
        except (KeyError, ValueError, TypeError):
            continue


def groups_of(entries: dict, target: Target, precision: str) -> list[Group]:
    """The training groups of a database's entries at `precision` (problems with at least two measured candidates)."""
    return training_groups(entries, lambda e: database.precision_of(e) == precision, _measured,
                           lambda problem, variant, config: features(problem, variant, config, target))


def training_groups(entries: dict, keep, measured, featurize) -> list[Group]:
    """A Group per entry that keep(entry) accepts and whose measured(entry) - (variant, config, ms) triples - number
    at least two, each row's features featurize(problem, variant, config): the GEMM variants' model (groups_of) and
    the depthwise one (depthwise_model.groups_of) differ only in those three."""
    out = []
    for key in sorted(entries):
        e = entries[key]
        if not keep(e):
            continue
        rows = list(measured(e))
        if len(rows) < 2:
            continue
        problem = database.problem_of(e)
        X = np.stack([featurize(problem, v, c) for v, c, _ in rows])
        out.append(Group(key, problem, tuple((v, c) for v, c, _ in rows), X, np.array([ms for *_, ms in rows])))
    return out


def _centred(groups):
    """Per-problem centred features and log times, with each row's weight towards its problem's best."""
    xs, ys, ws = [], [], []
    for g in groups:
        y = np.log(g.ms)
        w = np.exp(-(y - y.min()) / NEAR_BEST)
        xs.append(g.X - np.average(g.X, axis=0, weights=w))
        ys.append(y - np.average(y, weights=w))
        ws.append(w)
    return np.concatenate(xs), np.concatenate(ys), np.concatenate(ws)


def fit_groups(groups, ridge=RIDGE) -> np.ndarray:
    """Weights of the NAMES columns (lower score: faster): weighted ridge least squares on standardised,
    per-problem centred features."""
    X, y, w = _centred(groups)
    scale = np.sqrt(np.average(X * X, axis=0, weights=w))
    used = scale > 1e-9
    Xs = X[:, used] / scale[used]
    A = Xs.T @ (Xs * w[:, None]) + ridge * w.sum() / len(groups) * np.eye(Xs.shape[1])
    beta = np.linalg.solve(A, Xs.T @ (w * y))
    coef = np.zeros(X.shape[1])
    coef[used] = beta / scale[used]
    return coef


def fit_model(groups, precision: str, ridge=RIDGE) -> Model:
    """The model of `groups`: the ridge fit, then each group's residuals under it (centred per problem)."""
    coef = fit_groups(groups, ridge)
    residuals = []
    for g in groups:
        r = np.log(g.ms) - g.X @ coef
        r -= r.mean()
        residuals.append((g.problem, {config_key(v, c): float(x) for (v, c), x in zip(g.candidates, r)}))
    return Model(precision, coef, frozenset(v for g in groups for v, _ in g.candidates), tuple(residuals))


# --- leave-one-out and the command line -----------------------------------------------------------------------------

def loo_records(groups, ridge=RIDGE) -> list[dict]:
    """For each group: fitted on all the others, the model's pick among that problem's measured candidates, its
    measured time against the best measured ({"problem", "direction", "picked", "best", "ms_picked", "ms_best",
    "slowdown"})."""
    out = []
    for i, g in enumerate(groups):
        model = fit_model(groups[:i] + groups[i + 1:], "", ridge)
        pick, best = int(np.argmin(model.scores(g.problem, g.candidates, None, g.X))), int(np.argmin(g.ms))
        out.append({"problem": g.key, "direction": g.problem.direction,
                    "picked": f"{g.candidates[pick][0]}:{g.candidates[pick][1]}",
                    "best": f"{g.candidates[best][0]}:{g.candidates[best][1]}",
                    "ms_picked": float(g.ms[pick]), "ms_best": float(g.ms[best]),
                    "slowdown": float(g.ms[pick] / g.ms[best]), "candidates": len(g.ms)})
    return out


def summary(records) -> dict:
    """{"problems", "within_10pct" (fraction), "geomean_slowdown", "worst"} of LOO records."""
    if not records:
        return {"problems": 0}
    s = np.array([r["slowdown"] for r in records])
    return {"problems": len(records), "within_10pct": float(np.mean(s <= WITHIN)),
            "geomean_slowdown": float(math.exp(np.mean(np.log(s)))), "worst": float(s.max())}


def loo(entries: dict, target: Target, precisions=None, ridge=RIDGE) -> dict:
    """The leave-one-out result per precision: its summary, per direction, and every problem's record."""
    result = {}
    for precision in precisions or sorted({database.precision_of(e) for e in entries.values()}):
        records = loo_records(groups_of(entries, target, precision), ridge)
        by_dir = {d: summary([r for r in records if r["direction"] == d])
                  for d in sorted({r["direction"] for r in records})}
        result[precision] = {"summary": summary(records), "directions": by_dir, "records": records}
    return result


def table_summary(result: dict, table: str) -> dict:
    """{precision: summary} of a loo() result over the problems of one shape table (e.g. gpu_md, the issue's bar)."""
    _, layers = shapes.load_table(table)
    out = {}
    for precision, r in result.items():
        dtype = "float16" if precision == "fp16" else "float32"
        keys = {database.entry_key(layer.problem(d, dtype), precision) for layer in layers
                for d in ("fwd", "bwd_data", "bwd_weight")}
        out[precision] = summary([rec for rec in r["records"] if rec["problem"] in keys])
    return out


def fit(entries: dict, target: Target, ridge=RIDGE) -> dict:
    """{precision: Model} fitted on every problem of the database at each precision."""
    models = {}
    for precision in sorted({database.precision_of(e) for e in entries.values()}):
        groups = groups_of(entries, target, precision)
        if len(groups) >= 2:
            models[precision] = fit_model(groups, precision, ridge)
    return models


def _database(path):
    """(device key, entries) of a database file; ValueError naming it if it is none."""
    data = database.read_database(Path(path), "db")
    return data.get("device", ""), data["entries"]


def _print_loo(result):
    for precision, r in result.items():
        rows = [("all", r["summary"])] + list(r["directions"].items())
        for name, s in rows:
            print(f"{precision:5} {name:10} problems {s['problems']:3}  within 10 %: {s['within_10pct']:.0%}  "
                  f"geo-mean slowdown {s['geomean_slowdown']:.3f}  worst {s['worst']:.2f}")


def main(argv=None):
    """`python -m kernelgen.tuning.perf_model fit|loo [--db FILE] [--out FILE]`."""
    shipped = sorted(p for p in database.SHIPPED.glob("*.json")
                     if not p.name.startswith(("model_", "depthwise_model_")))  # (the model files sit beside it)
    ap = argparse.ArgumentParser(prog="python -m kernelgen.tuning.perf_model", description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["fit", "loo"])
    ap.add_argument("--db", default=str(shipped[0]) if shipped else None, help="the tuned database to fit on")
    ap.add_argument("--out", default=None, help="fit: the model file (default tuning/db/model_<device>.json); "
                                                 "loo: a JSON file for the per-problem result")
    ap.add_argument("--ridge", type=float, default=RIDGE)
    ap.add_argument("--table", default="gpu_md", help="loo: also summarise this shape table's problems")
    args = ap.parse_args(argv)
    try:
        device, entries = _database(args.db)
    except (ValueError, TypeError) as e:
        print(f"python -m kernelgen.tuning.perf_model: {e}", file=sys.stderr)
        return 2
    target = target_of(device)
    if target is None:
        print(f"python -m kernelgen.tuning.perf_model: device {device!r} of {args.db} is none of kernelgen.target's "
              f"KNOWN_TARGETS, whose facts the features need", file=sys.stderr)
        return 2
    if args.action == "fit":
        out = Path(args.out or database.SHIPPED / model_name(device))
        models = fit(entries, target, args.ridge)
        fitted_on = {"database": Path(args.db).name, "ridge": args.ridge,
                     "problems": {p: len(groups_of(entries, target, p)) for p in models}}
        out.write_text(json.dumps(to_json(models, device, fitted_on), indent=1) + "\n")
        models_for.cache_clear()
        print(f"perf_model fit: {', '.join(models)} models of {device} written to {out}")
        return 0
    result = loo(entries, target, ridge=args.ridge)
    _print_loo(result)
    tables = {args.table: table_summary(result, args.table)} if args.table else {}
    for precision, s in tables.get(args.table, {}).items():
        if s["problems"]:
            print(f"{precision:5} {args.table:10} problems {s['problems']:3}  within 10 %: {s['within_10pct']:.0%}  "
                  f"geo-mean slowdown {s['geomean_slowdown']:.3f}  worst {s['worst']:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": device, "database": Path(args.db).name, "ridge": args.ridge,
                                              "within": WITHIN, "tables": tables, "result": result}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
