"""The planner's half of the depthwise template's fitted model (tuning/depthwise_model.py fits it): its features of a
(problem, config), the fitted model read from tuning/db/depthwise_model_<device>.json (the user's cache dir first) -
a perf_model_predict.Model: linear weights plus the residuals of the training problems' configs, which correct the
same config's score on nearby problems - and `choose`, the planner's "model" link for depthwise problems.  A missing or unreadable file is no model (the
planner falls through to the cost-model default), never an error or a warning.  (Apart from the fit, as
perf_model_predict is from perf_model: `python -m kernelgen.tuning.depthwise_model` then runs a module nothing has
imported yet.)
"""
from __future__ import annotations

import json
import math
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
# per tensor dtype, the entries a fit reads (their precision) and the precisions its model ranks: on float32 tensors
# "tf32" is the same fp32 kernel and "fp16" / "bf16" add a rounding per load, not a byte; float16 tensors (half the
# bytes, 8-channel vectors) have their own
FITTED = {"float32": "fp32", "float16": "fp16"}
RANKS = {"float32": ("fp32", "tf32", "fp16", "bf16"), "float16": ("fp16",)}

NAMES = ("log_traffic", "log_parallel", "log_fill", "log_resident", "log_waves", "log_threads", "vc2", "vc4", "vc8",
         "halo", "smem_pad", "log_pw", "log_ph", "log_registers", "log_split_k", "log_block_bytes", "log_tc",
         "log_tw", "log_th", "halo_x_bwd_weight", "log_pw_x_bwd_weight", "log_ph_x_bwd_weight", "log_blocks_per_sm")


def features(problem, cfg: DepthwiseConfig, target: Target) -> np.ndarray:
    """The NAMES columns of one (problem, config) on a target."""
    g = geometry(problem, cfg)
    t = depthwise.model_terms(problem, cfg, target, g)
    item = {"float64": 8, "float16": 2}.get(problem.dtype, 4)
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
    """{tensor dtype: perf_model_predict.Model} of a device (the user's cache dir first, then the shipped file): the
    fitted weights, and the residuals each training problem's configs left (they correct the same config's score on
    nearby problems, as the GEMM model's do).  {} where no file reads as one: a missing or unreadable file is no
    model, never an error."""
    for base in (database.user_db_dir(), database.SHIPPED):
        try:
            data = json.loads(model_path(device, base).read_text())
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
            return out
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return {}


def choose(problem, precision: str, target: Target, device: str) -> DepthwiseConfig | None:
    """The model's best-scored config of the variant's config space (KEEP of them), or None (no model for the device
    and the tensors' dtype, a precision it does not rank, or no candidate)."""
    model = models_for(device).get(problem.dtype)
    if model is None or precision not in RANKS[problem.dtype]:
        return None
    choices = [(depthwise.NAME, c) for c in depthwise.VARIANT.config_space(problem, target, precision, keep=KEEP)]
    if not choices:
        return None
    X = np.stack([features(problem, c, target) for _, c in choices])
    return choices[int(np.argmin(model.scores(problem, choices, target, X)))][1]
