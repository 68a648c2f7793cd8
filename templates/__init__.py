"""The variant library: each module builds a Kernel from (ConvProblem, TileConfig) and defines one object, VARIANT,
that implements the Variant protocol (templates/variant.py), through which the planner and the tuner use it.
"""
from __future__ import annotations

from kernelgen.target import Target, as_target

from . import conv_v2, depthwise, implicit_gemm, implicit_gemm_tc, ks_deconv, sk_dilated, winograd, winograd_wgrad
from .config import CPU_DEFAULT, CUDA_DEFAULT, TileConfig  # noqa: F401 (re-exported)
from .variant import Variant

# preference order for the automatic choice; conv_v2 runs where forced or where the tuner picked it; depthwise (which
# computes any groups == C problem, C = 1 too) is last: the planner takes it first for groups == C > 1 itself
VARIANTS: dict[str, Variant] = {v.name: v for v in (ks_deconv.VARIANT, implicit_gemm.VARIANT, conv_v2.VARIANT,
                                                    sk_dilated.VARIANT, winograd.VARIANT, depthwise.VARIANT)}


# variants that compute in a reduced precision: never candidates, only planned for the precision they compute in
TENSOR_CORE_VARIANTS: dict[str, Variant] = {implicit_gemm_tc.VARIANT.name: implicit_gemm_tc.VARIANT}


# variants planned only where a call forces them (algo=): never automatic candidates until a GPU run has measured
# them against the others (templates/winograd_wgrad.py)
OPT_IN_VARIANTS: dict[str, Variant] = {winograd_wgrad.VARIANT.name: winograd_wgrad.VARIANT}


def get_variant(name) -> Variant:
    names = sorted(VARIANTS) + sorted(OPT_IN_VARIANTS)
    if not isinstance(name, str):
        raise TypeError(f"algo must be None or one of {names}, got {name!r}")
    for table in (VARIANTS, OPT_IN_VARIANTS, TENSOR_CORE_VARIANTS):
        if name in table:
            return table[name]
    raise ValueError(f"algo must be None or one of {names}, got {name!r}")


def computes(variant: Variant, problem) -> bool:
    """Can the variant compute this problem at its own first precision (fp32, or tf32 for a tensor-core one)?"""
    return variant.applies(problem, variant.precisions[0])


def candidates(problem) -> list[Variant]:
    """Variants that can compute this fp32 problem, in preference order."""
    return [v for v in VARIANTS.values() if v.applies(problem, "fp32")]


def default_config(problem, target: Target | str, variant: Variant) -> TileConfig:
    """The variant's cost-model default at its own first precision.  target: a Target, or a backend name for the
    target in effect on it."""
    return variant.default_config(problem, as_target(target), variant.precisions[0])
