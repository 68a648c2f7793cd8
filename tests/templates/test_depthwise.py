"""The direct depthwise template (templates/depthwise*.py, issue 28) against the float64 reference.

Every direction on fresh random data into NaN-poisoned outputs: on the CPU backend over a hypothesis strategy of
shapes (1D / 2D / 3D, stride 1 and 2 (3 sometimes), padding, dilation, multiplier 1 and 2, channel counts that
leave vector tails, batch 1..3, bias and relu) and of configs (block shapes, strips, window in shared memory or
not); a few fixed cases in the CUDA simulator, float16 storage and split backward-weight (atomics into a zeroed
dw) included.  The variant is not in the planner's library yet, so the kernels are built, rendered and launched
here directly (launcher_for), through the kernel cache as the planner's launchers are.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kernelgen
from kernelgen import reference
from kernelgen.ir import For, If, VectorLoad
from kernelgen.problem import make_problem
from kernelgen.render_cpu import render_cpu
from kernelgen.render_cuda import render_cuda
from kernelgen.runtime.cache import KERNELS
from kernelgen.runtime.launch import Launcher
from kernelgen.target import target_for
from kernelgen.templates import depthwise
from kernelgen.templates.config import TileConfig
from kernelgen.templates.depthwise_config import DepthwiseConfig, is_depthwise_config
from kernelgen.templates.depthwise_geometry import class_run, geometry, over_limits, unmet
from kernelgen.templates.variant import Variant
from harness import assert_close, direction_inputs, launch_poisoned, tolerance
from hypothesis import settings

DIRECTIONS = ("fwd", "bwd_data", "bwd_weight")


def launcher_for(problem, config, backend, precision="fp32"):
    """The depthwise kernel of (problem, config) rendered for `backend` and loaded through the kernel cache."""
    kernel = depthwise.build(problem, config, precision)
    render = (lambda: render_cpu(kernel)) if backend == "cpu" else (lambda: render_cuda(kernel))
    key = ("test_depthwise", problem, config, backend, precision)
    return KERNELS.get(key, render, lambda module: Launcher.from_module(module, backend))


def depthwise_problem(direction, x_shape, m, filt, kw, bias=False, activation=None, dtype="float32"):
    C = x_shape[-1]
    fwd = direction == "fwd"
    return make_problem(direction, x_shape, (C * m, *filt, 1), groups=C, dtype=dtype, has_bias=bias and fwd,
                        activation=activation if fwd else None, **kw)


def check(problem, kw, config, backend, rng, precision="fp32"):
    """Fresh inputs, the kernel run into a NaN-poisoned output, the float64 reference: returns the launcher."""
    inputs, want = direction_inputs(problem, {**kw, "groups": problem.groups}, rng)
    launcher = launcher_for(problem, config, backend, precision)
    got = launch_poisoned(launcher, problem, inputs, backend)
    what = f"{problem.key()} {config} {backend} {precision}"
    tol = tolerance(problem.dtype, precision if precision in ("fp16", "bf16") else "fp32")
    assert_close(got, want, problem.dtype, what, tol=tol)
    return launcher


# --- the CPU backend over random shapes and configs -------------------------------------------------------------

@st.composite
def cases(draw, direction):
    ndim = draw(st.sampled_from((1, 2, 2, 3)))
    C = draw(st.sampled_from((1, 3, 5, 8, 24, 40)))
    m = draw(st.sampled_from((1, 1, 2)))
    N = draw(st.integers(1, 3))
    filt = tuple(draw(st.sampled_from((1, 2, 3, 5) if ndim < 3 else (1, 2, 3))) for _ in range(ndim))
    stride = tuple(draw(st.sampled_from((1, 1, 2, 2, 3))) for _ in range(ndim))
    dilation = tuple(draw(st.sampled_from((1, 1, 2))) for _ in range(ndim))
    padding = tuple(draw(st.integers(0, 2)) for _ in range(ndim))
    sizes = tuple(draw(st.integers(max(1, d * (f - 1) + 1 - 2 * p), 9 if ndim < 3 else 5))
                  for f, d, p in zip(filt, dilation, padding))
    kw = dict(stride=stride, padding=padding, dilation=dilation)
    bias, activation = draw(st.booleans()), draw(st.sampled_from((None, "relu")))
    dtype = draw(st.sampled_from(("float32", "float32", "float32", "float64")))
    halo = draw(st.integers(0, 1))
    config = DepthwiseConfig(TC=draw(st.integers(1, 3)), TW=draw(st.integers(1, 3)), TH=draw(st.integers(1, 2)),
                             VC=draw(st.sampled_from((1, 2, 4))), PW=draw(st.integers(1, 4)),
                             PH=draw(st.integers(1, 3)), halo=halo, smem_pad=halo * draw(st.integers(0, 2)))
    if config.PH > 1 and direction != "bwd_weight" and draw(st.booleans()):
        config = dataclasses.replace(config, share_rows=1)
    problem = depthwise_problem(direction, (N, *sizes, C), m, filt, kw, bias, activation, dtype)
    return problem, kw, config


@pytest.mark.parametrize("direction", DIRECTIONS)
@settings(max_examples=2)  # 2 per direction in CI (fresh shapes every run); the named cases cover the rest
@given(data=st.data())
def test_cpu_random_shapes(direction, data):
    problem, kw, config = data.draw(cases(direction))
    check(problem, kw, config, "cpu", np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1))))


SHARED_ROWS_CASES = {  # name: (direction, x shape, multiplier, filter, conv arguments, config)
    "fwd_5x5_stride2_ragged": ("fwd", (2, 13, 11, 6), 1, (5, 5), dict(stride=2, padding=2),
                               DepthwiseConfig(2, 2, 1, 4, 2, 3, 0, share_rows=1)),
    "fwd_3x3_halo_multiplier": ("fwd", (1, 9, 8, 5), 2, (3, 3), dict(padding=1),
                                DepthwiseConfig(2, 2, 2, 2, 2, 2, 1, share_rows=1)),
    "fwd_dilated": ("fwd", (1, 11, 7, 4), 1, (3, 3), dict(padding=2, dilation=2),
                    DepthwiseConfig(1, 2, 1, 4, 3, 4, 1, share_rows=1)),
    # (VC 2: half the unrolled body of VC 4, which took 107 s of CI to compile; still a ragged channel block)
    "bwd_data_stride2_classes": ("bwd_data", (2, 11, 9, 6), 1, (5, 5), dict(stride=2, padding=2),
                                 DepthwiseConfig(2, 2, 1, 2, 2, 3, 1, share_rows=1)),
    "bwd_data_3d": ("bwd_data", (1, 3, 7, 6, 4), 1, (3, 3, 3), dict(stride=(1, 2, 1), padding=1),
                    DepthwiseConfig(1, 2, 2, 4, 2, 2, 0, share_rows=1)),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "fwd_dilated" else n
                                  for n in SHARED_ROWS_CASES])  # (dilation: test_cpu_random_shapes; CI time)
def test_cpu_shared_rows(name, rng):
    """share_rows: a thread's PH output rows accumulated together from source rows loaded once, against float64 -
    strided (forward: rows of two output rows overlap; backward-data: residue classes), dilated, ragged, 3D."""
    direction, x_shape, m, filt, kw, config = SHARED_ROWS_CASES[name]
    p = depthwise_problem(direction, x_shape, m, filt, kw, bias=direction == "fwd", activation="relu")
    check(p, kw, config, "cpu", rng)


def _source_loads_per_thread(stmts, src="x"):
    """The 16-byte source loads one thread of the kernel executes: serial and unrolled loops count their extent."""
    count = 0
    for s in stmts:
        if isinstance(s, VectorLoad) and s.buf == src:
            count += 1
        elif isinstance(s, For):
            times = s.extent if s.binding in ("serial", "unroll") and isinstance(s.extent, int) else 1
            count += times * _source_loads_per_thread(s.body, src)
        elif isinstance(s, If):
            count += _source_loads_per_thread(s.body, src) + _source_loads_per_thread(s.orelse, src)
    return count


def test_shared_rows_load_each_source_row_once():
    """A 5x5 stride-2 thread of 4 output rows, 2 pixels each (a 7-column segment a source row): 2 * 3 + 5 = 11 source
    rows loaded once each with share_rows, 4 * 5 = 20 without; the 4 strips' accumulators then live at once."""
    p = depthwise_problem("fwd", (1, 16, 16, 4), 1, (5, 5), dict(stride=2, padding=2))
    shared, alone = (DepthwiseConfig(1, 2, 1, 4, 2, 4, 0, share_rows=share) for share in (1, 0))
    assert _source_loads_per_thread(depthwise.build(p, shared).body) == 11 * 7
    assert _source_loads_per_thread(depthwise.build(p, alone).body) == 20 * 7
    assert geometry(p, shared).registers == geometry(p, alone).registers + 3 * 2 * 4


