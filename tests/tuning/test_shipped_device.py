"""A GPU kernelgen ships no database for reads the shipped files of a GPU of the same architecture
(database.shipped_device): an H200 plans with the H100's entries and models, its own autotuned entries over them."""
from __future__ import annotations

import dataclasses
import json

from kernelgen import planner
from kernelgen.target import KNOWN_TARGETS
from kernelgen.tuning import database, depthwise_model_predict, perf_model_predict, shapes

H100 = KNOWN_TARGETS["h100"].device_name
H200 = "sm_90_NVIDIA H200"


def test_a_sibling_of_the_same_architecture_stands_in():
    assert database.shipped_device(H200) == H100 and database.shipped_device(H100) == H100
    assert database.shipped_device("sm_80_NVIDIA A100-SXM4-40GB") == "sm_80_NVIDIA A100-SXM4-40GB"  # none ships
    assert database.shipped_device("sm_00_cpu") == "sm_00_cpu"
    assert "shipped entries of " + H100 in database.described(H200) and database.described(H100) == H100


def test_entries_and_models_of_the_sibling_the_users_own_over_them(tmp_path, monkeypatch, fresh_models):
    monkeypatch.setattr(database, "user_db_dir", lambda: tmp_path)
    database.entries_for.cache_clear()
    shipped = database.entries_for(H100)
    key = sorted(shipped)[0]
    own = {**shipped[key], "measured_by": "this H200"}
    (tmp_path / database.db_name(H200)).write_text(json.dumps({"format": database.FORMAT, "device": H200,
                                                               "entries": {key: own}}))
    database.entries_for.cache_clear()
    try:
        mine = database.entries_for(H200)
        assert mine[key] == own and set(mine) == set(shipped)
        assert set(perf_model_predict.models_for(H200)) == set(perf_model_predict.models_for(H100)) != set()
        assert set(depthwise_model_predict.models_for(H200)) == set(depthwise_model_predict.models_for(H100)) != set()
    finally:
        database.entries_for.cache_clear()


def test_an_h200_plans_a_tuned_problem_with_the_h100_entry(on_h100, monkeypatch):
    layer = next(layer for layer in shapes.load_table("resnet18_cifar")[1] if layer.name == "l1_3x3")
    p = layer.problem("fwd")
    on_h100_plan = planner.make_plan(p, "cuda")
    monkeypatch.setattr(planner, "tuned_device", lambda: H200)
    plan = planner.make_plan(p, "cuda")
    assert plan.decided_by == "tuned" and plan.config == on_h100_plan.config
    assert f"shipped entries of {H100}" in plan.reason


def test_measured_lists_what_the_tune_of_exactly_the_problem_timed(on_h100):
    """database.measured: the winner first, then every timed candidate; [] for a problem no tune measured (the
    planner's col2im and Winograd backward-weight rules step aside only where a tune timed their kernels)."""
    layer = next(layer for layer in shapes.load_table("gpu_md")[1] if layer.name == "r50_stem_7x7")
    p = layer.problem("bwd_data")
    pairs = database.measured(p, H100)
    assert len(pairs) > 1 and pairs[0] == database.exact(p, H100) and not any(c.col2im for _, c in pairs)
    assert database.measured(p, H100, "tf32") and database.measured(p, H100, "tf32") != pairs
    assert database.measured(dataclasses.replace(p, N=p.N + 1), H100) == []
