"""Im2col-Winograd (seed §5.3): 1D Winograd F(n, S) along the output width, channels-last.

The variant's interface: which problems it computes (stride 1, dilation 1, filter widths with an
enabled state count), the state-count settings, and its schedules.  The kernel is the block-tiled
schedule of winograd_tiled.py (alpha batched GEMMs over output tiles x output channels, reduced over
filter rows x channels, transforms fused in).  The state count alpha comes from the TileConfig
(`states`) or, when that is 0, from choose_states.  Backward-data reuses the forward kernel on dy
with the 180-degree rotated, channel-transposed filter, read in place (padding S-1-pad).
"""
from __future__ import annotations

from .config import TileConfig
from .winograd_tiled import build_tiled, conv_geometry, shared_bytes
from .winograd_transforms import STATES, supported

NAME = "winograd"
DIRECTIONS = ("fwd", "bwd_data")
ALLOW_16_STATES = False          # 16-state kernels are ~1e-4 relative in fp32: opt in
ENABLED_STATES = {4: True, 8: True, 16: True}



def choose_states(S):
    """Smallest enabled state count giving n >= 2 outputs per tile (largest n is not always best)."""
    for alpha in STATES:
        if alpha == 16 and not ALLOW_16_STATES:
            continue
        if ENABLED_STATES.get(alpha) and supported(alpha, S):
            return alpha
    return None


def settings():
    """The module settings this variant's choices read (part of every prepared call's key)."""
    return ALLOW_16_STATES, tuple(sorted(ENABLED_STATES.items()))


def key_extra(p):
    """What the kernel depends on beyond (problem, config): the state count the settings select."""
    return ("states", choose_states(p.filter_size[2]))


def applies(p):
    if p.direction not in DIRECTIONS or any(s != 1 for s in p.stride) or any(d != 1 for d in p.dilation):
        return False
    return choose_states(p.filter_size[2]) is not None


def enabled(alpha, S):
    """alpha may run for filter width S under the current settings."""
    return bool(ENABLED_STATES.get(alpha)) and (alpha != 16 or ALLOW_16_STATES) and supported(alpha, S)


def states_for(p, cfg):
    """The state count a config selects on a problem (None: nothing enabled fits)."""
    S = p.filter_size[2]
    if cfg.states:
        return cfg.states if enabled(cfg.states, S) else None
    return choose_states(S)


MAX_SHARED = 48 * 1024  # numba's static shared arrays


def config_ok(p, cfg):
    alpha = states_for(p, cfg)
    itemsize = 8 if p.dtype == "float64" else 4
    return (alpha is not None and cfg.split_k == 1 and cfg.stages == 1 and cfg.BM % cfg.TM == 0
            and cfg.BN % cfg.TN == 0 and 1 <= cfg.threads <= 1024
            and shared_bytes(cfg, alpha, itemsize) <= MAX_SHARED)


# CUDA tiles per state count (BM tiles, BN channels, BK, TM, TN): 256 threads, alpha*TM*TN = 64
# accumulators, so a thread stays well under 128 registers (no spills, 2 blocks per SM).
CUDA_TILES = {
    4: [(64, 64, 8, 4, 4), (32, 64, 8, 2, 4), (64, 32, 8, 4, 2), (128, 32, 8, 8, 2), (32, 32, 8, 2, 2)],
    8: [(32, 64, 8, 2, 4), (64, 32, 8, 4, 2), (32, 32, 8, 2, 2), (64, 64, 8, 4, 2), (32, 64, 4, 2, 4)],
    16: [(32, 32, 4, 2, 2), (16, 32, 4, 1, 2), (32, 16, 4, 2, 1), (32, 32, 8, 2, 2)],
}
CPU_TILE = (8, 8, 4, 2, 2)  # small: CPU compile time, and channel counts of tests


def default_config(p, backend):
    """The first listed tile of the auto state count: padded shared rows (the transposed V/U stores
    from channel-fastest threads would otherwise hit one bank 8 ways), narrower when Kout is small."""
    alpha = choose_states(p.filter_size[2])
    if alpha is None:
        raise ValueError(f"winograd: no enabled state count for {p.key()}")
    if backend != "cuda":
        return TileConfig(*CPU_TILE)
    kout = conv_geometry(p)[5]
    tiles = CUDA_TILES[alpha]
    if kout <= 32:
        tiles = [t for t in tiles if t[1] == 32] + tiles
    for t in tiles:
        cfg = TileConfig(*t, smem_pad=4, states=alpha)
        if config_ok(p, cfg):
            return cfg
    raise ValueError(f"winograd: no CUDA tile fits {p.key()}")


def candidate_configs(p):
    """What the tuner tries: every enabled state count for the width x its tiles x shared padding."""
    out = []
    for alpha in STATES:
        if not enabled(alpha, p.filter_size[2]):
            continue
        for t in CUDA_TILES[alpha]:
            for pad in (4, 0):
                cfg = TileConfig(*t, smem_pad=pad, states=alpha)
                if config_ok(p, cfg):
                    out.append(cfg)
    return out


def build(p, cfg: TileConfig, alpha=None):
    alpha = alpha or states_for(p, cfg)
    S = p.filter_size[2]
    if alpha is None or not supported(alpha, S):
        raise ValueError(f"winograd: no enabled state count for filter width {S} (config {cfg}, states "
                         f"{ENABLED_STATES}, ALLOW_16_STATES={ALLOW_16_STATES})")
    k = build_tiled(p, cfg, alpha)
    return k.__class__(k.name, k.params, k.locals, k.body, k.grid, k.threads,
                       {**k.meta, "problem": p.key(), "template": NAME})
