"""The tuner and the tuned database: format, resume, a failing candidate, run-time fallback.

Tuning runs CUDA kernels, so the end-to-end tests run under the simulator (`sim`), on a one-layer
table with two tiny tiles (`tiny_table`, conftest.py); the database and shape-table tests are pure Python.
Tensor-core tunes: test_tuning_precision.py.
"""
from __future__ import annotations

import json
import pytest

from kernelgen.problem import make_problem
from kernelgen.target import KNOWN_TARGETS
from kernelgen.templates import tile_space
from kernelgen.templates.config import TileConfig
from kernelgen.tuning import database, shapes, tuner

def test_shipped_tables_load_and_expand():
    for name in ("gpu_md", "resnet18_cifar"):
        _, layers = shapes.load_table(name)
        assert layers
        for layer in layers:
            for d in ("fwd", "bwd_data", "bwd_weight"):
                p = layer.problem(d)
                assert p.flops > 0
    _, gpu_md = shapes.load_table("gpu_md")
    deconv = [l for l in gpu_md if l.transposed][0]
    # a deconvolution's forward pass is the backward-data pass of the conv it transposes
    assert deconv.problem("fwd").direction == "bwd_data"
    assert deconv.problem("fwd").x_shape == (32, 56, 56, 64)


def test_unknown_table_names_the_argument():
    with pytest.raises(ValueError, match="table must be"):
        shapes.load_table("no_such_table")


def test_candidates_respect_resource_limits():
    p = make_problem("bwd_weight", (128, 32, 32, 64), (64, 3, 3, 64), padding=1)
    h100 = KNOWN_TARGETS["h100"]
    cands = tile_space.candidate_configs(p, h100)
    assert cands and all(tile_space.fits(c, h100) for c in cands)
    assert any(c.split_k > 1 for c in cands)  # backward-weight gets split-K candidates
    assert not tile_space.fits(TileConfig(256, 256, 16, 8, 8, stages=2), h100)  # 64 KiB of shared memory


def test_database_roundtrip_and_nearest_fallback(tmp_path, monkeypatch):
    monkeypatch.setattr(database, "SHIPPED", tmp_path / "none")
    monkeypatch.setattr(database, "user_db_dir", lambda: tmp_path)
    database.entries_for.cache_clear()
    tuned = make_problem("fwd", (8, 16, 16, 32), (64, 3, 3, 32), padding=1)
    cfg = TileConfig(64, 32, 8, 4, 4)
    database.save(tmp_path / database.db_name("sm_90_test"),
                  {tuned.key(): database.entry(tuned, "implicit_gemm", cfg, 0.5, [])}, "sm_90_test")
    assert database.lookup(tuned, "sm_90_test") == ("implicit_gemm", cfg, "tuned")
    near = make_problem("fwd", (16, 16, 16, 32), (64, 3, 3, 32), padding=1)
    assert database.lookup(near, "sm_90_test") == ("implicit_gemm", cfg, "nearest")
    # a different filter size is not a neighbour: the caller falls back to the heuristic default
    assert database.lookup(make_problem("fwd", (8, 16, 16, 32), (64, 5, 5, 32), padding=2), "sm_90_test") is None
    assert database.lookup(tuned, "sm_80_other") is None
    # a corrupt or foreign-format file is ignored, never a crash
    (tmp_path / database.db_name("sm_90_bad")).write_text("{not json")
    database.entries_for.cache_clear()
    assert database.lookup(tuned, "sm_90_bad") is None
    database.entries_for.cache_clear()