def test_shared_rows_refused_where_it_has_no_meaning():
    p = depthwise_problem("bwd_weight", (1, 8, 8, 4), 1, (3, 3), dict(padding=1))
    assert any("share_rows" in why for why in unmet(p, DepthwiseConfig(PH=2, share_rows=1)))
    with pytest.raises(ValueError, match="PH >= 2"):
        DepthwiseConfig(PH=1, share_rows=1).validate()


def test_planner_shares_rows_of_the_configs_it_chooses():
    """On a CUDA target the planner turns share_rows on for a forward / backward-data config it chose with PH >= 2
    (explain says so), never for a config the caller gave, for backward-weight, or where the rows' strips would not
    fit SHARE_ROWS_MAX_REGISTERS."""
    from kernelgen.planner import make_plan
    target = target_for("cuda")
    fwd = depthwise_problem("fwd", (32, 56, 56, 144), 1, (5, 5), dict(stride=2, padding=2))
    plan = make_plan(fwd, "cuda")
    assert plan.config.PH >= 2 and plan.config.share_rows == 1 and "share_rows" in plan.reason
    given = dataclasses.replace(plan.config, share_rows=0)
    assert make_plan(fwd, "cuda", config=given).config == given
    bwd = depthwise_problem("bwd_weight", (32, 56, 56, 144), 1, (5, 5), dict(stride=2, padding=2))
    assert depthwise.with_shared_rows(bwd, DepthwiseConfig(PH=2), target).share_rows == 0
    heavy = depthwise_problem("fwd", (32, 14, 14, 480), 1, (5, 5), dict(padding=2))
    big = DepthwiseConfig(32, 2, 4, 2, 8, 4, 0)  # 170 registers estimated with the 4 strips live
    assert geometry(heavy, dataclasses.replace(big, share_rows=1)).registers > depthwise.SHARE_ROWS_MAX_REGISTERS
    assert depthwise.with_shared_rows(heavy, big, target) is big
    assert depthwise.with_shared_rows(fwd, DepthwiseConfig(PH=1), target).share_rows == 0


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_cpu_default_config(direction, rng):
    """The CPU default of a MobileNet-like layer (stride 2, multiplier 1, 40 channels: a vector tail of 0 but a
    ragged last block row)."""
    kw = dict(stride=2, padding=1)
    p = depthwise_problem(direction, (2, 9, 11, 40), 1, (3, 3), kw, bias=True, activation="relu")
    config = depthwise.VARIANT.default_config(p, target_for("cpu"))
    assert depthwise.VARIANT.accepts(p, config) and config.halo == 0
    check(p, kw, config, "cpu", rng)


