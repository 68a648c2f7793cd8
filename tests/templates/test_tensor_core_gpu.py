"""The TF32 tensor-core kernels on a real GPU (the H100): every direction and layout against the float64
reference on fresh data with poisoned outputs, inputs not 16-byte aligned, resources and explain().  Tests
marked `gpu`: skipped without an NVIDIA device (the simulator cannot run mma.sync); the CPU-emulated tests of
the same IR are in test_tensor_core.py.  GPU_CASES / GPU_CONFIGS / gpu_layout_runs serve the 16-bit file too.
"""
from __future__ import annotations

import numpy as np
import pytest

import kernelgen
from kernelgen.api import get_launcher, make_plan
from kernelgen.problem import make_problem
from kernelgen.templates.config import TileConfig
from harness import conv_tensors, poisoned, reference_fn
from test_tensor_core import check_tf32

# --- the real tensor-core kernels (H100) -----------------------------------------------------------

GPU_CASES = {
    "3x3_pad1": ((8, 16, 16, 32), (64, 3, 3, 32), dict(padding=1)),
    "3x3_stride2": ((8, 16, 16, 32), (64, 3, 3, 32), dict(stride=2, padding=1)),
    "1x1_wide": ((8, 14, 14, 128), (256, 1, 1, 128), dict()),
    "ragged_groups": ((3, 13, 11, 20), (36, 3, 3, 10), dict(stride=(1, 2), padding=1, groups=2)),
    "stem_c3": ((4, 30, 30, 3), (16, 7, 7, 3), dict(stride=2, padding=3)),
}


def _gpu_run(direction, x, w, dy, kw, **opts):
    from numba import cuda
    x_d, w_d, dy_d = cuda.to_device(x), cuda.to_device(w), cuda.to_device(dy)
    if direction == "fwd":
        got = kernelgen.conv(x_d, w_d, **kw, **opts)
    elif direction == "bwd_data":
        got = kernelgen.conv_backward_data(dy_d, w_d, x.shape, **kw, **opts)
    else:
        got = kernelgen.conv_backward_weight(x_d, dy_d, w.shape, **kw, **opts)
    return got.copy_to_host(), reference_fn(direction, kw)


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weight"])
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_tf32(name, direction, rng):
    x_shape, w_shape, kw = GPU_CASES[name]
    x, w, dy = conv_tensors(rng, x_shape, w_shape, kw)
    got, reference = _gpu_run(direction, x, w, dy, kw, precision="tf32")
    err = check_tf32(got, reference, x, w, dy, f"{direction} {name}")
    # the hardware's fp32 accumulation order and rounding are its own: a looser bound than the CPU's,
    # still well under the ~3e-4 that un-rounded (truncated) operands would give
    assert err <= 1e-4, f"{direction} {name}: {err:.3g} from the TF32-rounded reference"


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weight"])
def test_gpu_tf32_every_output_written_and_resources(direction, rng):
    shape = ((3, 13, 11, 20), (36, 3, 3, 20), dict(stride=(1, 2), padding=1))
    got, reference, x, w, dy, res, _ = gpu_run_plan(shape, direction, None, "tf32", rng)
    check_tf32(got, reference, x, w, dy, direction)
    assert res.get("local_bytes") == 0, res


# the fragment layouts and register caps a GPU run must cover: swizzled BK 8 / 16 / 32, the old k-major
# layout (kept for the tuner), 8 warps of 32 x 32 under launch bounds, the narrow bwd-weight tile
GPU_CONFIGS = [TileConfig(128, 64, 16, WM=64, WN=32, stages=2, swizzle=1),
               TileConfig(128, 64, 16, WM=64, WN=32, stages=2, swizzle=2),  # interleaved A rows
               TileConfig(128, 64, 8, WM=64, WN=32, stages=2, swizzle=2),
               # BK 16 under this cap spills 96 B on the C=20 stride-(1, 2) forward (ptxas and the H100 agree)
               TileConfig(128, 64, 8, WM=32, WN=32, stages=2, swizzle=1, min_blocks=2),
               TileConfig(128, 64, 8, WM=64, WN=32, stages=2, swizzle=1),
               TileConfig(64, 64, 32, WM=32, WN=32, swizzle=1),
               TileConfig(64, 32, 16, WM=32, WN=16, split_k=3, stages=2, swizzle=1),
               TileConfig(128, 64, 16, WM=64, WN=32, split_k=5, stages=2, swizzle=1),  # bwd-weight's new pick
               TileConfig(128, 64, 16, WM=64, WN=32, smem_pad=8, stages=2),
               # asynchronous copies (cp.async): 3 and 4 stages, BK 8 / 16 / 32, a ragged split-K
               TileConfig(128, 64, 16, WM=64, WN=32, stages=3, swizzle=1, async_copy=1),
               TileConfig(128, 64, 16, WM=64, WN=32, stages=4, swizzle=1, async_copy=1),
               TileConfig(128, 64, 8, WM=64, WN=32, stages=4, swizzle=1, async_copy=1),
               TileConfig(64, 64, 32, WM=32, WN=32, stages=3, swizzle=1, async_copy=1),
               TileConfig(64, 32, 16, WM=32, WN=16, split_k=3, stages=3, swizzle=1, async_copy=1)]

