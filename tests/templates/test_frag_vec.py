"""TileConfig.frag_vec: fp32 register tiles reading their fragments as 8 / 16-byte shared loads (gemm_compute.
fragment_loads, cuda_memory.shared_load2/4), checked against float64 in the CUDA simulator (the rendered CUDA source
with its shared_load helpers) and on the CPU backend, for the GEMM tile, the forward Winograd and the Winograd
backward-weight; and the rendered source: vector loads only where asked, the tiles declared 16-byte aligned.
"""
from __future__ import annotations

import dataclasses

import pytest

from kernelgen import settings
from kernelgen.api import make_plan
from kernelgen.problem import make_problem
from kernelgen.render_cuda import render_cuda
from kernelgen.templates.config import TileConfig
from harness import assert_close, run_direction

CASES = [  # (algo, direction, x, w, kw, config): TM / TN of 4 (16-byte loads), 2 (8-byte) and 1 (word loads)
    ("implicit_gemm", "fwd", (1, 6, 7, 5), (9, 3, 3, 5), dict(padding=1),
     TileConfig(BM=8, BN=8, BK=4, TM=4, TN=2, smem_pad=4, stages=2)),
    ("implicit_gemm", "bwd_weight", (2, 5, 6, 4), (6, 3, 3, 4), dict(padding=1),
     TileConfig(BM=8, BN=8, BK=4, TM=2, TN=4, split_k=2)),
    ("winograd", "fwd", (1, 6, 9, 4), (5, 3, 3, 4), dict(padding=1),
     TileConfig(BM=8, BN=4, BK=4, TM=4, TN=1, states=4, smem_pad=4)),
    ("winograd_wgrad", "bwd_weight", (1, 5, 9, 3), (5, 3, 3, 3), dict(padding=1),
     TileConfig(BM=4, BN=4, BK=4, TM=2, TN=2, states=4, split_k=2, frag_vec=1)),
]


def _vec(config):
    return dataclasses.replace(config, frag_vec=1)


@pytest.mark.sim
@pytest.mark.parametrize("algo, direction, x, w, kw, config", CASES, ids=lambda c: getattr(c, "__name__", None))
def test_simulator(algo, direction, x, w, kw, config, rng):
    p = make_problem(direction, x, w, **kw)
    plan, got, want = run_direction(p, kw, "cuda", algo, _vec(config), rng)
    assert plan.config.frag_vec == 1
    assert_close(got, want, p.dtype, f"{algo} {p.key()} {plan.config}", tol=1e-4)


def test_cpu_backend(rng):
    algo, direction, x, w, kw, config = CASES[0]
    p = make_problem(direction, x, w, **kw)
    plan, got, want = run_direction(p, kw, "cpu", algo, _vec(config), rng)
    assert_close(got, want, p.dtype, f"{algo} {p.key()} {plan.config}")


@pytest.mark.parametrize("algo, direction, x, w, kw, config", CASES, ids=lambda c: getattr(c, "__name__", None))
def test_rendered_loads(algo, direction, x, w, kw, config):
    p = make_problem(direction, x, w, **kw)
    plain = render_cuda(make_plan(p, "cuda", algo, dataclasses.replace(config, frag_vec=0)).kernel_ir(), cache=False)
    vector = render_cuda(make_plan(p, "cuda", algo, _vec(config)).kernel_ir(), cache=False)
    assert "shared_load" not in plain
    widths = {n for n in (config.TM, config.TN) if n in (2, 4)}
    for n in widths:
        assert f"shared_load{n}(" in vector
    with settings.scope(cuda_simulator=False):  # (the simulator's arrays take no alignment: none rendered there)
        assert "alignment=16" in render_cuda(make_plan(p, "cuda", algo, _vec(config)).kernel_ir(), cache=False)


@pytest.mark.parametrize("change", [dict(frag_vec=2), dict(WM=16, WN=8, BK=8, frag_vec=1)])
def test_refused(change):
    with pytest.raises(ValueError, match="frag_vec"):
        TileConfig(**change).validate()


def test_string_round_trip():
    c = TileConfig(BM=64, BN=32, TM=4, TN=2, smem_pad=4, frag_vec=1)
    assert str(c).endswith("_FV") and TileConfig.parse(str(c)) == c
    assert "frag_vec" in c.as_dict() and "frag_vec" not in TileConfig().as_dict()


@pytest.mark.gpu
@pytest.mark.parametrize("algo, direction", [("implicit_gemm", "fwd"), ("implicit_gemm", "bwd_weight"),
                                             ("winograd", "fwd"), ("winograd_wgrad", "bwd_weight")])
def test_gpu_default_tile(algo, direction, rng):
    kw = dict(padding=1)
    p = make_problem(direction, (8, 28, 28, 64), (64, 3, 3, 64), **kw)
    config = _vec(make_plan(p, "cuda", algo).config)
    plan, got, want = run_direction(p, kw, "cuda", algo, config, rng)
    assert_close(got, want, p.dtype, f"{algo} {p.key()} {plan.config}", tol=1e-4)
