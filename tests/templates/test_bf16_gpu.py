"""bfloat16 storage on the GPU (issue 31): torch bfloat16 CUDA tensors in and out, no copies, every direction,
against float64 on the same bfloat16 values (outputs poisoned first): the TMA + warpgroup-MMA tiles (bf16 operands
as stored), the register-staged mma.sync tiles, split backward-weight through its float32 workspace, depthwise."""
from __future__ import annotations

import numpy as np
import pytest

import kernelgen
from kernelgen import reference as ref
from kernelgen.storage import narrow_bits, widen_bits
from kernelgen.templates.config import TileConfig
from test_bf16_storage import check_bf16

pytestmark = pytest.mark.gpu

CASES = {  # (x shape, w shape, conv keywords), as planned
    "c64": ((4, 14, 14, 64), (128, 3, 3, 64), dict(padding=1)),
    "ragged": ((2, 9, 7, 24), (40, 3, 3, 24), dict(padding=1, stride=2)),
}


def _tensor(torch, rng, shape):
    bits = narrow_bits(rng.standard_normal(shape, dtype=np.float32))
    t = torch.from_numpy(bits.view(np.int16)).cuda().view(torch.bfloat16)
    return t, widen_bits(bits).astype(np.float64)


def _poisoned(torch, shape):
    return torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda")


def _bits(t):
    import torch
    return t.cpu().view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weight"])
@pytest.mark.parametrize("name", list(CASES))
def test_torch_bfloat16_every_direction(name, direction, rng):
    torch = pytest.importorskip("torch")
    x_shape, w_shape, kw = CASES[name]
    (x, xv), (w, wv) = _tensor(torch, rng, x_shape), _tensor(torch, rng, w_shape)
    y_shape = kernelgen.explain(kernelgen.conv, x, w, **kw).problem.y_shape
    dy, dyv = _tensor(torch, rng, y_shape)
    extra = {}
    if direction == "fwd":
        out = _poisoned(torch, y_shape)
        got = kernelgen.conv(x, w, out=out, **kw, **extra)
        want = ref.conv_forward(xv, wv, **kw)
    elif direction == "bwd_data":
        out = _poisoned(torch, x_shape)
        got = kernelgen.conv_backward_data(dy, w, x_shape, out=out, **kw, **extra)
        want = ref.conv_backward_data(dyv, wv, x_shape, **kw)
    else:
        out = _poisoned(torch, w_shape)
        got = kernelgen.conv_backward_weight(x, dy, w_shape, out=out, **kw)
        want = ref.conv_backward_weight(xv, dyv, tuple(w.shape), **kw)
    assert got is out and got.data_ptr() == out.data_ptr()
    check_bf16(_bits(got), want, f"{name} {direction}", accumulation=1e-4)
    again = kernelgen.conv(x, w, **kw, **extra) if direction == "fwd" else None  # a new output, the fast route
    if again is not None:
        assert again.dtype == torch.bfloat16 and again.is_cuda
        assert torch.equal(again, got)


def test_split_backward_weight(rng):
    torch = pytest.importorskip("torch")
    kw = dict(padding=1)
    (x, xv) = _tensor(torch, rng, (32, 28, 28, 64))
    (dy, dyv) = _tensor(torch, rng, (32, 28, 28, 64))
    e = kernelgen.explain(kernelgen.conv_backward_weight, x, dy, (64, 3, 3, 64), **kw)
    assert e.config.split_k > 1 and e.precision == "bf16"
    out = _poisoned(torch, (64, 3, 3, 64))
    for _ in range(2):
        got = kernelgen.conv_backward_weight(x, dy, (64, 3, 3, 64), out=out, **kw)
    check_bf16(_bits(got), ref.conv_backward_weight(xv, dyv, (64, 3, 3, 64), **kw), "split dw", accumulation=1e-3)


@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weight"])
def test_depthwise(direction, rng):
    torch = pytest.importorskip("torch")
    kw = dict(padding=1, stride=2, groups=32)
    (x, xv), (w, wv) = _tensor(torch, rng, (4, 15, 15, 32)), _tensor(torch, rng, (32, 3, 3, 1))
    y_shape = (4, 8, 8, 32)
    dy, dyv = _tensor(torch, rng, y_shape)
    if direction == "fwd":
        got, want = kernelgen.conv(x, w, **kw), ref.conv_forward(xv, wv, **kw)
    elif direction == "bwd_data":
        got, want = kernelgen.conv_backward_data(dy, w, tuple(x.shape), **kw), ref.conv_backward_data(dyv, wv, tuple(x.shape), **kw)
    else:
        got = kernelgen.conv_backward_weight(x, dy, tuple(w.shape), **kw)
        want = ref.conv_backward_weight(xv, dyv, tuple(w.shape), **kw)
    assert got.dtype == torch.bfloat16
    check_bf16(_bits(got), want, f"depthwise {direction}", accumulation=1e-3)


@pytest.mark.parametrize("b_mn", [0, 1])
@pytest.mark.parametrize("direction", ["fwd", "bwd_data"])
def test_tma_tiles(direction, b_mn, rng):
    """The TMA + warpgroup-MMA tiles on bfloat16 tensors: boxes of bf16 bits, wgmma .bf16 (bwd_data: w flipped by
    the launcher, or read as stored with b_mn)."""
    torch = pytest.importorskip("torch")
    from kernelgen import arrays
    from kernelgen.api import get_launcher, make_plan
    from kernelgen.problem import make_problem
    if b_mn and direction == "fwd":
        pytest.skip("b_mn reads a backward-data filter")
    x_shape, w_shape, kw = (4, 14, 14, 64), (128, 3, 3, 64), dict(padding=1)
    p = make_problem(direction, x_shape, w_shape, dtype="bfloat16", **kw)
    cfg = TileConfig(128, 64, 64, stages=4, WM=64, WN=64, wgmma=1, tma=1, b_mn=b_mn)
    launcher = get_launcher(make_plan(p, "cuda", config=cfg, precision="bf16"))
    (w, wv), (a, av) = _tensor(torch, rng, w_shape), _tensor(torch, rng, x_shape if direction == "fwd" else p.y_shape)
    out = _poisoned(torch, p.output_shape)
    names = {"fwd": ("x", "y"), "bwd_data": ("dy", "dx")}[direction]
    launcher({names[0]: arrays.to_device_view(a.reshape(-1), "a"), "w": arrays.to_device_view(w.reshape(-1), "w"),
              names[1]: arrays.to_device_view(out.reshape(-1), "out")})
    want = ref.conv_forward(av, wv, **kw) if direction == "fwd" else ref.conv_backward_data(av, wv, x_shape, **kw)
    check_bf16(_bits(out), want, f"tma {direction} b_mn={b_mn}", accumulation=1e-4)
