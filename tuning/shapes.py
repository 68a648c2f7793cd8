"""Shape tables as data: JSON files of layers, each expanded into kernelgen problems per direction.

A layer is {"name", "N", "H", "W", "C", "K", "R", ["S"], "stride", "padding", "dilation", ["groups"],
["transposed", "output_padding"]}.  A transposed layer is a deconvolution x (N, H, W, C) -> (N, H', W', K)
whose weight is (C, R, S, K).  Tables ship in kernelgen/tuning/tables; users pass their own file path.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kernelgen.problem import ConvProblem, deconv_output_shape, make_problem

TABLES = Path(__file__).parent / "tables"


def storage_dtype(precision) -> str:
    """The dtype of the tensors a bench or tune runs at `precision`: float16 for "fp16" (the 16-bit tensors
    cuDNN's fp16 convolutions read and write, computed by kernelgen's fp16 tensor-core plans: kernelgen.storage),
    float32 for the others (fp32, tf32 and bf16 compute on float32 tensors)."""
    return "float16" if precision == "fp16" else "float32"


@dataclass(frozen=True)
class Layer:
    name: str
    N: int
    H: int
    W: int
    C: int
    K: int
    R: int
    S: int
    stride: int = 1
    padding: int = 0
    dilation: int = 1
    groups: int = 1
    transposed: bool = False
    output_padding: int = 0

    @classmethod
    def from_dict(cls, d):
        d = dict(d)
        d.setdefault("S", d["R"])
        return cls(**d)

    def shapes(self):
        """(x_shape, w_shape, conv kwargs) of the convolution, for deconv the one it transposes."""
        kw = dict(stride=self.stride, padding=self.padding, dilation=self.dilation, groups=self.groups)
        if self.transposed:
            x = (self.N, self.H, self.W, self.C)
            w = (self.C, self.R, self.S, self.K // self.groups)
            out = deconv_output_shape(x, w, self.stride, self.padding, self.output_padding, self.dilation,
                                      self.groups)
            return out, w, kw
        return (self.N, self.H, self.W, self.C), (self.K, self.R, self.S, self.C // self.groups), kw

    def problem(self, direction, dtype="float32") -> ConvProblem:
        """The layer's problem for `direction` on tensors of `dtype` (storage_dtype(precision) for a run at a
        precision: the dtype is part of the problem's key, and so of its tuned-database entry)."""
        x, w, kw = self.shapes()
        if self.transposed:  # a deconvolution's forward pass is its conv's backward-data
            direction = {"fwd": "bwd_data", "bwd_data": "fwd"}.get(direction, direction)
        return make_problem(direction, x, w, dtype=dtype, **kw)

    def label(self):
        core = f"{self.N},{self.H},{self.W},{self.C}->{self.K}, {self.R}x{self.S}, s{self.stride} p{self.padding} d{self.dilation}"
        return ("deconv " if self.transposed else "") + core


def load_table(name_or_path) -> tuple[str, list[Layer]]:
    p = Path(name_or_path)
    if not p.exists():
        p = TABLES / f"{name_or_path}.json"
    if not p.exists():
        known = sorted(t.stem for t in TABLES.glob("*.json"))
        raise ValueError(f"table must be a JSON file or one of {known}, got {name_or_path!r}")
    data = json.loads(p.read_text())
    return data.get("name", p.stem), [Layer.from_dict(d) for d in data["layers"]]
