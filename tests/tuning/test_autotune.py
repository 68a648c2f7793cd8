"""First-call autotuning (tuning/autotune.py, issue 25) on the CPU backend: the first call of an untuned problem
times its candidates, verified against float64, records the fastest in the user's tuned database, and later calls
(and processes) plan from that entry; a candidate that fails verification is never recorded; the caller's arrays
are never used as scratch; the settings are checked by name."""
from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

import kernelgen
from kernelgen import api, planner, settings
from kernelgen import reference as ref
from kernelgen.problem import make_problem
from kernelgen.tuning import autotune, database, tuner
from harness import poisoned, random_array


@pytest.fixture
def user_db(tmp_path, monkeypatch):
    """The user's tuned databases in a fresh folder (the kernels stay in the session's cache), autotuning on with
    three candidates a problem, and no prepared call or loaded database kept from another test."""
    monkeypatch.setattr(database, "user_db_dir", lambda: tmp_path / "tuned")
    api.clear_caches()
    with settings.scope(autotune=True, autotune_candidates=3, autotune_budget=120):
        yield tmp_path / "tuned"
    api.clear_caches()


def _entries(folder):
    return json.loads((folder / "sm_00_cpu.json").read_text())["entries"]


def test_first_call_tunes_records_and_later_calls_plan_from_the_entry(rng, user_db, monkeypatch, assert_close):
    x, w = random_array(rng, (3, 9, 9, 5)), random_array(rng, (7, 3, 3, 5))
    out = poisoned((3, 9, 9, 7))
    before = api.conv.plan_call(x, w, padding=1, backend="cpu", out=out)  # (planned with the setting off below)
    kernelgen.conv(x, w, padding=1, backend="cpu", out=out)
    assert_close(out, ref.conv_forward(x, w, padding=(1, 1)))
    (key, entry), = _entries(user_db).items()
    assert key == before.prep.problem.key() and entry["autotuned"]["decided_before"] == "default"
    timed = [t for t in entry["tried"] if "ms" in t]
    assert len(entry["tried"]) == 3 and timed and entry["ms"] == min(t["ms"] for t in timed)
    api.clear_caches()  # as a new process would: the entry decides, nothing is tuned again
    monkeypatch.setattr(autotune, "autotune", lambda *a, **k: pytest.fail("tuned a second time"))
    plan = api.conv.plan_call(x, w, padding=1, backend="cpu").prep.plan
    assert (plan.decided_by, plan.variant, plan.config) == ("tuned", entry["variant"], database.config_from(entry))
    assert_close(kernelgen.conv(x, w, padding=1, backend="cpu"), ref.conv_forward(x, w, padding=(1, 1)))


def test_a_candidate_that_fails_verification_is_never_recorded(rng, user_db, monkeypatch, assert_close):
    real = tuner.reference_output
    monkeypatch.setattr(tuner, "reference_output", lambda problem, inputs: real(problem, inputs) + 1.0)
    x, dy = random_array(rng, (2, 8, 8, 3)), random_array(rng, (2, 4, 4, 6))
    got = kernelgen.conv_backward_weight(x, dy, (6, 3, 3, 3), stride=2, padding=1, backend="cpu")
    assert_close(got, ref.conv_backward_weight(x, dy, (6, 3, 3, 3), stride=(2, 2), padding=(1, 1)))
    assert not (user_db / "sm_00_cpu.json").exists()


@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weight"])
def test_the_verification_case_is_the_whole_problem_s_reference(rng, direction):
    """Batch items 1.. are zero, so one item's float64 reference is the whole output's (issue 25's "verified
    against float64 as the tuner does", at the cost of one batch item)."""
    p = make_problem(direction, (3, 7, 6, 4), (5, 3, 2, 4), stride=(2, 1), padding=(1, 0), dilation=(1, 2))
    inputs, want = autotune._verification_case(p)
    for name, a in inputs.items():
        if name != "w":
            assert a[0].any() and not a[1:].any()
    np.testing.assert_allclose(want, tuner.reference_output(p, inputs), rtol=1e-12, atol=1e-12)


