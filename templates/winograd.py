"""Im2col-Winograd (seed §5.3): 1D Winograd F(n, S) along the output width, channels-last.

The variant's interface: which problems it computes (stride 1, dilation 1, filter widths with an
enabled state count), the state-count settings, and its schedules.  The kernel is the block-tiled
schedule of winograd_tiled.py (alpha batched GEMMs over output tiles x output channels, reduced over
filter rows x channels, transforms fused in).  The state count alpha comes from the TileConfig
(`states`) or, when that is 0, from choose_states.  Backward-data reuses the forward kernel on dy
with the 180-degree rotated, channel-transposed filter, read in place (padding S-1-pad).
"""
from __future__ import annotations

from kernelgen import settings
from kernelgen.ir import Kernel
from kernelgen.target import STATIC_SHARED_BYTES, Target, as_target

from .config import TileConfig
from .winograd_tiled import build_tiled, conv_geometry, reduction_error, shared_bytes
from .winograd_transforms import STATES, supported

NAME = "winograd"
DIRECTIONS = ("fwd", "bwd_data")
# Which state counts may run is a setting (kernelgen.settings: winograd_states, and winograd_16_states since
# 16-state kernels are ~1e-4 relative in fp32): settings.scope(winograd_16_states=True), or
# KERNELGEN_WINOGRAD_16=1 for a whole run.


def _enabled_states():
    states = settings.get("winograd_states")
    return states if settings.get("winograd_16_states") else tuple(a for a in states if a != 16)



def choose_states(S):
    """Smallest enabled state count giving n >= 2 outputs per tile (largest n is not always best)."""
    enabled_states = _enabled_states()
    for alpha in STATES:
        if alpha in enabled_states and supported(alpha, S):
            return alpha
    return None


def key_extra(p):
    """What the kernel depends on beyond (problem, config): the state count the settings select."""
    return ("states", choose_states(p.filter_size[2]))


def applies(p):
    if p.direction not in DIRECTIONS or any(s != 1 for s in p.stride) or any(d != 1 for d in p.dilation):
        return False
    return choose_states(p.filter_size[2]) is not None


def enabled(alpha, S):
    """alpha may run for filter width S under the current settings."""
    return alpha in _enabled_states() and supported(alpha, S)


def states_for(p, cfg):
    """The state count a config selects on a problem (None: nothing enabled fits)."""
    S = p.filter_size[2]
    if cfg.states:
        return cfg.states if enabled(cfg.states, S) else None
    return choose_states(S)


def config_ok(p, cfg, target: Target | None = None):
    """Does the tiled schedule build this config, its shared arrays static (numba's), within the target's limits
    (without one, those of every CUDA GPU)?"""
    alpha = states_for(p, cfg)
    itemsize = 8 if p.dtype == "float64" else 4
    max_threads, max_shared = (1024, STATIC_SHARED_BYTES) if target is None else \
        (target.max_threads_per_block, target.static_shared_per_block)
    return (alpha is not None and reduction_error(p, cfg, alpha) is None and cfg.BM % cfg.TM == 0
            and cfg.BN % cfg.TN == 0 and 1 <= cfg.threads <= max_threads
            and shared_bytes(cfg, alpha, itemsize) <= max_shared)


