"""The CUDA backend in numba's simulator, on tiny shapes, against the float64 reference.

conftest.py switches the simulator on for sessions without an NVIDIA device (these tests are
skipped otherwise).  The simulator runs every CUDA thread as a Python thread (~ms each), so the
launcher-level tests pass small TileConfigs (16-32 threads a block) through make_plan; the public
API tests use the default CUDA config on shapes of a single block or two.
"""
from __future__ import annotations

import numpy as np
import pytest

import kernelgen
from kernelgen import reference as ref
from kernelgen.api import get_launcher, make_plan
from kernelgen.problem import make_problem
from kernelgen.templates.config import TileConfig
from harness import direction_inputs, launch_poisoned

pytestmark = pytest.mark.sim

SMALL = TileConfig(BM=16, BN=8, BK=4, TM=2, TN=2)          # 32 threads
SMALL_2STAGE = TileConfig(BM=16, BN=8, BK=4, TM=2, TN=2, stages=2)
RAGGED_THREADS = TileConfig(BM=8, BN=12, BK=4, TM=2, TN=3)  # 16 threads: tiles not a multiple of them

# (x_shape, w_shape, hyper-parameters): GEMM dims ragged against the tiles above in every direction
CASES = {
    "2d_bias_stride": ((2, 5, 6, 3), (5, 3, 3, 3), dict(stride=(1, 2), padding=1)),
    "2d_groups_stride2": ((1, 6, 5, 4), (6, 2, 3, 2), dict(stride=2, padding=(1, 0), groups=2)),
    "1d_dilation": ((2, 9, 3), (4, 3, 3), dict(stride=2, padding=2, dilation=2)),
    "3d": ((1, 3, 4, 3, 2), (3, 2, 2, 2, 2), dict(stride=(1, 2, 1), padding=(1, 0, 1))),
}


def host_inputs(direction, x_shape, w_shape, kw, rng, bias):
    """The problem (with a bias in the forward when `bias`), fresh inputs and the float64 reference."""
    p = make_problem(direction, x_shape, w_shape, has_bias=bias and direction == "fwd", **kw)
    return (p, *direction_inputs(p, kw, rng))


def launch_with_config(problem, inputs, config):
    """The implicit GEMM under `config`, run into a NaN-filled device output, so an unwritten element shows.
    Returns (launcher, output)."""
    launcher = get_launcher(make_plan(problem, "cuda", algo="implicit_gemm", config=config))
    return launcher, launch_poisoned(launcher, problem, inputs, "cuda")


@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weight"])
@pytest.mark.parametrize("name", list(CASES))
def test_launcher_poisoned(name, direction, rng, assert_close):
    p, inputs, want = host_inputs(direction, *CASES[name], rng, bias=True)
    config = SMALL_2STAGE if name.startswith("2d") else SMALL
    _, got = launch_with_config(p, inputs, config)
    assert not np.isnan(got).any(), f"{np.isnan(got).sum()} of {got.size} outputs never written"
    assert_close(got, want, "float32", f"{direction} {name} {config}")