def test_lookup_skips_candidates_the_settings_forbid(tmp_path, monkeypatch, set_setting):
    """A tune run with 16-state Winograd allowed may record a 16-state winner; a caller who did not
    allow it gets the fastest measured candidate it may run, and a forced variant its own best."""
    monkeypatch.setattr(database, "SHIPPED", tmp_path / "none")
    monkeypatch.setattr(database, "user_db_dir", lambda: tmp_path)
    database.entries_for.cache_clear()
    p = make_problem("fwd", (8, 28, 28, 32), (32, 3, 3, 32), padding=1)
    a16, a4 = TileConfig(32, 32, 4, 2, 2, smem_pad=4, states=16), TileConfig(64, 32, 8, 4, 2, smem_pad=4, states=4)
    gemm = TileConfig(128, 64, 8, 8, 4, smem_pad=4, stages=2)
    tried = [{"variant": "winograd", "config": str(a16), "ms": 0.1}, {"variant": "winograd", "config": str(a4), "ms": 0.3},
             {"variant": "implicit_gemm", "config": str(gemm), "ms": 0.2},
             {"variant": "winograd", "config": "BM64_BN32_BK8_TM4_TN2_A8", "error": "compile: boom"}]
    database.save(tmp_path / database.db_name("sm_90_test"),
                  {p.key(): database.entry(p, "winograd", a16, 0.1, tried)}, "sm_90_test")
    set_setting(winograd_16_states=True)
    assert database.lookup(p, "sm_90_test", "implicit_gemm") == ("winograd", a16, "tuned")
    assert database.tuned_config(p, "sm_90_test", "implicit_gemm") == gemm
    set_setting(winograd_16_states=False)
    assert database.lookup(p, "sm_90_test", "implicit_gemm") == ("implicit_gemm", gemm, "tuned")
    assert database.tuned_config(p, "sm_90_test", "winograd") == a4
    assert database.tuned_config(p, "sm_90_test", "conv_v2") is None
    database.entries_for.cache_clear()


def test_tile_config_names_parse_back():
    from kernelgen.templates.config import CUDA_TC_DEFAULT
    for cfg in (TileConfig(), TileConfig(64, 32, 8, 4, 2, smem_pad=4, stages=2, states=8), CUDA_TC_DEFAULT,
                TileConfig(128, 64, 16, WM=64, WN=32, split_k=4, min_blocks=2, swizzle=1)):
        assert TileConfig.parse(str(cfg)) == cfg
    with pytest.raises(ValueError, match="BQ7"):
        TileConfig.parse("BM64_BQ7")


@pytest.mark.sim
def test_tune_resume_and_failing_candidate(tiny_table, tiny_tiles, tmp_path, monkeypatch):
    db = tmp_path / "db.json"
    real = tuner.candidates

    def with_a_broken_one(problem, variants=None, tiles=tuner.TILES, keep=None):
        # an unknown variant fails in the compile worker: it must be recorded and skipped
        return real(problem, variants, tiles, keep) + [("no_such_variant", TileConfig(16, 16, 4, 4, 2))]

    monkeypatch.setattr(tuner, "candidates", with_a_broken_one)
    # one variant's two cheapest candidates (keep=2): each runs simulated, five times (0.4 s a run), and the point
    # here is the bookkeeping (all 12 of keep's default: 81 s of CI)
    _, entries, failures = tuner.tune(str(tiny_table), db_path=db, workers=2, tiles=tiny_tiles, limit=1,
                                      variants=("implicit_gemm",), keep=2)
    assert len(entries) == 1 and len(failures) == 1
    (key, entry), = entries.items()
    assert key.startswith("fwd_")
    assert any("error" in t for t in entry["tried"])
    assert entry["ms"] == min(t["ms"] for t in entry["tried"] if "ms" in t)
    saved = json.loads(db.read_text())
    assert saved["format"] == database.FORMAT and key in saved["entries"]
    # resume: the finished problem is not tuned again, the rest are
    _, entries2, _ = tuner.tune(str(tiny_table), db_path=db, workers=2, tiles=tiny_tiles,
                                directions=("fwd", "bwd_weight"), variants=("implicit_gemm",), keep=2)
    assert entries2[key] == json.loads(json.dumps(entry))  # kept as saved, not re-tuned
    assert len(entries2) == 2


@pytest.mark.sim
def test_candidate_with_local_memory_is_rejected(monkeypatch):
    # a register tile that spilled much (a min_blocks cap can force it) must never become a tuned pick; the
    # simulator reports no resources, so the query is replaced by what ptxas said of such a kernel - and it
    # is made after the kernel is compiled (before, numba has no overload to report on)
    from kernelgen.tuning import bench
    compiled = []
    monkeypatch.setattr(tuner, "_compile", lambda launcher, dtype="float32": compiled.append(launcher))
    monkeypatch.setattr(bench, "kernel_resources",
                        lambda launcher, threads: {"registers": 128, "local_bytes": 96 if compiled else 0})
    p = make_problem("fwd", (1, 4, 5, 4), (4, 3, 3, 4), padding=1)
    with pytest.raises(ValueError, match="96 B of local memory"):
        tuner.measure(p, "implicit_gemm", TileConfig(16, 16, 4, 4, 2), sets=[], ref=None)