@pytest.mark.parametrize("precision", ["fp16", "bf16", "tf32"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_cpu_reduced_precisions(direction, precision, rng):
    """fp16 / bf16 round the float32 operands as read (fp32 accumulation), within the precision's bound; tf32 is fp32
    here (no tensor cores), within fp32's."""
    kw = dict(stride=1, padding=2, dilation=2)
    p = depthwise_problem(direction, (2, 6, 7, 5), 2, (3, 3), kw, bias=True)
    config = DepthwiseConfig(TC=2, TW=2, TH=2, VC=4, PW=2, PH=1, halo=1)
    if precision == "tf32":  # the fp32 source but for its comments: run once (forward), rendered for all
        assert "no tensor cores" in render_cpu(depthwise.build(p, config, precision))
        if direction != "fwd":
            return
    check(p, kw, config, "cpu", rng, precision)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_cpu_float16_storage(direction, rng):
    """float16 tensors at fp16: read as stored, fp32 accumulation, each output rounded once (1e-2 bound)."""
    kw = dict(stride=(1, 2), padding=1)
    p = depthwise_problem(direction, (2, 5, 8, 8), 1, (3, 3), kw, bias=True, dtype="float16")
    check(p, kw, DepthwiseConfig(TC=2, TW=2, TH=2, VC=8, PW=2, PH=1, halo=1), "cpu", rng, "fp16")


def test_split_k_refused_on_cpu_and_outside_backward_weight():
    # (float16 tensors split into a float32 workspace: test_depthwise_fp16_split.py)
    fwd = depthwise_problem("fwd", (2, 8, 8, 8), 1, (3, 3), dict(padding=1))
    with pytest.raises(ValueError, match="split_k=1 outside backward-weight"):
        depthwise.build(fwd, DepthwiseConfig(split_k=2))
    bwd = depthwise_problem("bwd_weight", (2, 8, 8, 8), 1, (3, 3), dict(padding=1))
    split = depthwise.build(bwd, DepthwiseConfig(TC=2, TW=2, TH=2, split_k=2))
    with pytest.raises(ValueError, match="atomic"):  # parallel blocks: a += would race
        render_cpu(split, parallel=True)
    assert "dw[" in render_cpu(split, parallel=False)  # blocks in turn (a test's check of the arithmetic): +=


# --- the config, the geometry, the variant ---------------------------------------------------------------------

CONFIGS = [DepthwiseConfig(), DepthwiseConfig(1, 32, 4, 1, 2, 4, 0), DepthwiseConfig(8, 4, 4, 8, 1, 2, 1, 3, 1),
           DepthwiseConfig(16, 2, 4, 2, 8, 1, 1, 0, 33), DepthwiseConfig(8, 8, 1, 1, 2, 4, 1, share_rows=1)]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_config_round_trips(config):
    assert config.validate() is config
    assert DepthwiseConfig.parse(str(config)) == config
    assert DepthwiseConfig.from_dict(config.as_dict()) == config
    assert is_depthwise_config(str(config)) and not is_depthwise_config(str(TileConfig()))
    with pytest.raises(ValueError):
        TileConfig.parse(str(config))


@pytest.mark.parametrize("bad, match", [(dict(VC=3), "VC must be one of"), (dict(TC=0), "TC must be an int >= 1"),
                                        (dict(halo=2), "halo must be 0 or 1"), (dict(halo=0, smem_pad=1), "needs halo"),
                                        (dict(TC=32, TW=32, TH=2), "threads per block"),
                                        (dict(split_k=0), "split_k must be")])
def test_config_validate_names_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        DepthwiseConfig(**bad).validate()
    with pytest.raises(ValueError):
        DepthwiseConfig.parse("DW_TC8_XX3")
    with pytest.raises(ValueError, match="unknown fields"):
        DepthwiseConfig.from_dict({"BM": 64})


@pytest.mark.parametrize("filt, stride, pad, dil", [(3, 2, 1, 1), (5, 2, 2, 1), (3, 3, 0, 2), (4, 2, 3, 3),
                                                     (1, 2, 0, 1), (7, 3, 3, 2)])
def test_class_runs_are_the_taps_that_land(filt, stride, pad, dil):
    """Each residue class's run lists exactly the taps with (rho + pad - tap * dil) % stride == 0, at the source
    offset (rho + pad - tap * dil) / stride, in ascending offsets."""
    for rho in range(stride):
        run = class_run(rho, filt, stride, pad, dil)
        want = sorted((t for t in range(filt) if (rho + pad - t * dil) % stride == 0), reverse=True)
        assert [run.tap(k) for k in range(run.count)] == want
        assert [run.off0 + k * run.doff for k in range(run.count)] == [(rho + pad - t * dil) // stride for t in want]


def test_variant_protocol_and_applies():
    v = depthwise.VARIANT
    assert isinstance(v, Variant) and v.name == "depthwise" and set(v.directions) == set(DIRECTIONS)
    dw = depthwise_problem("fwd", (1, 8, 8, 16), 2, (3, 3), {})
    dense = make_problem("fwd", (1, 8, 8, 32), (16, 3, 3, 16), groups=2)  # 16 channels a group: not narrow
    assert v.applies(dw, "fp32") and v.applies(dw, "tf32") and not v.applies(dense, "fp32")
    assert not v.applies(make_problem("fwd", (1, 8, 8, 16), (16, 3, 3, 1), groups=16, dtype="float16"), "fp32")
    wide = make_problem("fwd", (1, 8, 8, 1), (64, 7, 7, 1))  # C = 1, 64 filters of 49 taps: a GEMM, not depthwise
    assert not v.applies(wide, "fp32") and v.applies(make_problem("fwd", (1, 8, 8, 1), (8, 3, 3, 1)), "fp32")
    assert v.key_extra(dw) is None and not v.accepts(dw, TileConfig())
    with pytest.raises(TypeError, match="DepthwiseConfig"):
        v.build(dw, TileConfig())


@pytest.mark.sim
@pytest.mark.parametrize("x_shape, w_shape, padding", [((1, 1, 2), (2, 1, 1), 0), ((1, 2, 2), (2, 1, 1), 0),
                                                        ((2, 3, 3, 4), (4, 3, 3, 1), 1)])
def test_cuda_default_on_problems_smaller_than_any_searched_block(x_shape, w_shape, padding, rng):
    """A map of a pixel or a few and 2-4 channels: the search keeps no block (each has more than twice the threads
    the output has work for), so the default is one warp with a channel and a pixel a thread; every direction runs
    it (numba's simulator) and matches float64 (the API fuzz found "no CUDA block fits" on a 1x1 1D map)."""
    groups, nd = x_shape[-1], len(x_shape) - 2
    kw = dict(groups=groups, padding=padding, backend="cuda")
    ref_kw = dict(groups=groups, padding=(padding,) * nd)
    x, w = rng.standard_normal(x_shape).astype(np.float32), rng.standard_normal(w_shape).astype(np.float32)
    want = reference.conv_forward(x, w, **ref_kw)
    dy = rng.standard_normal(want.shape).astype(np.float32)
    assert kernelgen.explain("conv", x, w, **kw).variant == depthwise.NAME
    assert_close(kernelgen.conv(x, w, **kw), want)
    assert_close(kernelgen.conv_backward_data(dy, w, x_shape, **kw),
                 reference.conv_backward_data(dy, w, x_shape, **ref_kw))
    assert_close(kernelgen.conv_backward_weight(x, dy, w_shape, **kw),
                 reference.conv_backward_weight(x, dy, w_shape, **ref_kw))


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_cuda_default_and_space(direction):
    """The CUDA default and the tuner's space on the issue's layer (batch 32, 56x56, 64 channels): configs that
    build and fit the target, the default among the space, the space the cheapest config under the cost model
    first, then the cheapest of each kind of block (depthwise.spread), each kind's in the model's order."""
    p = depthwise_problem(direction, (32, 56, 56, 64), 1, (3, 3), dict(padding=1))
    target = target_for("cuda")
    default = depthwise.VARIANT.default_config(p, target)
    everything = depthwise.candidate_configs(p, target)
    space = depthwise.VARIANT.config_space(p, target, keep=50)
    assert default in everything and len(space) == 50 and space[0] == everything[0] and set(space) <= set(everything)
    kinds = {}
    for c in space:
        kinds.setdefault((c.threads, c.VC, c.halo), []).append(depthwise.model_time(p, c, target))
    assert len(kinds) > 4 and all(costs == sorted(costs) for costs in kinds.values())
    for config in [default] + space[:3]:
        assert depthwise.VARIANT.accepts(p, config) and not over_limits(geometry(p, config))
        assert (config.split_k > 1) == (direction == "bwd_weight")
    source = render_cuda(depthwise.build(p, default))
    assert "cuda.local.array" not in source  # every register array became scalars


# --- the CUDA simulator -----------------------------------------------------------------------------------------

SIM_CASES = {  # name: (direction, x shape, multiplier, filter, conv arguments, config, bias)
    "fwd_halo_bias_relu": ("fwd", (2, 5, 6, 6), 1, (3, 3), dict(padding=1), DepthwiseConfig(2, 2, 2, 4, 2, 1, 1, 1),
                           True),
    "fwd_stride2_multiplier": ("fwd", (1, 6, 7, 3), 2, (3, 3), dict(stride=2, padding=1),
                               DepthwiseConfig(2, 2, 2, 2, 2, 1, 0), False),
    "bwd_data_stride2": ("bwd_data", (1, 7, 6, 5), 1, (3, 3), dict(stride=2, padding=1),
                         DepthwiseConfig(2, 2, 2, 4, 2, 1, 1), False),
    "bwd_data_1d_dilation": ("bwd_data", (2, 9, 4), 2, (3,), dict(padding=2, dilation=2),
                             DepthwiseConfig(2, 4, 1, 2, 2, 1, 0), False),
    "bwd_weight_split": ("bwd_weight", (2, 6, 5, 6), 1, (3, 3), dict(stride=(1, 2), padding=1),
                         DepthwiseConfig(2, 2, 2, 4, 2, 1, 1, 0, 3), False),
    "bwd_weight_3d": ("bwd_weight", (1, 3, 4, 5, 3), 1, (2, 3, 3), dict(padding=(0, 1, 1)),
                      DepthwiseConfig(2, 2, 2, 2, 2, 1, 1), False),
    "fwd_5x5_stride2_shared_rows": ("fwd", (1, 9, 8, 4), 1, (5, 5), dict(stride=2, padding=2),
                                    DepthwiseConfig(2, 2, 1, 2, 2, 3, 1, share_rows=1), True),
}


@pytest.mark.sim
@pytest.mark.parametrize("name", list(SIM_CASES))
def test_simulator(name, rng):
    direction, x_shape, m, filt, kw, config, bias = SIM_CASES[name]
    p = depthwise_problem(direction, x_shape, m, filt, kw, bias, "relu" if bias else None)
    launcher = check(p, kw, config, "cuda", rng)
    assert launcher.zero_output == (config.split_k > 1)


@pytest.mark.sim
@pytest.mark.parametrize("direction", ["fwd", "bwd_data"])
def test_simulator_float16_storage(direction, rng):
    kw = dict(stride=1, padding=1)
    p = depthwise_problem(direction, (1, 4, 5, 8), 1, (3, 3), kw, dtype="float16")
    check(p, kw, DepthwiseConfig(2, 2, 2, 4, 2, 1, 1), "cuda", rng, "fp16")


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_planner_picks_depthwise_for_groups_equal_channels(precision):
    """kernelgen.conv and both backward ops with groups == C plan the depthwise template on their own (explain
    says so), the forward matching the float64 reference (the backward kernels' arithmetic: the CPU tests above,
    through the API: test_fuzz_api.py); a grouped layer with 16 channels a group does not take it (narrow groups,
    2..8 a group: test_narrow_groups.py)."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 9, 9, 6)).astype(np.float32)
    w = rng.standard_normal((12, 3, 3, 1)).astype(np.float32)
    kw = dict(stride=2, padding=1, groups=6, backend="cpu", precision=precision)
    y = kernelgen.conv(x, w, **kw)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    ref_kw = {k: kw[k] for k in ("stride", "padding", "groups")}
    cases = [(kernelgen.conv, (x, w), y, reference.conv_forward(x.astype(np.float64), w.astype(np.float64), **ref_kw)),
             (kernelgen.conv_backward_data, (dy, w, x.shape), None,
              reference.conv_backward_data(dy.astype(np.float64), w.astype(np.float64), x.shape, **ref_kw)),
             (kernelgen.conv_backward_weight, (x, dy, w.shape), None,
              reference.conv_backward_weight(x.astype(np.float64), dy.astype(np.float64), w.shape, **ref_kw))]
    for op, args, got, want in cases:
        assert kernelgen.explain(op, *args, **kw).variant == "depthwise"
        if got is not None:  # (each backward kernel a 10 s CPU compile: CI time)
            assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    wide, grouped = np.zeros((2, 9, 9, 32), np.float32), np.zeros((6, 3, 3, 16), np.float32)
    assert kernelgen.explain(kernelgen.conv, wide, grouped, padding=1, groups=2, backend="cpu").variant != "depthwise"
