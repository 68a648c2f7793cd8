"""Winograd transforms (exact rational generation) against direct correlation."""
from fractions import Fraction as Fr

import numpy as np
import pytest

from kernelgen import settings as kg_settings

from kernelgen.templates.winograd_transforms import STATES, winograd_matrices, supported

COMBOS = [(a, r) for a in STATES for r in range(2, 10) if supported(a, r)]


def _as_float(m):
    return np.array([[float(v) for v in row] for row in m], dtype=np.float64)


def test_f23_matches_lavin_gray_up_to_row_scaling():
    AT, G, BT = winograd_matrices(2, 3)
    lavin_AT = [[1, 1, 1, 0], [0, 1, -1, -1]]
    lavin_G = [[1, 0, 0], [Fr(1, 2), Fr(1, 2), Fr(1, 2)], [Fr(1, 2), Fr(-1, 2), Fr(1, 2)], [0, 0, 1]]
    lavin_BT = [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]]
    # Equivalent up to per-state scalings (AT columns, G rows, BT rows whose product is 1):
    # for every state i, the rank-1 term AT[:, i] x G[i] x BT[i] must be identical.
    for i in range(4):
        ours = [[[AT[o][i] * G[i][j] * BT[i][k] for k in range(4)] for j in range(3)] for o in range(2)]
        theirs = [[[Fr(lavin_AT[o][i]) * Fr(lavin_G[i][j]) * Fr(lavin_BT[i][k]) for k in range(4)]
                   for j in range(3)] for o in range(2)]
        assert ours == theirs, i
    # Same points (0, 1, -1, inf): the finite G rows agree with Lavin's up to sign only.
    for i in range(4):
        assert [abs(v) for v in G[i]] == [abs(Fr(v)) for v in lavin_G[i]]


def test_combos_cover_issue_range():
    assert len(COMBOS) == 2 + 6 + 8  # alpha 4: r 2,3; alpha 8: r 2..7; alpha 16: r 2..9
    assert (4, 3) in COMBOS and (16, 9) in COMBOS and (8, 8) not in COMBOS


@pytest.mark.parametrize("alpha,r", COMBOS)
def test_transform_equals_direct_correlation(alpha, r):
    n = alpha - r + 1
    AT, G, BT = (_as_float(m) for m in winograd_matrices(n, r))
    assert AT.shape == (n, alpha) and G.shape == (alpha, r) and BT.shape == (alpha, alpha)
    rng = np.random.default_rng(alpha * 100 + r)
    for _ in range(5):
        g = rng.standard_normal(r)
        d = rng.standard_normal(alpha)
        direct = np.array([g @ d[i:i + r] for i in range(n)])
        wino = AT @ ((G @ g) * (BT @ d))
        np.testing.assert_allclose(wino, direct, rtol=1e-9, atol=1e-9 * np.abs(d).sum() * np.abs(g).sum())
    # Exactness: the rational product reproduces correlation exactly on integer data.
    AT_f, G_f, BT_f = winograd_matrices(n, r)
    g = [Fr(int(v)) for v in rng.integers(-5, 6, r)]
    d = [Fr(int(v)) for v in rng.integers(-5, 6, alpha)]
    gg = [sum(G_f[i][j] * g[j] for j in range(r)) for i in range(alpha)]
    dd = [sum(BT_f[i][j] * d[j] for j in range(alpha)) for i in range(alpha)]
    y = [sum(AT_f[o][i] * gg[i] * dd[i] for i in range(alpha)) for o in range(n)]
    assert y == [sum(g[j] * d[o + j] for j in range(r)) for o in range(n)]


# --- kernels ----------------------------------------------------------------------------------------
import kernelgen  # noqa: E402
from kernelgen import reference as R  # noqa: E402
from kernelgen.problem import make_problem  # noqa: E402
from kernelgen.target import STATIC_SHARED_BYTES  # noqa: E402
from kernelgen.templates import winograd  # noqa: E402
from kernelgen.templates.config import TileConfig  # noqa: E402
from harness import launch_poisoned  # noqa: E402

CPU_CFG = TileConfig(*winograd.CPU_TILE)
TINY = TileConfig(BM=4, BN=4, BK=2, TM=2, TN=2, smem_pad=4)  # 4 threads: the simulator's cost is per thread


