"""The planner's half of the performance model (tuning/perf_model.py fits it): a fitted model of one device and
precision, read from tuning/db/model_<device>.json (the user's cache dir first), and `choose`, the planner's "model"
link: the best-scored config of a problem's variants.  A missing or unreadable model file is no model (the planner
falls through to its default), never an error or a warning.

A model scores a candidate by linear weights of its features (tuning/perf_features.py) plus the residuals the fit
left on the same config of nearby tuned problems (what the analytic terms miss about a tile, measured).
(perf_model.py keeps the fit, the leave-one-out and the command line apart from this module, which the planner
imports, so that `python -m kernelgen.tuning.perf_model` runs a module nothing has imported yet.)
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from functools import lru_cache

import numpy as np

from kernelgen.problem import ConvProblem
from kernelgen.storage import HALF_DTYPES
from kernelgen.target import KNOWN_TARGETS, Target
from kernelgen.tuning import database
from kernelgen.tuning.perf_features import NAMES, VARIANT_NAMES, features

FORMAT = 1
NEIGHBOUR_SCALE = 1.0  # a neighbour's weight: exp(-distance / NEIGHBOUR_SCALE), distance in log sizes
SHRINK = 0.05          # weight of an implicit zero residual: a config measured on far problems only counts little
# configs of a variant the planner ranks: as many as a tune tries by default (tuner --keep 12), the cheapest under
# the variant's own cost model - the distribution the model was fitted on
KEEP = 12


def model_name(device: str) -> str:
    """The file of a device's model: model_<db_name>."""
    return "model_" + database.db_name(device)


def target_of(device: str) -> Target | None:
    """The KNOWN_TARGETS entry a tuned database's device key names ("sm_90_NVIDIA H100 80GB HBM3"), or None."""
    return next((t for t in KNOWN_TARGETS.values() if t.device_name == device), None)


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
    """{precision: Model} for a device: the user's fitted file (cache dir) if it reads, else the shipped one (of
    database.shipped_device: a device of the same architecture where none ships for this one); {}
    where neither exists or reads (no model is no error: the planner falls through to its default)."""
    for path in (database.user_db_dir() / model_name(device), database.SHIPPED / model_name(
            database.shipped_device(device))):
        try:
            return from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return {}


def model_for(device: str, precision: str) -> Model | None:
    return models_for(device).get(precision)


def unfitted(problem, config) -> bool:
    """Is config of a kind no fitted measurement holds, so the model cannot rank it?  A 16-bit forward or
    backward-data split (into a float32 workspace: none could run before 2026-11-28); the planner splits such small
    grids itself (planner._split_small_half_grid)."""
    return config.split_k > 1 and problem.direction != "bwd_weight" and problem.dtype in HALF_DTYPES


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
            choices += [(v.name, c) for c in configs if v.accepts(problem, c, precision) and not unfitted(problem, c)]
    return model.best(problem, choices, target) if choices else None
