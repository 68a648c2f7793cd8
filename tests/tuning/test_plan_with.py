"""bench --against: plans made with another directory's tuned database and models (tuning/plan_with.py)."""
from __future__ import annotations

import shutil

import pytest

from kernelgen import planner
from kernelgen.target import KNOWN_TARGETS
from kernelgen.tuning import bench, database, depthwise_model_predict, perf_model_predict, shapes
from kernelgen.tuning.plan_with import shipped_from

DEVICE = KNOWN_TARGETS["h100"].device_name


def _r18_layer1():
    return next(layer for layer in shapes.load_table("resnet18_cifar")[1] if layer.name == "l1_3x3")


def test_plans_inside_read_the_directory_and_outside_the_shipped_files(tmp_path, on_h100, fresh_models):
    """An empty directory: no tuned entry and no model inside the block (the cost-model default decides); a copy
    of the shipped files: the shipped plan; after the block, the shipped files again."""
    p = _r18_layer1().problem("bwd_data")
    shipped = planner.make_plan(p, "cuda")
    assert shipped.decided_by == "tuned"
    with shipped_from(tmp_path):
        bare = planner.make_plan(p, "cuda")
        assert bare.decided_by == "default" and perf_model_predict.models_for(DEVICE) == {}
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in (database.db_name(DEVICE), perf_model_predict.model_name(DEVICE),
                 depthwise_model_predict.model_path(DEVICE, copy).name):
        shutil.copy(database.SHIPPED / name, copy / name)
    with shipped_from(copy):
        assert planner.make_plan(p, "cuda").config == shipped.config
    again = planner.make_plan(p, "cuda")
    assert again.decided_by == "tuned" and again.config == shipped.config and database.SHIPPED.name == "db"


def test_not_a_directory_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        with shipped_from(tmp_path / "missing"):
            pass
    assert database.SHIPPED.name == "db"


def test_plan_jobs_plans_each_problem_with_each_source(tmp_path, on_h100, fresh_models, monkeypatch):
    """Every problem's jobs come in pairs - shipped, then the --against directory - planned each with its own
    files (the kernels' compile replaced here: the bench's pool compiles for the GPU)."""
    monkeypatch.setattr(bench, "precompile", lambda plans, workers=None: [None] * len(plans))
    jobs, plans = bench.plan_jobs([_r18_layer1()], ["fwd", "bwd_data"], [None], [None], "fp32",
                                  [None, str(tmp_path)])
    assert [(j[1], j[4]) for j in jobs] == [("fwd", None), ("fwd", str(tmp_path)), ("bwd_data", None),
                                            ("bwd_data", str(tmp_path))]
    assert [p.decided_by for p in plans] == ["tuned", "default", "tuned", "default"]


def test_plan_jobs_compiles_each_kernel_once(tmp_path, on_h100, fresh_models, monkeypatch):
    """A copy of the shipped files plans every problem as the shipped ones do: one compile per kernel, not two."""
    compiled = []
    monkeypatch.setattr(bench, "precompile", lambda plans, workers=None: compiled.extend(plans) or [None] * len(plans))
    for name in (database.db_name(DEVICE), perf_model_predict.model_name(DEVICE)):
        shutil.copy(database.SHIPPED / name, tmp_path / name)
    jobs, plans = bench.plan_jobs([_r18_layer1()], ["fwd", "bwd_data"], [None], [None], "fp32", [None, str(tmp_path)])
    assert len(plans) == 4 and plans[0].key() == plans[1].key() and plans[2].key() == plans[3].key()
    assert len(compiled) == 2 and {p.key() for p in compiled} == {plans[0].key(), plans[2].key()}
