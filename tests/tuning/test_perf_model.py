"""The performance model (tuning/perf_model.py, perf_features.py) and its link of the planner's resolution chain:
features finite and deterministic, a fit that recovers a known ranking, leave-one-out on the shipped database, the
chain's order (config= over tuned over nearest over model over default) as explain() reports it, and a missing or
corrupt model file falling through silently."""
from __future__ import annotations

from dataclasses import replace

import json
import math
import warnings

import numpy as np
import pytest

from kernelgen import planner, settings
from kernelgen.problem import make_problem
from kernelgen.target import KNOWN_TARGETS
from kernelgen.templates import VARIANTS, candidates, implicit_gemm, implicit_gemm_tc
from kernelgen.templates.config import TileConfig
from kernelgen.tuning import database, perf_model
from kernelgen.tuning.perf_features import NAMES, features

H100 = KNOWN_TARGETS["h100"]
DEVICE = H100.device_name
SHIPPED_DB = database.SHIPPED / database.db_name(DEVICE)
# a problem no shipped entry is near (batch 3, 40 channels): only the model or the default can answer it
FAR = make_problem("fwd", (3, 20, 20, 40), (24, 3, 3, 40), padding=1)


def some_candidates(problem, precision="fp32"):
    variants = candidates(problem) if precision == "fp32" else [implicit_gemm_tc.VARIANT]
    return [(v.name, c) for v in variants if v.name in perf_model.VARIANT_NAMES
            for c in v.config_space(problem, H100, precision, keep=perf_model.KEEP)]


# --- features ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weight"])
def test_features_are_finite_and_deterministic(direction):
    problems = [make_problem(direction, (8, 14, 14, 64), (128, 3, 3, 64), padding=1),
                make_problem(direction, (2, 9, 9, 3), (5, 1, 1, 3)),
                make_problem(direction, (4, 16, 16, 32), (32, 3, 3, 32), padding=2, stride=2, dilation=2)]
    for p in problems:
        for precision in ("fp32", "tf32"):
            cands = some_candidates(p, precision)
            assert cands, p.key()
            for v, c in cands:
                row = features(p, v, c, H100)
                assert row.shape == (len(NAMES),) and np.all(np.isfinite(row)), (p.key(), v, str(c))
                assert np.array_equal(row, features(p, v, c, H100))


def test_features_read_the_target():
    """The wave terms are the Target's: another SM count changes them."""
    p, cfg = make_problem("fwd", (8, 14, 14, 64), (128, 3, 3, 64), padding=1), TileConfig(128, 64, 8, 8, 4)
    a100 = features(p, implicit_gemm.NAME, cfg, KNOWN_TARGETS["a100"])
    assert not np.array_equal(features(p, implicit_gemm.NAME, cfg, H100), a100)


# --- the fit ----------------------------------------------------------------------------------------------------

def synthetic_groups(rng, n_problems=24):
    """Groups whose log times are a known linear function of the features (a few columns) plus small noise."""
    truth = np.zeros(len(NAMES))
    for name, w in (("log_work_per_sm", 1.0), ("log_waves_quantisation", 0.7), ("log_loads_per_fma", 0.5),
                    ("smem_pad", -0.1), ("log_stages", -0.15)):
        truth[NAMES.index(name)] = w
    groups = []
    for i in range(n_problems):
        n, hw, c, k = (int(rng.choice(s)) for s in ((4, 8, 32, 64), (7, 14, 28, 56), (32, 64, 128), (32, 64, 256)))
        p = make_problem(str(rng.choice(["fwd", "bwd_weight"])), (n, hw, hw, c), (k, 3, 3, c), padding=1)
        cands = [(implicit_gemm.NAME, cfg) for cfg in implicit_gemm.VARIANT.config_space(p, H100, "fp32")]
        X = np.stack([features(p, v, cfg, H100) for v, cfg in cands])
        ms = np.exp(X @ truth + rng.normal(0, 0.01, len(cands)) + 3.0)
        groups.append(perf_model.Group(f"p{i}", p, tuple(cands), X, ms))
    return groups, truth


def test_fit_recovers_a_known_ranking():
    groups, truth = synthetic_groups(np.random.default_rng())
    train, held_out = groups[:16], groups[16:]
    model = perf_model.fit_model(train, "fp32", ridge=0.01)
    for g in held_out:
        predicted = model.scores(g.problem, g.candidates, H100, g.X)
        true = g.X @ truth
        assert np.corrcoef(predicted, true)[0, 1] > 0.95, g.problem.key()
        assert g.ms[int(np.argmin(predicted))] <= 1.05 * g.ms.min(), g.problem.key()


