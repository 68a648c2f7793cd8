"""The four public ops on the CPU backend against the float64 reference (kernelgen.reference).

Every new shape costs a numba compile (~2-4 s), so the hand-picked cases are chosen to cover the
template's code paths (tile-multiple and ragged GEMM dims, channel counts that are and are not a
multiple of BK, bounds checks on and off, strided zero-insertion in backward-data, groups) and
hypothesis adds a few random shapes per run on top.  The reference itself is checked first, by
a naive loop, by the adjoint identities and (when installed) by torch.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import kernelgen
from kernelgen.problem import deconv_output_shape
from kernelgen import reference as ref
from kernelgen.problem import make_problem
from harness import direction_inputs, poisoned, run_poisoned


@dataclass(frozen=True)
class Case:
    x_shape: tuple
    w_shape: tuple
    stride: object = 1
    padding: object = 0
    dilation: object = 1
    groups: int = 1

    @property
    def kw(self):
        return dict(stride=self.stride, padding=self.padding, dilation=self.dilation, groups=self.groups)

    def problem(self, direction, dtype="float32", **extra):
        return make_problem(direction, self.x_shape, self.w_shape, dtype=dtype, **self.kw, **extra)


CASES = {
    # M, N, K of every direction ragged against the 32x32x8 CPU tiles; groups; per-dim stride/padding
    "2d_groups_ragged": Case((3, 7, 9, 6), (10, 3, 3, 3), stride=(2, 1), padding=(1, 2), groups=2),
    "1d_stride3_dil2": Case((3, 17, 5), (7, 4, 5), stride=3, padding=2, dilation=2),
    "3d_mixed": Case((1, 5, 6, 7, 4), (6, 2, 3, 2, 2), stride=(1, 2, 1), padding=(0, 1, 1), dilation=(2, 1, 1),
                     groups=2),
    "2d_depthwise_dil2": Case((2, 6, 6, 8), (8, 3, 3, 1), padding=1, dilation=2, groups=8),
    # 1x1, stride 1, no padding: no bounds tests at all; C = 16 is a multiple of BK (per-slice tap decode)
    "2d_1x1_channels_x_bk": Case((2, 5, 5, 16), (24, 1, 1, 16)),
    "2d_cg8_stride2": Case((1, 9, 8, 8), (5, 3, 3, 8), stride=2, padding=1),
}
FLOAT64_CASES = ("2d_groups_ragged", "3d_mixed")


def run_direction(direction, case: Case, dtype, rng, bias=True):
    """Run one direction through the public API on the CPU; return (got, float64 reference)."""
    p = case.problem("fwd")
    x = rng.standard_normal(case.x_shape).astype(dtype)
    w = rng.standard_normal(case.w_shape).astype(dtype)
    dy = rng.standard_normal(p.y_shape).astype(dtype)
    if direction == "fwd":
        b = rng.standard_normal(p.K).astype(dtype) if bias else None
        return (kernelgen.conv(x, w, b, backend="cpu", **case.kw),
                ref.conv_forward(x, w, b, **case.kw))
    if direction == "bwd_data":
        return (kernelgen.conv_backward_data(dy, w, case.x_shape, backend="cpu", **case.kw),
                ref.conv_backward_data(dy, w, case.x_shape, **case.kw))
    return (kernelgen.conv_backward_weight(x, dy, case.w_shape, backend="cpu", **case.kw),
            ref.conv_backward_weight(x, dy, case.w_shape, **case.kw))


DIRECTIONS = ("fwd", "bwd_data", "bwd_weight")


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("name", list(CASES))
def test_cases_float32(name, direction, rng, assert_close):
    got, want = run_direction(direction, CASES[name], "float32", rng)
    assert isinstance(got, np.ndarray)
    assert_close(got, want, "float32", f"{direction} {name}")


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("name", FLOAT64_CASES)
def test_cases_float64(name, direction, rng, assert_close):
    got, want = run_direction(direction, CASES[name], "float64", rng)
    assert_close(got, want, "float64", f"{direction} {name}")


# --- deconv (transposed convolution) ------------------------------------------------------------

DECONV_CASES = {
    "2d_groups_bias": (dict(x=(2, 4, 5, 6), w=(6, 3, 3, 4), bias=True),
                       dict(stride=2, padding=1, output_padding=1, groups=2)),
    "1d_stride3": (dict(x=(1, 7, 3), w=(3, 5, 2), bias=False), dict(stride=3, padding=2, output_padding=2)),
    "3d_mixed": (dict(x=(1, 3, 3, 2, 4), w=(4, 2, 2, 3, 3), bias=True),
                 dict(stride=(2, 1, 2), padding=(0, 1, 1), output_padding=(1, 0, 0), dilation=(1, 2, 1))),
    # output_padding >= stride is legal when dilation > stride (PyTorch: < max(stride, dilation)); the
    # trailing outputs then see no input at all
    "2d_outpad_from_dilation": (dict(x=(1, 5, 4, 2), w=(2, 2, 3, 3), bias=False),
                                dict(stride=(2, 1), padding=(2, 0), dilation=3, output_padding=2)),
}


@pytest.mark.parametrize("name", list(DECONV_CASES))
def test_deconv(name, rng, assert_close):
    shapes, kw = DECONV_CASES[name]
    dtype = "float64" if name == "3d_mixed" else "float32"
    x = rng.standard_normal(shapes["x"]).astype(dtype)
    w = rng.standard_normal(shapes["w"]).astype(dtype)
    c_out = shapes["w"][-1] * kw.get("groups", 1)
    b = rng.standard_normal(c_out).astype(dtype) if shapes["bias"] else None
    got = kernelgen.deconv(x, w, b, backend="cpu", **kw)
    assert_close(got, ref.deconv(x, w, b, **kw), dtype, f"deconv {name}")


# --- hypothesis: random small problems ------------------------------------------------------------

@st.composite
def conv_cases(draw, max_ndim=3):
    ndim = draw(st.integers(1, max_ndim))
    groups = draw(st.integers(1, 3))
    cg, kg, n = draw(st.integers(1, 5)), draw(st.integers(1, 5)), draw(st.integers(1, 3))
    filt, stride, pad, dil, size = [], [], [], [], []
    for _ in range(ndim):
        f, d = draw(st.integers(1, 3)), draw(st.integers(1, 2))
        p = draw(st.integers(0, 2))
        span = d * (f - 1) + 1
        filt.append(f), dil.append(d), pad.append(p), stride.append(draw(st.integers(1, 3)))
        size.append(draw(st.integers(max(1, span - 2 * p), max(1, span - 2 * p) + (6 if ndim < 3 else 3))))
    return Case((n, *size, cg * groups), (kg * groups, *filt, cg), tuple(stride), tuple(pad), tuple(dil), groups)


@settings(max_examples=6)  # (CI time: a CPU compile or two each; fresh shapes every run)
@given(case=conv_cases(), direction=st.sampled_from(DIRECTIONS), dtype=st.sampled_from(["float32", "float64"]),
       bias=st.booleans(), seed=st.integers(0, 2**63))
def test_random_problems(case, direction, dtype, bias, seed, assert_close):
    got, want = run_direction(direction, case, dtype, np.random.default_rng(seed), bias)
    assert_close(got, want, dtype, f"{direction} {case}")


@settings(max_examples=4)
@given(case=conv_cases(max_ndim=2), data=st.data(), seed=st.integers(0, 2**63))
def test_random_deconv(case, data, seed, assert_close):
    # the deconv of x with w is the backward-data of the conv (K, *f, Cg) whose output x would be
    rng = np.random.default_rng(seed)
    op = tuple(data.draw(st.integers(0, max(s, d) - 1)) for s, d in zip(case.stride, case.dilation))
    y_shape = case.problem("fwd").y_shape
    x = rng.standard_normal(y_shape).astype("float32")
    w = rng.standard_normal(case.w_shape).astype("float32")
    b = rng.standard_normal(case.x_shape[-1]).astype("float32")
    kw = dict(stride=case.stride, padding=case.padding, dilation=case.dilation, groups=case.groups,
              output_padding=op)
    try:  # padding can exceed what the transposed conv gives back: an empty output is rightly an error
        deconv_output_shape(x.shape, w.shape, case.stride, case.padding, op, case.dilation, case.groups)
    except ValueError:
        assume(False)
    got = kernelgen.deconv(x, w, b, backend="cpu", **kw)
    assert_close(got, ref.deconv(x, w, b, **kw), "float32", f"deconv {case} output_padding={op}")


# --- every output element is written: poisoned outputs at the launcher level -------------------------

def gemm_dims(p):
    """(M, N, K) of the implicit GEMM per group, as the template sees it."""
    out, inp, taps = np.prod(p.out_size), np.prod(p.in_size), np.prod(p.filter_size)
    return {"fwd": (p.N * out, p.Kg, taps * p.Cg), "bwd_data": (p.N * inp, p.Cg, taps * p.Kg),
            "bwd_weight": (p.Kg, taps * p.Cg, p.N * out)}[p.direction]


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_every_output_written(direction, rng, assert_close):
    case = CASES["2d_groups_ragged"]
    p = case.problem(direction, has_bias=direction == "fwd")
    inputs, want = direction_inputs(p, case.kw, rng)
    plan, got = run_poisoned(p, inputs, "cpu", "implicit_gemm")
    cfg = plan.config
    M, N, K = gemm_dims(p)
    assert M % cfg.BM and N % cfg.BN and K % cfg.BK, "this case must leave partial tiles in every GEMM dim"
    assert not np.isnan(got).any(), f"{np.isnan(got).sum()} of {got.size} outputs never written"
    assert_close(got, want, "float32", direction)


def test_relu_epilogue_poisoned(rng, assert_close):
    """The fused bias + relu epilogue at the plan level (kernelgen.conv(activation="relu") below)."""
    case = CASES["2d_groups_ragged"]
    p = case.problem("fwd", has_bias=True, activation="relu")
    inputs, want = direction_inputs(p, case.kw, rng)  # want: relu(conv + bias)
    _, got = run_poisoned(p, inputs, "cpu", "implicit_gemm")
    assert set(inputs) == {"x", "w", "bias"} and (want == 0).any() and (want > 0).any()
    assert_close(got, want, "float32", "relu(conv + bias)")


# --- API behaviour around the kernels ------------------------------------------------------------

def test_non_contiguous_inputs_and_default_backend(rng, assert_close):
    case = CASES["2d_groups_ragged"]
    big = rng.standard_normal((3, 14, 9, 6)).astype("float32")
    x = big[:, ::2]  # a strided view of the right shape
    assert not x.flags.c_contiguous
    w, b = rng.standard_normal(case.w_shape).astype("float32"), rng.standard_normal(10).astype("float32")
    got = kernelgen.conv(x, w, b, **case.kw)  # backend=None: no real GPU here -> cpu, NumPy out
    assert isinstance(got, np.ndarray)
    assert_close(got, ref.conv_forward(x, w, b, **case.kw), "float32")


def test_int_and_tuple_hyperparameters_agree(rng):
    case = CASES["2d_cg8_stride2"]
    x = rng.standard_normal(case.x_shape).astype("float32")
    w, b = rng.standard_normal(case.w_shape).astype("float32"), rng.standard_normal(5).astype("float32")
    first = kernelgen.conv(x, w, b, stride=2, padding=1, backend="cpu")
    second = kernelgen.conv(x, w, b, stride=(2, 2), padding=[1, 1], dilation=(1, 1), backend="cpu")
    np.testing.assert_array_equal(first, second)


# --- the reference itself ------------------------------------------------------------------------

def naive_conv(x, w, stride, padding, dilation, groups):
    """Direct definition, one output element at a time (2D only, tiny shapes)."""
    N, H, W, C = x.shape
    K, R, S, Cg = w.shape
    P = (H + 2 * padding - dilation * (R - 1) - 1) // stride + 1
    Q = (W + 2 * padding - dilation * (S - 1) - 1) // stride + 1
    y = np.zeros((N, P, Q, K))
    Kg = K // groups
    for n, p, q, k, r, s, c in itertools.product(range(N), range(P), range(Q), range(K), range(R), range(S),
                                                 range(Cg)):
        h, v = p * stride - padding + r * dilation, q * stride - padding + s * dilation
        if 0 <= h < H and 0 <= v < W:
            y[n, p, q, k] += x[n, h, v, (k // Kg) * Cg + c] * w[k, r, s, c]
    return y


def test_reference_forward_matches_naive_loop(rng):
    x, w = rng.standard_normal((2, 6, 5, 4)), rng.standard_normal((6, 3, 2, 2))
    got = ref.conv_forward(x, w, stride=2, padding=1, dilation=2, groups=2)
    np.testing.assert_allclose(got, naive_conv(x, w, 2, 1, 2, 2), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", list(CASES))
def test_reference_backwards_are_adjoints(name, rng):
    """<conv(x, w), dy> = <x, dx(dy, w)> = <w, dw(x, dy)>: the backward references are the transposes."""
    case = CASES[name]
    p = case.problem("fwd")
    x, w, dy = (rng.standard_normal(s) for s in (p.x_shape, p.w_shape, p.y_shape))
    lhs = np.vdot(ref.conv_forward(x, w, **case.kw), dy)
    dx = ref.conv_backward_data(dy, w, p.x_shape, **case.kw)
    dw = ref.conv_backward_weight(x, dy, p.w_shape, **case.kw)
    np.testing.assert_allclose([np.vdot(x, dx), np.vdot(w, dw)], [lhs, lhs], rtol=1e-10)


def test_reference_matches_torch(rng):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    x, w, b = rng.standard_normal((2, 7, 6, 4)), rng.standard_normal((6, 3, 3, 2)), rng.standard_normal(6)
    kw = dict(stride=2, padding=1, dilation=(1, 2), groups=2)
    to_t = lambda a, perm: torch.from_numpy(np.ascontiguousarray(a.transpose(perm)))
    want = F.conv2d(to_t(x, (0, 3, 1, 2)), to_t(w, (0, 3, 1, 2)), torch.from_numpy(b), **kw)
    np.testing.assert_allclose(ref.conv_forward(x, w, b, **kw), want.numpy().transpose(0, 2, 3, 1), rtol=1e-10,
                               atol=1e-10)
    # conv_transpose2d weight is (C_in, C_out // groups, R, S): ours is (C_in, R, S, C_out // groups)
    xd, wd = rng.standard_normal((2, 4, 5, 6)), rng.standard_normal((6, 3, 3, 4))
    bd = rng.standard_normal(8)
    for kw in (dict(stride=(2, 3), padding=1, output_padding=(1, 2), dilation=1, groups=2),
               dict(stride=(2, 1), padding=(2, 0), output_padding=2, dilation=3, groups=2)):
        want = F.conv_transpose2d(to_t(xd, (0, 3, 1, 2)), to_t(wd, (0, 3, 1, 2)), torch.from_numpy(bd), **kw)
        np.testing.assert_allclose(ref.deconv(xd, wd, bd, **kw), want.numpy().transpose(0, 2, 3, 1),
                                   rtol=1e-10, atol=1e-10, err_msg=str(kw))


@pytest.mark.parametrize("with_bias", [True, False])
def test_conv_activation_argument(rng, assert_close, with_bias):
    x = rng.standard_normal((2, 7, 6, 5)).astype(np.float32)
    w = rng.standard_normal((6, 3, 3, 5)).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32) if with_bias else None
    out = poisoned((2, 7, 6, 6))  # every output must be written
    got = kernelgen.conv(x, w, b, padding=1, activation="relu", backend="cpu", out=out)
    want = np.maximum(ref.conv_forward(x, w, b, padding=1), 0.0)
    assert got is out and (want == 0).any() and (want > 0).any()
    assert_close(got, want, "float32", "conv(activation='relu')")
    for bad in ("gelu", "ReLU", ["relu"], 0):
        with pytest.raises(ValueError, match="activation must be one of"):
            kernelgen.conv(x, w, b, padding=1, activation=bad, backend="cpu")