# CUDA tiles per state count (BM tiles, BN channels, BK, TM, TN): 256 threads, alpha*TM*TN = 64
# accumulators (a larger tile's states split over state groups: state_groups_of), so a thread stays
# within 128 registers (no spills, 2 blocks per SM).  Per state and channel step a warp (16 tx x 2 ty)
# reads TM floats of V (2 distinct rows: broadcast) and TN of U (16 distinct): for 8 states 4 x 2 needs
# 2 shared wavefronts per 8 FMAs, 2 x 4 needs 3 - shared bandwidth would bound it - so the 8-state
# default is 64 tiles x 32 channels.
CUDA_TILES = {  # tile: (guessed efficiency relative to the first, resident blocks per SM at 128 registers)
    4: {(64, 64, 8, 4, 4): (1.0, 2), (32, 64, 8, 2, 4): (0.8, 2), (64, 32, 8, 4, 2): (0.85, 2),
        (128, 32, 8, 8, 2): (0.85, 2), (32, 32, 8, 2, 2): (0.6, 4),
        # BK 4 halves the pipeline's staging (EV alpha + EU S values): 64 x 64 then pipelines without
        # spilling (ptxas: 128 registers, 0 B local; BK 8 spills 8 B); a guess until tuned
        (64, 64, 4, 4, 4): (0.95, 2)},
    8: {(64, 32, 8, 4, 2): (1.0, 2), (32, 64, 8, 2, 4): (0.8, 2), (32, 32, 8, 2, 2): (0.65, 4),
        (64, 64, 8, 4, 2): (0.95, 1), (64, 32, 4, 4, 2): (0.9, 2),
        # 4 x 4 per thread in 2 state groups: tuner candidates, not measured yet (guessed below 64 x 32)
        (64, 32, 8, 4, 4): (0.9, 2), (32, 32, 8, 4, 4): (0.7, 4)},
    16: {(32, 32, 4, 2, 2): (1.0, 2), (16, 32, 4, 1, 2): (0.7, 4), (32, 16, 4, 2, 1): (0.7, 4),
         (32, 32, 8, 2, 2): (1.0, 2),
         # 4 x 4 per thread in 4 state groups (LDS.128, 2 wavefronts per 16 FFMA): 1.18-1.26x the 2 x 2
         # tile on the 7x7 and 9x9 layers (H100, tuning/results/2026-11-23_h100_winograd_state_groups.json)
         (32, 32, 8, 4, 4): (1.2, 2)},
}
CPU_TILE = (8, 8, 4, 2, 2)  # small: CPU compile time, and channel counts of tests
# The 2-stage pipeline (stages=2) holds a step's raw gathers (EV alpha + EU S values) across the
# products.  ptxas (sm_90, 128-register cap of 2 blocks/SM) spills 8-208 B with it on most table layers
# with alpha * TM * TN = 64 accumulators, even at BK 4 (9 staged values); 32 accumulators leave room
# (no spills, PERF_NOTES #22).  The default pipelines only those; the tuner tries stages=2 everywhere
# (it rejects kernels with local memory).
PIPELINE_MAX_ACC = 32
# Cost per state count beyond its multiplies (transforms ~ nnz(BT) / (alpha BN), smaller register
# tiles): a guess until the tuner measures it.
STATE_OVERHEAD = {4: 1.0, 8: 1.25, 16: 1.6}
ACCUMULATORS = 64  # per thread, as above