# --- leave-one-out and the command line -------------------------------------------------------------------------

def test_loo_on_the_shipped_database():
    _, entries = perf_model._database(SHIPPED_DB)
    groups = perf_model.groups_of(entries, H100, "tf32")
    records = perf_model.loo_records(groups)
    assert len(records) == len(groups) > 10
    for r in records:
        assert r["problem"] in entries and r["direction"] in ("fwd", "bwd_data", "bwd_weight")
        assert r["ms_picked"] >= r["ms_best"] > 0 and math.isclose(r["slowdown"], r["ms_picked"] / r["ms_best"])
        assert r["picked"].startswith("implicit_gemm_tc:") and r["candidates"] >= 2
    s = perf_model.summary(records)
    assert s["problems"] == len(records) and 0 <= s["within_10pct"] <= 1 and s["geomean_slowdown"] >= 1


def test_fit_command_reproduces_the_shipped_model(tmp_path, capsys):
    """The shipped model is the fit of the shipped database (refit with `python -m kernelgen.tuning.perf_model fit`
    after a tune is merged)."""
    out = tmp_path / "model.json"
    assert perf_model.main(["fit", "--db", str(SHIPPED_DB), "--out", str(out)]) == 0
    fitted = perf_model.from_json(json.loads(out.read_text()))
    shipped = perf_model.from_json(json.loads((database.SHIPPED / perf_model.model_name(DEVICE)).read_text()))
    assert set(fitted) == set(shipped) == {"fp32", "tf32", "fp16"}
    for precision, m in fitted.items():
        assert np.allclose(m.coef, shipped[precision].coef, rtol=1e-6, atol=1e-9), precision
        assert m.variants == shipped[precision].variants and len(m.residuals) == len(shipped[precision].residuals)


def test_commands_refuse_a_missing_database(tmp_path, capsys):
    assert perf_model.main(["loo", "--db", str(tmp_path / "none.json")]) == 2
    assert "none.json" in capsys.readouterr().err


# --- the planner's chain ----------------------------------------------------------------------------------------

def shipped_fp32_problem():
    """An fp32 problem of the shipped database (a dense one: the depthwise entries lend to depthwise problems only),
    its entry's key."""
    entries = database.entries_for(DEVICE)
    key = next(k for k, e in sorted(entries.items()) if database.precision_of(e) == "fp32"
               and e["problem"]["direction"] == "fwd" and e["problem"]["N"] <= 32 and e["problem"]["groups"] == 1)
    return database.problem_of(entries[key]), key


