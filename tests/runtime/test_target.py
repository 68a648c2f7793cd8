"""The Target: device facts read from a numba device or taken from the table, the target in effect, and what the
cost models, gates and kernel keys make of it.  No GPU needed: a stand-in device object answers the attributes."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from kernelgen import planner, settings, target
from kernelgen.problem import make_problem
from kernelgen.target import CPU_TARGET, KNOWN_TARGETS, Target
from kernelgen.templates import implicit_gemm_tc, tile_space, winograd
from kernelgen.tuning import database

H100, A100 = KNOWN_TARGETS["h100"], KNOWN_TARGETS["a100"]
ROOT = Path(__file__).resolve().parents[2]


class FakeDevice:
    """numba.cuda's device object as the driver describes an H100 PCIe (114 SMs)."""
    name = b"NVIDIA H100 PCIe"
    compute_capability = (9, 0)
    MULTIPROCESSOR_COUNT = 114
    MAX_SHARED_MEMORY_PER_BLOCK = 48 * 1024
    MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 227 * 1024
    MAX_SHARED_MEMORY_PER_MULTIPROCESSOR = 228 * 1024
    MAX_REGISTERS_PER_MULTIPROCESSOR = 65536
    MAX_THREADS_PER_BLOCK = 1024
    WARP_SIZE = 32


def test_from_device_reads_the_attributes():
    t = Target.from_device(FakeDevice())
    assert (t.backend, t.name, t.compute_capability, t.sm_count) == ("cuda", "NVIDIA H100 PCIe", (9, 0), 114)
    assert (t.static_shared_per_block, t.optin_shared_per_block, t.shared_per_sm) == (48 << 10, 227 << 10, 228 << 10)
    assert (t.registers_per_sm, t.max_threads_per_block, t.warp_size, t.max_registers_per_thread) == (65536, 1024, 32,
                                                                                                      255)
    assert t.has("wgmma") and t.has("tma") and t.has("mma_tf32") and t.arch == "sm_90"
    assert t.device_name == "sm_90_NVIDIA H100 PCIe"
    ampere = type("Ampere", (FakeDevice,), {"compute_capability": (8, 6), "name": "NVIDIA RTX A6000"})()
    a = Target.from_device(ampere)
    assert a.tensor_cores == ("mma_tf32", "mma_fp16", "mma_bf16") and not a.has("tma") and a.arch == "sm_86"
    with pytest.raises(ValueError, match="kind must be one of"):
        a.has("tensor")
    with pytest.raises(AttributeError):  # frozen: a target never changes once read
        t.sm_count = 132


def test_the_table_and_the_target_in_effect(monkeypatch):
    assert (H100.sm_count, A100.sm_count, KNOWN_TARGETS["l40s"].sm_count) == (132, 108, 142)
    assert H100.optin_shared_per_block == 227 * 1024 and A100.optin_shared_per_block == 163 * 1024
    assert H100.has("wgmma") and not A100.has("wgmma") and not KNOWN_TARGETS["l40s"].has("tma")
    # the H100 entry is the GPU the shipped database was tuned on, under the same name
    assert (database.SHIPPED / database.db_name(H100.device_name)).exists()
    monkeypatch.setattr(target, "gpu_present", lambda: False)  # offline: the `target` setting's entry
    assert target.target_for("cpu") is CPU_TARGET and target.target_for("cuda") == H100
    with settings.scope(target="a100"):
        assert target.target_for("cuda") == A100
    with settings.scope(target="b200"), pytest.raises(ValueError, match="setting target .* got 'b200'"):
        target.target_for("cuda")
    with pytest.raises(ValueError, match="backend must be"):
        target.target_for("gpu")
    monkeypatch.setattr(target, "gpu_present", lambda: True)  # a GPU: its own facts, whatever the setting says
    monkeypatch.setattr(target, "device_target", lambda: Target.from_device(FakeDevice()))
    with settings.scope(target="a100"):
        assert target.target_for("cuda").sm_count == 114


def test_an_a100_changes_the_wave_arithmetic():
    """Split-K fills about two waves of the target's SMs: 18 blocks of 128 x 64 need 15 splits on 132 SMs, 12 on
    108; the cost models count waves of the target's SMs; the TMA / wgmma tiles need a target that has them."""
    bwd_w = make_problem("bwd_weight", (32, 28, 28, 128), (128, 3, 3, 128), padding=1)
    tile = (128, 64, 8, 8, 4)
    assert (tile_space.split_for(bwd_w, tile, H100), tile_space.split_for(bwd_w, tile, A100)) == (15, 12)
    assert tile_space.default_tile_config(bwd_w, H100, lambda c: True, "t").split_k != \
        tile_space.default_tile_config(bwd_w, A100, lambda c: True, "t").split_k
    assert implicit_gemm_tc.default_config(bwd_w, H100, "tf32") != implicit_gemm_tc.default_config(bwd_w, A100, "tf32")
    small = make_problem("fwd", (32, 7, 7, 512), (576, 3, 3, 512), padding=1)  # 13 x 9 = 117 blocks of 128 x 64
    assert implicit_gemm_tc.tc_split_choices(small, 128, 64, 16, H100) == [1, 2, 3]  # SMs idle: split
    assert implicit_gemm_tc.tc_split_choices(small, 128, 64, 16, A100) == [1]  # more blocks than SMs
    c7 = make_problem("fwd", (18, 28, 28, 32), (32, 7, 7, 32), padding=3)  # 8 states, 64 x 32 tiles: 111 blocks
    assert winograd.grid_blocks(c7, 8, 64, 32) == 111
    work = 64 * 32 * 8 * winograd.STATE_OVERHEAD[8]  # one block's; 2 resident per SM hide latency, 1 less so
    assert [winograd.model_time(c7, 8, (64, 32, 8, 4, 2), t) for t in (H100, A100)] == [work / 0.8, 2 * work]
    fp16 = make_problem("fwd", (32, 28, 28, 128), (128, 3, 3, 128), padding=1, dtype="float16")
    assert implicit_gemm_tc.tma_candidate_configs(fp16, "fp16", H100) and implicit_gemm_tc.untuned_tma_config(
        fp16, "fp16", H100).tma
    assert implicit_gemm_tc.tma_candidate_configs(fp16, "fp16", A100) == []
    assert implicit_gemm_tc.untuned_tma_config(fp16, "fp16", A100) is None


