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
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from kernelgen.problem import ConvProblem
from kernelgen.target import KNOWN_TARGETS, Target
from kernelgen.templates.config import TileConfig
from kernelgen.tuning import database
from kernelgen.tuning.perf_features import NAMES, VARIANT_NAMES, features

FORMAT = 1
RIDGE = 3.0        # on standardised features: the data are ~20-65 problems per precision
NEAR_BEST = 0.5    # weight exp(-(log ms - log best) / NEAR_BEST): candidates 2x the best count e^-1.4 as much
NEIGHBOUR_SCALE = 1.0  # a neighbour's weight: exp(-distance / NEIGHBOUR_SCALE), distance in log sizes
SHRINK = 0.05          # weight of an implicit zero residual: a config measured on far problems only counts little
WITHIN = 1.10      # the bar: the pick's measured time within 10 % of the tuned best
# configs of a variant the planner ranks: as many as a tune tries by default (tuner --keep 12), the cheapest under
# the variant's own cost model - the distribution the model was fitted on
KEEP = 12


def model_name(device: str) -> str:
    """The file of a device's model: model_<db_name>."""
    return "model_" + database.db_name(device)


def target_of(device: str) -> Target | None:
    """The KNOWN_TARGETS entry a tuned database's device key names ("sm_90_NVIDIA H100 80GB HBM3"), or None."""
    return next((t for t in KNOWN_TARGETS.values() if t.device_name == device), None)


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
    out = []
    for key in sorted(entries):
        e = entries[key]
        if database.precision_of(e) != precision:
            continue
        rows = list(_measured(e))
        if len(rows) < 2:
            continue
        problem = database.problem_of(e)
        X = np.stack([features(problem, v, c, target) for v, c, _ in rows])
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


def distance(a: ConvProblem, b: ConvProblem) -> float:
    """How unlike two problems are: the sum of |log size ratios| (N, C, K, spatial sizes), plus 2 for another
    direction and 1 each for another filter size or stride."""
    sizes = [(a.N, b.N), (a.C, b.C), (a.K, b.K)] + list(zip(a.in_size, b.in_size))
    return (sum(abs(math.log(max(x, 1)) - math.log(max(y, 1))) for x, y in sizes) + 2.0 * (a.direction != b.direction)
            + (a.filter_size != b.filter_size) + (a.stride != b.stride))


def config_key(variant, config) -> str:
    return f"{variant}:{config}"


@dataclass(frozen=True)
class Model:
    """A fitted ranking model of one device and precision: linear weights of the features, and each training
    problem's residuals per measured config (what the analytic terms miss about a tile - its registers, its bank
    conflicts - measured), which correct the score of the same config on nearby problems."""
    precision: str
    coef: np.ndarray
    variants: frozenset  # the variants it was fitted on: it ranks no other
    residuals: tuple = ()  # ((ConvProblem, {config_key: residual of log ms}), ...)

    def scores(self, problem, choices, target: Target, X=None) -> np.ndarray:
        """Predicted log time of each (variant, config) of `choices` up to a per-problem constant (lower: faster).
        X: their feature rows, if already computed."""
        if X is None:
            X = np.stack([features(problem, v, c, target) for v, c in choices])
        linear = X @ self.coef
        near = [(math.exp(-distance(problem, p) / NEIGHBOUR_SCALE), r) for p, r in self.residuals]
        keys = [config_key(v, c) for v, c in choices]
        weight, total = np.full(len(keys), SHRINK), np.zeros(len(keys))
        for w, r in near:
            for i, k in enumerate(keys):
                if k in r:
                    weight[i] += w
                    total[i] += w * r[k]
        return linear + total / weight

    def best(self, problem, choices, target: Target):
        """The (variant, config) of `choices` with the lowest score, or None (none of a variant it knows)."""
        known = [(v, c) for v, c in choices if v in self.variants]
        return known[int(np.argmin(self.scores(problem, known, target)))] if known else None


