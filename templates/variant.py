"""What every convolution variant is, to the planner and the tuner: the `Variant` protocol.

Each variant module defines one object that implements it (`VARIANT`): the four GEMM-shaped fp32 variants are
tile_space.TiledGemmVariant instances, Winograd and the tensor-core implicit GEMM have classes of their own.  The
planner and the tuner reach a variant only through these members, and pass it the Target in effect, so a cost
model or a tile filter never reads a device or a global.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from kernelgen.ir import Kernel
from kernelgen.problem import ConvProblem
from kernelgen.target import Target

from .config import TileConfig


@runtime_checkable
class Variant(Protocol):
    name: str                       # the algo= name
    directions: tuple[str, ...]     # of "fwd", "bwd_data", "bwd_weight"
    precisions: tuple[str, ...]     # ("fp32",), or the tensor-core precisions it computes in

    def applies(self, problem: ConvProblem, precision: str) -> bool:
        """Can it compute this problem (its direction, dtype, strides ...) at this precision?"""

    def accepts(self, problem: ConvProblem, config: TileConfig, precision: str) -> bool:
        """Does this config build for this problem at this precision, under the current settings (a tuned
        entry's config is checked with it before it is used)?"""

    def build(self, problem: ConvProblem, config: TileConfig, precision: str) -> Kernel:
        """The kernel's IR."""

    def config_space(self, problem: ConvProblem, target: Target, precision: str, *, keep: int | None = None,
                     tiles=None) -> list[TileConfig]:
        """The configs a tune tries on the target; keep: at most about that many of those its cost model orders,
        the cheapest; tiles: the fp32 block shapes (BM, BN, BK, TM, TN) to enumerate, for the GEMM variants."""

    def default_config(self, problem: ConvProblem, target: Target, precision: str) -> TileConfig:
        """The cost model's pick on the target, where no tuned entry answers."""

    def key_extra(self, problem: ConvProblem) -> object:
        """What the kernel depends on beyond (problem, config, precision, code settings), for the cache key (None:
        nothing; Winograd: the state count the settings select)."""