def test_chain_order(on_h100, fresh_models):
    tuned, key = shipped_fp32_problem()
    given = TileConfig(64, 64, 8, 4, 4)
    assert planner.make_plan(tuned, "cuda", config=given).decided_by == "config="
    assert planner.make_plan(tuned, "cuda").decided_by == "tuned"
    near = make_problem("fwd", (tuned.N, *tuned.in_size[1:], tuned.C + tuned.C // 8), (tuned.K, *tuned.filter_size[1:],
                                                                                         tuned.C + tuned.C // 8),
                        padding=tuned.padding[1:], stride=tuned.stride[1:])
    plan = planner.make_plan(near, "cuda")
    assert plan.decided_by.startswith("nearest tuned ") and plan.decided_by.split()[-1] in database.entries_for(DEVICE)
    plan = planner.make_plan(FAR, "cuda")
    assert plan.decided_by == "model" and "performance model" in plan.reason
    assert VARIANTS[plan.variant].accepts(FAR, plan.config, "fp32")
    with settings.scope(model="off"):
        off = planner.make_plan(FAR, "cuda")
        assert off.decided_by == "default" and "'off'" in off.reason
        # (FAR's grid of 10 blocks is then split over the reduction: planner._split_small_grid)
        assert replace(off.config, split_k=1) == candidates(FAR)[0].default_config(FAR, H100, "fp32")
        assert off.config.split_k > 1 and "split" in off.reason
    with settings.scope(no_tuned=True):
        assert planner.make_plan(tuned, "cuda").decided_by == "model"  # the database off: the model answers
    assert planner.make_plan(FAR, "cpu").decided_by == "default"  # never the model on the CPU backend


def test_chain_order_tensor_core(on_h100, fresh_models):
    entries = database.entries_for(DEVICE)
    key = next(k for k, e in sorted(entries.items()) if database.precision_of(e) == "tf32")
    tuned = database.problem_of(entries[key])
    assert planner.make_plan(tuned, "cuda", precision="tf32").decided_by == "tuned"
    plan = planner.make_plan(FAR, "cuda", precision="tf32")
    assert plan.decided_by == "model" and plan.config in implicit_gemm_tc.VARIANT.config_space(FAR, H100, "tf32")
    far16 = make_problem("fwd", (3, 20, 20, 64), (64, 3, 3, 64), padding=1, dtype="float16")
    assert planner.make_plan(far16, "cuda", precision="fp16").decided_by == "model"
    with settings.scope(model="off"):  # fp16 on sm_90 without a model: the untuned TMA tile, then the default
        assert planner.make_plan(far16, "cuda", precision="fp16").decided_by == "untuned sm_90 TMA tile"
        assert planner.make_plan(FAR, "cuda", precision="tf32").decided_by == "default"


def test_forced_variant_takes_the_model_among_its_own_configs(on_h100, fresh_models):
    plan = planner.make_plan(FAR, "cuda", algo="implicit_gemm")
    assert plan.variant == "implicit_gemm" and plan.decided_by == "model"
    unsplit = replace(plan.config, split_k=1)  # (its small grid split after: planner._split_small_grid)
    assert unsplit in implicit_gemm.VARIANT.config_space(FAR, H100, "fp32", keep=perf_model.KEEP)


def test_model_link_needs_a_gpu_or_the_setting(fresh_models):
    """Offline (no GPU), planning for CUDA is unchanged unless model='on' names the target setting's GPU."""
    if planner.gpu_present():
        pytest.skip("a GPU is present: the link is on by default here")
    assert planner.make_plan(FAR, "cuda").decided_by == "default"
    with settings.scope(model="on"):
        assert planner.make_plan(FAR, "cuda").decided_by == "model"
        assert planner.make_plan(FAR, "cpu").decided_by == "default"
    with settings.scope(model=False):
        assert settings.get("model") == "off"
    with pytest.raises(ValueError, match="setting model"):
        with settings.scope(model="sometimes"):
            pass


def test_decided_by_is_not_part_of_the_key():
    plan = planner.make_plan(FAR, "cpu")
    other = planner.Plan(plan.problem, plan.variant, plan.config, plan.backend, plan.precision, plan.target,
                         "model", "another reason")
    assert other == plan and other.key() == plan.key() and hash(other) == hash(plan)


CORRUPT = {
    "not json": "{ this is not json",
    "another format": json.dumps({"format": 99, "features": list(NAMES), "models": {}}),
    "other features": json.dumps({"format": perf_model.FORMAT, "features": ["x"], "models": {}}),
    "short weights": json.dumps({"format": perf_model.FORMAT, "features": list(NAMES),
                                 "models": {"fp32": {"coef": [1.0], "variants": ["implicit_gemm"]}}}),
    "nan weights": json.dumps({"format": perf_model.FORMAT, "features": list(NAMES),
                               "models": {"fp32": {"coef": [float("nan")] * len(NAMES), "variants": []}}}),
    "no models": json.dumps({"format": perf_model.FORMAT, "features": list(NAMES)}),
}


@pytest.mark.parametrize("case", [None, *CORRUPT])
def test_missing_or_corrupt_model_falls_through_silently(case, tmp_path, monkeypatch, on_h100, fresh_models, capsys):
    shipped, user = tmp_path / "shipped", tmp_path / "user"
    shipped.mkdir(), user.mkdir()
    for name in (database.db_name(DEVICE),):  # the database stays: only the model file is missing or broken
        (shipped / name).write_text(SHIPPED_DB.read_text())
    if case is not None:
        (shipped / perf_model.model_name(DEVICE)).write_text(CORRUPT[case])
    monkeypatch.setattr(database, "SHIPPED", shipped)
    monkeypatch.setattr(database, "user_db_dir", lambda: user)
    database.entries_for.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert perf_model.models_for(DEVICE) == {}
        plan = planner.make_plan(FAR, "cuda")
    assert plan.decided_by == "default" and "no performance model" in plan.reason
    assert capsys.readouterr() == ("", "")
    database.entries_for.cache_clear()
