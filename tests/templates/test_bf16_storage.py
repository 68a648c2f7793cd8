"""bfloat16 inputs and outputs (issue 31): bfloat16 tensors computed with precision="bf16" by kernels that read and
write their bit patterns (kernelgen.storage; NumPy and numba have no bfloat16, so the elements travel as uint16).

bf16 operands are exact as stored, products exact in float32, sums in float32, each output rounded to bfloat16 once:
against the float64 reference of the same bfloat16 inputs an output is within half a bf16 ulp plus the float32
accumulation error (check_rounded_once), besides the issue's 1e-2 bound.  Fresh random data, outputs poisoned
(bf16 NaN bits).  The CPU backend runs the same IR, the MMAs emulated per lane (wgmma too: kernelgen.cpu_round);
tests/templates/test_bf16_gpu.py runs the kernels on the H100.
"""
from __future__ import annotations

import numpy as np
import pytest
from numba import njit

import kernelgen
from kernelgen import reference as ref
from kernelgen.api import get_launcher, make_plan
from kernelgen.cpu_round import bf16_bits_to_f32, f32_to_bf16_bits
from kernelgen.dlpack import BFloat16Array
from kernelgen.problem import make_problem
from kernelgen.render_cuda import render_cuda
from kernelgen.storage import narrow_bits, poisoned, widen_bits
from kernelgen.templates.config import TileConfig
from harness import norm_err, random_array

NAN_BITS = 0x7FC0


def bf16(rng, shape):
    """(BFloat16Array on the host, its values as float64): fresh random data rounded to bfloat16."""
    bits = narrow_bits(random_array(rng, shape, np.float32))
    return BFloat16Array(bits, False), widen_bits(bits).astype(np.float64)


def out_bits(shape):
    return BFloat16Array(poisoned(int(np.prod(shape)), "bfloat16").reshape(shape), False)


def check_bf16(got, want, what, accumulation=1e-5):
    """bfloat16 bits, every element written, within 1e-2 of float64 and rounded once to nearest."""
    bits = got.bits if isinstance(got, BFloat16Array) else got
    assert bits.dtype == np.uint16, f"{what}: dtype {bits.dtype}"
    values = widen_bits(bits).astype(np.float64).reshape(want.shape)
    assert not np.isnan(values).any(), f"{what}: {int(np.isnan(values).sum())} outputs never written"
    assert norm_err(values, want) <= 1e-2, f"{what}: {norm_err(values, want):.3g} from float64"
    # half a bf16 ulp of each exact value: 2**(e - 8) for |want| in [2**e, 2**(e + 1))
    ulp = np.ldexp(1.0, np.frexp(np.abs(want))[1] - 8)
    excess = np.abs(values - want) - (0.5 * ulp + accumulation * np.abs(want).max())
    assert excess.max() <= 0, f"{what}: {int((excess > 0).sum())} outputs not rounded once to nearest"


# --- the bits helpers of the CPU target ------------------------------------------------------------------

@njit
def _decode_all(bits, out):
    for i in range(bits.size):
        out[i] = bf16_bits_to_f32(bits[i])


@njit
def _encode_all(x, out):
    for i in range(x.size):
        out[i] = f32_to_bf16_bits(x[i])


def test_bits_helpers_match_numpy(rng):
    bits = np.arange(1 << 16, dtype=np.uint16)  # every bfloat16
    got = np.empty(bits.size, np.float32)
    _decode_all(bits, got)
    want = widen_bits(bits)
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all()
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    x = (rng.standard_normal(50000) * 10.0 ** rng.integers(-40, 38, 50000)).astype(np.float32)
    x = np.concatenate([x, np.float32([0.0, -0.0, np.inf, -np.inf, 3.4e38, -3.39e38, 1e-45, 1e-39, -9e-41])])
    enc = np.empty(x.size, np.uint16)
    _encode_all(x, enc)
    np.testing.assert_array_equal(enc, narrow_bits(x))


# --- the CPU backend, through the public ops -----------------------------------------------------------

def test_cpu_forward_bias_relu(rng):
    (x, xv), (w, wv), (b, bv) = bf16(rng, (2, 6, 6, 8)), bf16(rng, (12, 3, 3, 8)), bf16(rng, (12,))
    out = out_bits((2, 6, 6, 12))
    y = kernelgen.conv(x, w, b, padding=1, activation="relu", backend="cpu", out=out)
    assert y is out
    check_bf16(y, np.maximum(ref.conv_forward(xv, wv, bv, padding=1), 0.0), "fwd bias relu")
    y2 = kernelgen.conv(x, w, b, padding=1, activation="relu", backend="cpu")  # precision None: bf16
    assert isinstance(y2, BFloat16Array) and not y2.on_device
    np.testing.assert_array_equal(y2.bits, y.bits)


