"""Launcher.on_images: the kernel of a larger batch, launched on fewer blocks, computes the convolution of fewer
images (templates.tiled_gemm.batch_grid; runtime.batch_fallback runs a new, smaller batch so, issue 27).

Each case builds the kernel of a batch of 4, launches it on the blocks that cover the first n images of fresh
data - zero-extended to the images those blocks read where n images do not fill whole blocks - into a poisoned
output, and checks the first n images (or the weight gradient) against float64.  Where n fills whole blocks, the
output holds exactly n images: a block past them would write out of bounds, which the simulator refuses."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kernelgen.api import get_launcher, make_plan
from kernelgen.problem import make_problem
from kernelgen.runtime.batch_fallback import BATCHED
from kernelgen.runtime.launch import Launcher
from kernelgen.tuning.database import parse_config
from harness import assert_close, direction_inputs, launch_poisoned

S1, S2 = dict(stride=1, padding=1), dict(stride=2, padding=1)
# direction, the larger batch's x shape, w shape, conv arguments, algo, config (None: the planner's), n, whole blocks
CASES = {
    "fwd whole blocks": ("fwd", (4, 8, 8, 8), (4, 3, 3, 8), S1, "implicit_gemm", "BM32_BN64_BK8_TM4_TN4", 3, True),
    "fwd padded": ("fwd", (4, 5, 5, 8), (4, 3, 3, 8), S1, "implicit_gemm", "BM32_BN64_BK8_TM4_TN4", 2, False),
    "bwd_data whole blocks": ("bwd_data", (4, 8, 8, 8), (4, 3, 3, 8), S1, "implicit_gemm", "BM64_BN32_BK8_TM4_TN4",
                              2, True),
    "bwd_data KS-deconv": ("bwd_data", (4, 8, 8, 8), (4, 3, 3, 8), S2, "ks_deconv", "BM16_BN32_BK8_TM2_TN4", 2, True),
    "bwd_weight split-K whole": ("bwd_weight", (4, 8, 8, 8), (4, 3, 3, 8), S1, "implicit_gemm",
                                 "BM32_BN64_BK8_TM4_TN4_SK4", 2, True),
    "bwd_weight split-K padded": ("bwd_weight", (4, 5, 5, 8), (4, 3, 3, 8), S1, "implicit_gemm",
                                  "BM32_BN64_BK8_TM4_TN4_SK4", 2, False),
    "fwd Winograd": ("fwd", (4, 8, 8, 8), (4, 3, 3, 8), S1, "winograd", None, 2, True),
    "bwd_data Winograd": ("bwd_data", (4, 7, 7, 8), (4, 3, 3, 8), S1, "winograd", None, 1, False),
}


@pytest.mark.sim
@pytest.mark.parametrize("case", CASES.values(), ids=list(CASES))
def test_fewer_blocks_compute_fewer_images(case, rng):
    direction, x_shape, w_shape, kw, algo, config, n, whole = case
    big = make_problem(direction, x_shape, w_shape, **kw)
    launcher = get_launcher(make_plan(big, "cuda", algo, config and parse_config(config)))
    assert launcher.batch_grid, f"{algo} {direction} does not say its blocks are image-major"
    fewer, images = launcher.on_images(n)
    axis = launcher.batch_grid[0]
    assert fewer.grid[axis] < launcher.grid[axis] and fewer.kernel is launcher.kernel
    assert (images == n) == whole and n <= images <= big.N
    inputs, want = direction_inputs(dataclasses.replace(big, N=n), kw, rng)
    extended = {name: np.concatenate([a, np.zeros((images - n,) + a.shape[1:], a.dtype)])
                if name in BATCHED[direction] else a for name, a in inputs.items()}
    got = launch_poisoned(fewer, dataclasses.replace(big, N=images), extended, "cuda")
    assert_close(got if direction == "bwd_weight" else got[:n], want)


def test_a_kernel_says_how_few_blocks_cover_how_many_images():
    """The arithmetic alone: 64 rows an image, 32 a block, 8 blocks (4 images); 25 items an image, 32 a block, 4
    blocks (4 images)."""
    rows64 = Launcher(None, (), (), (8, 2, 1), 128, False, "cuda", batch_grid=(0, 64, 32))
    fewer, images = rows64.on_images(3)
    assert (fewer.grid, images, fewer.batch_grid) == ((6, 2, 1), 3, (0, 64, 32))
    assert rows64.on_images(3)[0] is fewer  # one launcher per image count
    assert rows64.on_images(4) is None  # every block: nothing fewer
    rows25 = Launcher(None, (), (), (1, 1, 4), 128, False, "cuda", batch_grid=(2, 25, 32))
    # 1 image: 1 block, which reads 32 items (2 images); 3 images: 3 blocks, 96 items (4 images, zero-extended)
    assert [(f.grid, m) for f, m in map(rows25.on_images, (1, 2, 3))] == [((1, 1, 1), 2), ((1, 1, 2), 3),
                                                                          ((1, 1, 3), 4)]
    assert Launcher(None, (), (), (8, 1, 1), 128, False, "cuda").on_images(1) is None  # no BATCH_GRID


def test_the_launcher_on_fewer_images_shares_none_of_the_larger_one_s_state():
    """Its grid differs, so every per-launcher cache (configured kernels, copies, the prepacked launch, its lock, its
    own on_images answers) is its own, each field named with a leading underscore, a new one included.  (Tensor maps
    are per stream, not per launcher: runtime/map_ring.py.)"""
    from dataclasses import fields
    big = Launcher(None, (), (), (8, 2, 1), 128, False, "cuda", batch_grid=(0, 64, 32))
    big._configured["s"] = big._rounded["m"] = object()
    fewer, _ = big.on_images(3)
    state = [f.name for f in fields(Launcher) if f.name.startswith("_")]
    assert {"_configured", "_fast", "_general_path", "_fewer"} <= set(state)
    for name in state:
        mine, theirs = getattr(fewer, name), getattr(big, name)
        assert mine is None or mine is not theirs, name
    assert fewer._configured == {} and fewer._rounded == {}
