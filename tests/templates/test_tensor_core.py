"""The TF32 tensor-core path (issue 9): precision="tf32", the Mma IR statement and its renderings.

CPU tests run the tensor-core template's IR through the CPU renderer, which emulates each warp's
m16n8k8 MMA per lane with TF32 rounding, against float64 references on fresh random data with
NaN-poisoned outputs.  Two references: the exact one (TF32 must stay within 1e-3 relative error of
it) and one computed from TF32-rounded inputs, which the emulation must match to float32 accuracy:
that is what shows the kernel computes TF32 math, rather than fp32 math that happens to be close.
The simulator cannot run mma.sync (no warp-level exchange); tests marked `gpu` run the real
tensor-core kernels (scripts/gpu_run.sh tests).
"""
from __future__ import annotations

import numpy as np
import pytest

import kernelgen
from kernelgen import reference as ref
from kernelgen.api import get_launcher, make_plan
from kernelgen.ir import Load, Mma
from kernelgen.mma_layout import a_coord, a_owner, b_coord, b_owner, d_coord, tf32_round
from kernelgen.problem import make_problem
from kernelgen.render_cuda import render_cuda
from kernelgen.templates.config import CUDA_TC_DEFAULT, TileConfig
from harness import conv_tensors, launch_poisoned, poisoned, reference_fn, rel_err, tolerance

TF32_TOL = tolerance("float32", "tf32")  # issue 9: TF32 against float64, relative
EMULATED_TOL = 2e-5    # CPU emulation against the float64 GEMM of TF32-rounded inputs (fp32 accumulation)

CASES = {
    # GEMM dims ragged against the tiles, groups, per-dim stride/padding, C not a multiple of BK
    "ragged_groups": ((3, 7, 9, 6), (10, 3, 3, 3), dict(stride=(2, 1), padding=(1, 2), groups=2)),
    # C a multiple of BK (per-slice tap decode), dilation
    "c16_dilated": ((2, 9, 8, 16), (24, 3, 3, 16), dict(padding=2, dilation=2)),
}


def run(direction, x, w, dy, kw, **opts):
    """The public op for a direction, writing into a NaN-poisoned `out`; and its reference."""
    reference = reference_fn(direction, kw)
    if direction == "fwd":
        return kernelgen.conv(x, w, out=poisoned(dy.shape), **kw, **opts), reference
    if direction == "bwd_data":
        return kernelgen.conv_backward_data(dy, w, x.shape, out=poisoned(x.shape), **kw, **opts), reference
    return kernelgen.conv_backward_weight(x, dy, w.shape, out=poisoned(w.shape), **kw, **opts), reference


def check_tf32(got, reference, x, w, dy, what, operands=tf32_round):
    """got within TF32_TOL of the float64 reference; returns its error against the reference of the operands
    as the kernel's MMA reads them (operands: TF32-rounded by default)."""
    assert not np.isnan(got).any(), f"{what}: {np.isnan(got).sum()} outputs never written"
    exact = reference(x.astype(np.float64), w.astype(np.float64), dy.astype(np.float64))
    rounded = reference(*(operands(a).astype(np.float64) for a in (x, w, dy)))
    assert rel_err(got, exact) <= TF32_TOL, f"{what}: {rel_err(got, exact):.3g} from float64"
    return rel_err(got, rounded)


# --- the pieces ------------------------------------------------------------------------------------

def test_tf32_rounding_is_cvt_rna(rng):
    from kernelgen.cpu_round import tf32
    one = np.float32(1.0)
    cases = {1 + 2 ** -11: 1 + 2 ** -10, -(1 + 2 ** -11): -(1 + 2 ** -10),   # ties away from zero
             1 + 2 ** -12: 1.0, 1 + 3 * 2 ** -12: 1 + 2 ** -10, 0.0: 0.0, 3.0: 3.0}
    for x, want in cases.items():
        assert tf32_round(np.float32(x)) == np.float32(want) == tf32(float(x)), x
    x = (rng.standard_normal(20000) * 10.0 ** rng.integers(-30, 30, 20000)).astype(np.float32)
    got = np.array([tf32(float(v)) for v in x], np.float32)
    np.testing.assert_array_equal(got, tf32_round(x))
    assert (tf32_round(x).view(np.uint32) & 0x1FFF == 0).all() and np.abs(tf32_round(x) / x - one).max() <= 2 ** -11