def test_budget_zero_times_the_planner_s_pick_only(rng, user_db):
    x, w = random_array(rng, (2, 6, 6, 4)), random_array(rng, (4, 3, 3, 4))
    with settings.scope(autotune=False):
        pick = api.conv.plan_call(x, w, backend="cpu").prep.plan
    with settings.scope(autotune_budget=0):
        kernelgen.conv(x, w, backend="cpu")
    (entry,) = _entries(user_db).values()
    timed = [(t["variant"], t["config"]) for t in entry["tried"] if "ms" in t]
    assert timed == [(pick.variant, str(pick.config))] and len(entry["tried"]) == 3  # the others listed untimed
    assert (entry["variant"], entry["config"]) == (pick.variant, pick.config.as_dict())


def test_threads_tuning_different_problems_keep_both_entries(rng, user_db):
    """The database's read-modify-write is locked: two first calls at once both land."""
    cases = [(random_array(rng, (2, 5, 5, c)), random_array(rng, (3, 1, 1, c))) for c in (2, 3)]
    errors = []

    def first_call(x, w):
        try:
            with settings.scope(autotune=True, autotune_candidates=2):
                kernelgen.conv(x, w, backend="cpu")
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            errors.append(e)
    threads = [threading.Thread(target=first_call, args=case) for case in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(_entries(user_db)) == 2


def test_settings_and_set_autotune_are_checked_by_name(monkeypatch):
    assert kernelgen.set_autotune(True) is False
    try:
        assert settings.get("autotune") is True
    finally:
        kernelgen.set_autotune(False)
    with pytest.raises(TypeError, match="enabled must be a bool"):
        kernelgen.set_autotune("yes")
    monkeypatch.setenv("KERNELGEN_AUTOTUNE_BUDGET", "soon")
    with pytest.raises(ValueError, match="KERNELGEN_AUTOTUNE_BUDGET"):
        settings.get("autotune_budget")
    with pytest.raises(ValueError, match="autotune_candidates"):
        with settings.scope(autotune_candidates=0):
            pass


def test_autotuning_leaves_config_and_tuned_plans_alone(rng):
    x, w = random_array(rng, (1, 5, 5, 2)), random_array(rng, (2, 3, 3, 2))
    plan = planner.make_plan(api.conv.plan_call(x, w, backend="cpu").prep.problem, "cpu")
    with settings.scope(autotune=True):
        assert autotune.wanted(plan) and not autotune.wanted(plan, config=plan.config)
        assert not autotune.wanted(planner.Plan(plan.problem, plan.variant, plan.config, "cpu", decided_by="tuned"))
        with settings.scope(cuda_simulator=True):  # (the simulator times nothing meaningful)
            cuda = planner.Plan(plan.problem, plan.variant, plan.config, "cuda", decided_by="default")
            assert not autotune.wanted(cuda)
    assert not autotune.wanted(plan)


def test_module_autotune_tunes_every_convolution_of_a_training_step(user_db):
    """nn's Module.autotune: the step traced with autotuning on - each of its convolution problems (forward, and
    backward-weight of the first layer, whose input needs no gradient) gets an entry - and the step then plans
    every convolution from those entries with the setting off."""
    from kernelgen import nn
    from kernelgen.nn.precompile_step import trace_plans
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.GlobalAvgPool(), nn.Linear(4, 2))
    with settings.scope(autotune_candidates=2):
        report = model.autotune((2, 5, 5, 3), workers=1)
    assert report.errors == [] and report.kernels == 2
    assert len(_entries(user_db)) == 2
    with settings.scope(autotune=False):
        assert {plan.decided_by for plan in trace_plans(model, (2, 5, 5, 3))} == {"tuned"}