def test_candidates_keep_the_cheapest_per_variant():
    p = make_problem("fwd", (32, 28, 28, 128), (128, 3, 3, 128), padding=1)
    every = tuner.candidates(p)
    kept = tuner.candidates(p, keep=4)
    assert 0 < len(kept) <= 4 * len({v for v, _ in every}) < len(every)
    assert set(kept) <= set(every)



def test_bench_forces_variants_only_where_they_apply_and_summarises_each():
    from kernelgen.tuning import bench
    from kernelgen.tuning.shapes import load_table
    _, layers = load_table("cks")
    by = {l.name: l for l in layers}
    assert bench._applies(by["r18_c512_4"].problem("fwd"), "conv_v2")
    assert not bench._applies(by["r18_c128_s2"].problem("bwd_data"), "winograd")   # stride 2
    assert bench._applies(by["r18_c128_s2"].problem("bwd_data"), None)
    rows = [{"direction": "fwd", "ratio": 2.0, "forced": "conv_v2"}, {"direction": "fwd", "ratio": 0.5},
            {"direction": "fwd", "ratio": 8.0, "forced": "conv_v2"}]
    s = bench.summary(rows)
    assert s["fwd"] == {"geomean_ratio": 0.5, "n": 1}
    assert abs(s["fwd [conv_v2]"]["geomean_ratio"] - 4.0) < 1e-12


def test_bench_set_parses_integer_tile_fields_and_names_the_bad_one():
    from kernelgen.tuning.bench import parse_overrides
    assert parse_overrides("swizzle=2,stages=1") == {"swizzle": 2, "stages": 1}
    assert parse_overrides("") == {}
    for bad in ("swizzel=2", "swizzle=two", "swizzle"):
        with pytest.raises(ValueError, match="--set"):
            parse_overrides(bad)


def test_bench_set_alternatives_plan_and_summarise_apart():
    from kernelgen.api import make_plan
    from kernelgen.tuning import bench
    p = make_problem("fwd", (8, 14, 14, 64), (64, 3, 3, 64), padding=1)
    plan = make_plan(p, "cuda", precision="tf32")
    assert bench.set_fields(plan, None) is plan
    two = bench.set_fields(plan, "swizzle=2")
    assert two.config.swizzle == 2 and two.config.BM == plan.config.BM and two.precision == "tf32"
    bad = bench.set_fields(plan, "BK=32,swizzle=2")  # swizzle 2 needs BK 8 or 16: a reason, not a crash
    assert isinstance(bad, str) and "swizzle" in bad and "BK=32" in bad
    rows = [{"direction": "fwd", "ratio": 0.5, "set": "swizzle=1"}, {"direction": "fwd", "ratio": 2.0, "set": "swizzle=2"},
            {"direction": "fwd", "ratio": 8.0, "set": "swizzle=2"}, {"direction": "fwd", "error": "x", "set": "swizzle=2"}]
    s = bench.summary(rows)
    assert s["fwd [swizzle=1]"] == {"geomean_ratio": 0.5, "n": 1} and s["fwd [swizzle=2]"]["n"] == 2
    assert abs(s["fwd [swizzle=2]"]["geomean_ratio"] - 4.0) < 1e-12


def test_side_by_side_timing_alternates_and_keeps_each_best_round():
    from kernelgen.tuning.timing import time_side_by_side
    order, results = [], {"a": iter([5.0, 3.0, 4.0]), "b": iter([9.0, 9.5, 8.0])}

    def timer(fn, repeat):
        order.append(fn())
        return next(results[order[-1]])
    assert time_side_by_side([lambda: "a", lambda: "b"], rounds=3, repeat=7, timer=timer) == [3.0, 8.0]
    assert order == ["a", "b"] * 3


def test_compile_job_carries_the_precision():
    # the bench's precompile must build the plan it will time: an fp16 tensor-core plan, not the variant's TF32
    from kernelgen.templates.config import CUDA_TC_DEFAULT
    p = make_problem("fwd", (2, 6, 6, 16), (16, 3, 3, 16), padding=1)
    err, _ = tuner._compile_one((p, "implicit_gemm", TileConfig(16, 16, 4, 4, 2), "fp16"))
    assert err is not None and "precision='fp16'" in err
    assert tuner._compile_one((p, "implicit_gemm_tc", CUDA_TC_DEFAULT, "fp16"))[0] is None


# --- tensor-core precisions: candidates, database keys, plans --------------------------------------------
