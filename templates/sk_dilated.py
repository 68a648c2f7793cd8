"""Sk-dilated: dilated convolution without a zero-filled (dilated) filter.

Honest scope: the core's implicit GEMM (templates/implicit_gemm.py) already reads the filter with
unit step and the input with step `dilation` in all three directions, so it never materialises a
dilated filter.  What this variant adds is the V2 form (templates/conv_v2.py), dilation + filter
trimming, in every direction ConvV2 covers: forward and stride-1 backward-data trim the taps (lo/hi
divide by the dilation), backward-weight trims each tap's output range (its bounds subtract
tap*dilation), so terms whose dilated position lands in the padding (or outside dy) are neither
read nor multiplied.  Where ConvV2 does not apply (nothing to trim, strided backward-data) or its
schedule constraints are not met (config_ok), it builds the core's unit-step view.  It only applies
to problems with some dilation > 1; it is never the automatic choice (it is reached with
algo="sk_dilated" or by the tuner).
"""
from __future__ import annotations

from dataclasses import replace

from . import conv_v2, implicit_gemm
from .config import TileConfig
from .tile_space import TiledGemmVariant
from .tiled_gemm import tiled_gemm

NAME = "sk_dilated"
DIRECTIONS = ("fwd", "bwd_data", "bwd_weight")


def applies(p):
    if not any(d > 1 for d in p.dilation):
        return False
    return implicit_gemm.applies(p)


def config_ok(p, cfg: TileConfig):
    """Every schedule runs (the core view where ConvV2's does not fit) except a 2-stage pipeline on a
    tile that would otherwise run trimmed: trimming is what this variant is for (the untrimmed
    pipelined kernel is implicit_gemm's), and default_config then falls back to one stage."""
    return not (cfg.stages > 1 and conv_v2.applies(p) and conv_v2.config_ok(p, replace(cfg, stages=1)))


def _trimmed(p, cfg):
    return conv_v2.applies(p) and conv_v2.config_ok(p, cfg)


def build(p, cfg: TileConfig):
    if _trimmed(p, cfg):
        view, name = conv_v2.v2_view(p, cfg), f"conv_{p.direction}_sk_v2"
    else:
        view, name = implicit_gemm.VIEWS[p.direction](p, cfg), f"conv_{p.direction}_sk"
    k = tiled_gemm(name, view, cfg)
    return k.__class__(k.name, k.params, k.locals, k.body, k.grid, k.threads,
                       {**k.meta, "problem": p.key(), "template": NAME, "trimmed": _trimmed(p, cfg)})


VARIANT = TiledGemmVariant(NAME, DIRECTIONS, applies, build, config_ok)
