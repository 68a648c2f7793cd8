"""ConvProblem: shapes, 3D normalisation, the specialisation key, derived sizes."""
from __future__ import annotations

import numpy as np
import pytest

from kernelgen.problem import ConvProblem, conv_out_size, deconv_output_shape, make_problem


def test_shapes_and_normalisation_2d():
    p = make_problem("fwd", (2, 7, 9, 6), (10, 3, 3, 3), stride=(2, 1), padding=1, dilation=(1, 2), groups=2)
    assert (p.N, p.C, p.K, p.Cg, p.Kg, p.groups, p.ndim) == (2, 6, 10, 3, 5, 2, 2)
    assert p.in_size == (1, 7, 9) and p.filter_size == (1, 3, 3)
    assert p.stride == (1, 2, 1) and p.padding == (0, 1, 1) and p.dilation == (1, 1, 2)
    assert p.out_size == (1, 4, 7)  # (7 + 2 - 3) // 2 + 1, (9 + 2 - 5) // 1 + 1
    assert p.x_shape == (2, 7, 9, 6) and p.w_shape == (10, 3, 3, 3) and p.y_shape == (2, 4, 7, 10)
    assert {d: make_problem(d, p.x_shape, p.w_shape, stride=(2, 1), padding=1, dilation=(1, 2),
                            groups=2).output_shape for d in ("fwd", "bwd_data", "bwd_weight")} == \
        {"fwd": p.y_shape, "bwd_data": p.x_shape, "bwd_weight": p.w_shape}


@pytest.mark.parametrize("x_shape, w_shape, out", [((3, 11, 4), (5, 3, 4), (1, 1, 9)),
                                                   ((1, 4, 5, 6, 2), (3, 2, 3, 4, 2), (3, 3, 3))])
def test_1d_and_3d(x_shape, w_shape, out):
    p = make_problem("fwd", x_shape, w_shape)
    assert p.ndim == len(x_shape) - 2 and p.out_size == out
    assert p.x_shape == x_shape and p.w_shape == w_shape and p.y_shape[1:-1] == out[3 - p.ndim:]


@pytest.mark.parametrize("size, f, s, pad, d", [(7, 3, 2, 1, 1), (9, 3, 1, 2, 2), (5, 1, 3, 0, 1), (6, 4, 3, 0, 1)])
def test_conv_out_size_matches_sliding_windows(size, f, s, pad, d):
    starts = [o for o in range(-pad, size + pad) if o + d * (f - 1) < size + pad][::s]
    assert conv_out_size(size, f, s, pad, d) == len(starts)


def test_key_is_stable_readable_and_distinguishes_everything():
    base = dict(stride=1, padding=1, dilation=1, groups=1)
    p = make_problem("fwd", (2, 8, 8, 4), (6, 3, 3, 4), **base)
    assert p.key() == "fwd_n2_c4_k6_i8x8_f3x3_s1x1_p1x1_d1x1_g1_float32"
    assert p.key().isidentifier()
    variants = [make_problem("bwd_data", (2, 8, 8, 4), (6, 3, 3, 4), **base),
                make_problem("fwd", (2, 8, 8, 4), (6, 3, 3, 4), **{**base, "stride": (1, 2)}),
                make_problem("fwd", (2, 8, 8, 4), (6, 3, 3, 4), **{**base, "padding": (1, 0)}),
                make_problem("fwd", (2, 8, 8, 4), (6, 3, 3, 4), **{**base, "dilation": 2}),
                make_problem("fwd", (2, 8, 8, 4), (6, 3, 3, 2), **{**base, "groups": 2}),
                make_problem("fwd", (2, 8, 8, 4), (6, 3, 3, 4), dtype="float64", **base),
                make_problem("fwd", (2, 8, 8, 4), (6, 3, 3, 4), has_bias=True, **base),
                make_problem("fwd", (2, 8, 8, 4), (6, 3, 3, 4), has_bias=True, activation="relu", **base),
                make_problem("fwd", (1, 2, 8, 8, 4), (6, 1, 3, 3, 4), **base),  # same sizes as 3D: ndim differs
                make_problem("fwd", (3, 8, 8, 4), (6, 3, 3, 4), **base)]
    keys = [p.key()] + [v.key() for v in variants]
    assert len(set(keys)) == len(keys)
    # equal problems are equal, hashable cache keys
    again = make_problem("fwd", [2, 8, 8, 4], (6, 3, 3, 4), stride=(1, 1), padding=[1, 1])
    assert again == p and hash(again) == hash(p) and again.key() == p.key()


