"""Tensor-core tunes (--precision tf32/fp16/bf16): their candidates, database keys and plans on the CPU, float16
storage, the bench's dtypes and `db merge`.  The simulator cannot run mma.sync, so the end-to-end tune test replaces
the timing; the GPU test runs the bench on float16 tensors.
"""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from kernelgen.problem import make_problem
from kernelgen.target import KNOWN_TARGETS
from kernelgen.templates import implicit_gemm_tc
from kernelgen.templates.config import TileConfig
from kernelgen.tuning import database, shapes, tuner

TC_PRECISIONS = ("tf32", "fp16", "bf16")
H100 = KNOWN_TARGETS["h100"]


@pytest.mark.parametrize("precision", TC_PRECISIONS)
def test_tensor_core_candidates_are_valid_configs(precision):
    from kernelgen.templates import implicit_gemm_tc
    fwd = make_problem("fwd", (32, 28, 28, 128), (128, 3, 3, 128), padding=1)
    bwd_w = make_problem("bwd_weight", (32, 28, 28, 128), (128, 3, 3, 128), padding=1)
    for p in (fwd, bwd_w):
        every = tuner.tc_candidates(p, precision)
        cfgs = [c for _, c in every]
        assert {v for v, _ in every} == {implicit_gemm_tc.NAME}
        assert implicit_gemm_tc.default_config(p, "cuda", precision) in cfgs
        assert len(set(cfgs)) == len(cfgs)
        for c in cfgs:
            implicit_gemm_tc.check_config(c.validate(), precision)
            implicit_gemm_tc.build(p, c, precision)  # the template accepts it (IR only, nothing compiled)
        mma = [c for c in cfgs if not c.tma]
        for c in mma:
            assert c.tensor_core and c.stages == 2 and (c.BM, c.BN, c.WM, c.WN) in implicit_gemm_tc.CUDA_TC_TILES
        # TMA tiles: TF32 forward only (this problem: stride 1, 128 channels); 98 blocks of 256 x 128 also split
        tma = [(c.BM, c.BN, c.WM, c.WN, c.stages, c.tma) for c in cfgs if c.tma]
        assert set(tma) == (set(implicit_gemm_tc.TMA_TILES) if (p, precision) == (fwd, "tf32") else set())
        assert len(tma) == (4 if (p, precision) == (fwd, "tf32") else 0)
        assert {c.swizzle for c in mma} == {1, 2}
        assert {(c.BM, c.BN, c.WM, c.WN) for c in mma} == set(implicit_gemm_tc.CUDA_TC_TILES)
        kept = [c for _, c in tuner.tc_candidates(p, precision, keep=12)]
        assert len(kept) <= 12 + len(tma) and set(kept) <= set(cfgs) and kept[0] == cfgs[0]  # the default stays
        assert [c for c in kept if c.tma] == [c for c in cfgs if c.tma]  # the cost model does not rank TMA tiles
        shipped = TileConfig(64, 64, 32, WM=32, WN=16, stages=2, swizzle=1)  # a database's entry: tried too
        assert [c for _, c in tuner.tc_candidates(p, precision, 4, tuned=shipped)][-1] == shipped
    assert all(c.split_k == 1 for _, c in tuner.tc_candidates(fwd, precision) if not c.tma)  # 392 blocks: no split
    assert any(c.split_k > 1 for _, c in tuner.tc_candidates(bwd_w, precision))
    assert len([c for _, c in tuner.tc_candidates(fwd, precision) if not c.tma]) <= 16
    assert {c.BK for _, c in tuner.tc_candidates(fwd, precision)} == {16, 32}  # the default depth and twice it
    assert all(c.swizzle == 1 for _, c in tuner.tc_candidates(fwd, precision) if c.BK == 32 and not c.tma)


