"""3-D convolutions that are 2-D ones on the same memory (ConvProblem.folded_2d): a filter one deep along depth at
stride 1 without padding folds the depth into the batch; a filter one wide and high, at stride 1 without padding
there, is a 2-D convolution over (D, H x W).  The implicit-GEMM kernels build them as that 2-D convolution
(templates/implicit_gemm.computed), which opens the 2-D paths (TMA boxes) to them; every direction is checked
against the float64 reference of the 3-D problem, outputs poisoned, on fresh random data.  The kernels' batch rows
stay counted in the 3-D problem's images (the launcher's on_images reads them)."""
from __future__ import annotations

import numpy as np
import pytest

from kernelgen.problem import make_problem
from harness import assert_close, run_direction

# (x shape, w shape, conv keywords): depth-folded with stride / padding / dilation in H, W; temporal with them in D
DEPTH = ((2, 3, 7, 6, 16), (24, 1, 3, 3, 16), dict(padding=(0, 1, 1), stride=(1, 2, 1), dilation=(1, 1, 2)))
TEMPORAL = ((2, 5, 3, 4, 16), (24, 3, 1, 1, 16), dict(padding=(1, 0, 0), stride=(2, 1, 1)))


def test_the_2d_forms():
    p = make_problem("fwd", *DEPTH[:2], **DEPTH[2])
    q = p.folded_2d()
    assert (q.N, q.in_size, q.out_size, q.filter_size, q.ndim) == (6, (1, 7, 6), (1, 4, 4), (1, 3, 3), 2)
    assert q.flops == p.flops and q.stride == (1, 2, 1) and q.dilation == (1, 1, 2)
    t = make_problem("bwd_weight", *TEMPORAL[:2], **TEMPORAL[2]).folded_2d()
    assert (t.N, t.in_size, t.out_size, t.filter_size, t.stride, t.padding) == \
        (2, (1, 5, 12), (1, 3, 12), (1, 3, 1), (1, 2, 1), (0, 1, 0))
    for x_shape, w_shape, kw in (((1, 4, 5, 5, 8), (8, 3, 3, 3, 8), {}),                     # deep and wide
                                 ((1, 4, 5, 5, 8), (8, 1, 3, 3, 8), dict(stride=(2, 1, 1))),  # strided depth
                                 ((1, 4, 5, 5, 8), (8, 1, 3, 3, 8), dict(padding=(1, 0, 0)))):  # padded depth
        assert make_problem("fwd", x_shape, w_shape, **kw).folded_2d() is None
    assert make_problem("fwd", (1, 5, 5, 8), (8, 3, 3, 8)).folded_2d() is None  # 2-D already


@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weight"])
@pytest.mark.parametrize("case", [DEPTH, TEMPORAL], ids=["depth", "temporal"])
def test_fp32_implicit_gemm_computes_the_3d_problem(case, direction, rng):
    from kernelgen.templates.config import TileConfig
    x_shape, w_shape, kw = case
    extra = dict(has_bias=True, activation="relu") if direction == "fwd" else {}
    p = make_problem(direction, x_shape, w_shape, **kw, **extra)
    plan, got, want = run_direction(p, kw, "cpu", "implicit_gemm", TileConfig(BM=16, BN=16, BK=8, TM=2, TN=2), rng)
    assert_close(got, want, "float32", f"{direction} {p.key()}")


@pytest.mark.parametrize("direction", ["fwd", pytest.param("bwd_data", marks=pytest.mark.slow),
                                       pytest.param("bwd_weight", marks=pytest.mark.slow)])  # (CI time; the GPU test
# runs all three, test_tma_bwd_weight.py the unfolded 16-bit backward-weight on the CPU)
def test_fp16_tma_on_a_depth_folded_problem(direction, rng):
    """TMA boxes need a 2-D convolution: the folded form gets them (stride 2 backward-data: KS-deconv's classes;
    backward-weight: both operands MN-major)."""
    from kernelgen.api import get_launcher, make_plan
    from kernelgen.storage import poisoned
    from kernelgen.templates import implicit_gemm_tc
    from kernelgen.templates.config import TileConfig
    from harness import reference
    from test_tma_fp16 import close_to_float64
    kw = dict(padding=(0, 1, 1), stride=(1, 2, 2))
    p = make_problem(direction, (2, 2, 9, 8, 64), (64, 1, 3, 3, 64), dtype="float16", **kw)
    assert not implicit_gemm_tc.tma_unmet(p)
    bwd_w = direction == "bwd_weight"
    cfg = TileConfig(BM=64, BN=64, BK=64, WM=64, WN=64, stages=2, wgmma=1, tma=1, a_mn=int(bwd_w),
                     b_mn=int(direction != "fwd"))
    launcher = get_launcher(make_plan(p, "cpu", config=cfg, precision="fp16"))
    x, w, dy = (rng.standard_normal(s).astype(np.float16) for s in (p.x_shape, p.w_shape, p.y_shape))
    inputs = {"fwd": {"x": x, "w": w}, "bwd_data": {"dy": dy, "w": w}, "bwd_weight": {"x": x, "dy": dy}}[direction]
    out = poisoned(int(np.prod(p.output_shape)), np.float16)
    launcher({**{k: v.ravel() for k, v in inputs.items()}, launcher.outputs[0]: out})
    f64 = lambda a: a.astype(np.float64)
    close_to_float64(out.reshape(p.output_shape), reference(direction, f64(x), f64(w), f64(dy), kw))


def test_batch_rows_are_counted_in_the_3d_images():
    """The kernel's BATCH_GRID (Launcher.on_images) counts the 3-D problem's images: each is D of the 2-D form's,
    its rows together."""
    from kernelgen.templates import implicit_gemm
    from kernelgen.templates.config import TileConfig
    p = make_problem("fwd", (4, 3, 8, 8, 16), (16, 1, 3, 3, 16), padding=(0, 1, 1))
    k = implicit_gemm.build(p, TileConfig(BM=32, BN=16, BK=8, TM=2, TN=2))
    assert k.meta["batch_grid"] == (0, 3 * 8 * 8, 32) and k.meta["problem"] == p.key()


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weight"])
@pytest.mark.parametrize("case", [DEPTH, TEMPORAL], ids=["depth", "temporal"])
def test_gpu_folded_3d_through_the_api(case, direction, rng):
    """kernelgen's public ops on CUDA float16 arrays of a 3-D convolution with a 2-D form, as planned (the TMA
    tiles on sm_90), against float64; a second call on a smaller batch borrows nothing it should not."""
    from numba import cuda

    import kernelgen
    from harness import reference
    from test_tma_fp16 import close_to_float64
    x_shape, w_shape, kw = case
    for n in (x_shape[0], 1):
        shape = (n,) + x_shape[1:]
        p = make_problem(direction, shape, w_shape, dtype="float16", **kw)
        x, w, dy = (rng.standard_normal(s).astype(np.float16) for s in (p.x_shape, p.w_shape, p.y_shape))
        d = {k: cuda.to_device(v) for k, v in (("x", x), ("w", w), ("dy", dy))}
        if direction == "fwd":
            got = kernelgen.conv(d["x"], d["w"], backend="cuda", precision="fp16", **kw)
        elif direction == "bwd_data":
            got = kernelgen.conv_backward_data(d["dy"], d["w"], shape, backend="cuda", precision="fp16", **kw)
        else:
            got = kernelgen.conv_backward_weight(d["x"], d["dy"], w_shape, backend="cuda", precision="fp16", **kw)
        f64 = lambda a: a.astype(np.float64)
        close_to_float64(got.copy_to_host(), reference(direction, f64(x), f64(w), f64(dy), kw))
