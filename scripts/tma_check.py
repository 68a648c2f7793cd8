"""Do TMA copies work from a numba kernel, and do they feed the tensor cores where cp.async does not?  A probe
for PERF_NOTES (#34), not a test: hand-written kernels for one layer (r50_3x3_28 forward: x 32x28x28x128,
w 128x3x3x128, padding 1), the shapes the tiled-GEMM template would generate.

    python scripts/tma_check.py [--out tma_check.json]      # on the H100 (scripts/gpu_run.sh tma-check)
    NUMBA_ENABLE_CUDASIM=0 python scripts/tma_check.py --compile-only   # anywhere: PTX -> ptxas sm_90a

1. copies: one im2col TMA copy (128 output pixels x 32 channels of one filter tap, padding as zeros) and one
   tiled copy (64 filters x 32 of their k) into shared memory, unswizzled and 128-byte swizzled, against NumPy;
   for the im2col offsets both readings ({dw, dh} and {dh, dw}) are reported.
2. streams: the layer's whole operand stream (392 blocks x 36 k slices of a 128 x 64 tile, 24 KiB a slice)
   copied global -> shared with no arithmetic, by TMA (one thread per block issues, mbarriers) and by
   16-byte cp.async from every thread (what the generated kernels do: .ca, allocating in L1; and .cg, through L2
   only): GB/s and the TFLOP/s the layer would run at if the copies were all it did.
3. conv: the layer computed by TMA copies feeding m64nBNk8 wgmma (two warpgroups, 128 x BN tiles, S stages;
   operands not rounded, see PERF_NOTES #35) in four schedules: a block barrier per slice (what the generated
   kernels do); warp-specialised as cuDNN's (a producer warp, full/empty mbarriers per stage, wait_group 1); the
   same with the consumers rounding each landed stage to TF32 in shared memory; the same persistent (one block
   per SM slot looping over the tiles); each checked on sampled outputs against float64 of exact, TF32-truncated
   and TF32-rounded operands, and timed beside cuDNN (torch, TF32 on, channels-last) in alternating rounds in the
   same process.  mbarrier waits give up after SPIN_LIMIT rounds: a wrong protocol shows as wrong numbers.
4. generated: kernelgen's own TMA kernels for the layer (TileConfig.tma=1, a block barrier per slice, and tma=2,
   warp-specialised; GENERATED), through the launcher, checked and timed beside cuDNN the same way.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tma_check_kernels import (BM, C, FLOP, H, HW, K, KTOT, M, N, PAD, R, SLICES, SMS, THREADS, W,  # noqa: E402
                               build, kernels)


def tensor_maps(x_dev, w_dev, bn, swizzle):
    from kernelgen.runtime.tensor_map import channels_last, encode_im2col, encode_tiled
    from numba import cuda
    dims, strides = channels_last((N, H, W, C))
    xmap = encode_im2col(x_dev.device_ctypes_pointer.value, np.float32, dims, strides, (-PAD, -PAD),
                         (PAD - (R - 1), PAD - (R - 1)), 32, 128, swizzle=swizzle)
    wmap = encode_tiled(w_dev.device_ctypes_pointer.value, np.float32, (KTOT, K), (KTOT * 4,), (32, bn),
                        swizzle=swizzle)
    return cuda.to_device(xmap), cuda.to_device(wmap)


def tap_row(x, m, dh, dw):
    """The C channels that output pixel m reads at filter tap (dh, dw): zeros in the padding."""
    n, ho, wo = m // HW, (m % HW) // W, m % W
    hi, wi = ho - PAD + dh, wo - PAD + dw
    return x[n, hi, wi] if 0 <= hi < H and 0 <= wi < W else np.zeros(C, x.dtype)


def expected_a(x, m0, c0, dh, dw):
    """The 128 x 32 im2col tile: pixels m0.. at tap (dh, dw), channels c0..c0 + 31."""
    return np.stack([tap_row(x, m0 + p, dh, dw)[c0:c0 + 32] for p in range(128)])


def check_copies(x, w2d, x_dev, w_dev):
    from numba import cuda

    from kernelgen.runtime.tensor_map import copy_kernel, unswizzle128
    k = copy_kernel()
    results = []
    for swizzle in (None, 128):
        xmap, wmap = tensor_maps(x_dev, w_dev, 64, swizzle)
        cases = ((0, (0, 2), 0, 64, 0), (768, (2, 1), 96, 1120, 64), (M - 128, (1, 0), 32, 0, 64))
        for m0, (r, s), c0, kb, nb0 in cases:
            n, ho, wo = m0 // HW, (m0 % HW) // W, m0 % W
            coords = np.array([c0, wo - PAD, ho - PAD, n, s, r, kb, nb0], np.int32)
            out = cuda.to_device(np.full(6144, np.nan, np.float32))
            k[1, 128, 0, 6144 * 4](xmap, wmap, out, cuda.to_device(coords), 4096, 2048)
            got = out.copy_to_host()
            a, b = got[:4096].reshape(128, 32), got[4096:].reshape(64, 32)
            if swizzle:
                a, b = unswizzle128(a), unswizzle128(b)
            row = dict(swizzle=swizzle, m0=m0, tap=(r, s), c0=c0,
                       a_dw_dh=bool(np.array_equal(a, expected_a(x, m0, c0, r, s))),
                       a_dh_dw=bool(np.array_equal(a, expected_a(x, m0, c0, s, r))),
                       b=bool(np.array_equal(b, w2d[nb0:nb0 + 64, kb:kb + 32])))
            results.append(row)
            print(f"copy swizzle={swizzle} m0={m0} tap={r, s} c0={c0}: im2col offsets (dw, dh) "
                  f"{'ok' if row['a_dw_dh'] else 'WRONG'}, (dh, dw) {'ok' if row['a_dh_dw'] else 'wrong'}; "
                  f"tiled {'ok' if row['b'] else 'WRONG'}", flush=True)
    return results


def cudnn_conv(x, w):
    """cuDNN's convolution of the layer (torch, TF32 on, channels-last), or None without torch."""
    try:
        import torch
    except ImportError:
        return None
    torch.backends.cudnn.allow_tf32 = True
    xt = torch.from_numpy(x).cuda().permute(0, 3, 1, 2)  # NHWC storage = channels-last NCHW view
    wt = torch.from_numpy(w).cuda().permute(0, 3, 1, 2)
    return lambda: torch.nn.functional.conv2d(xt, wt, padding=PAD)