ASYNC_CONFIG = TileConfig(128, 64, 16, WM=64, WN=32, stages=3, swizzle=1, async_copy=1)

# warpgroup MMAs (sm_90a wgmma): 1 and 2 warpgroups, two 64-row strips per warpgroup, n 16..128, BK 8 / 16 / 32,
# 2..4 stages, a ragged split-K
WGMMA_GPU_CONFIGS = [TileConfig(128, 128, 16, WM=64, WN=128, stages=3, async_copy=1, wgmma=1),
                     TileConfig(128, 64, 16, WM=64, WN=64, stages=4, async_copy=1, wgmma=1),
                     TileConfig(64, 128, 8, WM=64, WN=128, stages=4, async_copy=1, wgmma=1),
                     TileConfig(128, 32, 32, WM=128, WN=32, stages=2, async_copy=1, wgmma=1),
                     TileConfig(64, 16, 16, WM=64, WN=16, split_k=3, stages=3, async_copy=1, wgmma=1),
                     # past 48 KiB: dynamic shared memory, the launcher opts the kernel in
                     TileConfig(128, 128, 32, WM=64, WN=128, stages=6, async_copy=1, wgmma=1)]
WG_CONFIG = WGMMA_GPU_CONFIGS[0]
# Local memory (bytes per thread) measured on the H100 where it is not 0: backward-weight's 128 x 32 slices of both
# operands are 32 cp.async copies per thread and stage, each with its own im2col address, at the 255-register cap
# of 256 threads (2026-11-26, 16 B).  Neither the planner nor the tuner offers copy-fed wgmma tiles for
# backward-weight (the tuner takes at most tuning.tuner.MAX_LOCAL_BYTES anyway); a larger spill still fails.
WGMMA_KNOWN_SPILL = {(str(WGMMA_GPU_CONFIGS[-1]), "bwd_weight"): 16}
# TMA copies (tma=1, forward only): one and two warpgroups, 3..6 stages (6: dynamic shared memory), 128-wide n;
# tma=2 (a producer warp): two warpgroups at 4 stages, one at 2 (the producer one slice ahead); both split-K
TMA_GPU_CONFIGS = [TileConfig(128, 64, 32, WM=64, WN=64, stages=4, wgmma=1, tma=1),
                   TileConfig(64, 128, 32, WM=64, WN=128, stages=3, wgmma=1, tma=1),
                   TileConfig(128, 128, 32, WM=64, WN=128, stages=6, wgmma=1, tma=1),
                   TileConfig(128, 64, 32, WM=64, WN=64, stages=4, wgmma=1, tma=2),
                   TileConfig(64, 128, 32, WM=64, WN=128, stages=2, wgmma=1, tma=2),
                   # split-K (3 divides every TMA_SHAPES' slices; the 1x1 has one slice per split)
                   TileConfig(128, 64, 32, WM=64, WN=64, split_k=3, stages=4, wgmma=1, tma=2),
                   TileConfig(128, 128, 32, WM=64, WN=128, split_k=3, stages=6, wgmma=1, tma=1)]
# a 3x3 with padding, a dilated 3x3 with ragged M and N, a 1x1 over three 32-channel slices
TMA_SHAPES = [((4, 16, 16, 64), (64, 3, 3, 64), dict(padding=1)),
              ((3, 13, 11, 32), (40, 3, 3, 32), dict(padding=2, dilation=2)),
              ((2, 9, 7, 96), (24, 1, 1, 96), dict()),
              # strided: the im2col map's traversal steps (9 and 3 slices: split-K 3 divides them too)
              ((2, 17, 15, 32), (40, 3, 3, 32), dict(padding=1, stride=2)),
              ((2, 10, 12, 96), (24, 1, 1, 96), dict(stride=2))]


# backward-data reduces over K (a multiple of 32): a 3x3, a dilated 3x3 with 24 outputs per pixel, a 1x1; strided,
# KS-deconv's classes (ks_deconv.ks_tma): a 3x3 whose classes differ in size and taps, a 1x1 whose classes but one
# have no tap (zeros); 3 slices of 32 channels per tap, so split-K 3 divides them all
TMA_BWD_SHAPES = [((4, 16, 16, 64), (64, 3, 3, 64), dict(padding=1)),
                  ((3, 13, 11, 24), (64, 3, 3, 24), dict(padding=2, dilation=2)),
                  ((2, 9, 7, 40), (96, 1, 1, 40), dict()),
                  ((2, 14, 13, 40), (96, 3, 3, 40), dict(padding=1, stride=2)),
                  ((2, 10, 12, 24), (96, 1, 1, 24), dict(stride=2))]