def _run_alpha(direction, alpha, src, w, x_shape, padding, groups, backend="cpu", bias=None, cfg=CPU_CFG):
    """Run the winograd kernel with an explicit state count and config, into a NaN-poisoned output."""
    from kernelgen.render_cpu import render_cpu
    from kernelgen.render_cuda import render_cuda
    from kernelgen.runtime.cache import KERNELS
    from kernelgen.runtime.launch import Launcher
    dtype = "float64" if src.dtype == np.float64 else "float32"
    p = make_problem(direction, x_shape, w.shape, stride=1, padding=padding, dilation=1, groups=groups,
                     dtype=dtype, has_bias=bias is not None)
    kernel = winograd.build(p, cfg, alpha)
    render = render_cuda if backend == "cuda" else render_cpu
    launcher = KERNELS.get(("winograd-test", p.key(), alpha, str(cfg), backend), lambda: render(kernel),
                           lambda m: Launcher.from_module(m, backend))
    inputs = {"x" if direction == "fwd" else "dy": src, "w": w}
    if bias is not None:
        inputs["bias"] = bias
    return launch_poisoned(launcher, p, inputs, backend)


def _case(rng, alpha, r, direction, dtype=np.float64, groups=1, pad=None, H=3, C=5, K=6, bias=False,
          cfg=CPU_CFG, backend="cpu", fh=2):
    """C = 5 and K = 6 are not multiples of the CPU tile's BK = 4 / BN = 8; the output width is not
    a multiple of n; filter height fh = 2 with padding makes rows fall off the top and bottom."""
    n = alpha - r + 1
    W = n + r + 1
    pad = (r // 2) if pad is None else pad
    x_shape = (2, H, W, C * groups)
    w = rng.standard_normal((K * groups, fh, r, C)).astype(dtype)
    b = rng.standard_normal(K * groups).astype(dtype) if bias else None
    if direction == "fwd":
        x = rng.standard_normal(x_shape).astype(dtype)
        got = _run_alpha("fwd", alpha, x, w, x_shape, pad, groups, backend, b, cfg)
        want = R.conv_forward(x.astype(np.float64), w.astype(np.float64), b, padding=pad, groups=groups)
    else:
        oh, ow = H + 2 * pad - fh + 1, W + 2 * pad - r + 1
        dy = rng.standard_normal((2, oh, ow, K * groups)).astype(dtype)
        got = _run_alpha("bwd_data", alpha, dy, w, x_shape, pad, groups, backend, cfg=cfg)
        want = R.conv_backward_data(dy.astype(np.float64), w.astype(np.float64), x_shape, padding=pad,
                                    groups=groups)
    assert not np.isnan(got).any(), "an output was never written"
    return got, want


# every width for 4 and 8 states; two of the slow-to-compile 16-state kernels
@pytest.mark.parametrize("alpha,r", [(a, r) if a < 16 else pytest.param(a, r, marks=pytest.mark.slow)  # (CI time)
                                     for a, r in COMBOS if a < 16 or r in (3, 9)])
def test_forward_float64_every_state_and_width(alpha, r):
    rng = np.random.default_rng()
    got, want = _case(rng, alpha, r, "fwd", groups=2 if r % 2 else 1, bias=r == 3)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9 * np.abs(want).max())


@pytest.mark.parametrize("alpha,r,pad", [(4, 3, 2), (4, 2, 1), (8, 2, 0), (8, 3, 1), (8, 4, 3), (8, 5, 2),
                                         (8, 6, 1), (8, 7, 3), (16, 9, 4)])
def test_backward_data_float64(alpha, r, pad):
    rng = np.random.default_rng()
    got, want = _case(rng, alpha, r, "bwd_data", groups=2 if r in (3, 6) else 1, pad=pad)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9 * np.abs(want).max())


@pytest.mark.parametrize("direction", ["fwd", "bwd_data"])
def test_many_blocks_every_axis(direction):
    """Several blocks along tiles, channels and groups, several channel chunks: K = 10 over BN = 4,
    C = 5 over BK = 2, with the tiny simulator config run on the CPU."""
    rng = np.random.default_rng()
    got, want = _case(rng, 8, 3, direction, groups=2, C=5, K=10, H=4, bias=direction == "fwd", cfg=TINY)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9 * np.abs(want).max())


