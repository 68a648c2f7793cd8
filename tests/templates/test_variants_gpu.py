"""Every variant, forced with algo=, in every direction it computes, on a real GPU.

The same float64-reference check as the CPU and simulator tests of each variant (outputs poisoned
with NaN before the launch), on shapes large enough for several blocks per dimension and with the
CUDA defaults the automatic choice would use (pipelined schedules, padded shared rows).  A
(variant, direction, case) the variant does not compute is skipped, so adding a case never asks a
variant for something it cannot do.
"""
from __future__ import annotations

import pytest

from kernelgen.problem import make_problem
from kernelgen.templates import VARIANTS

pytestmark = pytest.mark.gpu

CASES = {  # x shape, w shape, conv arguments
    "2d_pad1": ((16, 14, 14, 64), (64, 3, 3, 64), dict(padding=1)),
    "2d_small_map": ((32, 4, 4, 128), (96, 3, 3, 128), dict(padding=1)),
    "2d_stride2": ((8, 17, 15, 32), (48, 3, 3, 32), dict(stride=2, padding=1)),
    "2d_5x5_stride2": ((8, 16, 16, 16), (24, 5, 5, 16), dict(stride=2, padding=2)),
    "2d_dilated": ((8, 20, 18, 32), (40, 3, 3, 32), dict(padding=2, dilation=2)),
    "1d_5tap": ((16, 67, 24), (40, 5, 24), dict(padding=2)),
    "3d": ((4, 6, 9, 9, 16), (24, 3, 3, 3, 16), dict(padding=1)),
}

def _check(variant, direction, case, rng, assert_close, run_direction):
    x_shape, w_shape, kw = CASES[case]
    p = make_problem(direction, x_shape, w_shape, **kw)
    module = VARIANTS[variant]
    if not module.applies(p, "fp32"):
        pytest.skip(f"{variant} does not compute {p.key()}")
    plan, got, want = run_direction(p, kw, "cuda", algo=variant, rng=rng)
    assert plan.variant == variant
    # float32 with FMA contraction and split-K atomics; Winograd's transforms add a few roundings
    tol = 1e-4 if variant == "winograd" else 2e-5
    assert_close(got, want, "float32", f"{variant} {direction} {case}", tol=tol)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weight"])
@pytest.mark.parametrize("variant", sorted(set(VARIANTS) - {"implicit_gemm"}))  # the core: test_conv_gpu.py
def test_variant_on_gpu(variant, direction, case, rng, assert_close, run_direction):
    _check(variant, direction, case, rng, assert_close, run_direction)


@pytest.mark.parametrize("case", ["2d_stride2", "2d_5x5_stride2"])
def test_ks_deconv_v2_on_gpu(case, rng, assert_close, run_direction, set_setting):
    """KS-deconv-V2 (filter trimming per sub-convolution) is opt-in: switched on here."""
    set_setting(ks_deconv_trim=True)
    _check("ks_deconv", "bwd_data", case, rng, assert_close, run_direction)
