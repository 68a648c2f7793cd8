"""The planner's half of the depthwise template's fitted model (tuning/depthwise_model.py fits it): its features of a
(problem, config); the fitted model read from tuning/db/depthwise_model_<device>.json (the user's cache dir first),
a perf_model_predict.Model - linear weights plus the residuals of the training problems' configs, which correct the
same config's score on nearby problems; and `choose`, the planner's "model" link for depthwise problems.  A missing
or unreadable file is no model (the planner falls through to the cost-model default), never an error or a warning.
(Apart from the fit, as perf_model_predict is from perf_model: `python -m kernelgen.tuning.depthwise_model` then runs
a module nothing has imported yet.)
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import threading
from dataclasses import asdict
from functools import lru_cache
from pathlib import Path

import numpy as np

from kernelgen.target import Target
from kernelgen.templates import depthwise
from kernelgen.templates.depthwise_config import DepthwiseConfig
from kernelgen.templates.depthwise_geometry import geometry
from kernelgen.tuning import database
from kernelgen.tuning.perf_model_predict import Model

FORMAT = 2  # {"models": {tensor dtype: {"coef": [...], "residuals": [...]}}}
# configs the planner scores: the tuner's depthwise candidates (tuner.depthwise_candidates with its default keep:
# spread over every block size, channel vector and window), the distribution the model was fitted on; the tuned
# winners use every block size from 64 to 512 threads, so none is left out (about 0.1 s a problem to enumerate)
KEEP = 24
# the rule of which model ranks a problem (_ranking_model), part of a remembered pick's key: a pick made under an
# older rule is not reused
RANKING = 2
# per tensor dtype, the entries a fit reads (their precision) and the precisions its model ranks: on float32 tensors
# "tf32" is the same fp32 kernel and "fp16" / "bf16" add a rounding per load, not a byte; float16 tensors (half the
# bytes, 8-channel vectors) have their own
FITTED = {"float32": "fp32", "float16": "fp16"}
RANKS = {"float32": ("fp32", "tf32", "fp16", "bf16"), "float16": ("fp16",)}
# bfloat16 tensors move the bytes float16 ones do, through the same kernels but for the conversions: their model
MODEL_OF = {"bfloat16": "float16"}

NAMES = ("log_traffic", "log_parallel", "log_fill", "log_resident", "log_waves", "log_threads", "vc2", "vc4", "vc8",
         "halo", "smem_pad", "log_pw", "log_ph", "log_registers", "log_split_k", "log_block_bytes", "log_tc",
         "log_tw", "log_th", "halo_x_bwd_weight", "log_pw_x_bwd_weight", "log_ph_x_bwd_weight", "log_blocks_per_sm")


def features(problem, cfg: DepthwiseConfig, target: Target) -> np.ndarray:
    """The NAMES columns of one (problem, config) on a target."""
    g = geometry(problem, cfg)
    t = depthwise.model_terms(problem, cfg, target, g)
    item = depthwise.itemsize(problem)
    bw = float(problem.direction == "bwd_weight")
    log = math.log
    return np.array([log(t.traffic), log(t.parallel), log(t.fill), log(t.resident), log(t.waves), log(cfg.threads),
                     cfg.VC == 2, cfg.VC == 4, cfg.VC == 8, cfg.halo, cfg.smem_pad > 0, log(cfg.PW), log(cfg.PH),
                     log(g.registers), log(cfg.split_k), log(cfg.block_groups * g.src_per_group * item), log(cfg.TC),
                     log(cfg.TW), log(cfg.TH), cfg.halo * bw, log(cfg.PW) * bw, log(cfg.PH) * bw,
                     log(t.blocks / target.sm_count)], dtype=np.float64)


def model_path(device: str, base: Path | None = None) -> Path:
    return (base or database.SHIPPED) / ("depthwise_model_" + database.db_name(device))


def to_json(models: dict, device: str, fitted_on: dict) -> dict:
    """The model file of {tensor dtype: perf_model_predict.Model}: weights and each training problem's residuals."""
    return {"format": FORMAT, "device": device, "features": list(NAMES), "fitted_on": fitted_on,
            "models": {dtype: {"coef": m.coef.tolist(),
                               "residuals": [{"problem": asdict(q), "configs": r} for q, r in m.residuals]}
                       for dtype, m in models.items()}}


