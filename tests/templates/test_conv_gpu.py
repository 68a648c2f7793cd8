"""The CUDA backend on a real GPU, realistic shapes (run by scripts/gpu_run.sh on the device machine).

Skipped without a GPU (conftest.py).  Inputs are torch CUDA tensors when torch with CUDA is
importable (zero-copy through __cuda_array_interface__, torch tensors out), else numba device arrays.
Results are checked on the host against the float64 reference.
"""
from __future__ import annotations

import numpy as np
import pytest

import kernelgen
from kernelgen import reference as ref
from kernelgen.problem import make_problem

pytestmark = pytest.mark.gpu

# float32 on the GPU: FMA contraction and split-K atomics reorder long sums
GPU_TOL = 2e-5

CASES = {
    "3x3_pad1": ((8, 16, 16, 32), (64, 3, 3, 32), dict(padding=1)),
    "3x3_stride2": ((8, 16, 16, 32), (64, 3, 3, 32), dict(stride=2, padding=1)),
    "1x1": ((8, 16, 16, 64), (32, 1, 1, 64), dict()),
    "grouped_dilated": ((4, 15, 17, 32), (48, 3, 3, 8), dict(padding=2, dilation=2, groups=4)),
    "1d": ((8, 129, 24), (40, 5, 24), dict(stride=2, padding=2)),
    "3d": ((2, 6, 10, 10, 16), (24, 3, 3, 3, 16), dict(padding=1)),
}


def _torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def to_gpu(a):
    torch = _torch_cuda()
    if torch is not None:
        return torch.from_numpy(a).cuda()
    from numba import cuda
    return cuda.to_device(a)


def to_host(d):
    torch = _torch_cuda()
    if torch is not None and isinstance(d, torch.Tensor):
        assert d.is_cuda, "CUDA inputs must give a CUDA result"
        return d.cpu().numpy()
    assert not isinstance(d, np.ndarray) and hasattr(d, "copy_to_host"), f"expected a device array, got {type(d)}"
    return d.copy_to_host()


@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weight"])
@pytest.mark.parametrize("name", list(CASES))
def test_directions(name, direction, rng, assert_close):
    x_shape, w_shape, kw = CASES[name]
    p = make_problem("fwd", x_shape, w_shape, **kw)
    x, w = rng.standard_normal(x_shape).astype("float32"), rng.standard_normal(w_shape).astype("float32")
    dy, b = rng.standard_normal(p.y_shape).astype("float32"), rng.standard_normal(p.K).astype("float32")
    if direction == "fwd":
        got, want = kernelgen.conv(to_gpu(x), to_gpu(w), to_gpu(b), **kw), ref.conv_forward(x, w, b, **kw)
    elif direction == "bwd_data":
        got = kernelgen.conv_backward_data(to_gpu(dy), to_gpu(w), x_shape, **kw)
        want = ref.conv_backward_data(dy, w, x_shape, **kw)
    else:
        got = kernelgen.conv_backward_weight(to_gpu(x), to_gpu(dy), w_shape, **kw)
        want = ref.conv_backward_weight(x, dy, w_shape, **kw)
    assert_close(to_host(got), want, "float32", f"{direction} {name}", tol=GPU_TOL)


def test_host_arrays_default_to_gpu(rng, assert_close):
    x_shape, w_shape, kw = CASES["3x3_pad1"]
    x, w = rng.standard_normal(x_shape).astype("float32"), rng.standard_normal(w_shape).astype("float32")
    assert kernelgen.explain("conv", x, w, **kw).backend == "cuda"
    got = kernelgen.conv(x, w, **kw)
    assert isinstance(got, np.ndarray)
    assert_close(got, ref.conv_forward(x, w, **kw), "float32", tol=GPU_TOL)


@pytest.mark.parametrize("kw", [dict(stride=2, padding=1, output_padding=1), dict(stride=1, padding=1, dilation=2),
                                dict(stride=(2, 1), padding=(2, 0), dilation=3, output_padding=2)])
def test_deconv(kw, rng, assert_close):
    x, w = rng.standard_normal((4, 9, 9, 32)).astype("float32"), rng.standard_normal((32, 3, 3, 16)).astype("float32")
    b = rng.standard_normal(16).astype("float32")
    got = kernelgen.deconv(to_gpu(x), to_gpu(w), to_gpu(b), **kw)
    assert_close(to_host(got), ref.deconv(x, w, b, **kw), "float32", f"deconv {kw}", tol=GPU_TOL)


@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weight"])
def test_every_output_written(direction, rng, assert_close, run_direction):
    """NaN-poisoned output (harness.run_direction); GEMM dims ragged against the default tiles."""
    x_shape, w_shape, kw = (3, 13, 11, 20), (36, 3, 3, 20), dict(stride=(1, 2), padding=1)
    p = make_problem(direction, x_shape, w_shape, **kw)
    _, got, want = run_direction(p, kw, "cuda", rng=rng)
    assert not np.isnan(got).any(), f"{np.isnan(got).sum()} of {got.size} outputs never written"
    assert_close(got, want, "float32", direction, tol=GPU_TOL)