def check_conv(y, x, w2d, rng):
    """Max relative errors of 256 sampled output pixels against float64 of the exact, the TF32-truncated
    (what wgmma reads from float32) and the TF32-rounded (cvt.rna) operands."""
    ms = rng.choice(M, 256, replace=False)
    got = y.reshape(M, K)[ms].astype(np.float64)
    bits = lambda a, add: ((a.view(np.uint32) + np.uint32(add)) & np.uint32(0xFFFFE000)).view(np.float32)
    out = {}
    readings = (("exact", lambda a: a), ("truncated", lambda a: bits(a, 0)), ("rounded", lambda a: bits(a, 0x1000)))
    for label, op in readings:
        xr, wr = op(x).astype(np.float64), op(w2d).astype(np.float64)
        patches = np.stack([np.concatenate([tap_row(xr, m, r, s) for r in range(R) for s in range(R)]) for m in ms])
        ref = patches @ wr.T
        out[label] = float(np.max(np.abs(got - ref)) / np.abs(ref).max())
    return out


def run(args):
    from numba import cuda
    from kernelgen.runtime.driver import allow_dynamic_shared
    from kernelgen.tuning.timing import time_cuda, time_host, time_side_by_side
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, H, W, C)).astype(np.float32)
    w = rng.standard_normal((K, R, R, C)).astype(np.float32)
    w2d = w.reshape(K, KTOT)
    x_dev, w_dev = cuda.to_device(x.ravel()), cuda.to_device(w2d.ravel())
    report = {"runs": []}
    try:
        report["copies"] = "not run (--generated-only)" if args.generated_only else check_copies(x, w2d, x_dev, w_dev)
    except Exception as e:  # e.g. the driver refuses a map: the cp.async streams can still run
        print(f"copies: {type(e).__name__}: {e}", flush=True)
        report["copies"] = f"{type(e).__name__}: {e}"
    cudnn = cudnn_conv(x, w)
    if cudnn:  # what cuDNN's TF32 gives, by the same measure: does it round its operands or truncate them?
        y = cudnn().permute(0, 2, 3, 1).contiguous().cpu().numpy()
        report["cudnn_max_rel_err"] = err = check_conv(y, x, w2d, rng)
        print("cuDNN TF32: err {exact:.1e} (truncated {truncated:.1e}, rounded {rounded:.1e})".format(**err), flush=True)
    for bn, s in () if args.generated_only else ((64, 4), (128, 4), (128, 6)):
        try:
            xmap, wmap = tensor_maps(x_dev, w_dev, bn, 128)
        except Exception as e:
            print(f"tensor maps for BN {bn}: {type(e).__name__}: {e}", flush=True)
            xmap = wmap = None
        tiles = (M // BM) * (K // bn)
        for label, src, name, nbytes, threads in kernels(bn, s):
            conv = name.startswith("conv_")
            # persistent: as many blocks as fit at once (228 KiB of shared memory per SM, 1 KiB reserved a block)
            blocks = SMS * min(2, 228 * 1024 // (nbytes + 2048)) if name.endswith("persistent") else tiles
            try:
                k = build(src, name)
                tma = not name.startswith("stream_ldgsts")
                if tma and xmap is None:
                    raise RuntimeError("no tensor maps")
                y = cuda.to_device(np.full(M * K if conv else tiles * THREADS, np.nan, np.float32))
                ordered = (xmap, wmap, y) if tma else (x_dev, w_dev, y)
                allow_dynamic_shared(k, ordered, nbytes)
                launch = lambda: k[blocks, threads, 0, nbytes](*ordered)
                # one checked call first: a kernel that computes nonsense, or crawls through its bounded waits,
                # is reported, not timed
                first_ms = time_host(lambda: (launch(), cuda.synchronize()), warmup=0, repeat=1)
                err = check_conv(y.copy_to_host(), x, w2d, rng) if conv else None  # exact / truncated / rounded
                if (err and not min(err.values()) <= 1e-2) or first_ms > 200:  # garbage is ~1 off
                    raise RuntimeError(f"not timed: first call {first_ms:.0f} ms, errors {err}")
                if conv and cudnn:  # side by side, alternating rounds (tuning.timing)
                    us, base_us = (1e3 * ms for ms in time_side_by_side([launch, cudnn]))
                else:
                    us, base_us = 1e3 * time_cuda(launch), None
            except Exception as e:  # report and go on to the next kernel
                print(f"{label}: {type(e).__name__}: {e}", flush=True)
                report["runs"].append(dict(kernel=label, error=f"{type(e).__name__}: {e}"))
                continue
            moved = tiles * SLICES * (4096 + bn * 32) * 4  # bytes landing in shared memory
            row = dict(kernel=label, bn=bn, stages=s, us=us, gb_s=moved / us / 1e3, tflops=FLOP / us / 1e6,
                       regs=next(iter(k.get_regs_per_thread().values())))
            if conv:
                row.update(max_rel_err=err, cudnn_us=base_us, vs_cudnn=base_us / us if base_us else None)
            report["runs"].append(row)
            print(f"{label:34s} {us:8.1f} us  {row['gb_s']:7.0f} GB/s into shared  {row['tflops']:6.1f} TFLOP/s"
                  + ("  err {exact:.1e} (truncated {truncated:.1e}, rounded {rounded:.1e})".format(**row["max_rel_err"])
                     + f"  {row['vs_cudnn'] or 0:.2f}x cuDNN" if 'max_rel_err' in row
                     else "  (copies alone)"), flush=True)
    report["generated"] = generated_rows(x, w, w2d, x_dev, w_dev, cudnn, rng)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


GENERATED = ("BM=128,BN=64,BK=32,WM=64,WN=64,stages=4,wgmma=1,tma=1",
             "BM=128,BN=128,BK=32,WM=64,WN=128,stages=4,wgmma=1,tma=1",
             "BM=128,BN=128,BK=32,WM=64,WN=128,stages=6,wgmma=1,tma=1",
             "BM=128,BN=64,BK=32,WM=64,WN=64,stages=4,wgmma=1,tma=2",
             "BM=128,BN=128,BK=32,WM=64,WN=128,stages=4,wgmma=1,tma=2",
             "BM=128,BN=128,BK=32,WM=64,WN=128,stages=6,wgmma=1,tma=2",
             "BM=256,BN=64,BK=32,WM=128,WN=64,stages=4,wgmma=1,tma=2",
             "BM=256,BN=128,BK=32,WM=128,WN=128,stages=4,wgmma=1,tma=2")


def generated_rows(x, w, w2d, x_dev, w_dev, cudnn, rng):
    """The same layer by kernelgen's own generated TMA kernels (TileConfig.tma=1, PERF_NOTES #36: the "barrier"
    schedule; tma=2, #37: the "ws" one; both on operands the launcher rounded to TF32 first, #38), through the
    launcher (its rounding included), checked and timed beside cuDNN like the probe's."""
    from numba import cuda

    from kernelgen.api import get_launcher, make_plan
    from kernelgen.problem import make_problem
    from kernelgen.templates.config import TileConfig
    from kernelgen.tuning.timing import time_side_by_side
    p = make_problem("fwd", x.shape, w.shape, padding=PAD)
    rows = []
    for text in GENERATED:
        cfg = TileConfig(**{k: int(v) for k, v in (kv.split("=") for kv in text.split(","))})
        try:
            launcher = get_launcher(make_plan(p, "cuda", config=cfg, precision="tf32"))
            y = cuda.to_device(np.full(M * K, np.nan, np.float32))
            args = {"x": x_dev, "w": w_dev, "y": y}
            launcher(args)
            cuda.synchronize()
            err = check_conv(y.copy_to_host(), x, w2d, rng)
            if not min(err.values()) <= 1e-2:
                raise RuntimeError(f"not timed: errors {err}")
            fns = [lambda: launcher(args)] + ([cudnn] if cudnn else [])
            y.copy_to_device(np.full(M * K, np.nan, np.float32))
            times = [1e3 * ms for ms in time_side_by_side(fns)]
            cuda.synchronize()  # the timed calls (the launcher's fast route) computed the same
            timed_err = check_conv(y.copy_to_host(), x, w2d, rng)
            if not timed_err["rounded"] <= 1e-4:
                raise RuntimeError(f"the timed calls went wrong: {timed_err}")
        except Exception as e:
            print(f"generated {cfg}: {type(e).__name__}: {e}", flush=True)
            rows.append(dict(config=str(cfg), error=f"{type(e).__name__}: {e}"))
            continue
        us, base_us = times[0], times[1] if cudnn else None
        rows.append(dict(config=str(cfg), us=us, tflops=FLOP / us / 1e6, max_rel_err=err, cudnn_us=base_us,
                         vs_cudnn=base_us / us if base_us else None))
        print(f"generated {str(cfg):34s} {us:8.1f} us  {FLOP / us / 1e6:6.1f} TFLOP/s  err {err['exact']:.1e} "
              f"(rounded {err['rounded']:.1e})  {base_us / us if base_us else 0:.2f}x cuDNN", flush=True)
    return rows


def compile_only():
    """PTX and ptxas -arch=sm_90a for every kernel: syntax, registers, and the SASS census, without a GPU."""
    import re
    import subprocess
    import tempfile

    from numba import cuda, types

    from kernelgen.runtime.tensor_map import copy_kernel
    from ptx_check import _allow_missing_nvrtc, _disassembler, ptxas
    _allow_missing_nvrtc()
    workdir = tempfile.mkdtemp(prefix="kg_tma_")
    arr = lambda dt: types.Array(dt, 1, "C")
    maps = (arr(types.uint64), arr(types.uint64))
    todo = [("copy_kernel", copy_kernel(), (*maps, arr(types.float32), arr(types.int32), types.int64, types.int64))]
    for bn, s in ((64, 4), (128, 6)):
        for label, src, name, _, _ in kernels(bn, s):
            first = (arr(types.float32),) * 2 if name.startswith("stream_ldgsts") else maps
            todo.append((label, build(src, name), (*first, arr(types.float32))))
    tool = _disassembler()
    for label, k, sig in todo:
        ptx, _ = cuda.compile_ptx(k.py_func, sig, cc=(9, 0))
        path = os.path.join(workdir, f"{label}.ptx")
        with open(path, "w") as f:
            f.write(ptx.replace(".target sm_90\n", ".target sm_90a\n"))
        text, res = ptxas(path, path[:-4] + ".cubin")
        for advice in (line for line in text.splitlines() if "Performance" in line or "serializ" in line):
            print("  ptxas:", advice.strip())  # e.g. wgmma serialised by ptxas
        sass = subprocess.run([*tool, path[:-4] + ".cubin"], capture_output=True, text=True).stdout if tool else ""
        census = {op: len(re.findall(rf"\b{op}\b", sass)) for op in ("UTMALDG", "HGMMA", "SYNCS", "LDGSTS")}
        print(f"{label:34s} regs {res['registers']} spills {res['spill_stores']}/{res['spill_loads']} "
              f"stack {res['local_bytes']} {census}", flush=True)
    print("files in", workdir)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="tma_check.json")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--generated-only", action="store_true", help="skip the copy checks and the probe's kernels")
    args = ap.parse_args(argv)
    if args.compile_only:
        os.environ.setdefault("NUMBA_FORCE_CUDA_CC", "9.0")
        os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")
        return compile_only()
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