def test_flops_and_with_direction():
    p = make_problem("fwd", (2, 8, 8, 4), (6, 3, 3, 2), padding=1, groups=2, has_bias=True, activation="relu")
    assert p.flops == 2 * 2 * 8 * 8 * 6 * 2 * 9
    q = p.with_direction("bwd_weight")
    assert q.direction == "bwd_weight" and not q.has_bias and q.activation is None and q.flops == p.flops


def test_consistency_checks_in_the_dataclass():
    with pytest.raises(ValueError, match="output size"):
        ConvProblem("fwd", 1, 2, 2, (1, 1, 5), (1, 1, 3), (1, 1, 4), (1, 1, 1), (0, 0, 0), (1, 1, 1))
    with pytest.raises(ValueError, match="direction"):
        make_problem("sideways", (1, 5, 2), (2, 3, 2))
    with pytest.raises(TypeError, match="dtype"):
        make_problem("fwd", (1, 5, 2), (2, 3, 2), dtype="int16")
    assert make_problem("fwd", (1, 5, 2), (2, 3, 2), dtype="float16").key().endswith("_float16")  # storage
    assert make_problem("fwd", (1, 5, 2), (2, 3, 2), dtype="bfloat16").key().endswith("_bfloat16")
    with pytest.raises(ValueError, match="activation"):
        make_problem("fwd", (1, 5, 2), (2, 3, 2), activation="gelu_maybe")


@pytest.mark.parametrize("x_shape, w_shape, kw", [
    ((2, 4, 5, 6), (6, 3, 3, 4), dict(stride=2, padding=1, output_padding=1, dilation=1, groups=2)),
    ((1, 7, 3), (3, 5, 2), dict(stride=3, padding=2, output_padding=2, dilation=1, groups=1)),
    ((1, 5, 4, 2), (2, 2, 3, 3), dict(stride=(2, 1), padding=(2, 0), output_padding=2, dilation=3, groups=1)),
])
def test_deconv_output_shape(x_shape, w_shape, kw):
    nd = len(x_shape) - 2
    t = lambda v: v if isinstance(v, tuple) else (v,) * nd
    want = tuple((i - 1) * s - 2 * p + d * (f - 1) + op + 1 for i, f, s, p, d, op in zip(
        x_shape[1:-1], w_shape[1:-1], t(kw["stride"]), t(kw["padding"]), t(kw["dilation"]), t(kw["output_padding"])))
    got = deconv_output_shape(x_shape, w_shape, kw["stride"], kw["padding"], kw["output_padding"], kw["dilation"],
                              kw["groups"])
    assert got == (x_shape[0],) + want + (w_shape[-1] * kw["groups"],)
    torch = pytest.importorskip("torch")
    xt = torch.zeros((x_shape[0], x_shape[-1]) + x_shape[1:-1])
    wt = torch.zeros((w_shape[0], w_shape[-1]) + w_shape[1:-1])
    fn = {1: torch.nn.functional.conv_transpose1d, 2: torch.nn.functional.conv_transpose2d}[nd]
    assert tuple(fn(xt, wt, **kw).shape[2:]) == want


def test_numpy_integers_accepted():
    p = make_problem("fwd", tuple(np.int64(v) for v in (1, 6, 3)), (2, 3, 3), stride=np.int32(2),
                     padding=(np.int64(1),), groups=np.int64(1))
    assert p.stride == (1, 1, 2) and p.padding == (0, 0, 1) and isinstance(p.stride[-1], int)
