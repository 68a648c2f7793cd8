"""Where the direct depthwise kernel's threads read and write: the geometry templates/depthwise_ir.py builds from.

Forward, backward-data and backward-weight are one gather: an output position reads, per filter tap, one source
position of each spatial dim.

    forward, backward-weight (x side)   source = output * stride - pad + tap * dil          (the window of x)
    backward-data                       source = (output + pad - tap * dil) / stride  where that divides

Backward-data is the forward scheme on the flipped filter: its output (dx) positions fall into `stride` residue
classes per dim, and a class meets a fixed set of taps, an arithmetic progression (KS-deconv's sub-filters).  A
thread's register strip takes positions of one class, `stride` apart, so every tap it gathers is a real one and its
source positions are consecutive.  An `Axis` (H or W) holds that: per class a `TapRun` (the taps, the source offset
of each), and the block's window of source positions.  Depth has no strips: each block is one output plane and its
T tap planes (the window's first dim) are computed at run time, validity included.

Channels come in groups: depthwise's group is one input channel and its m = K / C filters; a narrow group (C /
groups = Cg in 2..8) is Cg input channels and their Kg = K / groups filters, every output channel of the group
summing over all Cg.  The geometry is the same with Cg = 1 the depthwise case: a gather's source has
`src_per_group` channels a group (forward x: Cg, backward-data dy: Kg), its output `out_per_group` (y: Kg, dx: Cg),
and a thread holds taps x (its share of the outputs) x src_per_group filter words for each of its groups.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from kernelgen.problem import ConvProblem
from kernelgen.storage import HALF_DTYPES
from kernelgen.target import MAX_REGISTERS_PER_THREAD, STATIC_SHARED_BYTES
from kernelgen.templates.depthwise_config import DepthwiseConfig

# copy chunks a thread stages per unrolled batch of the window copy (its staging registers: at most 32)
STAGE_REGISTERS = 32
REGISTER_OVERHEAD = 32  # addresses, coordinates, loop state: a guess beside the counted arrays
MAX_GRID_Y = 65535  # CUDA's limit on a grid's y: the channel blocks of a gather, the splits of backward-weight
# the most filter taps x multiplier a thread holds (at VC = 1): 3x3 up to m = 14, 5x5 m = 5, 7x7 m = 2, 3x3x3 m = 4;
# a narrow group's thread holds at most this many filter words in all (taps x outputs x sources x VC)
MAX_FILTER_WORDS = 128
MAX_NARROW = 8  # the most input channels (and filters) of a narrow group: beyond it a group's GEMM is not tiny
NARROW_DIRECTIONS = ("fwd", "bwd_data", "bwd_weight")


def cdiv(a, b):
    return -(-a // b)


class _once:
    """A derived attribute of a frozen dataclass, computed on first use and kept in the instance's __dict__
    (functools.cached_property without Python 3.11's per-access lock: the tuner's space reads thousands)."""

    def __init__(self, fn):
        self.fn, self.name, self.__doc__ = fn, fn.__name__, fn.__doc__

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.fn(obj)
        return value


@dataclass(frozen=True)
class TapRun:
    """The taps of one filter dim that meet one output class: tap first + k * tap_step for k < count, read at source
    offset off0 + k * doff (doff >= 0: ascending) from the strip position's source origin."""
    first: int
    tap_step: int
    count: int
    off0: int
    doff: int

    def tap(self, k):
        return self.first + k * self.tap_step

    @property
    def last_off(self):
        return self.off0 + (self.count - 1) * self.doff


def forward_run(filt, pad, dil) -> TapRun:
    return TapRun(0, 1, filt, -pad, dil)


