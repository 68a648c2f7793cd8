"""kernelgen.profile_compile (issue 27): where a cold start's time goes, per kernel and stage."""
from __future__ import annotations

import time

import kernelgen
from kernelgen import compile_profile, settings
from kernelgen.runtime.cache import KERNELS
from harness import random_array

KW = dict(padding=1)


def test_a_cold_call_s_stages_are_its_kernel_s_and_a_warm_call_adds_none(rng, tmp_path):
    x, w = random_array(rng, (2, 7, 6, 3)), random_array(rng, (5, 3, 3, 3))
    with settings.scope(cache_dir=str(tmp_path)):
        with kernelgen.profile_compile() as report:
            kernelgen.conv(x, w, **KW)
        before = {k: dict(v) for k, v in report.seconds.items()}
        with kernelgen.profile_compile() as warm:
            kernelgen.conv(x, w, **KW)
    (kernel, stages), = before.items()
    assert kernel == kernelgen.explain(kernelgen.conv, x, w, **KW).problem.key()
    assert {"plan", "ir", "print", "cache", "numba", "load", "pass:fold_constants", "pass:flatten_buffers",
            "pass:eliminate_common_subexpressions"} <= set(stages)
    assert all(s >= 0 for s in stages.values()) and sum(stages.values()) <= report.wall
    assert warm.seconds == {}  # planned, rendered and compiled already: nothing to profile
    assert report.seconds == before  # the second block's calls went to its own report
    assert "numba" in report.table() and kernel[:40] in report.table()


def test_a_stage_counts_its_own_time_not_its_nested_stages():
    with kernelgen.profile_compile() as report:
        with compile_profile.kernel_scope("k"):
            with compile_profile.stage("outer"):
                time.sleep(0.02)
                with compile_profile.stage("inner"):
                    time.sleep(0.05)
    outer, inner = report.seconds["k"]["outer"], report.seconds["k"]["inner"]
    assert 0.04 <= inner and 0.015 <= outer < 0.04  # not 0.07


def test_nothing_is_recorded_outside_a_profile():
    assert not compile_profile.active()
    with compile_profile.kernel_scope("k"), compile_profile.stage("s"):
        compile_profile.record("k", "workers", 1.0)
    with kernelgen.profile_compile() as report:
        assert compile_profile.active()
    assert report.seconds == {} and not compile_profile.active()


def test_precompile_reports_its_workers_seconds_per_kernel(rng, tmp_path):
    """(Nothing of these kernels kept in this process first: where another test had compiled or rendered them here, a
    worker forked from this process inherited them and compiled nothing, or built no IR - the order-dependent failure
    of `pytest tests/tuning tests/runtime`.)"""
    calls = [(kernelgen.conv, (random_array(rng, (2, 5, 5, c)), random_array(rng, (4, 3, 3, c))), KW) for c in (2, 3)]
    kernelgen.api.clear_caches()
    with settings.scope(cache_dir=str(tmp_path)):
        KERNELS.clear()  # (the empty tmp_path's files, and the compiled kernels this process keeps in memory)
    with settings.scope(cache_dir=str(tmp_path)), kernelgen.profile_compile() as report:
        result = kernelgen.precompile(calls, workers=1)
    assert result.compiled == 2 and result.workers == 1
    workers = {k for k, row in report.seconds.items() if "workers" in row}
    here = {k for k, row in report.seconds.items() if "numba" in row}
    assert len(workers) == 1 and len(here) == 2  # one compiled in the worker, both loaded here as they came
    for k in workers:  # the worker's own stages come back, and this process's wait for it
        row = report.seconds[k]
        assert row["workers:numba"] > 0 and "workers:ir" in row and "wait" in row, row


def test_compile_plans_uses_a_pool_started_earlier_and_leaves_it_running(rng, tmp_path, monkeypatch):
    """A pool started earlier (pool_on_demand's, its workers importing while the caller traces) takes the jobs in
    place of a new one, and stays usable."""
    from concurrent.futures import ThreadPoolExecutor

    from kernelgen.precompile import plan_calls
    from kernelgen.tuning import compile_pool
    calls = [(kernelgen.conv, (random_array(rng, (2, 5, 5, c)), random_array(rng, (4, 3, 3, c))), KW) for c in (2, 3)]
    submitted = []
    with ThreadPoolExecutor(2) as pool, settings.scope(cache_dir=str(tmp_path)):
        submit = pool.submit
        monkeypatch.setattr(pool, "submit", lambda fn, *a: submitted.append(fn.__name__) or submit(fn, *a))
        report = compile_pool.compile_plans(plan_calls(calls), pool=pool)
        assert pool.submit(lambda: 7).result() == 7
    assert report.compiled == 2 and report.workers == 1 and not report.errors
    assert submitted == ["compile_job", "<lambda>"]  # the other kernel compiled here


def test_the_pool_on_demand_starts_at_the_first_plan_not_on_disk(rng, tmp_path, monkeypatch):
    """pool_on_demand starts no workers while every plan shown is in the disk cache (a warm first step only
    loads), starts them once at the first plan that is not, and none with fewer than 2 idle CPUs."""
    from kernelgen.precompile import plan_calls
    from kernelgen.tuning import compile_pool
    started = []

    class Executor:
        def __init__(self, n, mp_context=None):
            started.append(n)

        def submit(self, fn, *args):
            pass

        def shutdown(self, wait=True, cancel_futures=False):
            started.append("shutdown")
    monkeypatch.setattr(compile_pool, "ProcessPoolExecutor", Executor)
    monkeypatch.setattr(compile_pool, "_idle_cpus", lambda: 3)
    cached, new = plan_calls([(kernelgen.conv, (random_array(rng, (1, 4, 6, c)), random_array(rng, (2, 3, 3, c))), KW)
                              for c in (5, 6)])  # (shapes no other test compiles)
    with settings.scope(cache_dir=str(tmp_path)):
        compile_pool.compile_plans([cached], workers=0)  # on disk now
        with compile_pool.pool_on_demand() as demand:
            for plan in (cached, None, cached):
                demand.see(plan)
            assert demand.pool is None and started == []
            demand.see(new)
            demand.see(new)
            assert isinstance(demand.pool, Executor) and started == [3]
        assert started == [3, "shutdown"]
        monkeypatch.setattr(compile_pool, "_idle_cpus", lambda: 1)
        with compile_pool.pool_on_demand() as demand:
            demand.see(new)
            assert demand.pool is None
