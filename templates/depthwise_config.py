"""The depthwise variant's schedule parameters, as data: `DepthwiseConfig`, its string and dict forms.

A block of the direct depthwise kernel (templates/depthwise.py) is TC x TW x TH threads, channel-fastest.  Each
thread owns VC consecutive channel groups (a group: one input channel and its m = K / C filters) and a register
strip of PW output pixels along W, for PH output rows (per residue class of a strided backward-data).  The block's
input window (the halo) is staged once in shared memory when `halo` is on.  Backward-weight reduces over the
batch and pixels: its blocks each take a share of the spatial tiles (`split_k` shares, added into a zeroed dw
with atomics, as TileConfig.split_k does for the GEMM variants).

Narrow groups (C / groups = Cg in 2..8): a group is Cg input channels and its Kg = K / groups filters, and its
filter taps x Kg x Cg words are more than a thread's registers hold (3x3, Cg = Kg = 4: 144), so `group_split`
consecutive threads share a group's VC groups, each accumulating 1 / group_split of the group's outputs (forward:
of its Kg output channels, backward-data: of its Cg input channels) from all of the group's sources.

Strings read like TileConfig's and never start the same way (the tuned database stores both): str() and parse()
are inverses, and so are as_dict() and from_dict().
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields

PREFIX = "DW"
VECTOR_WIDTHS = (1, 2, 4, 8)  # channel groups per thread: 8 only for float16 tensors (16 bytes of them)
MAX_PAD = 8


@dataclass(frozen=True)
class DepthwiseConfig:
    """TC, TW, TH: threads of a block along channels (fastest), W and H.  VC: channel groups per thread (its
    vector: 16-byte loads of 4 float32 channels).  PW: output pixels per thread along W (the register strip);
    PH: output rows per thread.  halo: the block's input window staged in shared memory once (1) or each thread
    reading global memory through the caches (0).  smem_pad: words after each pixel of the shared window (bank
    spreading).  split_k: blocks sharing backward-weight's reduction over batch and pixels (atomics into a
    zeroed dw, a float32 workspace for float16 tensors; 1 in the other directions and on the CPU).  group_split:
    consecutive threads (of TC) sharing the same VC groups, each with its share of their outputs (narrow groups
    only; 1 for depthwise).  share_rows: the thread's PH output rows accumulated together, each source row loaded
    once for all of them (1; PH >= 2, forward and backward-data) rather than once per output row and filter row (0)."""
    TC: int = 8
    TW: int = 8
    TH: int = 2
    VC: int = 4
    PW: int = 4
    PH: int = 1
    halo: int = 1
    smem_pad: int = 0
    split_k: int = 1
    group_split: int = 1
    share_rows: int = 0

    @property
    def threads(self) -> int:
        return self.TC * self.TW * self.TH

    @property
    def block_groups(self) -> int:
        """Channel groups a block covers (group_split threads share each thread's VC groups)."""
        return self.TC // self.group_split * self.VC

    def validate(self):
        """self, or ValueError naming the first field out of its range."""
        for name in ("TC", "TW", "TH", "PW", "PH", "split_k", "group_split"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DepthwiseConfig: {name} must be an int >= 1, got {value!r} ({self})")
        if self.VC not in VECTOR_WIDTHS:
            raise ValueError(f"DepthwiseConfig: VC must be one of {VECTOR_WIDTHS}, got {self.VC!r} ({self})")
        if self.halo not in (0, 1):
            raise ValueError(f"DepthwiseConfig: halo must be 0 or 1, got {self.halo!r} ({self})")
        if not (isinstance(self.smem_pad, int) and 0 <= self.smem_pad <= MAX_PAD):
            raise ValueError(f"DepthwiseConfig: smem_pad must be 0..{MAX_PAD}, got {self.smem_pad!r} ({self})")
        if self.share_rows not in (0, 1):
            raise ValueError(f"DepthwiseConfig: share_rows must be 0 or 1, got {self.share_rows!r} ({self})")
        if self.share_rows and self.PH < 2:
            raise ValueError(f"DepthwiseConfig: share_rows shares source rows among PH >= 2 output rows ({self})")
        if self.smem_pad and not self.halo:
            raise ValueError(f"DepthwiseConfig: smem_pad pads the shared window, which needs halo=1 ({self})")
        if self.TC % self.group_split:
            raise ValueError(f"DepthwiseConfig: group_split must divide TC, got {self.group_split} ({self})")
        if not 1 <= self.threads <= 1024:
            raise ValueError(f"DepthwiseConfig: {self.threads} threads per block, expected 1..1024 ({self})")
        return self

    def as_dict(self) -> dict:
        """The fields as a dict (a tuned-database entry's "config"); share_rows only where set, as str() shows it, so
        the entries stored before it existed read back as they are."""
        d = asdict(self)
        if not self.share_rows:
            del d["share_rows"]
        return d

    @classmethod
    def from_dict(cls, d) -> DepthwiseConfig:
        """The inverse of as_dict (a tuned-database entry's "config")."""
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"DepthwiseConfig.from_dict: unknown fields {sorted(unknown)} in {d!r}")
        return cls(**d)

    def __str__(self):
        s = f"{PREFIX}_TC{self.TC}_TW{self.TW}_TH{self.TH}_VC{self.VC}_PW{self.PW}_PH{self.PH}"
        if self.halo:
            s += "_HALO"
        if self.smem_pad:
            s += f"_PAD{self.smem_pad}"
        if self.split_k > 1:
            s += f"_SK{self.split_k}"
        if self.group_split > 1:
            s += f"_GS{self.group_split}"
        if self.share_rows:
            s += "_SR"
        return s

    @classmethod
    def parse(cls, text) -> DepthwiseConfig:
        """The inverse of str(): "DW_TC8_TW8_TH2_VC4_PW4_PH2_HALO_SK4_GS2_SR" -> DepthwiseConfig."""
        parts = str(text).split("_")
        if parts[0] != PREFIX:
            raise ValueError(f"DepthwiseConfig.parse: {text!r} does not start with {PREFIX}_")
        names = {"TC": "TC", "TW": "TW", "TH": "TH", "VC": "VC", "PW": "PW", "PH": "PH", "PAD": "smem_pad",
                 "SK": "split_k", "GS": "group_split"}
        kw = {"halo": 0}
        for part in parts[1:]:
            m = re.fullmatch(r"([A-Z]+)(\d+)", part)
            if part == "HALO":
                kw["halo"] = 1
            elif part == "SR" and "share_rows" not in kw:
                kw["share_rows"] = 1
            elif m and m.group(1) in names and names[m.group(1)] not in kw:
                kw[names[m.group(1)]] = int(m.group(2))
            else:
                raise ValueError(f"DepthwiseConfig.parse: cannot read {part!r} of {text!r}")
        return cls(**kw)


def is_depthwise_config(text) -> bool:
    """Does a config string name a DepthwiseConfig (rather than a TileConfig)?"""
    return str(text).startswith(PREFIX + "_")