def test_plan_keys_differ_where_the_target_changes_the_code(monkeypatch):
    """An offline plan for the A100 picks another split (another kernel) and keys it apart; a plan of the same
    config is keyed by its target too (a device-read target by its own facts), and equal targets key alike.  A
    wgmma / TMA config is refused for a CUDA target without them."""
    monkeypatch.setattr(target, "gpu_present", lambda: False)
    bwd_w = make_problem("bwd_weight", (32, 28, 28, 128), (128, 3, 3, 128), padding=1)
    h100 = planner.make_plan(bwd_w, "cuda")
    with settings.scope(target="a100"):
        a100 = planner.make_plan(bwd_w, "cuda")
        assert a100.target == A100 and a100.config.split_k != h100.config.split_k
        assert a100.render() != h100.render() and a100.key() != h100.key()
    same = planner.Plan(bwd_w, h100.variant, h100.config, "cuda", target=A100)
    assert same.render() == h100.render() and same.key() != h100.key()
    device = planner.Plan(bwd_w, h100.variant, h100.config, "cuda", target=Target.from_device(FakeDevice()))
    assert device.key() not in (h100.key(), same.key())
    assert planner.Plan(bwd_w, h100.variant, h100.config, "cuda", target=H100).key() == h100.key()
    fp16 = make_problem("fwd", (32, 28, 28, 128), (128, 3, 3, 128), padding=1, dtype="float16")
    tma = implicit_gemm_tc.untuned_tma_config(fp16, "fp16", H100)  # warpgroup MMAs fed by TMA: the H100's alone
    assert planner.make_plan(fp16, "cuda", config=tma, precision="fp16").config == tma
    with settings.scope(target="a100"), pytest.raises(ValueError, match="config: wgmma and tma tiles need a GPU"):
        planner.make_plan(fp16, "cuda", config=tma, precision="fp16")
    with settings.scope(target="a100"):  # the CPU backend emulates them
        assert planner.make_plan(fp16, "cpu", config=tma, precision="fp16").config == tma
    cpu = planner.make_plan(bwd_w, "cpu")
    with settings.scope(target="a100"):  # the CPU's plan is the CPU's: the setting changes only its key's token
        assert planner.make_plan(bwd_w, "cpu").config == cpu.config and cpu.target is CPU_TARGET


def test_the_device_facts_live_in_the_target():
    """No SM count or shared-memory size is written anywhere else, and only settings.py reads the environment."""
    facts = re.compile(r"(?<![\w.])(132|48 \* 1024|227 \* 1024|49152)(?![\w.])")
    for folder in ("kernelgen", "templates", "runtime", "tuning"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            code = "\n".join(line.split("#")[0] for line in text.splitlines())
            if path.name != "target.py":
                assert not facts.search(code), f"{path}: {facts.search(code).group()}"
            if path.name != "settings.py":
                assert "os.environ" not in text, path


def test_worker_blas_threads_are_capped_unless_set(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("MKL_NUM_THREADS", "4")
    settings.cap_worker_blas_threads(1)
    import os
    assert os.environ["OMP_NUM_THREADS"] == "1" and os.environ["MKL_NUM_THREADS"] == "4"


def test_no_driver_library_means_no_gpu_without_importing_numba_cuda():
    """Where the CUDA driver library does not load, gpu_present says so before importing numba.cuda (0.3-0.7 s of a
    cold start on a machine without a GPU); checked in a fresh process, with the driver's path pointed nowhere."""
    import subprocess
    import sys
    code = ("import sys; from kernelgen.target import gpu_present; "
            "print(gpu_present(), 'numba.cuda' in sys.modules)")
    env = dict(settings.process_environment(), NUMBA_CUDA_DRIVER="/nonexistent/libcuda.so.1")
    env.pop("KERNELGEN_CUDA_SIMULATOR", None)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "False"], out.stderr[-2000:]


def test_cpu_default_tile_shrinks_with_the_problem():
    """The CPU's default register tile: one output a thread below CPU_TINY_FLOPS (numba compiles the kernel fastest),
    2 x 2 below CPU_SMALL_FLOPS, the 4 x 4 default above."""
    from kernelgen.templates import config
    sizes = {"tiny": (2, 16, 16, 16), "small": (8, 16, 16, 32), "large": (8, 32, 32, 64)}
    tiles = {}
    for name, x in sizes.items():
        p = make_problem("fwd", x, (x[3], 3, 3, x[3]), padding=1)
        tiles[name] = tile_space.default_tile_config(p, CPU_TARGET, lambda c: True, "t")
        assert (p.flops < config.CPU_TINY_FLOPS, p.flops < config.CPU_SMALL_FLOPS) == \
            {"tiny": (True, True), "small": (False, True), "large": (False, False)}[name], (name, p.flops)
    assert (tiles["tiny"].TM, tiles["tiny"].TN) == (1, 1)
    assert (tiles["small"].TM, tiles["small"].TN) == (2, 2)
    assert (tiles["large"].TM, tiles["large"].TN) == (4, 4)
