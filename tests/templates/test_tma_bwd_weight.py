"""16-bit backward-weight on TMA + warpgroup MMAs (TileConfig.a_mn and b_mn; issue 33): dw[k, tap, c] = sum over the
output pixels of dy[pixel, k] x[pixel at tap, c], both operands arriving as boxes of 64 columns x 64 pixels (dy's
tiled, x's im2col) that the wgmma reads MN-major.

On the CPU backend the copies happen when issued and the MMAs are emulated per lane (kernelgen.cpu_round.wgmma_f16
with A and B MN-major); split-K runs its blocks in turn there (render_cpu parallel=False), adding into the float32
workspace the launcher rounds into dw.  The GPU tests run the same kernels on the H100.  Fresh random data, outputs
poisoned, every result against float64 on the same 16-bit values.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kernelgen import reference as ref
from kernelgen.problem import make_problem
from kernelgen.storage import narrow_bits, poisoned, widen_bits
from kernelgen.templates.config import TileConfig
from harness import random_array
from test_tma_fp16 import close_to_float64


def bwd_weight_config(**kw):
    return TileConfig(**{"BK": 64, "WM": 64, "wgmma": 1, "tma": 1, "a_mn": 1, "b_mn": 1, **kw})


# (x shape, w shape, conv keywords, tile): 1-2 warpgroups along k_out, 64-256 columns, ragged k_out (40), ragged
# columns (3 x 3 x 64 = 576 against 128: the last box reads the filter's last tap, not stored), pixels ragged against
# the 64-pixel slices, stride 2 (the im2col walk's traversal), dilation, 1x1, tma=2, split-K (even and ragged)
CASES = [((2, 5, 6, 64), (64, 3, 3, 64), dict(padding=1), dict(BM=64, BN=64, WN=64, stages=2)),
         ((2, 9, 7, 64), (40, 3, 3, 64), dict(padding=1, stride=2), dict(BM=128, BN=128, WN=128, stages=3, tma=2)),
         pytest.param((1, 10, 9, 128), (128, 3, 3, 128), dict(padding=2, dilation=2),  # (85 s of numba on the CPU)
                      dict(BM=128, BN=256, WN=256, stages=2), marks=pytest.mark.slow),
         ((2, 6, 5, 64), (64, 1, 1, 64), {}, dict(BM=64, BN=64, WN=64, stages=4, tma=2)),
         ((2, 12, 16, 128), (128, 3, 3, 128), dict(padding=1), dict(BM=128, BN=128, WN=64, stages=2, split_k=3)),
         ((2, 11, 13, 64), (64, 3, 3, 64), dict(padding=1), dict(BM=64, BN=128, WN=128, stages=2, split_k=3, tma=2))]


def _launcher(p, cfg, precision):
    """A CPU launcher of the TMA kernel; split-K through the sequential renderer (blocks in turn)."""
    from kernelgen.api import get_launcher, make_plan
    from kernelgen.render_cpu import render_cpu
    from kernelgen.runtime.cache import KERNELS
    from kernelgen.runtime.launch import Launcher
    from kernelgen.templates import implicit_gemm_tc
    if cfg.split_k == 1:
        return get_launcher(make_plan(p, "cpu", config=cfg, precision=precision))
    source = render_cpu(implicit_gemm_tc.build(p, cfg, precision), parallel=False)
    return KERNELS.get(("test_tma_bwd_weight", p, cfg, precision), lambda: source,
                       lambda m: Launcher.from_module(m, "cpu"))


@pytest.mark.parametrize("x_shape, w_shape, kw, tile", CASES)
def test_cpu_fp16_tma_backward_weight(x_shape, w_shape, kw, tile, rng):
    p = make_problem("bwd_weight", x_shape, w_shape, dtype="float16", **kw)
    launcher = _launcher(p, bwd_weight_config(**tile), "fp16")
    assert [(m[0], m[1], m[2], m[10]) for m in launcher.tensor_maps] == [("dy_map", "dy", "tiled", ()),
                                                                         ("x_map", "x", "im2col", ())]
    assert launcher.widened == (("dw",) if tile.get("split_k", 1) > 1 else ())
    for _ in range(2):  # fresh data each call (a split's workspace is zeroed every call)
        x, dy = (random_array(rng, s, np.float16) for s in (x_shape, p.y_shape))
        dw = poisoned(int(np.prod(w_shape)), np.float16)
        launcher({"x": x.ravel(), "dy": dy.ravel(), "dw": dw})
        close_to_float64(dw.reshape(w_shape), ref.conv_backward_weight(x.astype(np.float64), dy.astype(np.float64),
                                                                        w_shape, **kw))


@pytest.mark.parametrize("case", [0, 4])
def test_cpu_bf16_tma_backward_weight(case, rng):
    """bfloat16 bits in and out, the same kernels with .bf16 operands."""
    from test_bf16_storage import check_bf16
    x_shape, w_shape, kw, tile = CASES[case]
    p = make_problem("bwd_weight", x_shape, w_shape, dtype="bfloat16", **kw)
    launcher = _launcher(p, bwd_weight_config(**tile), "bf16")
    x, dy = (narrow_bits(random_array(rng, s, np.float32)) for s in (x_shape, p.y_shape))
    dw = poisoned(int(np.prod(w_shape)), "bfloat16")
    launcher({"x": x.ravel(), "dy": dy.ravel(), "dw": dw})
    f64 = lambda bits: widen_bits(bits).astype(np.float64)
    check_bf16(dw.reshape(w_shape), ref.conv_backward_weight(f64(x), f64(dy), w_shape, **kw), "tma dw",
               accumulation=1e-4)


def test_backward_weight_tma_refusals():
    """What the boxes need, named before anything is built: 16-bit arrays, C a multiple of 64, a_mn with b_mn, and
    a_mn only where A is MN-major."""
    from kernelgen.api import make_plan
    cfg = bwd_weight_config(BM=64, BN=64, WN=64, stages=2)
    with pytest.raises(ValueError, match="channels a multiple of 64"):
        make_plan(make_problem("bwd_weight", (1, 6, 6, 40), (64, 3, 3, 40), dtype="float16", padding=1), "cpu",
                  config=cfg, precision="fp16").kernel_ir()
    with pytest.raises(ValueError, match="a_mn=1 .backward-weight's A MN-major. needs b_mn=1"):
        TileConfig(BM=64, BN=64, BK=64, WM=64, WN=64, stages=2, wgmma=1, tma=1, a_mn=1).validate()
    fwd = make_problem("fwd", (1, 6, 6, 64), (64, 3, 3, 64), dtype="float16", padding=1)
    with pytest.raises(ValueError, match="a_mn=1 reads backward-weight's dy MN-major"):
        make_plan(fwd, "cpu", config=cfg, precision="fp16").kernel_ir()
    assert TileConfig.parse(str(cfg)) == cfg and cfg.as_dict()["a_mn"] == 1


def test_backward_weight_tma_candidates_and_cuda_module():
    """The tuner's backward-weight TMA tiles (split to about one and two waves: ragged splits allowed, the boxes past
    the last pixel read zeros), and the rendered kernel: both operands' wgmma transposed (the _amn_bmn intrinsic)."""
    from kernelgen.api import make_plan
    from kernelgen.render_cuda import render_cuda
    from kernelgen.target import KNOWN_TARGETS
    from kernelgen.templates import implicit_gemm_tc
    p = make_problem("bwd_weight", (32, 56, 56, 64), (64, 3, 3, 64), dtype="float16", padding=1)
    cands = implicit_gemm_tc.tma_candidate_configs(p, "fp16", KNOWN_TARGETS["h100"])
    assert cands and all(c.a_mn and c.b_mn and c.tma for c in cands)
    assert all(implicit_gemm_tc.accepts(c, "fp16") for c in cands)
    assert min(c.split_k for c in cands) > 1  # 3 x 3 x 64 columns: 5-9 tiles of 128 x 128, the SMs filled by splits
    assert not implicit_gemm_tc.tma_candidate_configs(replace(p, dtype="float32"), "tf32", KNOWN_TARGETS["h100"])
    src = render_cuda(make_plan(p, "cuda", config=cands[0], precision="fp16").kernel_ir(), cache=False)
    assert "wgmma_f16_m64n128k16_amn_bmn" in src and "tma_load_im2col_4d" in src and "tma_load_2d" in src