def class_run(rho, filt, stride, pad, dil) -> TapRun:
    """Backward-data's class rho: dx positions i = i0 + rho + stride * q (i0 a multiple of stride) read dy position
    i0 / stride + q + (rho + pad - tap * dil) / stride for the taps where that divides."""
    taps = sorted((t for t in range(filt) if (rho + pad - t * dil) % stride == 0), reverse=True)
    if not taps:
        return TapRun(0, 0, 0, 0, 0)
    offs = [(rho + pad - t * dil) // stride for t in taps]
    if len(taps) == 1:
        return TapRun(taps[0], 0, 1, offs[0], 0)
    return TapRun(taps[0], taps[1] - taps[0], len(taps), offs[0], offs[1] - offs[0])


@dataclass(frozen=True)
class Axis:
    """One of H, W: a block covers `per_block` strip positions of each class; class rho's strip position q is output
    position start + rho + classes * q and reads source start * ratio + q * step + (its run's offsets)."""
    out_size: int
    src_size: int
    step: int
    runs: tuple
    per_block: int
    ratio: tuple  # (num, den): a block's source origin = its first output position * num // den

    @property
    def classes(self):
        return len(self.runs)

    @_once
    def lo(self):
        return min([r.off0 for r in self.runs if r.count] or [0])

    @_once
    def hi(self):
        return max([r.last_off for r in self.runs if r.count] or [0])

    @_once
    def block_out(self):
        return self.per_block * self.classes

    @_once
    def tiles(self):
        return cdiv(self.out_size, self.block_out)

    @_once
    def halo(self):
        """Source positions of a block's window."""
        return (self.per_block - 1) * self.step + self.hi - self.lo + 1

    @_once
    def src_per_tile(self):
        """Source positions between the windows of neighbouring blocks."""
        num, den = self.ratio
        return self.block_out * num // den

    def src_origin(self, tile):
        """The source position of window position 0 of block `tile` (an Expr)."""
        return tile * self.src_per_tile + self.lo

    def segment(self, run: TapRun, strip):
        """(g, length): a strip of `strip` positions reads the source positions u * g, u < length, from its first
        one (the offsets p * step + k * doff share the divisor g)."""
        g = math.gcd(self.step, run.doff) if run.doff else self.step
        return g, ((strip - 1) * self.step + (run.count - 1) * run.doff) // g + 1

    @property
    def below(self):
        """Can a window position fall before the source (padding)?"""
        return self.lo < 0

    @property
    def beyond(self):
        """Can a window position fall past the source (padding, or a ragged last block)?"""
        return (self.tiles - 1) * self.src_per_tile + self.lo + self.halo > self.src_size

    @property
    def ragged(self):
        """Can a block's output position fall past the output?"""
        return self.tiles * self.block_out > self.out_size


@dataclass(frozen=True)
class Geometry:
    """A problem under a config: the gather's axes and the block's shapes.  `gather` is "fwd" (x's window: forward
    and backward-weight) or "bwd_data" (dy's)."""
    problem: ConvProblem
    cfg: DepthwiseConfig
    gather: str
    h: Axis
    w: Axis
    out_depth: int
    src_depth: int

    @property
    def m(self):
        return self.problem.K // self.problem.C

    @property
    def narrow(self):
        """Narrow groups (Cg > 1) rather than depthwise?"""
        return self.problem.Cg > 1

    @property
    def groups(self):
        return self.problem.groups

    @property
    def out_per_thread(self):
        """Accumulated channels of each of a thread's groups per pixel: its share of out_per_group."""
        return self.out_per_group // self.cfg.group_split

    @property
    def filter_words(self):
        """Filter registers of a thread: taps x VC groups x its outputs of each x the group's sources (depthwise:
        taps x VC x m)."""
        return self.taps * self.cfg.VC * self.out_per_thread * self.src_per_group

    @property
    def taps(self):
        return math.prod(self.problem.filter_size)

    @property
    def src_per_group(self):
        """Source channels of a channel group: x has Cg (depthwise 1), dy Kg (depthwise m)."""
        return self.problem.Kg if self.gather == "bwd_data" else self.problem.Cg

    @property
    def out_per_group(self):
        """Accumulated channels of a group per pixel: y has Kg (depthwise m), dx Cg (depthwise 1)."""
        return self.problem.Cg if self.gather == "bwd_data" else self.problem.Kg

    @property
    def src_channels(self):
        return self.problem.groups * self.src_per_group

    @property
    def window_channels(self):
        """Channels of a pixel of the shared window, padding included."""
        return self.cfg.block_groups * self.src_per_group + self.cfg.smem_pad

    @_once
    def window_shape(self):
        return (self.problem.filter_size[0], self.h.halo, self.w.halo, self.window_channels)

    @_once
    def spatial_tiles(self):
        return self.problem.N * self.out_depth * self.h.tiles * self.w.tiles

    @_once
    def channel_blocks(self):
        return cdiv(self.problem.groups, self.cfg.block_groups)

    @_once
    def copy_vector(self):
        """Source channels per load of the window copy: 4 (one 16-byte load) where they stay in one tensor row."""
        return 4 if self.src_channels % 4 == 0 and self.cfg.block_groups * self.src_per_group % 4 == 0 else 1

    @_once
    def copy_chunks(self):
        t, hh, ww, _ = self.window_shape
        return t * hh * ww * (self.cfg.block_groups * self.src_per_group // self.copy_vector)

    @property
    def dy_words(self):
        """Backward-weight's dy values of a strip pixel: the thread's outputs of each of its VC groups."""
        return self.cfg.VC * self.out_per_thread

    @property
    def reduction_row(self):
        """Words per thread of backward-weight's shared reduction, its dw accumulators (filter_words), odd: a
        thread's row starts in its own bank."""
        n = self.filter_words
        return n + 1 - n % 2

    @_once
    def shared_words(self):
        words = math.prod(self.window_shape) if self.cfg.halo else 0
        if self.problem.direction == "bwd_weight":
            words += self.cfg.threads * self.reduction_row
        return words

    @_once
    def registers(self):
        """Per thread: the counted arrays (filter or dw accumulators, strip accumulators or dy values, the source
        segment, the copy's staging) plus REGISTER_OVERHEAD."""
        cfg = self.cfg
        seg = max(self.w.segment(run, cfg.PW)[1] for run in self.w.runs) * cfg.VC * self.src_per_group
        stage = min(STAGE_REGISTERS, cdiv(self.copy_chunks, cfg.threads) * self.copy_vector) if cfg.halo else 0
        strip = cfg.PW * cfg.VC * self.out_per_thread  # (the strip's accumulators; backward-weight's dy values)
        strip *= cfg.PH if cfg.share_rows else 1  # (the PH rows' strips all live at once)
        return self.filter_words + strip + seg + stage + REGISTER_OVERHEAD


@functools.lru_cache(maxsize=4096)
def _axis(gather, out_size, src_size, filt, stride, pad, dil, per_block):
    if gather == "bwd_data":
        runs = tuple(class_run(rho, filt, stride, pad, dil) for rho in range(stride))
        return Axis(out_size, src_size, 1, runs, per_block, (1, stride))
    return Axis(out_size, src_size, stride, (forward_run(filt, pad, dil),), per_block, (stride, 1))


def geometry(p: ConvProblem, cfg: DepthwiseConfig) -> Geometry:
    gather = "bwd_data" if p.direction == "bwd_data" else "fwd"
    (_, H, W), (_, OH, OW) = p.in_size, p.out_size
    out_h, src_h, out_w, src_w = (H, OH, W, OW) if gather == "bwd_data" else (OH, H, OW, W)
    h = _axis(gather, out_h, src_h, p.filter_size[1], p.stride[1], p.padding[1], p.dilation[1], cfg.TH * cfg.PH)
    w = _axis(gather, out_w, src_w, p.filter_size[2], p.stride[2], p.padding[2], p.dilation[2], cfg.TW * cfg.PW)
    out_d, src_d = (p.in_size[0], p.out_size[0]) if gather == "bwd_data" else (p.out_size[0], p.in_size[0])
    return Geometry(p, cfg, gather, h, w, out_d, src_d)


def unmet(p: ConvProblem, cfg: DepthwiseConfig, g: Geometry | None = None) -> list[str]:
    """Why this config cannot build this problem (an empty list: it builds).  g: its geometry, where the caller has
    it (the candidate search builds thousands)."""
    try:
        cfg.validate()
    except ValueError as e:
        return [str(e)]
    why = narrow_unmet(p, cfg) if p.Cg > 1 else []
    if p.Cg == 1 and cfg.group_split > 1:
        why.append(f"group_split=1 for depthwise (groups = C), got {cfg.group_split}")
    if cfg.VC == 8 and p.dtype not in HALF_DTYPES:
        why.append("VC=8 (16 bytes of 16-bit elements) for float16 and bfloat16 tensors only")
    if cfg.share_rows and p.direction == "bwd_weight":
        why.append("share_rows=0 for backward-weight (its strips reduce into dw, not into output rows)")
    if cfg.split_k > 1 and p.direction != "bwd_weight":
        why.append(f"split_k=1 outside backward-weight, got {cfg.split_k}")
    g = g or geometry(p, cfg)
    if cfg.split_k > max_split(g):
        why.append(f"split_k <= the {g.spatial_tiles} spatial tiles and {MAX_GRID_Y}, got {cfg.split_k}")
    if g.channel_blocks > MAX_GRID_Y:
        why.append(f"at most {MAX_GRID_Y} channel blocks (the grid's y), got {g.channel_blocks}")
    return why


def max_split(g: Geometry) -> int:
    """The most split_k shares a block shape's backward-weight can take: one spatial tile each, within the grid's y."""
    return max(1, min(g.spatial_tiles, MAX_GRID_Y))


def narrow_problem_unmet(p: ConvProblem) -> list[str]:
    """Why the direct template cannot compute this narrow-group problem (Cg > 1) with any config."""
    if p.direction not in NARROW_DIRECTIONS:
        return [f"narrow groups in {'/'.join(NARROW_DIRECTIONS)} only, got {p.direction}"]
    if p.Cg > MAX_NARROW or p.Kg > MAX_NARROW:
        return [f"at most {MAX_NARROW} channels and filters a group, got {p.Cg} and {p.Kg}"]
    # a thread's least filter: one output of its group (group_split = all of them), all of the group's sources
    least = math.prod(p.filter_size) * (p.Kg if p.direction == "bwd_data" else p.Cg)
    if least > MAX_FILTER_WORDS:
        return [f"taps x a group's sources <= {MAX_FILTER_WORDS} filter words a thread, got {least}"]
    return []


def narrow_unmet(p: ConvProblem, cfg: DepthwiseConfig) -> list[str]:
    why = narrow_problem_unmet(p)
    if why:
        return why
    out_per_group = p.Cg if p.direction == "bwd_data" else p.Kg
    if out_per_group % cfg.group_split:
        return [f"group_split dividing a group's {out_per_group} outputs, got {cfg.group_split}"]
    words = geometry(p, cfg).filter_words
    if words > MAX_FILTER_WORDS:
        why.append(f"at most {MAX_FILTER_WORDS} filter words a thread (taps x VC x outputs x sources), got {words}")
    return why


def over_limits(g: Geometry, itemsize=4, max_shared=STATIC_SHARED_BYTES, max_registers=MAX_REGISTERS_PER_THREAD,
                max_threads=1024) -> list[str]:
    """What of a block's resources exceeds a GPU's limits (itemsize: bytes of a shared word, 8 at float64)."""
    why = []
    if g.cfg.threads > max_threads:
        why.append(f"at most {max_threads} threads per block, got {g.cfg.threads}")
    if g.shared_words * itemsize > max_shared:
        why.append(f"at most {max_shared} bytes of shared memory, got {g.shared_words * itemsize}")
    if g.registers > max_registers:
        why.append(f"at most {max_registers} registers per thread, estimated {g.registers}")
    return why