def state_groups_of(alpha, tile):
    """Groups the alpha states of a tile are split over so that a thread keeps ACCUMULATORS (1: no split)."""
    return max(1, alpha * tile[3] * tile[4] // ACCUMULATORS)


def auto_states(S):
    """State counts the CUDA default may pick: the enabled ones, 16 only where nothing else fits
    (~1e-4 relative error; a config can still name it)."""
    states = [a for a in STATES if enabled(a, S)]
    return [a for a in states if a != 16] or states


def grid_blocks(p, alpha, bm, bn):
    """Blocks of a bm x bn tile (output tiles of n = alpha - S + 1 widths x output channels) over the grid."""
    _, _, _, (OD, OH, OW), _, kout, _, _, _ = conv_geometry(p)
    tiles = p.N * OD * OH * -(-OW // (alpha - p.filter_size[2] + 1))
    return -(-tiles // bm) * -(-kout // bn) * p.groups


def model_time(p, alpha, tile, target: Target):
    """Modeled time: blocks per SM x work per block (BM x BN x alpha products per channel step) x
    STATE_OVERHEAD / (efficiency x latency hiding of the blocks resident together).  A small grid
    wants a smaller tile (128 blocks of 64 x 64: one per SM, none to hide latency); the last width
    tile's waste is in M."""
    bm, bn = tile[0], tile[1]
    eff, per_sm = CUDA_TILES[alpha][tile]
    blocks = grid_blocks(p, alpha, bm, bn)
    per_sm_run = -(-blocks // target.sm_count)  # blocks one SM works through (as tile_space.estimated_cost)
    hiding = {1: 0.8, 2: 1.0}.get(min(per_sm_run, per_sm), 1.05)
    return per_sm_run * bm * bn * alpha * STATE_OVERHEAD[alpha] / (eff * hiding)


def default_config(p, target: Target | str):
    """CPU: a small tile, states by choose_states.  CUDA: the (state count, tile) of least
    model_time, shared rows padded (the transposed V/U stores from channel-fastest threads would
    otherwise hit one bank 8 ways), pipelined where preferred_stages says the registers allow.
    target: a Target, or a backend name for the target in effect on it."""
    if choose_states(p.filter_size[2]) is None:
        raise ValueError(f"winograd: no enabled state count for {p.key()}")
    target = as_target(target)
    if target.backend != "cuda":
        return TileConfig(*CPU_TILE)
    cands = candidate_configs(p, target, auto_states(p.filter_size[2]))
    if not cands:
        raise ValueError(f"winograd: no CUDA tile fits {p.key()}")
    return cands[0]


def candidate_configs(p, target: Target | str = "cuda", states=None):
    """What the tuner tries, cheapest under model_time first: every enabled state count for the width
    x its tiles x pipeline stages (the preferred_stages variant of a tile first).  Shared rows are
    always padded: unpadded rows lost on all four layers of the first sweep (0.84-0.92x of padded,
    tuning/results/2026-11-23_h100_winograd_sweep.json)."""
    target, out = as_target(target), []
    for alpha in states or STATES:
        if not enabled(alpha, p.filter_size[2]):
            continue
        for t in CUDA_TILES[alpha]:
            for stages in (1, 2):
                cfg = TileConfig(*t, smem_pad=4, stages=stages, states=alpha,
                                 state_groups=state_groups_of(alpha, t))
                if config_ok(p, cfg, target):
                    out.append(cfg)
                    out += [c for c in split_variants(p, cfg, target) if config_ok(p, c, target)]
    key = lambda c: (model_time(p, c.states, (c.BM, c.BN, c.BK, c.TM, c.TN), target),
                     c.stages != preferred_stages(c), c.split_k)
    return sorted(out, key=key)


def split_variants(p, cfg, target: Target):
    """split_k 2 and 4 of a tile whose grid leaves SMs idle (fewer blocks than fit at once): on the H100 that
    won 5-6 % on the 7x7 layer's 168 blocks and r50_3x3_7 backward-data, and lost 5-25 % on fuller grids
    (atomics into a zeroed y; tuning/results/2026-11-23_h100_winograd_split_k.json), so only the tuner tries it."""
    per_sm = CUDA_TILES[cfg.states][(cfg.BM, cfg.BN, cfg.BK, cfg.TM, cfg.TN)][1]
    if grid_blocks(p, cfg.states, cfg.BM, cfg.BN) >= target.sm_count * per_sm:
        return []
    return [TileConfig(**{**cfg.as_dict(), "split_k": k}) for k in (2, 4)]


def preferred_stages(cfg):
    """2 (pipelined) where the staging registers fit beside the accumulators (PIPELINE_MAX_ACC)."""
    return 2 if cfg.states // cfg.state_groups * cfg.TM * cfg.TN <= PIPELINE_MAX_ACC else 1


def build(p, cfg: TileConfig, alpha=None):
    alpha = alpha or states_for(p, cfg)
    S = p.filter_size[2]
    if alpha is None or not supported(alpha, S):
        raise ValueError(f"winograd: no enabled state count for filter width {S} (config {cfg}, states "
                         f"{_enabled_states()}: kernelgen.settings winograd_states / winograd_16_states)")
    k = build_tiled(p, cfg, alpha)
    return k.__class__(k.name, k.params, k.locals, k.body, k.grid, k.threads,
                       {**k.meta, "problem": p.key(), "template": NAME})


class Winograd:
    """The Variant (templates.variant) of this module: its own schedule space (state counts, tiles sized by
    alpha) and cost model (model_time)."""
    name = NAME
    directions = DIRECTIONS
    precisions = ("fp32",)

    def applies(self, problem, precision="fp32") -> bool:
        return precision == "fp32" and problem.direction in DIRECTIONS and applies(problem)

    def accepts(self, problem, config, precision="fp32") -> bool:
        return precision == "fp32" and config_ok(problem, config)

    def build(self, problem, config, precision="fp32") -> Kernel:
        if precision != "fp32":
            raise ValueError(f"precision: {NAME} computes in fp32, got {precision!r}")
        return build(problem, config)

    def config_space(self, problem, target: Target, precision="fp32", *, keep=None, tiles=None) -> list:
        """candidate_configs, cheapest under model_time first: the first `keep` of them (tiles: the fp32 GEMM
        variants' option, not used here)."""
        return candidate_configs(problem, target)[:keep or None]

    def default_config(self, problem, target: Target, precision="fp32") -> TileConfig:
        return default_config(problem, target)

    def key_extra(self, problem):
        return key_extra(problem)


VARIANT = Winograd()