def test_fragment_layout_covers_each_element_once():
    seen_a, seen_b, seen_d = set(), set(), set()
    for lane in range(32):
        for r in range(4):
            seen_a.add(a_coord(lane, r)), seen_d.add(d_coord(lane, r))
            assert a_owner(*a_coord(lane, r)) == (lane, r)
        for r in range(2):
            seen_b.add(b_coord(lane, r))
            assert b_owner(*b_coord(lane, r)) == (lane, r)
    assert len(seen_a) == 16 * 8 and len(seen_b) == 8 * 8 and len(seen_d) == 16 * 8


def test_mma_statement_validates():
    frag = lambda n: tuple(Load("f", (i,)) for i in range(n))
    Mma(frag(4), frag(4), frag(2))
    Mma(frag(4), frag(8), frag(4), shape="m16n8k16", dtype="bf16")
    with pytest.raises(ValueError, match="shape/dtype must be one of"):
        Mma(frag(4), frag(4), frag(2), shape="m16n8k8", dtype="fp16")
    with pytest.raises(ValueError, match="4 accumulator, 4 A and 2 B"):
        Mma(frag(4), frag(4), frag(4))
    with pytest.raises(ValueError, match="4 accumulator, 8 A and 4 B"):
        Mma(frag(4), frag(4), frag(2), shape="m16n8k16", dtype="fp16")


def test_tensor_core_config_strings_and_validation():
    assert str(TileConfig()) == "BM64_BN64_BK8_TM4_TN4" and "WM" not in TileConfig().as_dict()
    assert str(CUDA_TC_DEFAULT) == "BM128_BN64_BK16_WM64_WN32_S2_SWZ" and CUDA_TC_DEFAULT.threads == 128
    for bad in (dict(WM=24, WN=8), dict(WM=16, WN=12), dict(BK=12, WM=16, WN=8), dict(BM=48, WM=32, WN=8)):
        with pytest.raises(ValueError, match="tensor-core tile"):
            TileConfig(**bad).validate()
    # the new fields: absent from fp32 (and unused tensor-core) strings and dicts, validated when used
    assert "swizzle" not in TileConfig().as_dict() and "min_blocks" not in TileConfig(WM=16, WN=8).as_dict()
    cfg = TileConfig(128, 64, 16, WM=32, WN=32, stages=2, swizzle=1, min_blocks=2)
    assert str(cfg) == "BM128_BN64_BK16_WM32_WN32_S2_SWZ_MB2" and cfg.as_dict()["min_blocks"] == 2
    assert TileConfig(**cfg.as_dict()) == cfg
    for bad in (dict(swizzle=1), dict(WM=16, WN=8, swizzle=1, smem_pad=4), dict(BK=24, WM=16, WN=8, swizzle=1),
                dict(BK=32, WM=16, WN=8, swizzle=2), dict(WM=16, WN=8, swizzle=3)):
        with pytest.raises(ValueError, match="swizzle"):
            TileConfig(**bad).validate()
    ilv = TileConfig(128, 64, 16, WM=64, WN=32, stages=2, swizzle=2)
    assert str(ilv) == "BM128_BN64_BK16_WM64_WN32_S2_SWZ2" and TileConfig.parse(str(ilv)) == ilv


def _eval(e, env):
    import operator
    from kernelgen.ir import BinOp, Const, Var
    if isinstance(e, Const):
        return e.value
    if isinstance(e, Var):
        return env[e.name]
    assert isinstance(e, BinOp), e
    ops = {"+": operator.add, "-": operator.sub, "*": operator.mul, "//": operator.floordiv, "%": operator.mod}
    return ops[e.op](_eval(e.a, env), _eval(e.b, env))


