"""Split backward-weight of the direct depthwise template on float16 tensors (issue 28): no 16-bit atomic adds, so
the kernel adds into a float32 workspace the launcher provides zeroed and rounds into the caller's float16 dw
(templates/depthwise_kernels.py WIDE_SUFFIX, runtime/launch.py Launcher.widened).

In the CUDA simulator on tiny shapes against the float64 reference, outputs poisoned first; the planner takes a
float16 config with split_k > 1; the tuner's space offers one.  (bfloat16 is not a storage dtype: bf16 computes
float32 tensors, whose split adds into the float32 dw itself, as test_depthwise.py checks.)
"""
from __future__ import annotations

import types

import numpy as np
import pytest

from kernelgen.planner import make_plan
from kernelgen.render_cuda import render_cuda
from kernelgen.target import as_target
from kernelgen.templates import depthwise
from kernelgen.templates.depthwise_config import DepthwiseConfig
from kernelgen.templates.depthwise_geometry import unmet
from kernelgen.storage import WIDE_SUFFIX
from kernelgen.tuning.compile_pool import compile_launcher
from harness import assert_close, direction_inputs, launch_poisoned, tolerance
from test_depthwise import depthwise_problem, launcher_for

KW = dict(stride=1, padding=1)
X_SHAPE = (2, 6, 5, 8)  # 2 x 6 rows: 12 spatial tiles of a TH=1 x PH=1 block, enough for 4 splits


def split_config(split_k):
    return DepthwiseConfig(TC=2, TW=2, TH=1, VC=4, PW=2, PH=1, halo=1, split_k=split_k)


def float16_problem(m=1):
    return depthwise_problem("bwd_weight", X_SHAPE, m, (3, 3), KW, dtype="float16")


@pytest.mark.sim
@pytest.mark.parametrize("split_k,m", [(2, 1), (4, 2)])
def test_split_float16_backward_weight_matches_float64(split_k, m):
    rng = np.random.default_rng(split_k)
    p = float16_problem(m)
    inputs, want = direction_inputs(p, {**KW, "groups": p.groups}, rng)
    launcher = launcher_for(p, split_config(split_k), "cuda", "fp16")
    assert launcher.widened == ("dw",) and launcher.outputs == ("dw",) and launcher.zero_output
    for _ in range(2):  # the second call reuses the workspace: it must be zeroed again
        got = launch_poisoned(launcher, p, inputs, "cuda")
        assert got.dtype == np.float16
        assert_close(got, want, p.dtype, f"{p.key()} SK{split_k}", tol=tolerance("float16", "fp16"))


def test_split_float16_kernel_adds_into_a_float32_workspace():
    p = float16_problem()
    kernel = depthwise.build(p, split_config(2), "fp16")
    dw = kernel.params[-1]
    assert (dw.name, dw.dtype, dw.role) == ("dw" + WIDE_SUFFIX, "float32", "out")
    assert "cuda.atomic.add(dw" + WIDE_SUFFIX in render_cuda(kernel)
    unsplit = depthwise.build(p, split_config(1), "fp16").params[-1]
    assert (unsplit.name, unsplit.dtype) == ("dw", "float16")


def test_float16_split_config_is_accepted_and_offered():
    p = float16_problem()
    assert not unmet(p, split_config(4))
    plan = make_plan(p, "cuda", algo="depthwise", config=split_config(4), precision="fp16")
    assert plan.config.split_k == 4
    layer = depthwise_problem("bwd_weight", (8, 28, 28, 64), 1, (3, 3), KW, dtype="float16")  # a few channel blocks
    space = depthwise.candidate_configs(layer, as_target("cuda"), "fp16", threads=(256,), windows=((1, 0),))
    assert max(cfg.split_k for cfg in space) > 1


def test_other_directions_still_refuse_a_split():
    for direction in ("fwd", "bwd_data"):
        p = depthwise_problem(direction, X_SHAPE, 1, (3, 3), KW, dtype="float16")
        assert any("split_k=1" in why for why in unmet(p, split_config(2)))
        with pytest.raises(ValueError, match="config"):
            depthwise.build(p, split_config(2), "fp16")


def test_compile_pool_compiles_a_widened_output_as_float32():
    """The tuner's and precompile's workers compile each kernel ahead of its call: a widened output is the
    launcher's float32 workspace, so its parameter must be compiled as float32 where the others are float16."""
    seen = []
    kernel = types.SimpleNamespace(compile=seen.append)
    launcher = types.SimpleNamespace(kernel=kernel, tensor_maps=(), params=("x", "dy", "dw"), widened=("dw",))
    compile_launcher(launcher, "float16")
    (signature,) = seen
    assert [str(a.dtype) for a in signature] == ["float16", "float16", "float32"]