# 2-stage pipeline: reduction steps = filter rows x channel chunks, even (fh 2 x 2 chunks of C = 5 over
# BK = 4) and odd (fh 3 x 1 chunk of C = 3: the unrolled pair loop plus its tail step); widths ragged.  The 16-state
# kernels compile for ~a minute on the CPU: they run with the slow tests only (the 16-state kernels' single-stage
# forms run in CI: test_float32_accuracy[16-*], test_backward_data_float64[16-9-4]; 16 states are off by default)
@pytest.mark.parametrize("alpha,r,direction,fh,C,pad", [
    (4, 3, "fwd", 2, 5, None), pytest.param(4, 2, "fwd", 3, 3, None, marks=pytest.mark.slow),  # (r 2: 8 states in CI)
    (8, 2, "fwd", 2, 5, 0), (8, 5, "fwd", 3, 3, None),
    (8, 7, "fwd", 2, 5, None), pytest.param(16, 9, "fwd", 3, 3, None, marks=pytest.mark.slow),
    (4, 3, "bwd_data", 3, 3, 2), (8, 4, "bwd_data", 2, 5, 3), (8, 6, "bwd_data", 3, 5, 1),
    pytest.param(16, 3, "bwd_data", 2, 5, 1, marks=pytest.mark.slow)])
def test_two_stage_pipeline_float64(alpha, r, direction, fh, C, pad):
    rng = np.random.default_rng()
    cfg = TileConfig(*winograd.CPU_TILE, stages=2)
    got, want = _case(rng, alpha, r, direction, groups=2 if r % 2 else 1, pad=pad, C=C, fh=fh, cfg=cfg,
                      bias=direction == "fwd" and r == 3)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9 * np.abs(want).max())


@pytest.mark.parametrize("direction", ["fwd", "bwd_data"])
def test_two_stage_many_blocks_every_axis(direction):
    """Several blocks along every axis with 2 pipeline stages: 3 channel chunks x 3 filter rows = 9 steps."""
    rng = np.random.default_rng()
    cfg = TileConfig(**{**TINY.as_dict(), "stages": 2})
    got, want = _case(rng, 8, 3, direction, groups=2, C=5, K=10, H=4, bias=direction == "fwd", cfg=cfg, fh=3)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9 * np.abs(want).max())


@pytest.mark.parametrize("alpha,r,bound", [(4, 3, 2e-6), (8, 3, 1e-5), (8, 7, 1e-5), (16, 3, 2e-4),
                                           pytest.param(16, 9, 2e-4, marks=pytest.mark.slow)])  # (CI time)
def test_float32_accuracy(alpha, r, bound):
    rng = np.random.default_rng()
    got, want = _case(rng, alpha, r, "fwd", dtype=np.float32, C=16)
    rel = np.abs(got - want).max() / np.abs(want).max()
    assert rel <= bound, rel


def test_api_algo_winograd_with_bias_and_3d():
    rng = np.random.default_rng()
    x = rng.standard_normal((1, 3, 4, 7, 3))
    w = rng.standard_normal((4, 2, 3, 3, 3))
    b = rng.standard_normal(4)
    y = kernelgen.conv(x, w, b, padding=1, backend="cpu", algo="winograd")
    np.testing.assert_allclose(y, R.conv_forward(x, w, b, padding=1), rtol=1e-9, atol=1e-9)


def test_api_algo_winograd_1d_forward_and_backward_data():
    rng = np.random.default_rng()
    x, w = rng.standard_normal((2, 13, 6)), rng.standard_normal((5, 5, 6))
    y = kernelgen.conv(x, w, padding=2, backend="cpu", algo="winograd")
    np.testing.assert_allclose(y, R.conv_forward(x, w, padding=2), rtol=1e-9, atol=1e-9)
    dy = rng.standard_normal(y.shape)
    dx = kernelgen.conv_backward_data(dy, w, x.shape, padding=2, backend="cpu", algo="winograd")
    np.testing.assert_allclose(dx, R.conv_backward_data(dy, w, x.shape, padding=2), rtol=1e-9, atol=1e-9)


