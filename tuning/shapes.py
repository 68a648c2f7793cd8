"""Shape tables as data: JSON files of layers, each expanded into kernelgen problems per direction.

A layer is {"name", "N", "H", "W", "C", "K", "R", ["S"], "stride", "padding", "dilation", ["groups"],
["transposed", "output_padding"], ["dims", "D", "T"], ["net"]}.  "dims" is the number of spatial dims (2 by
default): a 1D layer ("dims": 1) has a length W and a filter S only (H and R are 1); a 3D layer ("dims": 3) adds a
depth D and a filter depth T (T defaults to R, S to R).  stride, padding, dilation and output_padding are an int or a
list of one per spatial dim (Inception's 1x7 pads [0, 3]).  A transposed layer is a deconvolution
x (N, *spatial, C) -> (N, *spatial', K) whose weight is (C, *filter, K // groups).  "net" names the network and layer
a row was taken from.  A table may say "held_out": true: its layers measure how the tuned database generalises, so
the tuner must refuse it (check_tunable).  Tables ship in kernelgen/tuning/tables; users pass their own file path.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from kernelgen.problem import ConvProblem, deconv_output_shape, make_problem

TABLES = Path(__file__).parent / "tables"
SPATIAL = {1: ("W",), 2: ("H", "W"), 3: ("D", "H", "W")}   # a layer's spatial sizes, outermost first
FILTER = {1: ("S",), 2: ("R", "S"), 3: ("T", "R", "S")}    # its filter sizes, in the same order
PER_DIM = ("stride", "padding", "dilation", "output_padding")  # an int, or one int per spatial dim


def storage_dtype(precision) -> str:
    """The dtype of the tensors a bench or tune runs at `precision`: float16 for "fp16" and bfloat16 for "bf16" (the
    16-bit tensors cuDNN's fp16 / bf16 convolutions read and write, computed by kernelgen's 16-bit tensor-core plans:
    kernelgen.storage), float32 for the others."""
    return {"fp16": "float16", "bf16": "bfloat16"}.get(precision, "float32")


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
    stride: int | tuple = 1
    padding: int | tuple = 0
    dilation: int | tuple = 1
    groups: int = 1
    transposed: bool = False
    output_padding: int | tuple = 0
    dims: int = 2
    D: int = 1
    T: int = 1
    net: str = field(default="", compare=False)  # where the row comes from: not part of the shape

    def __post_init__(self):
        if self.dims not in SPATIAL:
            raise ValueError(f"layer {self.name!r}: dims must be 1, 2 or 3, got {self.dims!r}")
        unused = [a for a in ("D", "T", "H", "R") if a not in SPATIAL[self.dims] + FILTER[self.dims]
                  and getattr(self, a) != 1]
        if unused:
            raise ValueError(f"layer {self.name!r}: {unused} must be 1 (or absent) in a {self.dims}D layer")
        for name in PER_DIM:
            value = getattr(self, name)
            if isinstance(value, list):  # from JSON: a tuple keeps the layer hashable
                object.__setattr__(self, name, value := tuple(value))
            if isinstance(value, tuple) and len(value) != self.dims:
                raise ValueError(f"layer {self.name!r}: {name} must be an int or {self.dims} ints (one per "
                                 f"spatial dim), got {list(value)}")

    @classmethod
    def from_dict(cls, d):
        d = dict(d)
        dims = d.get("dims", 2)
        if dims == 1:
            if "S" not in d:
                raise ValueError(f"layer {d.get('name')!r}: a 1D layer needs its filter length S")
            d.setdefault("H", 1)
            d.setdefault("R", 1)
        d.setdefault("S", d.get("R"))
        if dims == 3:
            d.setdefault("T", d.get("R"))
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"layer {d.get('name')!r}: unknown fields {unknown}")
        return cls(**d)

    @property
    def spatial(self) -> tuple:
        """The input's spatial sizes ((W,), (H, W) or (D, H, W))."""
        return tuple(getattr(self, a) for a in SPATIAL[self.dims])

    @property
    def filter(self) -> tuple:
        """The filter's spatial sizes ((S,), (R, S) or (T, R, S))."""
        return tuple(getattr(self, a) for a in FILTER[self.dims])

    @property
    def depthwise(self) -> bool:
        """One input channel per group: a depthwise conv, which the benches report apart from the rest."""
        return self.groups > 1 and self.groups == self.C

    def shapes(self):
        """(x_shape, w_shape, conv kwargs) of the convolution, for deconv the one it transposes."""
        kw = dict(stride=self.stride, padding=self.padding, dilation=self.dilation, groups=self.groups)
        x = (self.N, *self.spatial, self.C)
        if self.transposed:
            w = (self.C, *self.filter, self.K // self.groups)
            out = deconv_output_shape(x, w, self.stride, self.padding, self.output_padding, self.dilation,
                                      self.groups)
            return out, w, kw
        return x, (self.K, *self.filter, self.C // self.groups), kw

    def problem(self, direction, dtype="float32") -> ConvProblem:
        """The layer's problem for `direction` on tensors of `dtype` (storage_dtype(precision) for a run at a
        precision: the dtype is part of the problem's key, and so of its tuned-database entry)."""
        x, w, kw = self.shapes()
        if self.transposed:  # a deconvolution's forward pass is its conv's backward-data
            direction = {"fwd": "bwd_data", "bwd_data": "fwd"}.get(direction, direction)
        return make_problem(direction, x, w, dtype=dtype, **kw)

    def label(self):
        """'N,H,W,C->K, RxS, s1 p1 d1' (2D layers as they always read); 1D and 3D layers say so in front, groups
        and per-dim values ('p0x3') appear where they are not the plain case."""
        per_dim = lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v)
        core = (f"{self.N},{','.join(map(str, self.spatial))},{self.C}->{self.K}, {per_dim(self.filter)}, "
                f"s{per_dim(self.stride)} p{per_dim(self.padding)} d{per_dim(self.dilation)}")
        if self.groups != 1:
            core += f" g{self.groups}"
        return ("deconv " if self.transposed else "") + ("" if self.dims == 2 else f"{self.dims}d ") + core


@dataclass(frozen=True)
class Table:
    name: str
    layers: tuple
    path: Path
    held_out: bool = False  # never tuned: it measures the tuned database on shapes it has not seen


def _table_path(name_or_path) -> Path:
    p = Path(name_or_path)
    if not p.exists():
        p = TABLES / f"{name_or_path}.json"
    if not p.exists():
        known = sorted(t.stem for t in TABLES.glob("*.json"))
        raise ValueError(f"table must be a JSON file or one of {known}, got {name_or_path!r}")
    return p


def read_table(name_or_path) -> Table:
    """The table named (a shipped one) or at a path, with its layers and whether it is held out."""
    p = _table_path(name_or_path)
    data = json.loads(p.read_text())
    held_out = data.get("held_out", False)
    if not isinstance(held_out, bool):
        raise ValueError(f"table {p}: held_out must be true or false, got {held_out!r}")
    return Table(data.get("name", p.stem), tuple(Layer.from_dict(d) for d in data["layers"]), p, held_out)


def load_table(name_or_path) -> tuple[str, list[Layer]]:
    table = read_table(name_or_path)
    return table.name, list(table.layers)


def check_tunable(name_or_path) -> Table:
    """The table, unless it is held out from tuning (ValueError naming it): a tune of a held-out table would put
    its problems in the database, and the bench of it would then measure tuned shapes, not unseen ones."""
    table = read_table(name_or_path)
    if table.held_out:
        raise ValueError(f"table {table.name!r} is held out from tuning (\"held_out\": true in {table.path}): it "
                         f"measures the tuned database on shapes it has never seen; bench it, do not tune it")
    return table
