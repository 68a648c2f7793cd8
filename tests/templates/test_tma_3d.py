"""3-D convolutions on TMA: x (or dy) as a 5-D im2col map (C, W, H, D, N) whose copies walk w, h, d, then n and read
each pixel at a filter tap's (dw, dh, dd) offsets (implicit_gemm_tma.im2col_map, im2col_box).  The 3-D problems that
have a 2-D form take that instead (tests/templates/test_folded_3d.py); these are the ones with a filter deep and wide.

On the CPU backend the copies are kernelgen.cpu_tma.tma_im2col_5d's and the MMAs are emulated; the GPU tests run the
same kernels through the API on an sm_90 GPU.  Every case: fresh random data, a poisoned output, the float64
reference.
"""
from __future__ import annotations

import numpy as np
import pytest

from harness import poisoned, random_array

# (direction, x shape, w shape, conv keywords, tile): images of uneven depth, height and width, so one box's pixels
# cross rows, slices and images; padding in every dim; a strided and dilated depth
CPU_CASES = [("fwd", (2, 3, 5, 4, 64), (24, 3, 3, 3, 64), dict(padding=1), dict(BM=64, BN=24, WN=24, stages=2)),
             ("fwd", (1, 5, 6, 5, 64), (16, 3, 1, 3, 64), dict(padding=(2, 0, 1), stride=(2, 1, 2), dilation=(2, 1, 1)),
              dict(BM=64, BN=16, WN=16, stages=3, tma=2)),
             ("bwd_data", (2, 3, 4, 5, 24), (64, 3, 3, 3, 24), dict(padding=1), dict(BM=64, BN=24, WN=24, stages=2)),
             # both operands MN-major: dy's tiled box, x's 5-D im2col box at the column's tap (27 x 64 columns
             # against 128: the last box reads the filter's last tap), pixels ragged against the 64-pixel slices
             pytest.param("bwd_weight", (2, 3, 5, 4, 64), (40, 3, 3, 3, 64), dict(padding=1, stride=(2, 1, 1)),
                          dict(BM=64, BN=128, WN=128, stages=2, a_mn=1, b_mn=1), marks=pytest.mark.slow)]  # (46 s of
# CI: its GPU test checks it against float64)


def _config(**kw):
    from kernelgen.templates.config import TileConfig
    return TileConfig(**{"BK": 64, "WM": 64, "wgmma": 1, "tma": 1, **kw})


def _inputs(rng, direction, p, dtype):
    """Fresh random arrays of what `direction` reads."""
    names = {"fwd": ("x", "w"), "bwd_data": ("dy", "w"), "bwd_weight": ("x", "dy")}[direction]
    shapes = {"x": p.x_shape, "w": p.w_shape, "dy": p.y_shape}
    return {name: random_array(rng, shapes[name], dtype) for name in names}


def _want(direction, p, inputs, kw):
    from kernelgen import reference as ref
    f64 = {name: a.astype(np.float64) for name, a in inputs.items()}
    if direction == "fwd":
        return ref.conv_forward(f64["x"], f64["w"], **kw)
    if direction == "bwd_data":
        return ref.conv_backward_data(f64["dy"], f64["w"], p.x_shape, **kw)
    return ref.conv_backward_weight(f64["x"], f64["dy"], p.w_shape, **kw)


@pytest.mark.parametrize("direction, x_shape, w_shape, kw, tile", CPU_CASES)
def test_cpu_fp16_tma_3d(direction, x_shape, w_shape, kw, tile, rng):
    from kernelgen.api import get_launcher, make_plan
    from kernelgen.problem import make_problem
    from kernelgen.templates import implicit_gemm_tc
    from test_tma_fp16 import close_to_float64
    p = make_problem(direction, x_shape, w_shape, dtype="float16", **kw)
    assert p.folded_2d() is None and not implicit_gemm_tc.tma_unmet(p)
    launcher = get_launcher(make_plan(p, "cpu", config=_config(**tile), precision="fp16"))
    x_map = launcher.tensor_maps[1 if direction == "bwd_weight" else 0]
    assert (x_map[2], len(x_map[3])) == ("im2col", 5)  # (C, W, H, D, N)
    inputs = _inputs(rng, direction, p, np.float16)
    out = poisoned(int(np.prod(p.output_shape)), np.float16)
    launcher({**{k: v.ravel() for k, v in inputs.items()}, launcher.outputs[0]: out})
    close_to_float64(out.reshape(p.output_shape), _want(direction, p, inputs, kw))