LAYOUT_SHAPES = [((3, 13, 11, 20), (36, 3, 3, 20), dict(stride=(1, 2), padding=1)),
                 ((4, 16, 16, 64), (64, 3, 3, 64), dict(padding=1))]


def gpu_run_plan(shape, direction, config, precision, rng):
    """One tensor-core plan (config None: the default) on the GPU, fresh data and a poisoned output:
    (got, reference, x, w, dy, kernel resources, threads)."""
    from numba import cuda

    from kernelgen.tuning.bench import kernel_resources
    x_shape, w_shape, kw = shape
    x, w, dy = conv_tensors(rng, x_shape, w_shape, kw)
    p = make_problem(direction, x_shape, w_shape, y_shape=dy.shape, **kw)
    launcher = get_launcher(make_plan(p, "cuda", config=config, precision=precision))
    inputs = {"fwd": {"x": x, "w": w}, "bwd_data": {"dy": dy, "w": w}, "bwd_weight": {"x": x, "dy": dy}}[direction]
    args = {k: cuda.to_device(v.reshape(-1)) for k, v in inputs.items()}
    out = cuda.to_device(poisoned(int(np.prod(p.output_shape))))
    args[launcher.outputs[0]] = out
    launcher(args)
    cuda.synchronize()
    return (out.copy_to_host().reshape(p.output_shape), reference_fn(direction, kw), x, w, dy,
            kernel_resources(launcher, launcher.threads), launcher.threads)


def gpu_layout_runs(config, direction, precision, rng):
    """gpu_run_plan of one config over LAYOUT_SHAPES, one result tuple per shape."""
    for shape in LAYOUT_SHAPES:
        yield gpu_run_plan(shape, direction, config, precision, rng)


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weight"])
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=str)
def test_gpu_tf32_layouts(config, direction, rng):
    for got, reference, x, w, dy, res, threads in gpu_layout_runs(config, direction, "tf32", rng):
        err = check_tf32(got, reference, x, w, dy, f"{direction} {config}")
        assert err <= 1e-4, f"{direction} {config}: {err:.3g} from the TF32-rounded reference"
        assert res.get("local_bytes") == 0, res
        if config.min_blocks:
            assert res["registers"] * threads * config.min_blocks <= 65536, res


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weight"])
@pytest.mark.parametrize("config", WGMMA_GPU_CONFIGS, ids=str)
def test_gpu_tf32_warpgroup_mma(config, direction, rng):
    """wgmma kernels against the float64 reference, and against the GEMM of TF32-rounded operands (the
    kernel rounds in shared memory what wgmma would truncate): the descriptors, the core-matrix layout and the
    accumulator layout are the hardware's."""
    for got, reference, x, w, dy, res, threads in gpu_layout_runs(config, direction, "tf32", rng):
        err = check_tf32(got, reference, x, w, dy, f"{direction} {config}")
        assert err <= 1e-4, f"{direction} {config}: {err:.3g} from the TF32-rounded reference"
        assert res.get("local_bytes") <= WGMMA_KNOWN_SPILL.get((str(config), direction), 0), res


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["fwd", "bwd_data"])
@pytest.mark.parametrize("config", TMA_GPU_CONFIGS, ids=str)
def test_gpu_tf32_tma(config, direction, rng):
    """TMA-fed warpgroup MMAs (the launcher encodes the tensor maps): the im2col and tiled boxes, the 128-byte
    swizzle, the mbarrier phases and the launcher's TF32-rounded copies of x and w (backward-data: of dy, and of w
    transposed with its taps reversed), against the TF32-rounded reference."""
    for shape in TMA_SHAPES if direction == "fwd" else TMA_BWD_SHAPES:
        got, reference, x, w, dy, res, threads = gpu_run_plan(shape, direction, config, "tf32", rng)
        err = check_tf32(got, reference, x, w, dy, f"{direction} {config} {shape}")
        assert err <= 1e-4, f"{direction} {config} {shape}: {err:.3g} from the TF32-rounded reference"
        assert res.get("local_bytes") == 0, res


