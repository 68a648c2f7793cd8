"""Tuneable schedule parameters, as data (the tuner enumerates these; templates only read them)."""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from kernelgen.templates.gemm_compute import check_fp32_tile, check_mma_tile, check_warpgroup
from kernelgen.templates.gemm_layout import check_swizzle
from kernelgen.templates.gemm_pipelines import PIPELINES


@dataclass(frozen=True)
class TileConfig:
    """Block tile BM x BN over the GEMM view, BK-deep reduction steps, TM x TN outputs per thread.

    split_k > 1 splits the reduction over extra blocks that add into a zeroed output with atomics
    (CUDA only: it trades a little atomic traffic for enough blocks when M x N is small, as in
    backward-weight).  smem_pad pads shared rows to break bank conflicts.  states is the Winograd
    state count alpha (0: the variant's choice; other variants ignore it).

    WM x WN > 0 (tensor-core schedules, templates/warp_mma.py): each warp computes a WM x WN
    sub-tile of the block tile with m16n8k8 MMAs; then TM/TN are unused and the block has
    32 * (BM / WM) * (BN / WN) threads.  0 (the default) is the fp32 per-thread register tile, and
    leaves every existing config's string, dict and key unchanged.

    swizzle=1 (tensor-core only): shared tiles stored as rows along k (As[m][k], Bs[n][k]) with the
    16-byte chunks of each row rotated per row group, so each lane reads its fragments of a whole BK
    slice as 64/128-bit vectors (LDS.64/LDS.128) and both the fragment loads and the staging stores are
    free of bank conflicts (templates/warp_mma.py).  Needs smem_pad=0 and BK in (8, 16, 32).
    swizzle=2: as 1, and A's rows g and g + 8 of each 16-row MMA tile interleaved word by word, so a lane's
    A words arrive from LDS.128 already in the MMA's fragment register order (no register moves per MMA;
    warp_mma.interleaved_col).  BK 8 or 16.
    state_groups > 1 (Winograd only): the states of a block tile are split over that many groups of threads,
    each holding TM x TN outputs of states / state_groups states, so a thread's register tile is larger per state
    (fewer shared loads per FMA); the groups add their parts of the outputs in turn in the epilogue.
    min_blocks > 0: CUDA launch bounds (threads, min_blocks): ptxas caps registers so that min_blocks
    blocks fit on an SM.  Both 0 by default and then absent from the string and dict.
    async_copy=1 (tensor-core tiles with swizzle=1, float32 arrays): slices move global -> shared by
    asynchronous copies (ir.AsyncCopy; cp.async on CUDA) with no staging registers, `stages` slices in
    flight (2..4; one barrier per slice), and operands rounded when fragments are loaded instead of when
    staged.  0 by default and then absent from the string and dict.
    wgmma=1 (TF32, sm_90 GPUs): warpgroups of 4 warps instead of warps: each computes a WM x WN sub-tile (WM a
    multiple of 64, WN a multiple of 8 up to 256) with warpgroup MMAs that read both operands from shared
    memory (ir.WarpgroupMma; templates/warpgroup_mma.py), so the block has 128 * (BM / WM) * (BN / WN)
    threads; slices arrive by asynchronous copies (needs async_copy=1, swizzle=0) into the MMA's core-matrix
    layout, where each thread rounds the words its copies landed to TF32 (wgmma would truncate them).  0 by
    default and then absent from string and dict.
    tma=1 (with wgmma=1 instead of async_copy, forward convolutions of channels-last arrays and backward-data,
    strided as KS-deconv's classes; float32 at TF32 with channels a multiple of 32 and BK = 32, or float16 at fp16 with
    channels a multiple of 64 and BK = 64): each slice arrives by two TMA copies that one thread issues
    (ir.TensorCopy: an im2col box of x, a tiled box of w) into the 128-byte swizzled layout, counted on a shared
    mbarrier per stage.
    split_k > 1 needs the slices to split evenly (each split's boxes start at its own first slice).
    0 by default and then absent from string and dict.
    tma=2: as 1, warp-specialised (cuDNN's and CUTLASS's Hopper schedule; ir.Pipeline): one more warp per block
    produces, issuing every copy as soon as the consumers release a stage (a full and an empty mbarrier per
    stage), and the compute threads consume with no block barrier in the k-loop.
    b_mn=1 (fp16 backward-data on TMA; the tuner's tiles wherever C % 8 == 0, PERF_NOTES #49): the B boxes come
    from w as stored (c contiguous) and the wgmma reads B MN-major, so no launch flips w first; BN and WN
    multiples of 64 (one 128-byte box row of c per 64 columns).  0 by default and then absent from string and
    dict.
    a_mn=1 (fp16 / bf16 backward-weight on TMA, with b_mn=1): the wgmma reads A MN-major too.  Backward-weight's
    GEMM reduces over the output pixels, and both of its operands are stored with that axis outermost (dy: k_out
    contiguous, x: c contiguous), so both arrive as boxes of 64 columns x BK rows of the reduction.  0 by default
    and then absent from string and dict.
    col2im=1 (backward-data with few input channels: implicit_gemm.col2im_view): the GEMM runs over dy's pixels,
    t[pixel, (tap, c)] = sum over k of dy[pixel, k] w[k, tap, c], and the epilogue adds each t into the dx element
    that tap reaches (atomically, into a zeroed dx: the col2im of Caffe's deconvolution, fused), so C = 3 makes
    taps x 3 columns of the tile instead of 3 of a BN-wide one.  Not with TMA boxes or split_k.  0 by default and
    then absent from string and dict.
    """
    BM: int = 64
    BN: int = 64
    BK: int = 8
    TM: int = 4
    TN: int = 4
    split_k: int = 1
    smem_pad: int = 0
    stages: int = 1
    WM: int = 0
    WN: int = 0
    states: int = 0
    swizzle: int = 0
    min_blocks: int = 0
    state_groups: int = 1
    async_copy: int = 0
    wgmma: int = 0
    tma: int = 0
    b_mn: int = 0
    a_mn: int = 0
    col2im: int = 0

    @property
    def tensor_core(self):
        return self.WM > 0

    @property
    def producer_threads(self):
        """Threads of the block that only issue copies (tma=2: one warp); the rest compute."""
        return 32 if self.tma == 2 else 0

    @property
    def threads(self):
        if self.tensor_core:
            return (128 if self.wgmma else 32) * (self.BM // self.WM) * (self.BN // self.WN) + self.producer_threads
        return (self.BM // self.TM) * (self.BN // self.TN) * self.state_groups

    @property
    def compute(self):
        """The inner product (templates/gemm_compute.py): "fp32_tile" (per-thread register tiles), "warp_mma"
        (mma.sync) or "warpgroup_mma" (wgmma)."""
        if not self.tensor_core:
            return "fp32_tile"
        return "warpgroup_mma" if self.wgmma else "warp_mma"

    @property
    def pipeline(self):
        """The k-loop (templates/gemm_pipelines.py): "single_stage", "register_double_buffer" (stages=2),
        "cp_async" / "cp_async_wgmma" (async_copy=1, warp / warpgroup MMAs), "tma" or "tma_warp_specialised"
        (tma=1 / 2)."""
        if self.tma:
            return "tma_warp_specialised" if self.tma == 2 else "tma"
        if self.async_copy:
            return "cp_async_wgmma" if self.wgmma else "cp_async"
        return "register_double_buffer" if self.stages > 1 else "single_stage"

    def validate(self):
        """self, or ValueError naming the first rule it breaks.  Each mode's rules sit beside the code that relies
        on them: the tiles' and the warpgroup MMAs' in gemm_compute, the swizzled layouts' in gemm_layout, each
        pipeline's in gemm_pipelines (PIPELINES[self.pipeline].check_config); the order below decides which rule
        a config that breaks several is refused by."""
        (check_mma_tile if self.WM or self.WN else check_fp32_tile)(self)
        if not 1 <= self.threads <= 1024:
            raise ValueError(f"TileConfig: {self.threads} threads per block, expected 1..1024 ({self})")
        check_swizzle(self)
        if self.min_blocks < 0 or self.swizzle not in (0, 1, 2):
            raise ValueError(f"TileConfig: min_blocks must be >= 0 and swizzle 0, 1 or 2, got {self}")
        if self.async_copy not in (0, 1):
            raise ValueError(f"TileConfig: async_copy must be 0 or 1, got {self}")
        if self.wgmma not in (0, 1):
            raise ValueError(f"TileConfig: wgmma must be 0 or 1, got {self}")
        check_warpgroup(self)
        if self.tma not in (0, 1, 2):
            raise ValueError(f"TileConfig: tma must be 0, 1 or 2 (a producer warp), got {self}")
        PIPELINES[self.pipeline].check_config(self)
        if self.state_groups < 1:
            raise ValueError(f"TileConfig: state_groups must be >= 1, got {self.state_groups}")
        if self.split_k < 1:
            raise ValueError(f"TileConfig: split_k must be >= 1, got {self.split_k}")
        if self.col2im not in (0, 1) or self.col2im and (self.tma or self.split_k > 1 or self.state_groups > 1):
            raise ValueError(f"TileConfig: col2im must be 0 or 1, and 1 needs tma=0, split_k=1 and state_groups=1 "
                             f"(its epilogue adds atomically already; its operands have no TMA boxes), got {self}")
        return self

    def as_dict(self):
        d = asdict(self)
        if not self.tensor_core:  # fp32 configs keep the dicts (database entries) they always had
            del d["WM"], d["WN"]
        # newer fields: absent while unused (keys, entries unchanged)
        for k in ("states", "swizzle", "min_blocks", "async_copy", "wgmma", "tma", "b_mn", "a_mn", "col2im"):
            if not d[k]:
                del d[k]
        if d["state_groups"] == 1:
            del d["state_groups"]
        return d

    def __str__(self):
        if self.tensor_core:
            s = f"BM{self.BM}_BN{self.BN}_BK{self.BK}_WM{self.WM}_WN{self.WN}"
        else:
            s = f"BM{self.BM}_BN{self.BN}_BK{self.BK}_TM{self.TM}_TN{self.TN}"
        if self.split_k > 1:
            s += f"_SK{self.split_k}"
        if self.smem_pad:
            s += f"_PAD{self.smem_pad}"
        if self.stages > 1:
            s += f"_S{self.stages}"
        if self.states:
            s += f"_A{self.states}"
        if self.swizzle:
            s += "_SWZ" if self.swizzle == 1 else f"_SWZ{self.swizzle}"
        if self.min_blocks:
            s += f"_MB{self.min_blocks}"
        if self.state_groups > 1:
            s += f"_SG{self.state_groups}"
        if self.async_copy:
            s += "_ASYNC"
        if self.wgmma:
            s += "_WG"
        if self.tma:
            s += "_TMA" if self.tma == 1 else f"_TMA{self.tma}"
        if self.a_mn:
            s += "_AMN"
        if self.b_mn:
            s += "_BMN"
        if self.col2im:
            s += "_C2I"
        return s

    @classmethod
    def parse(cls, text):
        """The inverse of str(): "BM64_BN32_BK8_TM4_TN2_PAD4_S2_A8" -> TileConfig (tuning records name
        their candidates this way)."""
        fields = {"BM": "BM", "BN": "BN", "BK": "BK", "TM": "TM", "TN": "TN", "WM": "WM", "WN": "WN",
                  "SK": "split_k", "PAD": "smem_pad", "S": "stages", "A": "states", "MB": "min_blocks",
                  "SG": "state_groups"}
        kw = {}
        for part in str(text).split("_"):
            m = re.fullmatch(r"([A-Z]+)(\d*)", part)
            if m and m.group(1) == "SWZ":
                kw["swizzle"] = int(m.group(2) or 1)
            elif part == "ASYNC":
                kw["async_copy"] = 1
            elif part == "WG":
                kw["wgmma"] = 1
            elif part == "BMN":
                kw["b_mn"] = 1
            elif part == "AMN":
                kw["a_mn"] = 1
            elif part == "C2I":
                kw["col2im"] = 1
            elif m and m.group(1) == "TMA":
                kw["tma"] = int(m.group(2) or 1)
            elif m and m.group(1) in fields and m.group(2):
                kw[fields[m.group(1)]] = int(m.group(2))
            else:
                raise ValueError(f"TileConfig.parse: cannot read {part!r} of {text!r}")
        return cls(**kw)


# Defaults per target: the GPU wants large register tiles; the CPU wants small code (compile time).
CUDA_DEFAULT = TileConfig(BM=128, BN=64, BK=8, TM=8, TN=4)
CPU_DEFAULT = TileConfig(BM=32, BN=32, BK=8, TM=4, TN=4)
# Small CPU problems (below CPU_SMALL_FLOPS: tests, the demo, a few images) take 2 x 2 register tiles: numba
# compiles their half-as-long kernels 2.5-3x faster (2.5 s against 5.9-7.7 s for a 3x3 forward on a busy 2-core
# machine), and at that size the 1.3-1.7x slower run (measured at 151 MFLOP: 145 against 84 ms) costs less.
CPU_SMALL = TileConfig(BM=16, BN=16, BK=8, TM=2, TN=2)
CPU_SMALL_FLOPS = 5e7
# Tiny ones (below CPU_TINY_FLOPS: a first call that runs in milliseconds) take one output a thread: numba compiles
# the demo's 3x3 forward in 1.1 s against 1.8 s for the 2 x 2 tile (idle 2-core machine), and the 1.8x slower run
# (2.5 against 1.4 ms at 2.4 MFLOP) would take ~600 calls to repay the difference.
CPU_TINY = TileConfig(BM=16, BN=16, BK=8, TM=1, TN=1)
CPU_TINY_FLOPS = 1e7


def cpu_base_tile(flops: float) -> TileConfig:
    """The CPU default tile of a problem of `flops`: the smaller the problem, the shorter the kernel numba compiles."""
    return CPU_TINY if flops < CPU_TINY_FLOPS else CPU_SMALL if flops < CPU_SMALL_FLOPS else CPU_DEFAULT
# Tensor-core (TF32) defaults: 4 warps of 64 x 32 (4 x 4 MMA tiles, 64 accumulators per lane) on the GPU;
# 4 warps of 16 x 8 on the CPU (one MMA tile each: small emulation code).  In the k-major layout
# (swizzle=0, as first shipped) smem_pad 8 makes a row 8 banks apart (mod 32), so the scalar fragment loads
# As[t][g] of the 32 lanes hit 32 distinct banks; the swizzled layout needs no padding.
# swizzle=1: shared rows along k, fragments read as LDS.128 (PERF_NOTES #19); the shared rows need no padding.
CUDA_TC_DEFAULT = TileConfig(BM=128, BN=64, BK=16, WM=64, WN=32, stages=2, swizzle=1)
CPU_TC_DEFAULT = TileConfig(BM=32, BN=16, BK=8, WM=16, WN=8)
# fp16 / bf16 (m16n8k16 MMAs) need BK a multiple of 16; the CUDA default already is
CPU_TC16_DEFAULT = TileConfig(BM=32, BN=16, BK=16, WM=16, WN=8)