def test_accuracy_switch_and_applicability(monkeypatch, set_setting):
    p9 = make_problem("fwd", (1, 4, 12, 2), (2, 3, 9, 2), stride=1, padding=0, dilation=1, groups=1,
                      dtype="float32", has_bias=False)
    assert not kg_settings.get("winograd_16_states") and not winograd.applies(p9)  # width 9 needs 16 states
    set_setting(winograd_16_states=True)
    assert winograd.applies(p9)
    set_setting(winograd_states=(4, 8))
    assert not winograd.applies(p9)
    strided = make_problem("fwd", (1, 4, 12, 2), (2, 3, 3, 2), stride=2, padding=0, dilation=1, groups=1,
                           dtype="float32", has_bias=False)
    assert not winograd.applies(strided)
    with pytest.raises(ValueError, match="cannot compute"):
        kernelgen.conv(np.ones((1, 4, 12, 2)), np.ones((2, 3, 3, 2)), stride=2, backend="cpu", algo="winograd")
    from kernelgen.templates import candidates
    p3 = make_problem("fwd", (1, 4, 12, 2), (2, 3, 3, 2), stride=1, padding=1, dilation=1, groups=1,
                      dtype="float32", has_bias=False)
    assert candidates(p3)[0].name != "winograd"  # never the automatic choice until measured