@pytest.mark.parametrize("config", [SMALL, SMALL_2STAGE, RAGGED_THREADS], ids=str)
@pytest.mark.parametrize("direction", ["fwd", "bwd_data"])
def test_schedules(direction, config, rng, assert_close):
    """One problem under single- and double-buffered pipelines and a thread count that does not
    divide the tile loads (guarded staging)."""
    p, inputs, want = host_inputs(direction, *CASES["2d_groups_stride2"], rng, bias=True)
    _, got = launch_with_config(p, inputs, config)
    assert_close(got, want, "float32", f"{direction} {config}")


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("split_k", [2, 3])
def test_backward_weight_split_k_atomics(split_k, stages, rng, assert_close):
    """split_k > 1 adds partial sums into a zeroed output with atomics; the NaN poison must be
    cleared by the launcher and every split must land.  3 splits do not divide the k tiles."""
    x_shape, w_shape, kw = CASES["2d_bias_stride"]
    p, inputs, want = host_inputs("bwd_weight", x_shape, w_shape, kw, rng, bias=False)
    config = TileConfig(BM=8, BN=16, BK=4, TM=2, TN=2, split_k=split_k, stages=stages)
    nkt = -(-(p.N * int(np.prod(p.out_size))) // config.BK)
    assert nkt >= 2 * split_k and (split_k == 2 or nkt % split_k), "the case must exercise uneven splits"
    launcher, got = launch_with_config(p, inputs, config)
    assert launcher.zero_output and launcher.grid[2] == p.groups * split_k
    assert_close(got, want, "float32", f"split_k={split_k} stages={stages}")


def test_forward_split_k_adds_the_bias_once(rng, assert_close):
    """Every split adds its partial sum into y; the bias belongs to one of them (split 0) only."""
    p, inputs, want = host_inputs("fwd", *CASES["2d_bias_stride"], rng, bias=True)
    launcher, got = launch_with_config(p, inputs, TileConfig(BM=8, BN=16, BK=4, TM=2, TN=2, split_k=2))
    assert launcher.zero_output and p.has_bias
    assert_close(got, want, "float32", "split_k=2 with bias")
    relu = make_problem("fwd", *CASES["2d_bias_stride"][:2], has_bias=True, activation="relu",
                        **CASES["2d_bias_stride"][2])
    with pytest.raises(ValueError, match="split_k must be 1 with activation"):
        make_plan(relu, "cuda", algo="implicit_gemm", config=TileConfig(8, 16, 4, 2, 2, split_k=2)).kernel_ir()


def test_relu_epilogue(rng, assert_close):
    x_shape, w_shape, kw = CASES["2d_bias_stride"]
    p = make_problem("fwd", x_shape, w_shape, has_bias=True, activation="relu", **kw)
    x, w = rng.standard_normal(x_shape).astype("float32"), rng.standard_normal(w_shape).astype("float32")
    b = rng.standard_normal(p.K).astype("float32")
    _, got = launch_with_config(p, {"x": x, "w": w, "bias": b}, SMALL)
    assert_close(got, np.maximum(ref.conv_forward(x, w, b, **kw), 0.0), "float32", "relu(conv + bias)")


# --- the public API on the cuda backend ------------------------------------------------------------

def to_device(*arrays):
    from numba import cuda
    return [cuda.to_device(a) for a in arrays]


def check_device_result(got, want, assert_close, what):
    assert hasattr(got, "copy_to_host") and not isinstance(got, np.ndarray), \
        f"{what}: device inputs must give a device array, got {type(got).__name__}"
    assert_close(got.copy_to_host(), want, "float32", what)


def test_api_device_arrays_all_ops(rng, assert_close):
    x_shape, w_shape, kw = CASES["2d_groups_stride2"]
    p = make_problem("fwd", x_shape, w_shape, **kw)
    x, w = rng.standard_normal(x_shape).astype("float32"), rng.standard_normal(w_shape).astype("float32")
    dy, b = rng.standard_normal(p.y_shape).astype("float32"), rng.standard_normal(p.K).astype("float32")
    dx_, dw_, ddy, db = to_device(x, w, dy, b)
    check_device_result(kernelgen.conv(dx_, dw_, db, **kw), ref.conv_forward(x, w, b, **kw), assert_close, "conv")
    check_device_result(kernelgen.conv_backward_data(ddy, dw_, x_shape, **kw),
                        ref.conv_backward_data(dy, w, x_shape, **kw), assert_close, "conv_backward_data")
    check_device_result(kernelgen.conv_backward_weight(dx_, ddy, w_shape, **kw),
                        ref.conv_backward_weight(x, dy, w_shape, **kw), assert_close, "conv_backward_weight")


def test_api_deconv_device_arrays(rng, assert_close):
    # output_padding 2 >= stride 1 (dilation 3): also covers the zero extension of x on the device
    x, w = rng.standard_normal((1, 3, 2, 4)).astype("float32"), rng.standard_normal((4, 2, 2, 3)).astype("float32")
    kw = dict(stride=(2, 1), padding=(1, 0), output_padding=(1, 2), dilation=(1, 3))
    dx_, dw_ = to_device(x, w)
    check_device_result(kernelgen.deconv(dx_, dw_, **kw), ref.deconv(x, w, **kw), assert_close, "deconv")


def test_api_deconv_device_bias(rng, assert_close):
    x, w = rng.standard_normal((1, 3, 2, 4)).astype("float32"), rng.standard_normal((4, 2, 2, 3)).astype("float32")
    b = rng.standard_normal(3).astype("float32")
    dx_, dw_, db = to_device(x, w, b)
    check_device_result(kernelgen.deconv(dx_, dw_, db, stride=2), ref.deconv(x, w, b, stride=2), assert_close,
                        "deconv + bias")


def test_api_host_arrays_on_cuda_backend(rng, assert_close):
    """NumPy in, backend='cuda' -> NumPy out (copied through the device)."""
    x_shape, w_shape, kw = CASES["1d_dilation"]
    x, w = rng.standard_normal(x_shape).astype("float32"), rng.standard_normal(w_shape).astype("float32")
    got = kernelgen.conv(x, w, backend="cuda", **kw)
    assert isinstance(got, np.ndarray)
    assert_close(got, ref.conv_forward(x, w, **kw), "float32", "conv, host arrays on cuda")


def test_device_inputs_pick_cuda_backend(rng):
    """backend=None with device arrays must not fall back to the CPU (no GPU is 'present' under the
    simulator): the result stays on the device."""
    x_shape, w_shape, kw = CASES["1d_dilation"]
    x, w = to_device(rng.standard_normal(x_shape).astype("float32"), rng.standard_normal(w_shape).astype("float32"))
    assert kernelgen.explain("conv", x, w, **kw).backend == "cuda"
    with pytest.raises(ValueError, match="backend"):
        kernelgen.conv(x, w, backend="cpu", **kw)
