"""The depthwise template's fitted model (tuning/depthwise_model.py, depthwise_model_predict.py) and its link of the
planner's depthwise chain: features finite and deterministic, a fit that recovers a known ranking, leave-one-out on
the shipped database beating the cost-model default, the shipped file reproduced by the fit command, the chain's
order (config= over tuned over model over default), a missing or corrupt file falling through silently, and no
depthwise entry lent to a dense problem as its nearest."""
from __future__ import annotations

import dataclasses
import json
import math
import warnings

import numpy as np
import pytest

from kernelgen import planner, settings
from kernelgen.problem import make_problem
from kernelgen.target import KNOWN_TARGETS
from kernelgen.templates import depthwise
from kernelgen.templates.depthwise_config import DepthwiseConfig
from kernelgen.tuning import database, depthwise_model, depthwise_model_predict as predict, perf_model, shapes

H100 = KNOWN_TARGETS["h100"]
DEVICE = H100.device_name
SHIPPED_DB = database.SHIPPED / database.db_name(DEVICE)
# a depthwise layer of none of the tuned tables (MobileNetV2's 56x56 layer at batch 64: the unseen table's row)
UNSEEN = make_problem("fwd", (64, 56, 56, 144), (144, 3, 3, 1), padding=1, groups=144)


@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weight"])
def test_features_are_finite_and_deterministic(direction):
    p = make_problem(direction, (8, 14, 14, 48), (48, 5, 5, 1), padding=2, stride=2, groups=48)
    configs = depthwise.VARIANT.config_space(p, H100, "fp32", keep=predict.KEEP)
    assert configs
    for c in configs:
        row = predict.features(p, c, H100)
        assert row.shape == (len(predict.NAMES),) and np.all(np.isfinite(row))
        assert np.array_equal(row, predict.features(p, c, H100))


def test_fit_recovers_a_known_ranking():
    """Times made from known weights of the features (times a per-problem size): the fit ranks held-out problems'
    configs as those weights do."""
    rng = np.random.default_rng(0)
    truth = rng.standard_normal(len(predict.NAMES)) * 0.2
    groups = []
    for i, (n, c, hw) in enumerate([(8, 32, 28), (16, 64, 14), (4, 96, 56), (32, 16, 28), (8, 128, 7), (2, 64, 56)]):
        for direction in ("fwd", "bwd_data"):
            p = make_problem(direction, (n, hw, hw, c), (c, 3, 3, 1), padding=1, groups=c)
            configs = depthwise.VARIANT.config_space(p, H100, "fp32", keep=12)
            X = np.stack([predict.features(p, cfg, H100) for cfg in configs])
            ms = np.exp(X @ truth + i)
            groups.append(perf_model.Group(f"{direction}{i}", p, tuple(("depthwise", cfg) for cfg in configs), X, ms))
    records = perf_model.loo_records(groups, ridge=1e-3)
    assert all(r["slowdown"] < 1.05 for r in records), records


def test_leave_one_out_on_the_shipped_database_beats_the_default():
    """The shipped depthwise entries (tuning/tables/depthwise_train.json, tuned on the H100): the model's pick,
    fitted without each problem, is nearer that problem's best than the cost-model default is (each tensor dtype)."""
    entries = database.load(SHIPPED_DB)
    for dtype, precision in predict.FITTED.items():
        groups = depthwise_model.groups_of(entries, H100, dtype)
        assert len(groups) >= 30, dtype
        records = perf_model.loo_records(groups, depthwise_model.RIDGE)
        model = math.exp(np.mean([math.log(r["slowdown"]) for r in records]))
        default = math.exp(np.mean(np.log(depthwise_model.default_slowdowns(groups, H100, precision))))
        assert model < default and model < 1.15, (dtype, model, default)


def test_fit_command_reproduces_the_shipped_model(tmp_path, capsys):
    out = tmp_path / "dw.json"
    assert depthwise_model.main(["fit", "--db", str(SHIPPED_DB), "--out", str(out)]) == 0
    fitted, shipped = json.loads(out.read_text()), json.loads(predict.model_path(DEVICE).read_text())
    assert fitted["features"] == shipped["features"] == list(predict.NAMES)
    assert set(fitted["models"]) == set(shipped["models"]) and "float32" in fitted["models"]
    for dtype, m in fitted["models"].items():
        assert np.allclose(m["coef"], shipped["models"][dtype]["coef"], rtol=1e-6, atol=1e-9), dtype
        assert len(m["residuals"]) == len(shipped["models"][dtype]["residuals"]) > 0, dtype


def test_the_bench_table_stays_untuned():
    """The depthwise bench table measures the model on layers it has not seen: the database holds none of them."""
    keys = set(database.load(SHIPPED_DB))
    _, layers = shapes.load_table("depthwise")
    for layer in layers:
        for d in ("fwd", "bwd_data", "bwd_weight"):
            for precision, dtype in (("fp32", "float32"), ("fp16", "float16")):
                assert database.entry_key(layer.problem(d, dtype), precision) not in keys, layer.name