# --- the H100 -----------------------------------------------------------------------------------------------------

GPU_CONFIGS = [bwd_weight_config(BM=128, BN=128, WN=128, stages=6, tma=2, split_k=4),
               bwd_weight_config(BM=128, BN=256, WN=256, stages=4, tma=2, split_k=3),
               bwd_weight_config(BM=256, BN=128, WM=128, WN=128, stages=4, tma=2, split_k=2),
               bwd_weight_config(BM=64, BN=128, WN=128, stages=6, tma=1)]
GPU_SHAPES = [((4, 16, 16, 64), (64, 3, 3, 64), dict(padding=1)),
              ((3, 13, 11, 128), (40, 3, 3, 128), dict(padding=2, dilation=2)),
              ((2, 17, 15, 64), (128, 3, 3, 64), dict(padding=1, stride=2)),
              ((2, 9, 7, 192), (24, 1, 1, 192), {})]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=str)
def test_gpu_tma_backward_weight(config, dtype, rng):
    """The wgmma with both operands transposed reading TMA's boxes on the H100, two calls on fresh data each (the
    second by address: a split's workspace zeroed and narrowed, the maps derived); inputs left as they were."""
    from numba import cuda

    from kernelgen.api import get_launcher, make_plan
    precision = "fp16" if dtype == "float16" else "bf16"
    for x_shape, w_shape, kw in GPU_SHAPES:
        p = make_problem("bwd_weight", x_shape, w_shape, dtype=dtype, **kw)
        launcher = get_launcher(make_plan(p, "cuda", config=config, precision=precision))
        for call in range(2):
            if dtype == "float16":
                x, dy = (random_array(rng, s, np.float16) for s in (x_shape, p.y_shape))
                values = lambda a: a.astype(np.float64)
            else:
                x, dy = (narrow_bits(random_array(rng, s, np.float32)) for s in (x_shape, p.y_shape))
                values = lambda bits: widen_bits(bits).astype(np.float64)
            args = {"x": cuda.to_device(x.ravel()), "dy": cuda.to_device(dy.ravel())}
            dw = cuda.to_device(poisoned(int(np.prod(w_shape)), np.float16 if dtype == "float16" else "bfloat16"))
            launcher({**args, "dw": dw})
            want = ref.conv_backward_weight(values(x), values(dy), w_shape, **kw)
            got = dw.copy_to_host().reshape(w_shape)
            if dtype == "float16":
                close_to_float64(got, want)
            else:
                from test_bf16_storage import check_bf16
                check_bf16(got, want, f"{config} {x_shape} call {call}", accumulation=1e-4)
            for k, v in (("x", x), ("dy", dy)):
                assert np.array_equal(args[k].copy_to_host().view(np.uint16), v.ravel().view(np.uint16))
        assert launcher.fast  # the second call took the launch by address