def fit_model(groups, precision: str, ridge=RIDGE) -> Model:
    """The model of `groups`: the ridge fit, then each group's residuals under it (centred per problem)."""
    coef = fit_groups(groups, ridge)
    residuals = []
    for g in groups:
        r = np.log(g.ms) - g.X @ coef
        r -= r.mean()
        residuals.append((g.problem, {config_key(v, c): float(x) for (v, c), x in zip(g.candidates, r)}))
    return Model(precision, coef, frozenset(v for g in groups for v, _ in g.candidates), tuple(residuals))


def to_json(models: dict, device: str, fitted_on: dict) -> dict:
    return {"format": FORMAT, "device": device, "features": list(NAMES), "fitted_on": fitted_on,
            "models": {p: {"coef": m.coef.tolist(), "variants": sorted(m.variants),
                           "residuals": [{"problem": asdict(q), "configs": r} for q, r in m.residuals]}
                       for p, m in models.items()}}


def from_json(data) -> dict:
    """{precision: Model} of a model file's parsed JSON; ValueError if it is not one this code can read (another
    format, other feature columns, a weight that is not a finite number)."""
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("features") != list(NAMES):
        raise ValueError("not a model file of this format and feature set")
    out = {}
    for precision, m in data["models"].items():
        coef = np.asarray(m["coef"], dtype=np.float64)
        if coef.shape != (len(NAMES),) or not np.all(np.isfinite(coef)):
            raise ValueError(f"model {precision}: weights are not {len(NAMES)} finite numbers")
        residuals = tuple((database.problem_of(n), {str(k): float(v) for k, v in n["configs"].items()})
                          for n in m.get("residuals", ()))
        if not all(math.isfinite(v) for _, r in residuals for v in r.values()):
            raise ValueError(f"model {precision}: a residual is not a finite number")
        out[precision] = Model(precision, coef, frozenset(m["variants"]) & frozenset(VARIANT_NAMES), residuals)
    return out


@lru_cache(maxsize=8)
def models_for(device: str) -> dict:
    """{precision: Model} for a device: the user's fitted file (cache dir) if it reads, else the shipped one; {}
    where neither exists or reads (no model is no error: the planner falls through to its default)."""
    for base in (database.user_db_dir(), database.SHIPPED):
        try:
            return from_json(json.loads((base / model_name(device)).read_text()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return {}


def model_for(device: str, precision: str) -> Model | None:
    return models_for(device).get(precision)


def choose(problem, variants, precision: str, target: Target, device: str):
    """The model's pick for `problem` at `precision`: (variant name, config) of the best-scored config among each
    variant's config space on the target (its KEEP cheapest under its own cost model) that the variant accepts, or
    None where the device has no model at that precision or it knows none of the variants."""
    model = model_for(device, precision)
    if model is None:
        return None
    choices = []
    for v in variants:
        if v.name in model.variants and v.applies(problem, precision):
            try:
                configs = v.config_space(problem, target, precision, keep=KEEP)
            except ValueError:
                continue
            choices += [(v.name, c) for c in configs if v.accepts(problem, c, precision)]
    return model.best(problem, choices, target) if choices else None


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
    shipped = sorted(p for p in database.SHIPPED.glob("*.json") if not p.name.startswith("model_"))
    ap = argparse.ArgumentParser(prog="python -m kernelgen.tuning.perf_model", description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["fit", "loo"])
    ap.add_argument("--db", default=str(shipped[0]) if shipped else None, help="the tuned database to fit on")
    ap.add_argument("--out", default=None, help="fit: the model file (default tuning/db/model_<device>.json); "
                                                 "loo: a JSON file for the per-problem result")
    ap.add_argument("--ridge", type=float, default=RIDGE)
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
    if args.out:
        Path(args.out).write_text(json.dumps({"device": device, "database": Path(args.db).name, "ridge": args.ridge,
                                              "within": WITHIN, "result": result}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