@pytest.mark.slow  # (CI time: the 5-D map is the fp16 tests', the rounded copies the 2-D TF32 tests')
def test_cpu_tf32_tma_3d_forward(rng):
    """TF32: the maps read the launcher's TF32-rounded copies of x and w (32 channels a 128-byte row)."""
    from kernelgen import reference as ref
    from kernelgen.api import get_launcher, make_plan
    from kernelgen.mma_layout import tf32_round
    from kernelgen.problem import make_problem
    x_shape, w_shape, kw = (2, 3, 4, 5, 32), (16, 3, 2, 3, 32), dict(padding=(1, 1, 0), dilation=(2, 1, 1))
    x, w = (rng.standard_normal(s).astype(np.float32) for s in (x_shape, w_shape))
    p = make_problem("fwd", x_shape, w_shape, **kw)
    launcher = get_launcher(make_plan(p, "cpu", config=_config(BK=32, BM=64, BN=16, WN=16, stages=2),
                                      precision="tf32"))
    y = poisoned(int(np.prod(p.y_shape)))
    launcher({"x": x.ravel(), "w": w.ravel(), "y": y})
    rounded = ref.conv_forward(tf32_round(x).astype(np.float64), tf32_round(w).astype(np.float64), **kw)
    assert np.abs(y.reshape(p.y_shape) - rounded).max() <= 1e-5 * np.abs(rounded).max()


def test_3d_tma_needs_corners_the_driver_takes():
    """A 5-D map's corners lie in -16..15 (the driver's range): a padding of 17 cannot be a TMA box; reading w as
    stored (b_mn, a 4-D map of a 2-D filter) is not offered for a 3-D filter."""
    from kernelgen.problem import make_problem
    from kernelgen.target import KNOWN_TARGETS
    from kernelgen.templates import implicit_gemm_tc
    wide = make_problem("fwd", (1, 4, 40, 40, 64), (64, 3, 35, 3, 64), padding=(1, 17, 1), dtype="float16")
    assert any("im2col corners" in why for why in implicit_gemm_tc.tma_unmet(wide))
    p = make_problem("bwd_data", (2, 4, 8, 8, 64), (64, 3, 3, 3, 64), padding=1, dtype="float16")
    configs = implicit_gemm_tc.tma_candidate_configs(p, "fp16", KNOWN_TARGETS["h100"])
    assert configs and not any(c.b_mn for c in configs)


GPU_CASES = [((4, 8, 14, 14, 64), (64, 3, 3, 3, 64), dict(padding=1)),
             ((2, 5, 9, 11, 128), (40, 3, 3, 3, 128), dict(padding=(1, 2, 1), stride=(1, 2, 1), dilation=(1, 2, 1)))]
GPU_TILES = {"fwd": [dict(BM=128, BN=64, WN=64, stages=4), dict(BM=128, BN=128, WN=128, stages=6, tma=2)],
             "bwd_weight": [dict(BM=64, BN=128, WN=128, stages=6, tma=2, a_mn=1, b_mn=1),
                            dict(BM=128, BN=128, WN=128, stages=6, tma=2, a_mn=1, b_mn=1, split_k=3)]}


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "tf32"])
@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weight"])
def test_gpu_tma_3d(direction, precision, rng):
    """The sm_90 5-D im2col copies (cp.async.bulk.tensor.5d ... im2col) through the API, both precisions
    (backward-weight: 16-bit only, both operands MN-major), and fp16 split into its float32 workspace."""
    from numba import cuda

    from kernelgen.api import get_launcher, make_plan
    from kernelgen.problem import make_problem
    if direction == "bwd_weight" and precision == "tf32":
        pytest.skip("TF32 backward-weight on TMA: the TF32 wgmma reads K-major operands only")
    dtype = "float16" if precision == "fp16" else "float32"
    tiles = GPU_TILES["bwd_weight" if direction == "bwd_weight" else "fwd"]
    if precision == "fp16" and direction != "bwd_weight":
        tiles = tiles + [dict(BM=128, BN=64, WN=64, stages=8, tma=2, split_k=3)]  # (a divisor of 27 and 54 slices)
    for tile in tiles:
        config = _config(**tile, **({} if precision == "fp16" else {"BK": 32}))
        for x_shape, w_shape, kw in GPU_CASES:
            if direction == "bwd_data" and kw.get("stride", 1) != 1:
                continue  # (a strided backward-data is KS-deconv's, 2-D only)
            p = make_problem(direction, x_shape, w_shape, dtype=dtype, **kw)
            launcher = get_launcher(make_plan(p, "cuda", config=config, precision=precision))
            inputs = _inputs(rng, direction, p, dtype)
            out = cuda.to_device(poisoned(int(np.prod(p.output_shape)), dtype))
            launcher({**{k: cuda.to_device(v.ravel()) for k, v in inputs.items()}, launcher.outputs[0]: out})
            got = out.copy_to_host().reshape(p.output_shape).astype(np.float64)
            want = _want(direction, p, inputs, kw)
            assert np.abs(got - want).max() <= 3e-3 * np.abs(want).max(), (p.key(), config)