RAGGED = ((2, 6, 7, 6), (10, 3, 3, 3), dict(stride=(2, 1), padding=(1, 2), groups=2))


@pytest.mark.parametrize("direction", ["bwd_data", "bwd_weight"])
def test_cpu_backward(direction, rng):
    x_shape, w_shape, kw = RAGGED
    p = make_problem("fwd", x_shape, w_shape, **kw)
    (x, xv), (w, wv), (dy, dyv) = bf16(rng, x_shape), bf16(rng, w_shape), bf16(rng, p.y_shape)
    if direction == "bwd_data":
        got = kernelgen.conv_backward_data(dy, w, x_shape, backend="cpu", out=out_bits(x_shape), **kw)
        want = ref.conv_backward_data(dyv, wv, x_shape, **kw)
    else:
        got = kernelgen.conv_backward_weight(x, dy, w_shape, backend="cpu", out=out_bits(w_shape), **kw)
        want = ref.conv_backward_weight(xv, dyv, w_shape, **kw)
    check_bf16(got, want, direction)


def test_cpu_depthwise(rng):
    """The direct depthwise template on bfloat16 tensors (channels in eights)."""
    (x, xv), (w, wv) = bf16(rng, (2, 7, 7, 16)), bf16(rng, (16, 3, 3, 1))
    y = kernelgen.conv(x, w, padding=1, groups=16, backend="cpu", out=out_bits((2, 7, 7, 16)))
    check_bf16(y, ref.conv_forward(xv, wv, padding=1, groups=16), "depthwise")
    e = kernelgen.explain(kernelgen.conv, x, w, padding=1, groups=16, backend="cpu")
    assert e.variant == "depthwise" and e.precision == "bf16" and "bf16_bits_to_f32(" in e.source


def test_torch_cpu_tensors(rng):
    torch = pytest.importorskip("torch")
    (x, xv), (w, wv) = bf16(rng, (2, 5, 5, 8)), bf16(rng, (4, 3, 3, 8))
    tx, tw = (torch.from_numpy(a.bits.view(np.int16)).view(torch.bfloat16) for a in (x, w))
    y = kernelgen.conv(tx, tw, padding=1, backend="cpu")
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16
    check_bf16(y.view(torch.int16).numpy().view(np.uint16), ref.conv_forward(xv, wv, padding=1), "torch")


# --- the tensor-core templates on the CPU backend ---------------------------------------------------------

def _run(plan, arrays, out_name, out_shape):
    out = poisoned(int(np.prod(out_shape)), "bfloat16")
    get_launcher(plan)({**{n: a.bits.ravel() for n, a in arrays.items()}, out_name: out})
    return out.reshape(out_shape)


def test_cpu_tma_forward_reads_bfloat16_tiles(rng):
    """TMA boxes land bfloat16 as stored (64 to a 128-byte row) and each WarpgroupMma is of kind bf16."""
    x_shape, w_shape, kw = (2, 5, 7, 64), (40, 3, 3, 64), dict(padding=1)
    p = make_problem("fwd", x_shape, w_shape, dtype="bfloat16", **kw)
    plan = make_plan(p, "cpu", config=TileConfig(64, 40, 64, stages=2, WM=64, WN=40, wgmma=1, tma=1),
                     precision="bf16")
    launcher = get_launcher(plan)
    assert [(m[0], m[11]) for m in launcher.tensor_maps] == [("x_map", "bfloat16"), ("w_map", "bfloat16")]
    (x, xv), (w, wv) = bf16(rng, x_shape), bf16(rng, w_shape)
    y = _run(plan, {"x": x, "w": w}, "y", p.y_shape)
    check_bf16(y, ref.conv_forward(xv, wv, **kw), "tma fwd")


@pytest.mark.parametrize("b_mn", [0, 1])
def test_cpu_tma_backward_data(b_mn, rng):
    """Stride-1 backward-data: w through the launcher's flipped bfloat16 copy, or read as stored (b_mn)."""
    x_shape, w_shape, kw = (2, 5, 6, 24), (64, 3, 3, 24), dict(padding=1)
    p = make_problem("bwd_data", x_shape, w_shape, dtype="bfloat16", **kw)
    plan = make_plan(p, "cpu", config=TileConfig(64, 64 if b_mn else 24, 64, stages=2, WM=64, WN=64 if b_mn else 24,
                                                 wgmma=1, tma=1, b_mn=b_mn), precision="bf16")
    (w, wv), (dy, dyv) = bf16(rng, w_shape), bf16(rng, p.y_shape)
    w_bits = w.bits.copy()
    dx = _run(plan, {"dy": dy, "w": w}, "dx", x_shape)
    check_bf16(dx, ref.conv_backward_data(dyv, wv, x_shape, **kw), "tma bwd_data")
    np.testing.assert_array_equal(w.bits, w_bits)  # the caller's w untouched