def test_tensor_core_split_k_where_blocks_are_fewer_than_sms():
    """Forward and backward-data split the reduction only where a tile leaves SMs idle (deep layers' small maps),
    to about one and two waves; TMA splits divide the slices (a box never runs past the filter)."""
    small = make_problem("fwd", (32, 7, 7, 512), (512, 3, 3, 512), padding=1)  # M = 1568: 13 x 8 blocks of 128 x 64
    assert implicit_gemm_tc.tc_split_choices(small, 128, 64, 16, H100) == [1, 2, 3]
    assert implicit_gemm_tc.tc_split_choices(small, 64, 32, 16, H100) == [1]  # 25 x 16 = 400 blocks
    k_tiles = 9 * 512 // 32
    for s in implicit_gemm_tc.tc_split_choices(small, 128, 128, 32, H100, divides=True):
        assert k_tiles % s == 0
    for _, c in tuner.tc_candidates(small, "tf32"):
        assert not c.tma or (9 * 512 // 32) % c.split_k == 0
    assert any(c.tma and c.split_k > 1 for _, c in tuner.tc_candidates(small, "tf32"))
    bwd = make_problem("bwd_data", (32, 7, 7, 512), (512, 3, 3, 512), padding=1)
    assert any(c.split_k > 1 for _, c in tuner.tc_candidates(bwd, "tf32"))
    assert any(c.tma for _, c in tuner.tc_candidates(bwd, "tf32"))  # stride 1: the flipped filter's TMA boxes
    # strided: KS-deconv's classes on TMA, 4 slices x 16 of 32 channels per class (2 x 2 taps at most), 4 classes
    strided = make_problem("bwd_data", (32, 14, 14, 512), (512, 3, 3, 512), padding=1, stride=2)
    tma = [c for _, c in tuner.tc_candidates(strided, "tf32") if c.tma]
    assert tma and all(64 % c.split_k == 0 for c in tma) and any(c.split_k > 1 for c in tma)
    grouped = make_problem("bwd_data", (32, 14, 14, 512), (512, 3, 3, 256), padding=1, stride=2, groups=2)
    assert not any(c.tma for _, c in tuner.tc_candidates(grouped, "tf32"))


def test_fp16_tma_candidates_fit_the_grid():
    """fp16 takes no split-K: a grid of fewer 128 x 128 blocks than SMs gets the 64-row tiles too; a reduction of
    a few slices 2-stage tiles; a GEMM of a few columns (the stem's backward-data, C = 3) only the narrowest wgmma
    tiles."""
    from kernelgen.problem import make_problem
    bm64 = lambda p: {(c.BM, c.BN) for c in implicit_gemm_tc.tma_candidate_configs(p, "fp16", H100)
                      if c.BM == 64}
    small = make_problem("bwd_data", (32, 7, 7, 512), (512, 3, 3, 512), padding=1, dtype="float16")  # 13 x 4 blocks
    large = make_problem("bwd_data", (32, 28, 28, 128), (128, 3, 3, 128), padding=1, dtype="float16")
    assert bm64(small) == {(64, 128), (64, 64)} and not bm64(large)
    short = make_problem("fwd", (32, 56, 56, 64), (256, 1, 1, 64), dtype="float16")  # one 64-deep slice
    two_stage = {(c.BM, c.BN) for c in implicit_gemm_tc.tma_candidate_configs(short, "fp16", H100) if c.stages == 2}
    assert two_stage == {(128, 128), (128, 64)}
    assert not any(c.stages == 2 for c in implicit_gemm_tc.tma_candidate_configs(large, "fp16", H100))  # 18 slices
    stem = make_problem("bwd_data", (32, 224, 224, 3), (64, 7, 7, 3), padding=3, stride=2, dtype="float16")
    assert {(c.BN, c.WN, c.tma) for c in implicit_gemm_tc.tma_candidate_configs(stem, "fp16", H100)} == \
        {(8, 8, 1), (8, 8, 2)}


def test_b_mn_candidates_where_w_allows(monkeypatch):
    """implicit_gemm_tc.B_MN_WHERE_ALLOWED: every fp16 backward-data TMA tile a multiple of 64 wide reads w as stored
    where w's rows are 16-byte multiples (C % 8 == 0); the others, forward, and the switch off keep the flipped copy."""
    from kernelgen.problem import make_problem
    p = make_problem("bwd_data", (32, 28, 28, 128), (128, 3, 3, 128), padding=1, dtype="float16")
    cfgs = implicit_gemm_tc.tma_candidate_configs(p, "fp16", H100)
    assert cfgs and all(c.b_mn == (c.BN % 64 == 0 and c.WN % 64 == 0) for c in cfgs)
    ragged = make_problem("bwd_data", (32, 28, 28, 20), (128, 3, 3, 20), padding=1, dtype="float16")
    fwd = make_problem("fwd", (32, 28, 28, 128), (128, 3, 3, 128), padding=1, dtype="float16")
    assert not any(c.b_mn for q in (ragged, fwd) for c in implicit_gemm_tc.tma_candidate_configs(q, "fp16", H100))
    monkeypatch.setattr(implicit_gemm_tc, "B_MN_WHERE_ALLOWED", False)
    assert {replace(c, b_mn=0) for c in cfgs} == set(implicit_gemm_tc.tma_candidate_configs(p, "fp16", H100))


def test_tensor_core_candidates_keep_only_what_the_template_accepts(monkeypatch):
    # swizzle=2 needs BK 8 or 16, fp16/bf16 need BK % 16 == 0: with another candidate depth those are dropped
    from kernelgen.templates import config, implicit_gemm_tc
    p = make_problem("fwd", (32, 28, 28, 128), (128, 3, 3, 128), padding=1)
    monkeypatch.setattr(config, "CUDA_TC_DEFAULT", TileConfig(128, 64, 32, WM=64, WN=32, stages=2, swizzle=1))
    deep = [c for _, c in tuner.tc_candidates(p, "tf32") if not c.tma]
    assert len(deep) == 1 + len(implicit_gemm_tc.CUDA_TC_TILES)  # the default + one swizzle-1 config per tile
    assert all(c.swizzle == 1 for c in deep) and all(c.BK == 32 for c in deep[1:])
    monkeypatch.setattr(config, "CUDA_TC_DEFAULT", TileConfig(128, 64, 8, WM=64, WN=32, stages=2, swizzle=1))
    fp16 = [c for _, c in tuner.tc_candidates(p, "fp16")]  # depths 8 and 16: only 16 feeds the 16-bit MMA
    assert fp16[0] == implicit_gemm_tc.default_config(p, "cuda", "fp16") and {c.BK for c in fp16[1:]} == {16}
    assert {c.swizzle for _, c in tuner.tc_candidates(p, "tf32") if not c.tma} == {1, 2}  # BK 8 allows both (TF32)
    assert not implicit_gemm_tc.accepts(TileConfig(64, 64, 32, WM=32, WN=32, swizzle=2), "tf32")
    assert not implicit_gemm_tc.accepts(TileConfig(64, 64, 8, WM=32, WN=32, swizzle=1), "bf16")
    assert implicit_gemm_tc.accepts(TileConfig(64, 64, 8, WM=32, WN=32, swizzle=2), "tf32")


@pytest.fixture
def temp_db(tmp_path, monkeypatch):
    """An empty tuned-database directory in place of the shipped and user ones; returns a writer."""
    monkeypatch.setattr(database, "SHIPPED", tmp_path / "none")
    monkeypatch.setattr(database, "user_db_dir", lambda: tmp_path)
    database.entries_for.cache_clear()

    def write(entries, device="sm_90_test"):
        database.save(tmp_path / database.db_name(device), entries, device)
        database.entries_for.cache_clear()
        return tmp_path / database.db_name(device)
    yield write
    database.entries_for.cache_clear()


TC_TUNED = TileConfig(64, 32, 16, WM=32, WN=16, stages=2, swizzle=2)


def test_database_keys_separate_precisions(temp_db):
    p = make_problem("fwd", (8, 16, 16, 32), (64, 3, 3, 32), padding=1)
    near = make_problem("fwd", (16, 16, 16, 32), (64, 3, 3, 32), padding=1)
    fp32 = TileConfig(64, 32, 8, 4, 4)
    assert database.entry_key(p) == database.entry_key(p, "fp32") == p.key()
    assert database.entry_key(p, "tf32") == p.key() + "_tf32" != database.entry_key(p, "bf16")
    with pytest.raises(ValueError, match=r"precision must be one of .*'fp8'"):
        database.entry_key(p, "fp8")
    # only a tf32 entry: no fp32 request sees it, exact or nearest
    path = temp_db({database.entry_key(p, "tf32"): database.entry(p, "implicit_gemm_tc", TC_TUNED, 0.1, [], "tf32")})
    assert database.lookup(p, "sm_90_test") is None and database.lookup(near, "sm_90_test") is None
    assert database.tuned_config(p, "sm_90_test", "implicit_gemm_tc") is None
    assert database.tuned_config(p, "sm_90_test", "implicit_gemm_tc", "tf32") == TC_TUNED
    assert database.tuned_config(p, "sm_90_test", "implicit_gemm_tc", "fp16") is None
    assert json.loads(path.read_text())["entries"][p.key() + "_tf32"]["precision"] == "tf32"
    # both: each precision gets its own; fp32 entries are written as they always were (no precision field)
    path = temp_db({p.key(): database.entry(p, "implicit_gemm", fp32, 0.5, []),
                    database.entry_key(p, "tf32"): database.entry(p, "implicit_gemm_tc", TC_TUNED, 0.1, [], "tf32")})
    assert database.lookup(p, "sm_90_test") == ("implicit_gemm", fp32, "tuned")
    assert database.lookup(near, "sm_90_test") == ("implicit_gemm", fp32, "nearest")
    assert database.tuned_config(p, "sm_90_test", "implicit_gemm", "tf32") is None
    assert database.tuned_config(p, "sm_90_test", "implicit_gemm_tc", "tf32") == TC_TUNED
    assert "precision" not in json.loads(path.read_text())["entries"][p.key()]
    # a tf32 entry of the problem itself must not hide an fp32 neighbour's
    temp_db({near.key(): database.entry(near, "implicit_gemm", fp32, 0.5, []),
             database.entry_key(p, "tf32"): database.entry(p, "implicit_gemm_tc", TC_TUNED, 0.1, [], "tf32")})
    assert database.lookup(p, "sm_90_test") == ("implicit_gemm", fp32, "nearest")
    # a tensor-core winner under an fp32 key (hand-edited) is still never an fp32 answer, nor the reverse
    temp_db({p.key(): database.entry(p, "implicit_gemm_tc", TC_TUNED, 0.1, []),
             database.entry_key(p, "tf32"): database.entry(p, "implicit_gemm", fp32, 0.5, [], "tf32")})
    assert database.lookup(p, "sm_90_test") is None
    assert database.tuned_config(p, "sm_90_test", "implicit_gemm_tc") is None
    assert database.tuned_config(p, "sm_90_test", "implicit_gemm", "tf32") is None


def test_tensor_core_plan_uses_the_tuned_entry_of_its_precision(temp_db, monkeypatch):
    from kernelgen import api, planner
    from kernelgen.templates import implicit_gemm_tc
    p = make_problem("fwd", (8, 16, 16, 32), (64, 3, 3, 32), padding=1)
    temp_db({database.entry_key(p, "tf32"): database.entry(p, "implicit_gemm_tc", TC_TUNED, 0.1, [], "tf32")})
    monkeypatch.setattr(planner, "gpu_present", lambda: True)  # the database is per GPU: pretend this is the tuned one
    monkeypatch.setattr(planner, "tuned_device", lambda: "sm_90_test")
    monkeypatch.delenv("KERNELGEN_NO_TUNED", raising=False)
    assert TC_TUNED != implicit_gemm_tc.default_config(p, "cuda", "tf32")
    plan = api.make_plan(p, "cuda", precision="tf32")
    assert (plan.variant, plan.config, plan.precision) == ("implicit_gemm_tc", TC_TUNED, "tf32")
    assert api.make_plan(p, "cuda", precision="fp16").config == implicit_gemm_tc.default_config(p, "cuda", "fp16")
    assert not api.make_plan(p, "cuda").config.tensor_core  # fp32 never gets the tf32 entry
    given = TileConfig(64, 64, 16, WM=32, WN=32, stages=2, swizzle=1)
    assert api.make_plan(p, "cuda", config=given, precision="tf32").config == given  # config= wins
    assert api.make_plan(p, "cpu", precision="tf32").config == implicit_gemm_tc.default_config(p, "cpu", "tf32")
    monkeypatch.setenv("KERNELGEN_NO_TUNED", "1")
    assert api.make_plan(p, "cuda", precision="tf32").config == implicit_gemm_tc.default_config(p, "cuda", "tf32")
    monkeypatch.delenv("KERNELGEN_NO_TUNED")
    monkeypatch.setattr(planner, "gpu_present", lambda: False)
    assert api.make_plan(p, "cuda", precision="tf32").config == implicit_gemm_tc.default_config(p, "cuda", "tf32")


def test_tune_command_passes_its_tile_set(tiny_table, monkeypatch, capsys):
    """`tune --tiles wide` tunes over WIDE_TILES (the default over TILES); another name is refused by argparse."""
    from kernelgen import planner
    from kernelgen.templates.tile_space import TILES, WIDE_TILES
    seen = []
    monkeypatch.setattr(planner, "gpu_present", lambda: True)
    monkeypatch.setattr(tuner, "tune", lambda table, **kw: seen.append(kw) or ("db.json", {}, []))
    assert tuner.main([str(tiny_table)]) == 0 and tuner.main([str(tiny_table), "--tiles", "wide", "--keep", "0"]) == 0
    assert seen[0]["tiles"] == TILES and seen[0]["keep"] == 12
    assert seen[1]["tiles"] == WIDE_TILES and seen[1]["keep"] is None
    with pytest.raises(SystemExit):
        tuner.main([str(tiny_table), "--tiles", "huge"])
    assert "--tiles" in capsys.readouterr().err


def test_tune_refuses_an_unknown_precision(tiny_table, capsys):
    with pytest.raises(SystemExit):
        tuner.main([str(tiny_table), "--precision", "fp8"])
    err = capsys.readouterr().err
    assert "--precision" in err and "'fp8'" in err and "tf32" in err
    with pytest.raises(ValueError, match=r"precision must be one of \('fp32', 'tf32', 'fp16', 'bf16'\), got 'fp8'"):
        tuner.tune(str(tiny_table), precision="fp8")


def test_verification_tolerance_fits_the_precision():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal(1000)
    noise = rng.standard_normal(1000)
    off = lambda rel: ref + noise * (rel * np.linalg.norm(ref) / np.linalg.norm(noise))  # relative error `rel`
    assert abs(tuner.check_result(off(5e-5), ref) - 5e-5) < 1e-9
    with pytest.raises(ValueError, match="relative error 5.00e-04"):
        tuner.check_result(off(5e-4), ref)
    tuner.check_result(off(5e-4), ref, "tf32")
    with pytest.raises(ValueError, match="relative error"):
        tuner.check_result(off(5e-3), ref, "tf32")
    for precision in ("fp16", "bf16"):
        tuner.check_result(off(5e-3), ref, precision)
        with pytest.raises(ValueError, match="relative error"):
            tuner.check_result(off(2e-2), ref, precision)
    with pytest.raises(ValueError, match="relative error nan"):
        tuner.check_result(np.full(1000, np.nan), ref, "bf16")


@pytest.mark.sim
def test_measure_plans_at_the_tuned_precision(monkeypatch):
    from kernelgen import planner
    plans = []

    def stop(plan):
        plans.append(plan)
        raise RuntimeError("stop before launching")
    monkeypatch.setattr(planner, "get_launcher", stop)
    p = make_problem("fwd", (1, 4, 5, 4), (4, 3, 3, 4), padding=1)
    for precision in TC_PRECISIONS:
        with pytest.raises(RuntimeError, match="stop"):
            tuner.measure(p, "implicit_gemm_tc", TC_TUNED, sets=[], ref=None, precision=precision)
    assert [pl.precision for pl in plans] == list(TC_PRECISIONS)
    assert all(pl.variant == "implicit_gemm_tc" and pl.config == TC_TUNED for pl in plans)


@pytest.mark.sim
def test_tensor_core_tune_records_per_precision_entries(tiny_table, tiny_tiles, tmp_path, monkeypatch):
    # the simulator cannot run mma.sync, so timing is replaced; compiling (in the workers), candidates, keys,
    # entries and resume are the tuner's own
    timed = []

    def fake_measure(problem, variant, cfg, sets, ref, repeat=10, precision="fp32"):
        timed.append((variant, cfg, precision))
        return 1.0 / len(timed), 0.0, 0  # the last one timed wins
    monkeypatch.setattr(tuner, "measure", fake_measure)
    db = tmp_path / "db.json"
    _, entries, failures = tuner.tune(str(tiny_table), db_path=db, workers=1, limit=1, keep=2, precision="fp16")
    p = shapes.load_table(str(tiny_table))[1][0].problem("fwd", "float16")  # fp16 tunes float16 storage
    assert not failures and list(entries) == [p.key() + "_fp16"] and "float16" in p.key()
    assert [(v, prec) for v, _, prec in timed] == [("implicit_gemm_tc", "fp16")] * 2
    e = entries[p.key() + "_fp16"]
    assert e["precision"] == "fp16" and e["variant"] == "implicit_gemm_tc"
    assert database.config_from(e) == timed[-1][1]
    assert timed[0][1] == implicit_gemm_tc.candidate_configs(p, "fp16", H100)[0]
    # an fp32 tune of the same database does not take the fp16 entry for its own, and keeps it
    timed.clear()
    _, entries, failures = tuner.tune(str(tiny_table), db_path=db, workers=1, limit=1, keep=1, tiles=tiny_tiles,
                                      variants=("implicit_gemm",))
    p32 = shapes.load_table(str(tiny_table))[1][0].problem("fwd")
    assert not failures and set(entries) == {p32.key(), p.key() + "_fp16"}
    assert timed and all(v == "implicit_gemm" and prec == "fp32" for v, _, prec in timed)
    assert "precision" not in entries[p32.key()]
    saved = json.loads(db.read_text())["entries"]
    assert saved[p.key() + "_fp16"]["precision"] == "fp16"


# --- fp16 runs on float16 storage: bench and tune give kernelgen the 16-bit tensors cuDNN gets ----------------

def test_storage_dtype_is_16_bits_for_fp16_and_bf16():
    assert shapes.storage_dtype("fp16") == "float16" and shapes.storage_dtype("bf16") == "bfloat16"
    for precision in ("fp32", "tf32"):
        assert shapes.storage_dtype(precision) == "float32"


def test_layer_problem_takes_the_storage_dtype():
    _, gpu_md = shapes.load_table("gpu_md")
    deconv = [l for l in gpu_md if l.transposed][0]
    for layer in (gpu_md[0], deconv):
        for d in ("fwd", "bwd_data", "bwd_weight"):
            p32, p16 = layer.problem(d), layer.problem(d, "float16")
            assert p32.dtype == "float32" and p16.dtype == "float16"
            assert p16.key() != p32.key() and p16.key().endswith("float16")
            assert (p16.direction, p16.x_shape, p16.w_shape, p16.y_shape) == \
                (p32.direction, p32.x_shape, p32.w_shape, p32.y_shape)
            # the tuned-database key an fp16 tune writes is the one kernelgen's float16 plans read
            assert database.entry_key(p16, "fp16") != database.entry_key(p32, "fp16")


def test_tuner_inputs_are_in_the_storage_dtype_and_the_reference_in_float64():
    from kernelgen import reference as R
    for d in ("fwd", "bwd_data", "bwd_weight"):
        p32 = make_problem(d, (2, 5, 6, 8), (8, 3, 3, 8), padding=1)
        p16 = make_problem(d, (2, 5, 6, 8), (8, 3, 3, 8), padding=1, dtype="float16")
        x32 = tuner.random_inputs(p32, np.random.default_rng(3))
        x16 = tuner.random_inputs(p16, np.random.default_rng(3))
        assert set(x16) == set(x32) and all(a.dtype == np.float32 for a in x32.values())
        assert all(a.dtype == np.float16 and a.shape == x32[n].shape for n, a in x16.items())
        assert all(np.array_equal(a, x32[n].astype(np.float16)) for n, a in x16.items())  # the same draws, rounded
        ref16, _ = tuner._reference_job((p16, 3))
        assert ref16.dtype == np.float64 and ref16.shape == p16.output_shape
        # computed from those exact float16 values (float64 arithmetic, not float16's)
        wide = {n: a.astype(np.float64) for n, a in x16.items()}
        assert np.array_equal(ref16, tuner.reference_output(p16, wide))
        assert not np.array_equal(ref16, tuner.reference_output(p32, x32))
        if d == "fwd":
            assert np.array_equal(ref16, R.conv_forward(wide["x"], wide["w"], padding=1))


def test_check_result_compares_float16_in_float64():
    ref = np.full(1000, 60000.0)  # squares overflow float16 (and a float16 norm with them)
    assert tuner.check_result(ref.astype(np.float16), ref, "fp16") == 0.0
    got = (ref * (1 + 5e-3)).astype(np.float16)
    assert abs(tuner.check_result(got, ref, "fp16") - 5e-3) < 1e-3


def test_fp16_tune_candidates_fit_float16_storage():
    # float16 backward-weight splits into a float32 workspace (its atomic adds need float32): split candidates, the
    # tuned one among them; the forward's and backward-data's mma.sync tiles stay unsplit (the model's space), their
    # TMA tiles split a small grid (half=True), never a strided backward-data's
    from kernelgen.templates import implicit_gemm_tc
    bwd_w = make_problem("bwd_weight", (32, 28, 28, 128), (128, 3, 3, 128), padding=1, dtype="float16")
    split = TileConfig(64, 64, 32, WM=32, WN=16, stages=2, swizzle=1, split_k=4)
    cands = tuner.tc_candidates(bwd_w, "fp16", tuned=split)
    assert cands and any(c.split_k > 1 for _, c in cands) and ("implicit_gemm_tc", split) in cands
    assert cands[0][1] == implicit_gemm_tc.default_config(bwd_w, "cuda", "fp16")
    small = make_problem("fwd", (32, 7, 7, 512), (512, 3, 3, 512), padding=1, dtype="float16")
    assert implicit_gemm_tc.tc_split_choices(small, 128, 64, 16, H100) == [1]
    assert implicit_gemm_tc.tc_split_choices(small, 128, 64, 64, H100, divides=True, half=True)[-1] > 1
    strided = make_problem("bwd_data", (32, 14, 14, 512), (512, 3, 3, 512), padding=1, stride=2, dtype="float16")
    assert implicit_gemm_tc.tc_split_choices(strided, 128, 64, 64, H100, divides=True, half=True) == [1]


def test_fp16_tune_works_on_float16_problems(tiny_table, tmp_path, monkeypatch):
    """tune(precision="fp16") measures the float16 problems, on float16 device copies, against float64."""
    seen = []

    class Stop(Exception):
        pass

    def fake_measure(problem, variant, cfg, sets, ref, repeat=10, precision="fp32"):
        seen.append((problem, ref, sets))
        raise Stop
    monkeypatch.setattr(tuner, "measure", fake_measure)
    monkeypatch.setattr(tuner, "device_sets", lambda host, rotations=3: [host])
    monkeypatch.setattr(tuner, "_compile_one", lambda args: (None, 0.0))
    monkeypatch.setattr(tuner, "device_name", lambda: "sm_90_test")

    class Pool:  # in-process: the compile and reference jobs (the workers' part) run right here
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def submit(self, fn, *args):
            from concurrent.futures import Future
            f = Future()
            f.set_result(fn(*args))
            return f
    monkeypatch.setattr(tuner, "ProcessPoolExecutor", Pool)
    _, entries, failures = tuner.tune(str(tiny_table), db_path=tmp_path / "db.json", limit=1, keep=1,
                                      precision="fp16")
    assert not entries and failures and seen
    problem, ref, sets = seen[0]
    assert problem == shapes.load_table(str(tiny_table))[1][0].problem("fwd", "float16")
    assert ref.dtype == np.float64 and all(a.dtype == np.float16 for s in sets for a in s.values())


def test_compile_signature_and_poisoned_output_follow_the_storage_dtype(monkeypatch):
    """The worker compiles an fp16 plan of a float16 problem for float16 arrays, and measure poisons a float16
    output.  Nothing is rendered or launched: stand-ins for the launcher and its kernel record what they get."""
    from numba import cuda

    from kernelgen import planner
    from kernelgen.templates.config import CUDA_TC_DEFAULT
    from kernelgen.tuning import bench
    signatures, plans = [], []

    class Kernel:
        def compile(self, sig):
            signatures.append(sig)

    class Launcher:
        kernel, params, outputs, threads, tensor_maps = Kernel(), ("x", "w", "y", "m"), ("y",), 128, (("m",),)
        widened = ()  # no float32 workspace (runtime/launch.py Launcher.widened)
    tuner._compile(Launcher(), "float16")
    tuner._compile(Launcher())
    assert [str(t) for t in signatures[0]] == ["array(float16, 1d, C)"] * 3 + ["array(uint64, 1d, C)"]
    assert [str(t) for t in signatures[1]] == ["array(float32, 1d, C)"] * 3 + ["array(uint64, 1d, C)"]

    monkeypatch.setattr(planner, "get_launcher", lambda plan: plans.append(plan) or Launcher())
    signatures.clear()
    p = make_problem("fwd", (1, 4, 5, 16), (16, 3, 3, 16), padding=1, dtype="float16")
    assert tuner._compile_one((p, "implicit_gemm_tc", CUDA_TC_DEFAULT, "fp16"))[0] is None
    assert [str(t) for t in signatures[0]][:3] == ["array(float16, 1d, C)"] * 3
    poisoned = []

    def to_device(a, *args, **kw):
        poisoned.append(a)
        raise RuntimeError("stop before launching")
    monkeypatch.setattr(bench, "kernel_resources", lambda launcher, threads: {})
    monkeypatch.setattr(cuda, "to_device", to_device)
    with pytest.raises(RuntimeError, match="stop"):
        tuner.measure(p, "implicit_gemm_tc", CUDA_TC_DEFAULT, sets=[], ref=None, precision="fp16")
    assert len(signatures) == 2 and [str(t) for t in signatures[1]][:3] == ["array(float16, 1d, C)"] * 3
    assert [(pl.problem, pl.precision) for pl in plans] == [(p, "fp16")] * 2
    (out,) = poisoned
    assert out.dtype == np.float16 and out.size == int(np.prod(p.output_shape)) and np.isnan(out).all()


class _FakeTensor(np.ndarray):
    """Just enough of a torch tensor for TorchConv.nhwc (a NumPy array: no torch on the CPU test machines)."""

    def to(self, dtype):
        return self.astype(dtype).view(_FakeTensor)

    def permute(self, *axes):
        return self.transpose(axes)


class _FakeTorch:
    float32, float16, bfloat16 = np.dtype("float32"), np.dtype("float16"), np.dtype("float64")  # bf16: a stand-in

    @staticmethod
    def randn(shape, device=None, generator=None):
        return np.random.default_rng(0).standard_normal(shape).astype(np.float32).view(_FakeTensor)


@pytest.mark.parametrize("precision", ("fp32", "tf32", "fp16"))
def test_bench_gives_kernelgen_the_storage_dtype_cudnn_reads(precision):
    """At fp16 kernelgen's tensor is the float16 NHWC tensor whose NCHW view cuDNN reads (the same memory);
    fp32/tf32: one float32 tensor.  (bf16 is fp16's case with bfloat16, which this NumPy stand-in for torch cannot
    hold: the GPU bench runs it.)"""
    from kernelgen.tuning import bench
    tc = object.__new__(bench.TorchConv)
    tc.torch = _FakeTorch
    tc.dtype = getattr(_FakeTorch, bench.CUDNN_DTYPES[precision]) if precision in bench.CUDNN_DTYPES else None
    storage = shapes.storage_dtype(precision)
    k, view = tc.nhwc((2, 3, 4, 5), None, storage)
    assert k.dtype == np.dtype(storage) and k.shape == (2, 3, 4, 5) and k.flags.c_contiguous
    assert view.shape == (2, 5, 3, 4)
    assert np.shares_memory(k, view) == (precision != "bf16")
    assert view.dtype == (np.float64 if precision == "bf16" else np.dtype(storage))
    assert np.array_equal(k, _FakeTorch.randn((2, 3, 4, 5)).astype(storage))
    assert tc.nhwc((2, 3, 4, 5), None)[0].dtype == np.float32  # no storage given (scripts): float32, as before


def test_floor_counts_the_storage_bytes():
    from kernelgen.tuning import bench
    big = dict(padding=1)
    p32 = make_problem("bwd_weight", (128, 56, 56, 64), (64, 1, 1, 64), **big)
    p16 = make_problem("bwd_weight", (128, 56, 56, 64), (64, 1, 1, 64), dtype="float16", **big)
    assert bench.floor_ms(p16, "fp16") == pytest.approx(bench.floor_ms(p32, "fp16") / 2)  # memory bound: half


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ("fp16", "bf16"))
def test_gpu_bench_fp16_runs_on_float16(torch, precision):
    from kernelgen.tuning import bench
    layer = shapes.Layer("t", 2, 8, 8, 32, 32, 3, 3, padding=1)
    tc = bench.TorchConv(dtype=bench.CUDNN_DTYPES[precision])
    for d in ("fwd", "bwd_data", "bwd_weight"):
        row = bench.bench_problem(layer, d, tc, rotations=1, repeat=1, precision=precision)
        assert row["dtype"] == shapes.storage_dtype(precision) and row["precision"] == precision
        assert row["rel_err_vs_cudnn"] < 1e-2, (d, row)