@pytest.mark.parametrize("BK", [8, 16, 32])
def test_swizzled_layout(BK):
    """The swizzled shared layout: each row's columns are a permutation of 0..BK-1; a lane's fragment words of
    a row are contiguous and aligned; the per-lane columns equal the layout's; fragment loads (4 words per lane
    of a 16-byte phase of 8 lanes, 2 per lane of an 8-byte phase of 16 lanes) and chunk stores (8 rows, same
    chunk) hit distinct banks."""
    from kernelgen.ir import Var
    from kernelgen.templates.warp_mma import lane_columns, swizzled_col
    V, C = BK // 4, BK // 4
    for row in range(64):
        assert sorted(swizzled_col(row, k, BK) for k in range(BK)) == list(range(BK))
    setup, col = lane_columns(Var("lg"), Var("lt"), V)
    word = {}  # (row base, lane) -> word addresses of its fragment loads in a tile of rows of BK words
    for base in (0, 8, 16, 24, 40):
        for lane in range(32):
            env = {"lg": lane // 4, "lt": lane % 4}
            for a in setup:
                env[a.var] = _eval(a.value, env)
            row = base + lane // 4
            cols = [_eval(col(w), env) for w in range(V)]
            assert cols == [swizzled_col(row, V * (lane % 4) + w, BK) for w in range(V)]
            for c0 in range(0, V, 4):  # one vector per 4 words (2 for BK 8)
                n = min(4, V)
                assert cols[c0:c0 + n] == list(range(cols[c0], cols[c0] + n)) and cols[c0] % n == 0
            word[base, lane] = [row * BK + c for c in cols]
        n = min(4, V)
        per_phase = 32 * 4 // (4 * n)  # lanes per 128-byte wavefront
        for v in range(0, V, n):
            for p0 in range(0, 32, per_phase):
                banks = [(word[base, lane][v] + j) % 32 for lane in range(p0, p0 + per_phase) for j in range(n)]
                assert len(set(banks)) == len(banks), (BK, base, v, p0)
    for chunk in range(C):  # 8 lanes storing the same chunk of 8 consecutive rows (STS.128)
        for r0 in (0, 8, 24):
            starts = [((r * BK + swizzled_col(r, 4 * chunk, BK)) // 4) % 8 for r in range(r0, r0 + 8)]
            assert len(set(starts)) == 8


# swizzled tiles for the CPU (small code): BK 8 / 16 / 32, the chunked staging of m/n-contiguous operands
SWIZZLED_CPU_TILES = [TileConfig(32, 16, 8, WM=16, WN=8, swizzle=1),
                      pytest.param(TileConfig(32, 16, 16, WM=16, WN=8, stages=2, swizzle=1), marks=pytest.mark.slow),
                      TileConfig(32, 32, 32, WM=16, WN=16, swizzle=1, min_blocks=2),
                      # interleaved A rows (swizzle=2): BK 8 unpadded, BK 16 with padded pair rows
                      TileConfig(32, 16, 8, WM=16, WN=8, swizzle=2),
                      TileConfig(64, 16, 16, WM=32, WN=8, stages=2, swizzle=2),
                      # asynchronous copies (no staging registers, fragments rounded when loaded): 2 to 4 stages,
                      # element copies (ragged_groups: channels not in fours) and 16-byte chunk copies
                      pytest.param(TileConfig(32, 16, 8, WM=16, WN=8, stages=3, swizzle=1, async_copy=1),
                                   marks=pytest.mark.slow),  # (CI time: BK 8 runs unpadded, async in the BK 32 tile)
                      # 4 stages: the slowest CPU compiles of the file (70-86 s a direction), so `slow`; 2 and 3
                      # stages take the same code path in CI, and the GPU tests run 4 (GPU_CONFIGS)
                      pytest.param(TileConfig(32, 16, 16, WM=16, WN=8, stages=4, swizzle=1, async_copy=1),
                                   marks=pytest.mark.slow, id="BM32_BN16_BK16_WM16_WN8_S4_SWZ_ASYNC"),
                      TileConfig(32, 32, 32, WM=16, WN=16, stages=2, swizzle=1, async_copy=1)]


def run_cpu_tile(config, direction, rng, operands=tf32_round):
    """One tensor-core config on the CPU backend, fresh data, poisoned output: its error against the GEMM of
    the operands as the MMA reads them (check_tf32 also bounds it against float64)."""
    x_shape, w_shape, kw = CASES["ragged_groups"] if config.BK == 8 else CASES["c16_dilated"]
    x, w, dy = conv_tensors(rng, x_shape, w_shape, kw)
    p = make_problem(direction, x_shape, w_shape, y_shape=dy.shape, **kw)
    launcher = get_launcher(make_plan(p, "cpu", config=config, precision="tf32"))
    inputs = {"fwd": {"x": x, "w": w}, "bwd_data": {"dy": dy, "w": w}, "bwd_weight": {"x": x, "dy": dy}}[direction]
    out = launch_poisoned(launcher, p, inputs, "cpu")
    return check_tf32(out, reference_fn(direction, kw), x, w, dy, direction, operands)


DIRECTIONS = ("fwd", "bwd_data", "bwd_weight")


def each_direction_once(configs):
    """(config, direction) cases of every config in every direction, where each config's runs in the default run
    (CI) are one direction - the configs take turns, so each direction still meets most kinds of tile - and the
    other two are `slow` (KERNELGEN_SLOW_TESTS=1: a CPU compile is 30-70 s a case, and the cross product was a
    quarter of CI's time)."""
    out = []
    for i, config in enumerate(configs):
        marks = getattr(config, "marks", ())
        config = getattr(config, "values", (config,))[0]
        for d in DIRECTIONS:
            slow = d != DIRECTIONS[i % len(DIRECTIONS)]
            out.append(pytest.param(config, d, marks=tuple(marks) + ((pytest.mark.slow,) if slow else ()),
                                    id=f"{config}-{d}"))
    return out


@pytest.mark.parametrize("config, direction", each_direction_once(SWIZZLED_CPU_TILES))
def test_cpu_swizzled_tiles(config, direction, rng):
    assert run_cpu_tile(config, direction, rng) <= EMULATED_TOL


# warpgroup MMAs (wgmma=1): one and two warpgroups, two 64-row strips per warpgroup, BK 8 / 16 / 32, element
# copies (ragged_groups: channels not in fours) and 16-byte chunk copies into the core-matrix layout
WGMMA_CPU_TILES = [TileConfig(64, 16, 8, WM=64, WN=16, stages=2, async_copy=1, wgmma=1),
                   TileConfig(128, 16, 16, WM=64, WN=16, stages=3, async_copy=1, wgmma=1),
                   TileConfig(128, 8, 16, WM=128, WN=8, stages=2, async_copy=1, wgmma=1),
                   TileConfig(64, 32, 32, WM=64, WN=16, stages=2, async_copy=1, wgmma=1)]


@pytest.mark.parametrize("config, direction", each_direction_once(WGMMA_CPU_TILES))
def test_cpu_warpgroup_tiles(config, direction, rng):
    """The warpgroup-MMA schedule, emulated per thread (wgmma truncates what it reads): TF32 within bounds, and
    equal to the float64 GEMM of TF32-rounded operands to float32 accuracy, because each thread rounds the
    words its copies landed before the MMAs read them."""
    assert run_cpu_tile(config, direction, rng) <= EMULATED_TOL


def aligned_kernel(src):
    """The module's first kernel (KERNEL, specialised for 16-byte aligned arrays), without the
    KERNEL_ANY_ALIGNMENT twin that follows it."""
    end = src.find("\n\n\n@cuda.jit")
    return src if end < 0 else src[:end]


def test_cuda_rendering_uses_the_intrinsics():
    p = make_problem("fwd", (4, 9, 9, 32), (64, 3, 3, 32), padding=1)
    module = render_cuda(make_plan(p, "cuda", config=CUDA_TC_DEFAULT, precision="tf32").kernel_ir(), cache=False)
    src = aligned_kernel(module)
    # alignment-specialised: 16-byte loads without a test here, the tested form in the twin
    assert "load4_aligned(x, " in src and "load4(x, " not in src and "load4(x, " in module
    assert "KERNEL = conv_fwd_tf32\n" in module and "KERNEL_ANY_ALIGNMENT = conv_fwd_tf32_any_alignment" in module
    assert "from kernelgen.cuda_mma import mma_m16n8k8_tf32, tf32" in src
    # 4 x 4 MMA tiles per warp x 2 k-steps of BK=16 x 2 pipeline stages, accumulators as scalars
    assert src.count("= mma_m16n8k8_tf32(") == 64 and "cuda.local.array" not in src
    assert "launch_bounds" not in src
    cfg = TileConfig(128, 64, 16, WM=32, WN=32, stages=2, swizzle=1, min_blocks=2)
    src = render_cuda(make_plan(p, "cuda", config=cfg, precision="tf32").kernel_ir(), cache=False)
    assert "LAUNCH_BOUNDS = (256, 2)" in src and "**jit_launch_bounds(LAUNCH_BOUNDS)" in src
    fp32 = render_cuda(make_plan(p, "cuda").kernel_ir(), cache=False)
    assert "tf32" not in fp32 and "mma" not in fp32


def test_async_copy_rendering_and_validation():
    """async_copy=1: the CUDA module copies with cp.async into 16-byte aligned shared tiles and keeps no
    staging registers; configs it cannot build are refused with the reason, before any kernel exists."""
    p = make_problem("fwd", (4, 9, 9, 32), (64, 3, 3, 32), padding=1)
    cfg = TileConfig(128, 64, 16, WM=64, WN=32, stages=3, swizzle=1, async_copy=1)
    module = render_cuda(make_plan(p, "cuda", config=cfg, precision="tf32").kernel_ir(), cache=False)
    src = aligned_kernel(module)
    assert "copy_async16(As, " in src and "copy_async16(Bs, " in src and "copy_async_wait(1)" in src
    assert "copy_async4(" not in src and "copy_async4(As, " in module
    assert "alignment=16" in src and "ra_0" not in src and "load4(" not in src
    # 3 unrolled slices x 4 x 4 MMA tiles x 2 k-steps; every fragment element rounded as it is loaded
    assert src.count("= mma_m16n8k8_tf32(") == 96 and src.count("= tf32(As[") == 3 * 32
    assert str(cfg) == "BM128_BN64_BK16_WM64_WN32_S3_SWZ_ASYNC" and TileConfig.parse(str(cfg)) == cfg
    for bad in (dict(stages=5), dict(stages=1), dict(swizzle=2), dict(swizzle=0)):
        with pytest.raises(ValueError, match="async_copy"):
            TileConfig(128, 64, 16, WM=64, WN=32, **{**dict(stages=3, swizzle=1, async_copy=1), **bad}).validate()
    with pytest.raises(ValueError, match="bytes of shared memory"):
        make_plan(p, "cuda", config=TileConfig(128, 64, 32, WM=64, WN=32, stages=3, swizzle=1, async_copy=1),
                  precision="tf32").kernel_ir()


def test_vector_staging_only_where_channels_come_in_fours():
    """k-contiguous operands (forward x and w, backward-data dy) are staged 4 channels per VectorLoad when
    the reduction's channel count is a multiple of 4; otherwise element by element."""
    from kernelgen.ir import VectorLoad
    from kernelgen.ir_walk import walk_stmts

    def vector_loads(direction, x_shape, w_shape, **kw):
        p = make_problem(direction, x_shape, w_shape, **kw)
        k = make_plan(p, "cuda", config=CUDA_TC_DEFAULT, precision="tf32").kernel_ir()
        return [s.buf for s in walk_stmts(k.body) if isinstance(s, VectorLoad)]
    assert set(vector_loads("fwd", (2, 9, 9, 32), (64, 3, 3, 32), padding=1)) == {"x", "w"}
    assert vector_loads("fwd", (2, 9, 9, 30), (64, 3, 3, 30), padding=1) == []
    assert vector_loads("fwd", (2, 9, 9, 20), (64, 3, 3, 10), padding=1, groups=2) == []   # Cg = 10
    assert set(vector_loads("bwd_data", (2, 9, 9, 30), (64, 3, 3, 30), padding=1)) == {"dy"}
    assert vector_loads("bwd_data", (2, 9, 9, 32), (62, 3, 3, 32), padding=1) == []
    assert vector_loads("bwd_weight", (2, 9, 9, 32), (64, 3, 3, 32), padding=1) == []


# --- CPU backend: the same IR, emulated ------------------------------------------------------------

@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weight"])
@pytest.mark.parametrize("name", list(CASES))
def test_cpu_tf32_directions(name, direction, rng):
    x_shape, w_shape, kw = CASES[name]
    x, w, dy = conv_tensors(rng, x_shape, w_shape, kw)
    got, reference = run(direction, x, w, dy, kw, backend="cpu", precision="tf32")
    err = check_tf32(got, reference, x, w, dy, f"{direction} {name}")
    assert err <= EMULATED_TOL, f"{direction} {name}: {err:.3g} from the TF32-rounded reference"


# the CUDA default, and the narrow tile small GEMMs get (each CPU compile of these costs ~0.5-1.5 min, so only the
# small tile's forward runs in CI - the default's forward took 84 s of it; test_cpu_swizzled_tiles covers every
# direction on small tiles, and the GPU tests run the default tile on the device)
SMALL_CUDA_TILE = TileConfig(64, 32, 16, WM=32, WN=16, stages=2, swizzle=1)


@pytest.mark.parametrize("direction, config",
                         [pytest.param(d, CUDA_TC_DEFAULT, marks=pytest.mark.slow) for d in DIRECTIONS]
                         + [("fwd", SMALL_CUDA_TILE), pytest.param("bwd_weight", SMALL_CUDA_TILE, marks=pytest.mark.slow)],
                         ids=str)
def test_cpu_runs_the_gpu_schedule(direction, config, rng):
    """The CUDA tiles (default: 4 x 4 MMA tiles per warp, two k-steps per slice, 2-stage pipeline) through
    the CPU renderer, on a problem ragged against them."""
    x_shape, w_shape, kw = (2, 13, 11, 20), (72, 3, 3, 20), dict(padding=1, stride=(1, 2))
    x, w, dy = conv_tensors(rng, x_shape, w_shape, kw)
    p = make_problem(direction, x_shape, w_shape, y_shape=dy.shape, **kw)
    plan = make_plan(p, "cpu", config=config, precision="tf32")
    inputs = {"fwd": {"x": x, "w": w}, "bwd_data": {"dy": dy, "w": w}, "bwd_weight": {"x": x, "dy": dy}}[direction]
    out = launch_poisoned(get_launcher(plan), p, inputs, "cpu")
    err = check_tf32(out, reference_fn(direction, kw), x, w, dy, direction)
    assert err <= EMULATED_TOL


def test_strided_backward_data_runs_ks_deconv_classes():
    """precision="tf32" backward-data at stride 2 computes KS-deconv's stride-1 classes (grid z = groups x 4
    classes, 2 x 2 taps each), not the zero-insertion view's 3 x 3 taps of which 3/4 are zeros; at stride 1 the
    implicit-GEMM view."""
    from kernelgen.templates.tiled_gemm import _cdiv
    p = make_problem("bwd_data", (2, 16, 16, 32), (64, 3, 3, 32), stride=2, padding=1)
    k = make_plan(p, "cuda", config=CUDA_TC_DEFAULT, precision="tf32").kernel_ir()
    assert k.meta["doc"].startswith("KS-deconv") and k.grid == (_cdiv(2 * 8 * 8, 128), 1, 4)
    assert k.meta["work"] == 2 * 8 * 8 * 32 * (4 * 64) * 4
    p1 = make_problem("bwd_data", (2, 16, 16, 32), (64, 3, 3, 32), padding=1)
    assert make_plan(p1, "cuda", config=CUDA_TC_DEFAULT, precision="tf32").kernel_ir().meta["doc"].startswith(
        "implicit-GEMM backward-data")


def test_deconv_tf32(rng):
    x = rng.standard_normal((2, 5, 4, 8)).astype(np.float32)
    w = rng.standard_normal((8, 3, 3, 6)).astype(np.float32)
    kw = dict(stride=2, padding=1, output_padding=1)
    got = kernelgen.deconv(x, w, backend="cpu", precision="tf32", **kw)
    assert rel_err(got, ref.deconv(x, w, **kw)) <= TF32_TOL
    assert rel_err(got, ref.deconv(tf32_round(x), tf32_round(w), **kw)) <= EMULATED_TOL
    assert kernelgen.explain("deconv", x, w, backend="cpu", precision="tf32", **kw).precision == "tf32"


# --- precision is never silent ---------------------------------------------------------------------

def test_default_is_fp32_and_global_setting_applies(rng, assert_close):
    x_shape, w_shape, kw = CASES["c16_dilated"]
    x, w, _ = conv_tensors(rng, x_shape, w_shape, kw)
    assert kernelgen.get_precision() == "fp32"
    e = kernelgen.explain(kernelgen.conv, x, w, backend="cpu", **kw)
    assert e.precision == "fp32" and e.variant != "implicit_gemm_tc" and "tf32" not in e.source
    want = ref.conv_forward(x, w, **kw)
    assert_close(kernelgen.conv(x, w, backend="cpu", **kw), want, "float32")  # 1e-5: TF32 cannot pass this
    old = kernelgen.set_precision("tf32")
    try:
        assert old == "fp32"
        e = kernelgen.explain(kernelgen.conv, x, w, backend="cpu", **kw)  # the prepared fp32 call is not reused
        assert e.precision == "tf32" and e.variant == "implicit_gemm_tc" and "precision: tf32" in str(e)
        assert kernelgen.explain(kernelgen.conv, x, w, backend="cpu", precision="fp32", **kw).precision == "fp32"
        assert rel_err(kernelgen.conv(x, w, backend="cpu", **kw), want) <= TF32_TOL
    finally:
        kernelgen.set_precision(old)
    assert_close(kernelgen.conv(x, w, backend="cpu", **kw), want, "float32")


def test_cuda_bwd_weight_tile_by_issue_cost():
    """Backward-weight's default tile: padded work x SASS instructions per MMA (split-K fills the GPU), so the
    large 128 x 64 tile wherever it pads little (PERF_NOTES #21); the other directions keep their choice."""
    from kernelgen.tuning.shapes import load_table
    layers = {layer.name: layer for layer in load_table("gpu_md")[1]}
    pick = lambda name, d: make_plan(layers[name].problem(d), "cuda", precision="tf32").config
    assert str(pick("r50_3x3_28", "bwd_weight")) == "BM128_BN64_BK16_WM64_WN32_SK15_S2_SWZ"
    assert str(pick("r18_c64_32", "bwd_weight")) == "BM64_BN64_BK16_WM32_WN32_SK30_S2_SWZ"  # M = 64: no 128-row tile
    assert str(pick("r50_3x3_28", "fwd")) == str(CUDA_TC_DEFAULT)


def test_plan_keys_differ_by_precision():
    p = make_problem("fwd", (2, 8, 8, 16), (16, 3, 3, 16), padding=1)
    cfg = TileConfig(BM=32, BN=16, BK=8, WM=16, WN=8)
    assert make_plan(p, "cpu", precision="tf32").key() != make_plan(p, "cpu").key()
    assert make_plan(p, "cpu", config=cfg, precision="tf32").precision == "tf32"


@pytest.mark.parametrize("kwargs, message", [
    (dict(precision="fp64"), r"precision must be one of \('fp32', 'tf32', 'fp16', 'bf16'\), got 'fp64'"),
    (dict(precision="fp16", config=TileConfig(32, 16, 8, WM=16, WN=8)), "config: precision='fp16' needs BK a multiple"),
    (dict(precision="bf16", config=TileConfig(32, 16, 24, WM=16, WN=8)), "config: precision='bf16' needs BK a multiple"),
    (dict(precision="tf32", algo="winograd"), "implemented by algo='implicit_gemm' only"),
    (dict(algo="implicit_gemm_tc"), "ask for it with precision='tf32'"),
    (dict(precision="tf32", config=TileConfig()), "tensor-core TileConfig"),
])
def test_bad_precision_arguments(kwargs, message, rng):
    x = rng.standard_normal((2, 6, 6, 8)).astype(np.float32)
    w = rng.standard_normal((8, 3, 3, 8)).astype(np.float32)
    config = kwargs.pop("config", None)
    with pytest.raises(ValueError, match=message):
        if config is None:
            kernelgen.conv(x, w, backend="cpu", **kwargs)
        else:
            make_plan(make_problem("fwd", x.shape, w.shape), "cpu", config=config, **kwargs)


def test_bad_global_precision_and_float64():
    with pytest.raises(ValueError, match="precision must be one of"):
        kernelgen.set_precision("half")
    with pytest.raises(ValueError, match=r"\('fp32', 'tf32', 'fp16', 'bf16'\)"):
        kernelgen.set_precision("float16")
    assert kernelgen.get_precision() == "fp32"
    x, w = np.ones((1, 4, 4, 8)), np.ones((8, 1, 1, 8))
    with pytest.raises(ValueError, match="needs float32 tensors"):
        kernelgen.conv(x, w, backend="cpu", precision="tf32")


@pytest.mark.sim
@pytest.mark.parametrize("precision", ["tf32", "fp16", "bf16"])
def test_simulator_has_no_mma(precision, rng):
    x = rng.standard_normal((1, 4, 4, 16)).astype(np.float32)
    w = rng.standard_normal((8, 1, 1, 16)).astype(np.float32)
    with pytest.raises(NotImplementedError, match="no CUDA-simulator stand-in"):
        kernelgen.conv(x, w, backend="cuda", precision=precision)


def test_bench_reports_precision(capsys):
    from kernelgen.tuning import bench
    row = {"layer": "r18_c64_32", "direction": "fwd", "variant": "implicit_gemm_tc",
           "config": str(CUDA_TC_DEFAULT), "kernelgen_tflops": 99.0, "cudnn_tflops": 110.0, "ratio": 0.9,
           "registers": 230, "shared_bytes": 26624, "local_bytes": 0, "occupancy": 0.125, "pct_of_peak": 0.25,
           "pct_of_floor": 0.25, "rel_err_vs_cudnn": 3e-4, "precision": "tf32"}
    md = bench.markdown([row], bench.summary([row]))
    assert "| 230 | 26624 | 0 | 0.125 | 25% |" in md and "of 396 TFLOP/s; cuDNN with TF32 on" in md
    assert bench.floor_ms(make_problem("fwd", (128, 32, 32, 64), (64, 3, 3, 64), padding=1), "tf32") < \
        bench.floor_ms(make_problem("fwd", (128, 32, 32, 64), (64, 3, 3, 64), padding=1))
    from kernelgen.api import gpu_present
    if not gpu_present():  # (on a GPU this would run the whole benchmark)
        for precision in ("tf32", "fp16", "bf16"):
            assert bench.main(["gpu_md", "--precision", precision]) == 1  # parsed; no GPU, nothing to time
    with pytest.raises(SystemExit):
        bench.main(["gpu_md", "--precision", "fp8"])
    md16 = bench.markdown([{**row, "precision": "fp16"}], bench.summary([row]))
    assert "of 792 TFLOP/s; cuDNN in float16" in md16