def test_cpu_split_backward_weight_rounds_its_workspace(rng):
    """Split backward-weight adds into a float32 workspace the launcher rounds into the bfloat16 dw (no 16-bit
    atomic adds); the CPU backend runs the blocks in turn."""
    from kernelgen.render_cpu import render_cpu
    from kernelgen.runtime.cache import KERNELS
    from kernelgen.runtime.launch import Launcher
    from kernelgen.templates import implicit_gemm_tc
    kw = dict(padding=1)
    p = make_problem("bwd_weight", (2, 6, 6, 16), (16, 3, 3, 16), dtype="bfloat16", **kw)
    (x, xv), (dy, dyv) = bf16(rng, p.x_shape), bf16(rng, p.y_shape)
    cfg = TileConfig(32, 16, 16, split_k=3, stages=2, WM=16, WN=8)
    source = render_cpu(implicit_gemm_tc.build(p, cfg, "bf16"), parallel=False)
    launcher = KERNELS.get(("test_bf16_split", p, cfg), lambda: source, lambda m: Launcher.from_module(m, "cpu"))
    assert launcher.widened == ("dw",) and launcher.bfloat16
    for _ in range(2):  # (the workspace is zeroed every call)
        dw = poisoned(int(np.prod(p.w_shape)), "bfloat16")
        launcher({"x": x.bits.ravel(), "dy": dy.bits.ravel(), "dw": dw})
        check_bf16(dw.reshape(p.w_shape), ref.conv_backward_weight(xv, dyv, p.w_shape, **kw), "split dw",
                   accumulation=1e-4)


# --- CUDA rendering, the planner, refusals ------------------------------------------------------------------

def test_cuda_rendering():
    """bfloat16 loads widen by a shift (bf16_widen), stores narrow by cvt.rn.bf16.f32 (bf16_narrow), the TMA tiles
    are uint16 arrays of bits and the warpgroup MMAs take .bf16 operands."""
    p = make_problem("fwd", (4, 9, 9, 64), (64, 3, 3, 64), padding=1, dtype="bfloat16", has_bias=True,
                     activation="relu")
    staged = render_cuda(make_plan(p, "cuda", config=TileConfig(128, 64, 32, stages=2, WM=64, WN=32, swizzle=1),
                                   precision="bf16").kernel_ir(), cache=False)
    assert "bf16_widen(x[" in staged and "bf16_narrow(" in staged and "mma_m16n8k16_bf16(" in staged
    assert "bf16(" not in staged.replace("_bf16(", "")  # staging exact operands rounds nothing
    tma = render_cuda(make_plan(p, "cuda", config=TileConfig(128, 64, 64, stages=4, WM=64, WN=64, wgmma=1, tma=1),
                                precision="bf16").kernel_ir(), cache=False)
    assert "wgmma_bf16_m64n64k16(" in tma and "uint16" in tma and "BFLOAT16 = True" in tma


def test_an_untuned_bfloat16_problem_is_planned_as_its_float16_twin(monkeypatch):
    """The chain after the exact bf16 entry is the float16 problem's at fp16: its tuned entry here (and so its model and
    sm_90 TMA tile where it has none)."""
    from kernelgen import planner
    twin_cfg = TileConfig(128, 64, 64, stages=8, WM=64, WN=64, wgmma=1, tma=2)
    asked = []

    def tuned(problem, precision):
        asked.append((problem.dtype, precision))
        return twin_cfg if (problem.dtype, precision) == ("float16", "fp16") else None
    monkeypatch.setattr(planner, "tuned_tensor_core_config", tuned)
    p = make_problem("fwd", (2, 8, 8, 64), (64, 3, 3, 64), padding=1, dtype="bfloat16")
    plan = make_plan(p, "cuda", precision="bf16")
    assert asked == [("bfloat16", "bf16"), ("float16", "fp16")]
    assert plan.config == twin_cfg and plan.precision == "bf16" and plan.decided_by == "tuned"
    assert plan.reason.startswith("as the float16 problem at fp16")
    assert planner.check_dtype_precision("bfloat16", "bf16") is None


@pytest.mark.parametrize("precision", ["fp32", "tf32", "fp16"])
def test_bfloat16_needs_precision_bf16(precision, rng):
    (x, _), (w, _) = bf16(rng, (1, 4, 4, 8)), bf16(rng, (4, 3, 3, 8))
    with pytest.raises(ValueError, match='bfloat16 tensors need precision="bf16"'):
        kernelgen.conv(x, w, backend="cpu", precision=precision)


def test_mixed_dtypes_are_refused(rng):
    x, _ = bf16(rng, (1, 4, 4, 8))
    with pytest.raises(TypeError, match="must not be bfloat16 unless every tensor"):
        kernelgen.conv(x, np.ones((4, 3, 3, 8), np.float32), backend="cpu")
    assert NAN_BITS == poisoned(1, "bfloat16")[0]