def test_fp16_tma_candidates_on_float16_arrays():
    """fp16 on float16 arrays tries the TMA tiles with BK 64 (a 128-byte row of float16), the 128 x 256 one too,
    unsplit on a grid that fills the SMs; backward-weight its own tiles (both operands MN-major), split into its
    float32 workspace."""
    from kernelgen.templates import implicit_gemm_tc
    kw = dict(padding=1, dtype="float16")
    fwd = make_problem("fwd", (32, 28, 28, 128), (128, 3, 3, 128), **kw)
    bwd = make_problem("bwd_data", (32, 28, 28, 128), (128, 3, 3, 128), **kw)
    bwd_w = make_problem("bwd_weight", (32, 28, 28, 128), (128, 3, 3, 128), **kw)
    for p in (fwd, bwd, bwd_w):
        tma = [c for _, c in tuner.tc_candidates(p, "fp16") if c.tma]
        want = set(implicit_gemm_tc.TMA_TILES_FP16) if p is not bwd_w else set(implicit_gemm_tc.TMA_TILES_BWD_WEIGHT)
        assert {(c.BM, c.BN, c.WM, c.WN, c.stages, c.tma) for c in tma} == want
        for c in tma:  # (a split where a tile's grid is under one wave: 98 blocks of 256 x 128)
            blocks = -(-25088 // c.BM) * -(-128 // c.BN)
            assert c.BK == 64 and (c.split_k > 1) <= (p is bwd_w or blocks < 132) and bool(c.a_mn) == (p is bwd_w)
            implicit_gemm_tc.build(p, c, "fp16")
    assert not [c for _, c in tuner.tc_candidates(make_problem("fwd", (32, 28, 28, 128), (128, 3, 3, 128),
                                                                padding=1), "fp16") if c.tma]  # float32 arrays


def test_db_merge_writes_one_precisions_entries(tmp_path):
    """`python -m kernelgen db merge`: a tune's fp16 entries into a shipped file, replacing those of the same key,
    its other entries and the shipped device name kept; a file that is no database is refused."""
    from kernelgen.__main__ import main
    shipped, tuned = tmp_path / "ship.json", tmp_path / "tuned.json"
    old = {"a_fp16": {"precision": "fp16", "ms": 2.0}, "b": {"ms": 1.0}}
    database.save(shipped, old, "sm_90 test")
    database.save(tuned, {"a_fp16": {"precision": "fp16", "ms": 1.5}, "c_tf32": {"precision": "tf32", "ms": 3.0},
                          "d": {"ms": 4.0}}, "other")
    assert main(["db", "merge", str(tuned), "--into", str(shipped), "--precision", "fp16"]) == 0
    assert database.load(shipped) == {"a_fp16": {"precision": "fp16", "ms": 1.5}, "b": {"ms": 1.0}}
    assert json.loads(shipped.read_text())["device"] == "sm_90 test"
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(ValueError, match="holds no database entries"):
        database.merge(tmp_path / "junk.json", shipped)