def test_candidates_start_with_the_planner_s_pick_and_take_turns_across_variants():
    """Offline, for the H100 (model "on"): ResNet-50's 3x3 256->256 at batch 64, whose model pick (a Winograd tile)
    ran at 0.52x cuDNN on the GPU; the candidates hold the pick and the best of the other variants too."""
    assert autotune._alternating([("a", 1), ("a", 2), ("b", 3), ("c", 4), ("b", 5)]) == \
        [("a", 1), ("b", 3), ("c", 4), ("a", 2), ("b", 5)]
    p = make_problem("fwd", (64, 14, 14, 256), (256, 3, 3, 256), padding=1)
    with settings.scope(model="on", autotune_candidates=6):
        plan = planner.make_plan(p, "cuda")
        plans = autotune.candidate_plans(plan)
    assert plans[0] is plan and len(plans) == 6 == len({(c.variant, c.config) for c in plans})
    assert len({c.variant for c in plans}) >= 2
    assert all(c.target == plan.target and c.precision == plan.precision for c in plans)


def test_an_entry_recorded_at_a_path_keeps_what_another_writer_put_there(tmp_path):
    """The offline tuner records each problem through database.record at its own path (not a save of the entries it
    read at its start), so an entry that a first-call autotune wrote meanwhile survives."""
    path = tmp_path / database.db_name("sm_90_test")
    a, b = (make_problem("fwd", (2, 5, 5, c), (3, 1, 1, c)) for c in (2, 3))
    database.save(path, {database.entry_key(a): {"ms": 1.0}}, "sm_90_test")  # the other writer's entry
    database.record(b, "sm_90_test", {"ms": 2.0}, path=path)
    assert set(database.load(path)) == {database.entry_key(a), database.entry_key(b)}



def test_candidates_compile_within_the_budget_the_pick_whatever_it_takes(monkeypatch, tmp_path):
    """compile_within, compiling here (workers=0) with compile_job standing in: the pick compiles however long it
    takes, the others while time is left; one that fails is reported; the deadline counts from the call."""
    from kernelgen.tuning import compile_pool
    plans = [planner.make_plan(make_problem("fwd", (1, 5, 5, c), (2, 3, 3, c)), "cpu") for c in (1, 2, 3, 4)]
    digests = [compile_pool.key_digest(p.key()) for p in plans]
    compiled = []

    def fake_compile(job, here=False):
        compiled.append(job[0])
        time.sleep(0.3 if job[0] == digests[0] else 0.05)
        return ("SyntaxError: stand-in" if job[0] == digests[2] else None), 0.0, {}
    monkeypatch.setattr(compile_pool, "compile_job", fake_compile)
    monkeypatch.setattr(compile_pool, "_estimated_cost", lambda job: -digests.index(job[0]))  # in the plans' order
    monkeypatch.setattr(compile_pool.KERNELS, "compiled_on_disk", lambda digest: False)
    with settings.scope(cache_dir=str(tmp_path)):
        ready, failed = compile_pool.compile_within(plans, 0.2, workers=0)
        assert (ready, failed, compiled) == ({digests[0]}, set(), [digests[0]])  # the pick alone: 0.3 s > 0.2
        compiled.clear()
        ready, failed = compile_pool.compile_within(plans, 5.0, workers=0)
    assert compiled == digests and ready == {digests[0], digests[1], digests[3]} and failed == {digests[2]}


def test_a_worker_still_compiling_at_the_deadline_is_left_out(rng, user_db):
    """compile_within with a worker pool on real CPU kernels: a budget of a few seconds takes what is in by then and
    stops the rest; a long one takes all."""
    from kernelgen.tuning import compile_pool
    plans = [planner.make_plan(make_problem("fwd", (1, 6, 6, 3), (c, 3, 3, 3)), "cpu") for c in (5, 6, 7)]
    with settings.scope(cache_dir=str(user_db.parent / "kernels")):
        ready, failed = compile_pool.compile_within(plans, 0.0, workers=2)
        assert ready == {compile_pool.key_digest(plans[0].key())} and not failed  # no pool: the pick only
        start = time.perf_counter()
        ready, failed = compile_pool.compile_within(plans, 300.0, workers=2)
        assert ready == {compile_pool.key_digest(p.key()) for p in plans} and not failed
        assert time.perf_counter() - start < 300