@pytest.mark.gpu
def test_gpu_tma_reads_an_unaligned_array(rng):
    """A TMA map needs a 16-byte aligned array: it reads the launcher's rounded copy, which is, whatever the
    caller's arrays are; the caller's x is left as it was."""
    from numba import cuda
    x_shape, w_shape, kw = TMA_SHAPES[0]
    x, w, dy = conv_tensors(rng, x_shape, w_shape, kw)
    p = make_problem("fwd", x_shape, w_shape, **kw)
    launcher = get_launcher(make_plan(p, "cuda", config=TMA_GPU_CONFIGS[0], precision="tf32"))
    shifted = cuda.to_device(np.concatenate([np.float32([7.0]), x.ravel()]))[1:]
    out = cuda.to_device(poisoned(dy.size))
    launcher({"x": shifted, "w": cuda.to_device(w.ravel()), "y": out})
    err = check_tf32(out.copy_to_host().reshape(dy.shape), reference_fn("fwd", kw), x, w, dy, "fwd")
    assert err <= 1e-4, f"{err:.3g} from the TF32-rounded reference"
    assert np.array_equal(shifted.copy_to_host(), x.ravel())


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["fwd", "bwd_data"])
@pytest.mark.parametrize("config", TMA_GPU_CONFIGS[:1] + TMA_GPU_CONFIGS[-1:], ids=str)
def test_gpu_tma_calls_after_the_first(config, direction, rng):
    """From the second call on a launcher takes the fast route (cuLaunchKernel on raw addresses: the rounding
    kernels, a split-K output's memset, then the conv with the maps of the rounded copies): fresh data each call,
    outputs poisoned; the caller's inputs are left as they were."""
    from numba import cuda
    x_shape, w_shape, kw = (TMA_SHAPES if direction == "fwd" else TMA_BWD_SHAPES)[0]
    p = make_problem(direction, x_shape, w_shape, **kw)
    launcher = get_launcher(make_plan(p, "cuda", config=config, precision="tf32"))
    for call in range(3):
        x, w, dy = conv_tensors(rng, x_shape, w_shape, kw)
        inputs = {"x": x, "w": w} if direction == "fwd" else {"dy": dy, "w": w}
        args = {k: cuda.to_device(v.ravel()) for k, v in inputs.items()}
        out = cuda.to_device(poisoned(int(np.prod(p.output_shape))))
        launcher({**args, launcher.outputs[0]: out})
        assert launcher.fast, "the first call compiles; the later ones take the fast route"
        got = out.copy_to_host().reshape(p.output_shape)
        err = check_tf32(got, reference_fn(direction, kw), x, w, dy, f"call {call}")
        assert err <= 1e-4, f"call {call}: {err:.3g} from the TF32-rounded reference"
        for k, v in inputs.items():
            assert np.array_equal(args[k].copy_to_host(), v.ravel())


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, ASYNC_CONFIG, WG_CONFIG], ids=str)
@pytest.mark.parametrize("direction", ["fwd", "bwd_data"])
def test_gpu_tf32_inputs_not_16_byte_aligned(direction, config, rng):
    """Arrays that start one float into an allocation (a torch or CuPy slice can): the vector staging
    (16-byte loads, or 16-byte asynchronous copies) falls back to 4-byte ones instead of faulting or
    reading the wrong elements."""
    from numba import cuda

    def shifted(a):
        return cuda.to_device(np.concatenate([np.float32([7.0]), a.ravel()]))[1:]
    x_shape, w_shape, kw = (4, 12, 12, 32), (64, 3, 3, 32), dict(padding=1)
    x, w, dy = conv_tensors(rng, x_shape, w_shape, kw)
    p = make_problem(direction, x_shape, w_shape, y_shape=dy.shape, **kw)
    launcher = get_launcher(make_plan(p, "cuda", config=config, precision="tf32"))
    args = {"x": shifted(x), "w": shifted(w)} if direction == "fwd" else {"dy": shifted(dy), "w": shifted(w)}
    out = cuda.to_device(poisoned(int(np.prod(p.output_shape))))
    args[launcher.outputs[0]] = out
    launcher(args)
    got = out.copy_to_host().reshape(p.output_shape)
    err = check_tf32(got, reference_fn(direction, kw), x, w, dy, direction)
    assert err <= 1e-4, f"{direction}: {err:.3g} from the reference of the operands as the MMA reads them"


@pytest.mark.gpu
def test_gpu_explain_reports_tf32(rng):
    x = rng.standard_normal((8, 16, 16, 32)).astype(np.float32)
    w = rng.standard_normal((64, 3, 3, 32)).astype(np.float32)
    e = kernelgen.explain(kernelgen.conv, x, w, padding=1, precision="tf32")
    # the planner's tile: mma.sync or (on sm_90, where the model may pick one) a warpgroup MMA, both on TF32
    assert e.backend == "cuda" and e.precision == "tf32"
    assert "mma_m16n8k8_tf32(" in e.source or "wgmma_tf32_" in e.source
    assert kernelgen.explain(kernelgen.conv, x, w, padding=1).precision == "fp32"
