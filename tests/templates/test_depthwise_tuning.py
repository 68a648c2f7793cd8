"""Tuning the depthwise template (issue 28): the tuner's candidates, the database's DepthwiseConfig entries, and the
planner reading them (exact entry, else the cost model's default).

No GPU here: the database is a temporary file and the planner is told a GPU is present (its `_tuned_db`), as a tune
on the H100 leaves it; a few tuner candidates are run on the CPU backend against float64 (the GPU run of a whole
tune is scripts/gpu_depthwise.sh).
"""
from __future__ import annotations

import pytest

from kernelgen import planner
from kernelgen.problem import make_problem
from kernelgen.target import KNOWN_TARGETS
from kernelgen.templates import depthwise
from kernelgen.templates.config import TileConfig
from kernelgen.templates.depthwise_config import DepthwiseConfig
from kernelgen.tuning import bench, database, shapes, tuner
from harness import assert_close, direction_inputs, launch_poisoned, tolerance

H100 = KNOWN_TARGETS["h100"]
DEVICE = "sm_90_test_gpu"


def dw_problem(direction="fwd", N=4, H=12, C=24, R=3, stride=1, dtype="float32"):
    return make_problem(direction, (N, H, H, C), (C, R, R, 1), padding=R // 2, stride=stride, groups=C, dtype=dtype)


@pytest.fixture
def tuned_db(tmp_path, monkeypatch):
    """A database of this test only, and a planner that reads it as on a GPU: save(entries) writes them."""
    monkeypatch.setattr(database, "SHIPPED", tmp_path / "none")
    monkeypatch.setattr(database, "user_db_dir", lambda: tmp_path)
    monkeypatch.setattr(planner, "_tuned_db", lambda: database)
    monkeypatch.setattr(planner, "tuned_device", lambda: DEVICE)
    database.entries_for.cache_clear()

    def save(entries):
        database.save(tmp_path / database.db_name(DEVICE), entries, DEVICE)
        database.entries_for.cache_clear()
    yield save
    database.entries_for.cache_clear()


def test_depthwise_entries_round_trip_through_the_database(tuned_db):
    p = dw_problem("bwd_weight")
    best = DepthwiseConfig(TC=8, TW=4, TH=2, VC=1, PW=2, PH=1, halo=1, split_k=4)
    runner_up = DepthwiseConfig(TC=4, TW=8, TH=2, VC=2, PW=2, PH=2, halo=0, split_k=2)
    tried = [{"variant": "depthwise", "config": str(best), "ms": 0.1},
             {"variant": "depthwise", "config": str(runner_up), "ms": 0.2},
             {"variant": "depthwise", "config": "DW_TC8_BROKEN", "error": "compile: ..."}]
    tuned_db({p.key(): database.entry(p, "depthwise", best, 0.1, tried)})
    entry = database.entries_for(DEVICE)[p.key()]
    assert database.config_from(entry) == best and isinstance(database.config_from(entry), DepthwiseConfig)
    assert list(database._ranked(entry)) == [("depthwise", best), ("depthwise", best), ("depthwise", runner_up)]
    assert database.tuned_config(p, DEVICE, "depthwise") == best
    assert database.tuned_config(p, DEVICE, "implicit_gemm") is None
    assert database.parse_config(str(best)) == best
    assert database.parse_config("BM64_BN64_BK8_TM4_TN4") == TileConfig.parse("BM64_BN64_BK8_TM4_TN4")


def test_planner_runs_the_exact_tuned_entry_else_the_default(tuned_db):
    p = dw_problem("fwd")
    tuned = DepthwiseConfig(TC=2, TW=16, TH=4, VC=4, PW=2, PH=1, halo=1, smem_pad=1)
    assert tuned != depthwise.VARIANT.default_config(p, H100)
    tuned_db({p.key(): database.entry(p, "depthwise", tuned, 0.1, [])})
    assert planner.make_plan(p, "cuda").config == tuned
    assert planner.make_plan(p, "cuda", precision="tf32").config == tuned  # the same fp32 FMAs: fp32's entry
    assert planner.make_plan(p, "cpu").config == depthwise.cpu_config(p)  # the database is the GPU's
    # no nearest neighbour: a layer twice the batch gets the cost model's default
    bigger = dw_problem("fwd", N=8)
    assert planner.make_plan(bigger, "cuda").config == depthwise.VARIANT.default_config(bigger, planner.target_for(
        "cuda"))
    # an entry the template no longer accepts (VC=8 is for float16 tensors) is skipped, not run
    tuned_db({p.key(): database.entry(p, "depthwise", DepthwiseConfig(VC=8), 0.1, [])})
    assert planner.make_plan(p, "cuda").config == depthwise.VARIANT.default_config(p, planner.target_for("cuda"))


def test_planner_reads_16_bit_entries_per_precision(tuned_db):
    p = dw_problem("bwd_data", dtype="float16")
    fp16 = DepthwiseConfig(TC=4, TW=8, TH=2, VC=8, PW=2, PH=1, halo=1)
    tuned_db({database.entry_key(p, "fp16"): database.entry(p, "depthwise", fp16, 0.1, [], "fp16")})
    assert planner.make_plan(p, "cuda", precision="fp16").config == fp16
    p32 = dw_problem("bwd_data")
    assert planner.make_plan(p32, "cuda", precision="bf16").config == depthwise.VARIANT.default_config(
        p32, planner.target_for("cuda"), "bf16")


@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weight"])
def test_tuner_tries_depthwise_configs_only_on_depthwise_problems(direction):
    p = dw_problem(direction, N=32, H=56, C=144)
    cands = tuner.candidates(p, keep=4, target=H100)
    assert cands and {v for v, _ in cands} == {"depthwise"}
    configs = [c for _, c in cands]
    # a tune never loses to the untuned plan, and times each config as the planner runs it (share_rows applied)
    assert depthwise.with_shared_rows(p, depthwise.VARIANT.default_config(p, H100), H100) in configs
    assert all(depthwise.with_shared_rows(p, c, H100) == c for c in configs)
    assert (direction == "bwd_weight") == (not any(c.share_rows for c in configs))
    assert len(configs) == len(set(configs)) <= 4 * tuner.DEPTHWISE_KEEP_FACTOR + 1
    assert all(depthwise.VARIANT.accepts(p, c) for c in configs)
    assert len({(c.VC, c.halo, c.threads) for c in configs}) >= 4  # spread over the knobs, not one shape's variants
    if direction == "bwd_weight":
        assert any(c.split_k > 1 for c in configs)
    # 16-bit tunes too, and the config a database holds is tried again
    p16 = dw_problem(direction, N=32, H=56, C=144, dtype="float16")
    held = DepthwiseConfig(TC=2, TW=8, TH=4, VC=8, PW=2, PH=1, halo=1, smem_pad=3)
    cands16 = tuner.tc_candidates(p16, "fp16", keep=4, tuned=held, target=H100)
    assert {v for v, _ in cands16} == {"depthwise"} and ("depthwise", held) in cands16
    # an ordinary convolution is tuned as before
    plain = make_problem(direction, (8, 16, 16, 32), (64, 3, 3, 32), padding=1)
    assert "depthwise" not in {v for v, _ in tuner.candidates(plain, keep=2, target=H100)}


def test_tuner_candidates_compute_the_convolution_on_the_cpu(rng):
    """The first few configs a tune would time, run on the CPU backend (split_k=1: no CPU atomics) against float64."""
    for direction in ("fwd", "bwd_data", "bwd_weight"):
        p = dw_problem(direction, N=2, H=7, C=12, stride=2 if direction == "bwd_data" else 1)
        kw = {"stride": p.stride[1:], "padding": p.padding[1:], "groups": p.C}
        configs = [c for _, c in tuner.candidates(p, keep=8, target=H100) if c.split_k == 1]
        for cfg in configs[:2]:
            inputs, want = direction_inputs(p, kw, rng)
            plan = planner.make_plan(p, "cpu", config=cfg)
            got = launch_poisoned(planner.get_launcher(plan), p, inputs, "cpu")
            assert_close(got, want, p.dtype, f"{p.key()} {cfg}", tol=tolerance(p.dtype))


# --- the depthwise shape table and the bench's roofline column ---------------------------------------------------

def test_depthwise_table_covers_both_networks_filters_strides_and_batches():
    name, layers = shapes.load_table("depthwise")
    dw = [l for l in layers if l.depthwise]
    assert name == "depthwise" and len(dw) == 38
    assert {l.R for l in dw} == {3, 5} and {l.stride for l in dw} == {1, 2} and {l.N for l in dw} == {32, 128}
    assert {l.net.split(".")[0] for l in dw} >= {"mobilenet_v2", "efficientnet_b0"}
    assert all(l.padding == (l.R - 1) // 2 and l.K == l.C for l in dw)
    assert len({(l.N, l.H, l.C, l.R, l.stride) for l in dw}) == len(dw)  # every shape once
    grouped = [l for l in layers if not l.depthwise]
    assert sorted(l.C // l.groups for l in grouped) == [4, 8]  # ResNeXt 32x4d: the narrow-group rows
    for layer in dw[:3] + dw[-3:]:
        for d in ("fwd", "bwd_data", "bwd_weight"):
            assert planner.make_plan(layer.problem(d), "cuda").variant == "depthwise"


def _bench_row(layer, direction, kg_ms, cudnn_ms):
    p = layer.problem(direction)
    roof = bench.roofline_ms(p)
    return {**bench._row_base(layer, direction, {}), "variant": "depthwise", "config": "DW_x", "ratio": cudnn_ms / kg_ms,
            "kernelgen_tflops": 1.0, "cudnn_tflops": 1.0, "pct_of_floor": 0.5, "rel_err_vs_cudnn": 1e-7,
            "precision": "fp32", "pct_of_roofline": roof / kg_ms, "cudnn_pct_of_roofline": roof / cudnn_ms,
            "map": list(layer.spatial)}


def test_bench_reports_percent_of_the_memory_roofline():
    _, layers = shapes.load_table("depthwise")
    big, small = layers[2], layers[9]  # 56 x 56 x 144 and 7 x 7 x 960 at batch 32
    p = big.problem("fwd")
    assert bench.roofline_ms(p) == pytest.approx(4 * (2 * 32 * 56 * 56 * 144 + 144 * 9) / 3.0e12 * 1e3)
    roof = bench.roofline_ms(p)
    rows = [_bench_row(big, "fwd", roof / 0.5, roof / 0.8), _bench_row(small, "fwd", bench.roofline_ms(
        small.problem("fwd")) / 0.9, 1.0), {**bench._row_base(big, "bwd_data", {}), "error": "plan: no"}]
    md = bench.markdown(rows, bench.summary(rows))
    assert "| 0.62 | 50% (80%) |" in md  # kernelgen's % next to the cuDNN ratio, cuDNN's in brackets
    assert "depthwise fwd, % of the 3.0 TB/s roofline (x, w, y once): geo-mean kernelgen 67%" in md
    assert "lowest on maps of 3136 pixels or more: 50% (bar 60%)" in md
    table = [line for line in md.splitlines() if line.startswith("|")]
    assert len(table) == 5 and len({line.count("|") for line in table}) == 1  # a failed row keeps the columns


def test_a_gemm_tile_config_names_a_gemm_variant_on_a_depthwise_problem():
    """groups == C > 1 is planned on the depthwise template, unless the call's config is a GEMM TileConfig: that
    names the GEMM variants (as algo= would), and a DepthwiseConfig keeps the depthwise template."""
    p = make_problem("bwd_data", (1, 4, 4, 2), (2, 1, 1, 1), stride=2, groups=2)
    assert planner.make_plan(p, "cpu").variant == "depthwise"
    gemm = planner.make_plan(p, "cpu", config=TileConfig(1, 2, 1, 1, 2))
    assert gemm.variant != "depthwise" and gemm.decided_by == "config="
    dw = depthwise.VARIANT.default_config(p, KNOWN_TARGETS["h100"], "fp32")
    assert planner.make_plan(p, "cpu", config=dw).variant == "depthwise"
