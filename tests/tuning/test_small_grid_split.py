"""A forward / backward-data plan whose grid fills under half the GPU's SMs, and that no tune measured, splits its
reduction (fp32: planner._split_small_grid; 16-bit, into a float32 workspace: planner._split_small_half_grid); the
split kernels add into the zeroed output (simulator, float64)."""
from __future__ import annotations

import numpy as np
import pytest

from kernelgen import planner
from kernelgen.api import get_launcher, make_plan
from kernelgen.problem import make_problem
from kernelgen.templates.config import TileConfig
from kernelgen.tuning import shapes
from harness import assert_close, direction_inputs, launch_poisoned


def _layer(name):
    return next(layer for layer in shapes.load_table("unseen")[1] if layer.name == name)


def test_a_batch_one_transposed_layer_splits(on_h100):
    up4 = _layer("pix2pix_unet256_up4").problem("fwd")  # its conv's backward-data: 64 blocks of the classes
    plan = planner.make_plan(up4, "cuda")
    assert plan.variant == "ks_deconv" and plan.config.split_k == 8 and "split 8 ways" in plan.reason
    assert plan.decided_by == "model"


def test_full_grids_tuned_entries_activations_and_the_cpu_do_not(on_h100):
    r18 = next(layer for layer in shapes.load_table("resnet18_cifar")[1] if layer.name == "l1_3x3")
    assert planner.make_plan(r18.problem("fwd"), "cuda").config.split_k == 1  # tuned, and a full grid
    wide = make_problem("bwd_data", (32, 28, 28, 128), (128, 3, 3, 128), padding=1)
    assert planner.make_plan(wide, "cuda").config.split_k == 1
    small = make_problem("fwd", (1, 7, 7, 1152), (320, 1, 1, 1152), activation="relu")
    assert planner.make_plan(small, "cuda").config.split_k == 1  # (a split output takes no activation)
    assert planner.make_plan(small.with_direction("fwd"), "cuda").config.split_k > 1
    assert planner.make_plan(small, "cpu").config.split_k == 1


def test_a_16_bit_small_grid_splits_into_its_workspace(on_h100):
    """c3d's conv5a (784 output pixels, 512 filters, 13824-long reduction) at fp16: the model ranks only unsplit
    configs (perf_model_predict.unfitted), then its TMA tile's grid of under half the SMs splits by a divisor of the
    slices, one block a SM at most; a strided backward-data, a full grid and an activation do not split."""
    from kernelgen.tuning import perf_model_predict
    conv5a = _layer("c3d_conv5a").problem("fwd", "float16")
    plan = planner.make_plan(conv5a, "cuda", precision="fp16")
    cfg = plan.config
    blocks = -(-784 // cfg.BM) * -(-512 // cfg.BN)
    assert cfg.tma and cfg.split_k > 1 and blocks * cfg.split_k <= 132 and (13824 // 64) % cfg.split_k == 0
    assert plan.decided_by == "model" and "into a float32 workspace" in plan.reason
    assert perf_model_predict.unfitted(conv5a, cfg) and not perf_model_predict.unfitted(conv5a.with_direction(
        "bwd_weight"), cfg)
    strided = make_problem("bwd_data", (1, 14, 14, 512), (512, 3, 3, 512), padding=1, stride=2, dtype="float16")
    full = make_problem("fwd", (32, 28, 28, 128), (128, 3, 3, 128), padding=1, dtype="float16")
    relu = make_problem("fwd", (8, 2, 7, 7, 512), (512, 3, 3, 3, 512), padding=1, dtype="float16", activation="relu")
    for p in (strided, full, relu):
        assert planner.make_plan(p, "cuda", precision="fp16").config.split_k == 1, p.key()


@pytest.mark.sim
@pytest.mark.parametrize("variant, direction, kw", [("ks_deconv", "bwd_data", dict(stride=2, padding=1)),
                                                    ("implicit_gemm", "fwd", dict(padding=1)),
                                                    ("implicit_gemm", "bwd_data", dict(stride=2, padding=1))])
def test_split_forward_and_backward_data_kernels(variant, direction, kw, rng):
    p = make_problem(direction, (1, 6, 5, 4), (6, 3, 3, 4), **kw)
    inputs, want = direction_inputs(p, kw, rng)
    plan = make_plan(p, "cuda", variant, TileConfig(BM=16, BN=8, BK=4, TM=2, TN=2, split_k=3))
    got = launch_poisoned(get_launcher(plan), p, inputs, "cuda")
    assert not np.isnan(got).any()
    assert_close(got, want, "float32", f"{variant} {direction} split 3")