def test_chain_order(on_h100, fresh_models):
    entries = database.entries_for(DEVICE)
    key = next(k for k, e in sorted(entries.items()) if e["variant"] == "depthwise")
    tuned = database.problem_of(entries[key])
    given = DepthwiseConfig(TC=8, TW=4, TH=8, VC=1, PW=2, PH=1, halo=1)
    assert planner.make_plan(UNSEEN, "cuda", config=given).decided_by == "config="
    assert planner.make_plan(tuned, "cuda").decided_by == "tuned"
    plan = planner.make_plan(UNSEEN, "cuda")
    assert plan.variant == "depthwise" and plan.decided_by == "model" and "depthwise model" in plan.reason
    picked = dataclasses.replace(plan.config, share_rows=0)  # (the planner shares rows where the pick allows)
    assert picked in depthwise.VARIANT.config_space(UNSEEN, H100, "fp32", keep=predict.KEEP)
    assert plan.config == depthwise.with_shared_rows(UNSEEN, picked, H100)
    assert planner.make_plan(UNSEEN, "cuda", precision="tf32").decided_by == "model"  # the same fp32 kernel
    with settings.scope(model="off"):
        off = planner.make_plan(UNSEEN, "cuda")
        assert off.decided_by == "default"
        assert off.config == depthwise.with_shared_rows(UNSEEN, depthwise.default_config(UNSEEN, H100), H100)
    half = make_problem("fwd", (64, 56, 56, 144), (144, 3, 3, 1), padding=1, groups=144, dtype="float16")
    assert planner.make_plan(half, "cuda", precision="fp16").decided_by == "model"  # float16 tensors: their own
    assert planner.make_plan(UNSEEN, "cpu").decided_by == "default"  # never the model on the CPU backend


def test_a_direction_the_model_was_not_fitted_on_takes_the_default(on_h100, fresh_models):
    """The float16 model's training problems are forward and backward-data only: float16 (and bfloat16)
    backward-weight takes the cost-model default, float32 backward-weight the float32 model (fitted on all three)."""
    models = predict.models_for(DEVICE)
    assert predict.trained_directions(models["float16"]) == {"fwd", "bwd_data"}
    assert predict.trained_directions(models["float32"]) == {"fwd", "bwd_data", "bwd_weight"}
    for dtype, precision in (("float16", "fp16"), ("bfloat16", "bf16")):
        half = make_problem("bwd_weight", (64, 56, 56, 144), (144, 3, 3, 1), padding=1, groups=144, dtype=dtype)
        assert predict.choose(half, precision, H100, DEVICE) is None
        assert planner.make_plan(half, "cuda", precision=precision).decided_by == "default"
        forward = make_problem("fwd", (64, 56, 56, 144), (144, 3, 3, 1), padding=1, groups=144, dtype=dtype)
        assert planner.make_plan(forward, "cuda", precision=precision).decided_by == "model"
    full = make_problem("bwd_weight", (64, 56, 56, 144), (144, 3, 3, 1), padding=1, groups=144)
    assert planner.make_plan(full, "cuda").decided_by == "model"


@pytest.mark.parametrize("case", [None, "not json", "other features", "nan", "old format"])
def test_missing_or_corrupt_model_falls_through_silently(case, tmp_path, monkeypatch, on_h100, fresh_models):
    shipped, user = tmp_path / "shipped", tmp_path / "user"
    shipped.mkdir(), user.mkdir()
    (shipped / database.db_name(DEVICE)).write_text(SHIPPED_DB.read_text())
    text = {"not json": "{ no",
            "other features": json.dumps({"format": predict.FORMAT, "features": ["x"],
                                          "models": {"float32": {"coef": [1.0]}}}),
            "nan": json.dumps({"format": predict.FORMAT, "features": list(predict.NAMES),
                               "models": {"float32": {"coef": [float("nan")] * len(predict.NAMES)}}}),
            "old format": json.dumps({"format": 1, "features": list(predict.NAMES),
                                      "coef": [0.0] * len(predict.NAMES)})}.get(case)
    if text is not None:
        predict.model_path(DEVICE, shipped).write_text(text)
    monkeypatch.setattr(database, "SHIPPED", shipped)
    monkeypatch.setattr(database, "user_db_dir", lambda: user)
    database.entries_for.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert planner.make_plan(UNSEEN, "cuda").decided_by == "default"
    database.entries_for.cache_clear()


def test_a_depthwise_entry_is_nobody_elses_nearest():
    dense = make_problem("fwd", (16, 28, 28, 58), (58, 3, 3, 58), padding=1)
    dw = make_problem("fwd", (16, 28, 28, 58), (58, 3, 3, 1), padding=1, groups=58)
    assert database._distance(dense, dw) is None and database._distance(dw, dense) is None
    assert database._distance(dw, dw) == 0