@lru_cache(maxsize=8)
def models_for(device: str) -> dict:
    """{tensor dtype: perf_model_predict.Model} of a device (the user's cache dir first, then the shipped file:
    database.shipped_device's where none ships for this device): the fitted weights, and the residuals each training
    problem's configs left (they correct the same config's score on nearby problems, as the GEMM model's do).  {}
    where no file reads as one: a missing or unreadable file is no model, never an error."""
    for path in (model_path(device, database.user_db_dir()), model_path(database.shipped_device(device))):
        try:
            data = json.loads(path.read_text())
            if data.get("format") != FORMAT or data.get("features") != list(NAMES):
                continue
            out = {}
            for dtype, m in data["models"].items():
                coef = np.asarray(m["coef"], dtype=np.float64)
                residuals = tuple((database.problem_of(n), {str(k): float(v) for k, v in n["configs"].items()})
                                  for n in m.get("residuals", ()))
                if dtype in FITTED and coef.shape == (len(NAMES),) and np.all(np.isfinite(coef)) \
                        and all(math.isfinite(v) for _, r in residuals for v in r.values()):
                    out[dtype] = Model(FITTED[dtype], coef, frozenset((depthwise.NAME,)), residuals)
            if out:
                _FILES[device] = _file_stamp(path)
            return out
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return {}


_FILES: dict = {}  # device -> the stamp of the model file models_for read (part of every remembered pick's key)


def _file_stamp(path: Path) -> str:
    st = path.stat()
    return f"{path}:{st.st_size}:{st.st_mtime_ns}"


def choose(problem, precision: str, target: Target, device: str) -> DepthwiseConfig | None:
    """The model's best-scored config of the variant's config space (KEEP of them), or None (no model for the device
    and the tensors' dtype, a precision it does not rank, or no candidate).  The config space takes 0.1-0.4 s to
    enumerate per problem (a MobileNetV2's 30 batch-128 depthwise problems: 4.7 s), so each pick is remembered on
    disk (remembered_pick) for every later process."""
    fitted = MODEL_OF.get(problem.dtype, problem.dtype)
    model = _ranking_model(models_for(device), fitted, problem.direction)
    if model is None or ("fp16" if fitted != problem.dtype else precision) not in RANKS[fitted]:
        return None
    memo = _pick_path(problem, precision, target, device)
    hit = remembered_pick(memo, problem, precision)
    if hit is not None:
        return hit
    choices = [(depthwise.NAME, c) for c in depthwise.VARIANT.config_space(problem, target, precision, keep=KEEP)]
    if not choices:
        return None
    X = np.stack([features(problem, c, target) for _, c in choices])
    pick = choices[int(np.argmin(model.scores(problem, choices, target, X)))][1]
    _remember(memo, pick)
    return pick


def trained_directions(model: Model) -> frozenset:
    """The directions a model's training problems were tuned in (its residuals name every one of them)."""
    return frozenset(q.direction for q, _ in model.residuals)


def _ranking_model(models: dict, fitted: str, direction: str) -> Model | None:
    """The `fitted` dtype's model where its training problems hold `direction`, else None: the cost-model default.
    The float16 fit has no backward-weight problems; on the held-out depthwise table's float16 backward-weight rows
    (H100, one call, BENCHMARKS.md 2026-11-28) the default ran at 1.031x cuDNN, the float32 model's picks at 0.964x,
    the float16 model's (fitted on forward and backward-data timings) at 0.876x."""
    model = models.get(fitted)
    return model if model is not None and direction in trained_directions(model) else None


def _pick_path(problem, precision, target: Target, device: str) -> Path:
    """Where a pick is remembered: named by a digest of everything it depends on - the problem, the precision, the
    Target's facts, the model file (path, size, mtime), this module's candidate count and its ranking rule."""
    text = repr((problem.key(), precision, target, _FILES.get(device), KEEP, FORMAT, RANKING))
    return database.user_db_dir().parent / "depthwise_picks" / (hashlib.sha256(text.encode()).hexdigest()[:32] + ".txt")


def remembered_pick(path: Path, problem, precision) -> DepthwiseConfig | None:
    """The pick remembered at `path`, if it reads and still fits the problem (else None: computed again)."""
    try:
        cfg = DepthwiseConfig.parse(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return cfg if depthwise.VARIANT.accepts(problem, cfg, precision) else None


def _remember(path: Path, cfg: DepthwiseConfig):
    """Write the pick whole (a temporary file renamed over it: a reader in another process sees all of it or none);
    a cache directory that cannot be written only costs the next process the enumeration."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(str(cfg) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass
