"""Tuneable schedule parameters, as data (the tuner enumerates these; templates only read them)."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class TileConfig:
    """Block tile BM x BN over the GEMM view, BK-deep reduction steps, TM x TN outputs per thread.

    split_k > 1 splits the reduction over extra blocks that add into a zeroed output with atomics
    (CUDA only: it trades a little atomic traffic for enough blocks when M x N is small, as in
    backward-weight).  smem_pad pads shared rows to break bank conflicts.  states is the Winograd
    state count alpha (0: the variant's choice; other variants ignore it).
    """
    BM: int = 64
    BN: int = 64
    BK: int = 8
    TM: int = 4
    TN: int = 4
    split_k: int = 1
    smem_pad: int = 0
    stages: int = 1
    states: int = 0

    @property
    def threads(self):
        return (self.BM // self.TM) * (self.BN // self.TN)

    def validate(self):
        if self.BM % self.TM or self.BN % self.TN:
            raise ValueError(f"TileConfig: BM/BN must be multiples of TM/TN, got {self}")
        if not 1 <= self.threads <= 1024:
            raise ValueError(f"TileConfig: {self.threads} threads per block, expected 1..1024 ({self})")
        if self.stages not in (1, 2):
            raise ValueError(f"TileConfig: stages must be 1 or 2, got {self.stages}")
        if self.split_k < 1:
            raise ValueError(f"TileConfig: split_k must be >= 1, got {self.split_k}")
        return self

    def as_dict(self):
        return asdict(self)

    def __str__(self):
        s = f"BM{self.BM}_BN{self.BN}_BK{self.BK}_TM{self.TM}_TN{self.TN}"
        if self.split_k > 1:
            s += f"_SK{self.split_k}"
        if self.smem_pad:
            s += f"_PAD{self.smem_pad}"
        if self.stages > 1:
            s += f"_S{self.stages}"
        if self.states:
            s += f"_A{self.states}"
        return s


# Defaults per target: the GPU wants large register tiles; the CPU wants small code (compile time).
CUDA_DEFAULT = TileConfig(BM=128, BN=64, BK=8, TM=8, TN=4)
CPU_DEFAULT = TileConfig(BM=32, BN=32, BK=8, TM=4, TN=4)
