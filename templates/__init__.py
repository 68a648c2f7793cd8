"""The variant library: each module builds a Kernel from (ConvProblem, TileConfig).

A variant module exposes NAME, DIRECTIONS, applies(problem) -> bool and build(problem, config).
"""
from __future__ import annotations

from . import implicit_gemm
from dataclasses import replace

from .config import CPU_DEFAULT, CUDA_DEFAULT, TileConfig

VARIANTS = {m.NAME: m for m in (implicit_gemm,)}


def get_variant(name):
    try:
        return VARIANTS[name]
    except KeyError:
        raise ValueError(f"algo must be None or one of {sorted(VARIANTS)}, got {name!r}") from None


def candidates(problem):
    """Variants that can compute this problem, in preference order."""
    return [m for m in VARIANTS.values() if problem.direction in m.DIRECTIONS and m.applies(problem)]


def default_config(problem, backend) -> TileConfig:
    """Heuristic schedule when no tuned entry exists."""
    if backend != "cuda":
        return CPU_DEFAULT
    cfg = CUDA_DEFAULT
    if problem.direction == "bwd_weight":
        # dw is small (K x R*S*C) and the reduction (N*P*Q) is long: split it so the grid fills the GPU
        M, Ng = problem.Kg, problem.Cg
        for f in problem.filter_size:
            Ng *= f
        blocks = -(-M // cfg.BM) * -(-Ng // cfg.BN) * problem.groups
        red = problem.N
        for o in problem.out_size:
            red *= o
        split = max(1, min(64, 264 // max(blocks, 1), red // (cfg.BK * 64)))
        return replace(cfg, split_k=split)
    return cfg