def test_configs(monkeypatch, set_setting):
    """Default CUDA configs keep alpha*TM*TN = 64 accumulators, name their state count, and fit shared
    memory; config_ok rejects what the schedule does not implement or the settings forbid."""
    from kernelgen.templates import default_config
    from kernelgen.tuning.tuner import candidates as tune_candidates
    for S, width, alphas in ((3, 7, {4}), (3, 28, {4, 8}), (5, 28, {8}), (7, 28, {8})):  # F(6,3) wastes 5 of 12 at 7
        p = make_problem("fwd", (32, width, width, 64), (64, S, S, 64), padding=S // 2)
        cfg = default_config(p, "cuda", winograd.VARIANT)
        assert cfg.states in alphas and cfg.states * cfg.TM * cfg.TN <= 64 and cfg.threads <= 512, cfg
        assert cfg == winograd.candidate_configs(p, "cuda", [4, 8])[0]  # the modeled cheapest
        assert default_config(p, "cpu", winograd.VARIANT) == CPU_CFG
        cands = tune_candidates(p, ["winograd"])
        assert cands and all(v == "winograd" and winograd.config_ok(p, c) for v, c in cands)
        assert {c.states for _, c in cands} == ({4, 8} if S == 3 else {8})  # 3x3 tries F(2,3) and F(6,3)
        assert cfg.stages == winograd.preferred_stages(cfg)  # pipelined where the registers allow
        assert {c.stages for _, c in cands} == {1, 2}
        assert winograd.config_ok(p, TileConfig(32, 64, 8, 2, 4, stages=2, states=cfg.states))
        assert winograd.config_ok(p, TileConfig(32, 64, 8, 2, 4, split_k=2, states=cfg.states))
        assert not winograd.config_ok(p, TileConfig(32, 64, 8, 2, 4, split_k=9, states=cfg.states))  # 8 S steps
        relu = make_problem("fwd", (32, width, width, 64), (64, S, S, 64), padding=S // 2, activation="relu")
        assert not winograd.config_ok(relu, TileConfig(32, 64, 8, 2, 4, split_k=2, states=cfg.states))
    p = make_problem("fwd", (32, 28, 28, 64), (64, 3, 3, 64), padding=1)
    assert not winograd.config_ok(p, TileConfig(128, 128, 16, 8, 8, states=8))      # 64 KiB of shared memory
    assert winograd.config_ok(p, TileConfig(64, 32, 8, 4, 2, stages=2, states=8))  # 2 x 24 KiB: just fits
    assert not winograd.config_ok(p, TileConfig(64, 32, 8, 4, 2, smem_pad=4, stages=2, states=8))  # 52 KiB
    p14 = make_problem("fwd", (32, 14, 14, 256), (256, 3, 3, 256), padding=1)
    assert winograd.default_config(p14, "cuda") == TileConfig(64, 32, 8, 4, 2, smem_pad=4, stages=2, states=4)
    assert not winograd.config_ok(p, TileConfig(32, 32, 4, 2, 2, states=16))        # 16 states not allowed
    set_setting(winograd_16_states=True)
    assert winograd.config_ok(p, TileConfig(32, 32, 4, 2, 2, states=16))
    set_setting(winograd_states=(4, 16))
    assert not winograd.config_ok(p, TileConfig(32, 64, 8, 2, 4, states=8))


def test_cuda_render_scalarizes_registers():
    x = np.random.default_rng().standard_normal((1, 5, 9, 3)).astype(np.float32)
    w = np.random.default_rng().standard_normal((4, 3, 3, 3)).astype(np.float32)
    ex = kernelgen.explain(kernelgen.conv, x, w, padding=1, backend="cuda", algo="winograd")
    src = ex.source
    assert "local.array" not in src and "winograd" in src and "cuda.shared.array" in src
    # the default here is pipelined (4 states, 32 accumulators): the first step's barrier, one per step of
    # the unrolled pair, one for the tail (3 filter rows x 1 channel chunk = 3 steps)
    assert src.count("cuda.syncthreads()") == 4
    from kernelgen.render_cuda import render_cuda
    p = make_problem("fwd", x.shape, w.shape, padding=1)
    one = TileConfig(**{**winograd.default_config(p, "cuda").as_dict(), "stages": 1})
    src = render_cuda(winograd.build(p, one), cache=False)
    assert "local.array" not in src and src.count("cuda.syncthreads()") == 2  # stage V and U | outer products


def test_cuda_render_two_stages():
    """One barrier per step plus the first step's; constant stage indices; registers still scalarised."""
    from kernelgen.render_cuda import render_cuda
    for fh, C in ((2, 16), (3, 8)):  # 4 steps (pairs only) and 3 steps (a pair and the tail)
        p = make_problem("fwd", (1, 6, 13, C), (8, fh, 3, C), padding=1)
        cfg = TileConfig(64, 32, 8, 4, 2, smem_pad=4, stages=2, states=4)
        src = render_cuda(winograd.build(p, cfg), cache=False)
        steps = fh * (C // 8)
        assert "local.array" not in src and src.count("cuda.syncthreads()") == 1 + 2 + steps % 2, src


@pytest.mark.sim
def test_simulator_two_stages():
    rng = np.random.default_rng()
    cfg = TileConfig(**{**TINY.as_dict(), "stages": 2})
    for direction in ("fwd", "bwd_data"):
        got, want = _case(rng, 4, 3, direction, dtype=np.float32, H=2, C=3, K=3, pad=1, cfg=cfg, backend="cuda",
                          bias=direction == "fwd")
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.sim
@pytest.mark.parametrize("alpha,r", [(4, 3), (8, 5)])
def test_simulator_forward_and_backward_data(alpha, r):
    rng = np.random.default_rng()
    for direction in ("fwd", "bwd_data"):
        got, want = _case(rng, alpha, r, direction, dtype=np.float32, H=2, C=3, K=3, pad=1, cfg=TINY,
                          backend="cuda", bias=direction == "fwd")
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


# (stages, direction) per case: the 4-state case every pair; the 8-state ones (a minute of CPU compile a pair) two
# pairs each that together cover both stage counts in both directions, 2 and 4 groups
_ALL_PAIRS = ((1, "fwd"), (1, "bwd_data"), (2, "fwd"), (2, "bwd_data"))


# (CI: the 4-state case the two pairs the 8-state one leaves, 38 s -> 19 s; all four with the slow tests)
@pytest.mark.parametrize("alpha,r,groups,pairs", [(4, 3, 2, ((2, "fwd"), (1, "bwd_data"))),
                                                  pytest.param(4, 3, 2, _ALL_PAIRS, marks=pytest.mark.slow),
                                                  (8, 5, 4, ((1, "fwd"), (2, "bwd_data"))),
                                                  pytest.param(8, 3, 2, ((2, "fwd"), (1, "bwd_data")),
                                                               marks=pytest.mark.slow)])  # (CI time: 29 s)
def test_state_groups_float64(alpha, r, groups, pairs):
    """States split over thread groups: each group's products and its part of AT, added into y in turn."""
    rng = np.random.default_rng()
    for stages, direction in pairs:
        cfg = TileConfig(*winograd.CPU_TILE, stages=stages, state_groups=groups)
        got, want = _case(rng, alpha, r, direction, cfg=cfg, bias=direction == "fwd")
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9 * np.abs(want).max())


def test_state_groups_refused_where_they_cannot_run():
    p = make_problem("fwd", (2, 6, 9, 5), (6, 3, 3, 5), padding=1)
    relu = make_problem("fwd", (2, 6, 9, 5), (6, 3, 3, 5), padding=1, has_bias=True, activation="relu")
    cfg = TileConfig(*winograd.CPU_TILE, states=4, state_groups=2)
    assert winograd.config_ok(p, cfg) and cfg.threads == 2 * 16
    assert not winograd.config_ok(p, TileConfig(*winograd.CPU_TILE, states=4, state_groups=3))
    assert not winograd.config_ok(relu, cfg)
    assert not winograd.config_ok(p, TileConfig(*winograd.CPU_TILE, states=4, state_groups=2, split_k=2))
    with pytest.raises(ValueError, match="state_groups must divide the 4 states"):
        winograd.build(p, TileConfig(*winograd.CPU_TILE, state_groups=3), 4)
    from kernelgen.api import make_plan
    with pytest.raises(ValueError, match="state_groups is a Winograd schedule field"):
        make_plan(p, "cpu", "implicit_gemm", TileConfig(8, 8, 4, 2, 2, state_groups=2)).kernel_ir()


@pytest.mark.sim
def test_simulator_state_groups():
    rng = np.random.default_rng()
    cfg = TileConfig(**{**TINY.as_dict(), "state_groups": 2, "stages": 2})
    for direction in ("fwd", "bwd_data"):
        got, want = _case(rng, 4, 3, direction, dtype=np.float32, H=2, C=3, K=3, pad=1, cfg=cfg, backend="cuda",
                          bias=direction == "fwd")
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.sim
@pytest.mark.parametrize("stages", [1, 2])
def test_simulator_split_k(stages):
    """split_k blocks each add a part of the 6 reduction steps (2 filter rows x 3 chunks of C = 5) into the
    zeroed output: 2 splits of 3 steps (the 2-stage pair and its tail), 3 of 2; the bias only once (K = 5:
    backward-data reduces over 3 chunks of K too).  A split
    that does not divide the steps is refused before anything runs."""
    rng = np.random.default_rng()
    for split in (2, 3):
        cfg = TileConfig(**{**TINY.as_dict(), "stages": stages, "split_k": split})
        for direction in ("fwd", "bwd_data"):
            got, want = _case(rng, 4, 3, direction, dtype=np.float32, H=2, C=5, K=5, pad=1, cfg=cfg,
                              backend="cuda", bias=direction == "fwd")
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    p = make_problem("fwd", (1, 4, 6, 5), (3, 2, 3, 5), padding=1)
    with pytest.raises(ValueError, match="split_k must divide the 6 Winograd reduction steps"):
        winograd.build(p, TileConfig(**{**TINY.as_dict(), "split_k": 4}), 4)


def test_changing_the_state_settings_never_reuses_a_cached_kernel(monkeypatch, set_setting):
    """The state count comes from module settings, so it is part of the kernel cache key."""
    from kernelgen.api import make_plan
    from kernelgen.problem import make_problem
    p = make_problem("fwd", (1, 6, 12, 4), (4, 3, 3, 4), padding=1)
    before = make_plan(p, "cpu", "winograd").key()
    set_setting(winograd_states=(8, 16))
    assert make_plan(p, "cpu", "winograd").key() != before


@pytest.mark.slow  # ~2 minutes of NVVM + ptxas on 2 cores; the GPU tests assert the same resources on the H100
def test_ptx_has_no_local_memory(tmp_path):
    """The default CUDA configs of a 3x3 and a 7x7 table layer compile to sm_90 with no local memory
    and no spills (needs numba's NVVM and ptxas; scripts/ptxas_report.py reports every table shape)."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    if shutil.which("ptxas") is None:
        pytest.skip("ptxas not on PATH")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "ptx.json"
    res = subprocess.run([sys.executable, os.path.join(root, "scripts", "ptxas_report.py"), "--only",
                          "r50_3x3_14,c7x7_28", "--json", str(out)], capture_output=True, text=True)
    if not out.exists() and ("NVVM" in res.stderr or "libnvvm" in res.stderr):
        pytest.skip("no NVVM on this machine")
    rows = json.loads(out.read_text())
    assert len(rows) == 4, res.stdout + res.stderr
    assert all(r["local_bytes"] == 0 and r["spill_stores"] == 0 and r["registers"] <= 128 for r in rows), rows
    assert res.returncode == 0, res.stdout


# --- real GPU: one table shape per filter width, default CUDA configs (scripts/gpu_run.sh tests) ---
GPU_LAYERS = ["r50_3x3_28", "r18_c512_4", "c5x5_28", "c7x7_28", "c9x9_28"]


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["fwd", "bwd_data"])
@pytest.mark.parametrize("name", GPU_LAYERS)
def test_gpu_table_shapes(name, direction, rng, monkeypatch, set_setting):
    from numba import cuda
    from kernelgen.api import make_plan
    from kernelgen.tuning.shapes import load_table
    set_setting(winograd_16_states=True)  # the 9x9 layer needs 16 states
    layer = next(l for l in load_table("winograd")[1] if l.name == name)
    p = layer.problem(direction)
    from kernelgen.api import tuned_variant_config
    cfg = make_plan(p, "cuda", "winograd").config  # the tuned database's entry where this GPU has one
    assert cfg == (tuned_variant_config(p, "winograd") or winograd.default_config(p, "cuda")) and cfg.states
    x_shape, w_shape, kw = layer.shapes()
    w = rng.standard_normal(w_shape).astype(np.float32)
    pad = kw["padding"]
    if direction == "fwd":
        x, b = rng.standard_normal(x_shape).astype(np.float32), rng.standard_normal(p.K).astype(np.float32)
        got = kernelgen.conv(cuda.to_device(x), cuda.to_device(w), cuda.to_device(b), padding=pad, algo="winograd")
        want = R.conv_forward(x, w, b, padding=pad)
    else:
        dy = rng.standard_normal(p.y_shape).astype(np.float32)
        got = kernelgen.conv_backward_data(cuda.to_device(dy), cuda.to_device(w), x_shape, padding=pad,
                                           algo="winograd")
        want = R.conv_backward_data(dy, w, x_shape, padding=pad)
    got = np.asarray(got.copy_to_host() if hasattr(got, "copy_to_host") else got.cpu().numpy())
    assert not np.isnan(got).any()
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel <= (1e-3 if cfg.states == 16 else 1e-4), (cfg, rel)


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["fwd", "bwd_data"])  # one kernel per test: 16-state compiles take minutes
@pytest.mark.parametrize("states,groups,r", [(4, 2, 3), (8, 2, 3), (16, 4, 9), (16, 4, 5)])
def test_gpu_state_groups_ragged(states, groups, r, direction, rng, monkeypatch, set_setting):
    """32 x 32 tiles of 4 x 4 per thread with the states split over groups; ragged as the test below.
    16 states at r = 5 is the 12-wide epilogue whose > 1000 blocks overran numba's recursive CFG walk."""
    set_setting(winograd_16_states=True)
    cfg = TileConfig(32, 32, 8, 4, 4, smem_pad=4, states=states, state_groups=groups)
    got, want = _case(rng, states, r, direction, dtype=np.float32, H=9, C=37, K=45, bias=direction == "fwd",
                      cfg=cfg, backend="cuda", fh=3)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= (1e-3 if states == 16 else 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("states", [4, 8])
def test_gpu_every_output_written_ragged(states, stages, split_k, rng):
    """NaN-poisoned output; tiles, channels and widths ragged against the default tile; C = 37 over BK 8 x
    3 filter rows = 15 steps (odd: the 2-stage tail step runs; 3 splits of 5 steps, bias added once)."""
    cfg = TileConfig(*next(iter(winograd.CUDA_TILES[states])), smem_pad=4, stages=stages, states=states,
                     split_k=split_k)
    if winograd.shared_bytes(cfg, states) > STATIC_SHARED_BYTES:  # 8 states, 2 stages: unpadded rows
        cfg = TileConfig(**{**cfg.as_dict(), "smem_pad": 0})
    got, want = _case(rng, states, 3, "fwd", dtype=np.float32, H=9, C=37, K=45, bias=True, cfg=cfg, backend="cuda",
                      fh=3)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 1e-4
    got, want = _case(rng, states, 3, "bwd_data", dtype=np.float32, H=9, C=37, K=45, cfg=cfg, backend="cuda")
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 1e-4
