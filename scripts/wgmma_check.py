"""Does sm_90a wgmma work from a generated numba kernel, and how fast?  A probe for PERF_NOTES, not a test.

    python scripts/wgmma_check.py [--out wgmma_check.json] [--parts layout,mn-major,ceiling]

1. layout: one m64n64k8 TF32 wgmma on fresh random operands staged in the no-swizzle K-major layout (core
   matrices of 8 rows x 16 bytes; K-adjacent ones 128 bytes apart, M-adjacent 256), checked against a float64
   product of TF32-truncated operands, for both readings of the descriptor's two offsets (leading = along K,
   stride = along M, and the other way round): which one the hardware means.
2. mn-major (fp16): one m64n128k16 wgmma with B MN-major (n contiguous: w as stored, for backward-data without
   the flip launch; PERF_NOTES lead) in the 128-byte swizzled layout TMA boxes of (64 n, 1, 16 k) would write (rows
   of 64 n along k, 8-row atoms 1024 bytes apart along k, 64-wide blocks of n 2048 bytes apart), A K-major as the
   generated kernels stage it; checked against float64 for both readings of the descriptor's offsets.
3. ceiling: wgmma from fixed shared tiles, BK = 32 per batch (4 k-steps x m64nNk8, per 64-row half of the block
   tile), wait(0) after each batch, at 1..3 blocks per SM: the issue ceiling for N = 64/128/256, 1 or 2
   warpgroups per block, with and without a block barrier per batch.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
from numba import cuda

from kernelgen import _cuda_wgmma_intrinsics as W

SMS = 132
ITERS = 1024


def _acc(n):
    return ", ".join(f"a{i}" for i in range(n // 2))


def build(src, name):
    ns = {"cuda": cuda, "float32": np.float32, "float16": np.float16,
          **{k: getattr(W, k) for k in dir(W) if not k.startswith("_")}}
    exec(compile(src, f"<{name}>", "exec"), ns)
    return ns[name]


def one_wgmma_kernel(name, stage, n, call):
    """A probe kernel `name(a, b, d, lbo, sbo)`: `stage` (source lines) puts A and B in shared memory, then one
    wgmma `call` (formatted with acc=) on the n / 2 accumulators, and D[64 x n] written out in their layout."""
    acc = _acc(n)
    src = f'''
@cuda.jit
def {name}(a, b, d, lbo, sbo):
    t = cuda.threadIdx.x
{stage}
    async_proxy_fence()
    cuda.syncthreads()
    {acc} = {", ".join(["float32(0.0)"] * (n // 2))}
    wgmma_fence()
    {acc} = {call.format(acc=acc)}
    wgmma_commit()
    {acc} = wgmma_wait(({acc},), 0)
    wq, lane = t // 32, t % 32
    g, q = lane // 4, lane % 4
    regs = ({acc},)
    for r in range({n // 2}):
        d[16 * wq + g + 8 * ((r % 4) // 2), 8 * (r // 4) + 2 * q + r % 2] = regs[r]
'''
    return build(src, name)


def readings(what, kernel, a, b, ref, offsets):
    """Max relative error of `kernel` against ref for each (label, lbo, sbo) reading of the descriptor offsets."""
    out = {}
    for label, lbo, sbo in offsets:
        d = cuda.to_device(np.full(ref.shape, np.nan, np.float32))
        kernel[1, 128](cuda.to_device(a), cuda.to_device(b), d, lbo, sbo)
        got = d.copy_to_host().astype(np.float64)
        err = float(np.nanmax(np.abs(got - ref)) / np.abs(ref).max()) if np.isfinite(got).all() else float("inf")
        out[label] = err
        print(f"{what} {label:44s} max rel err {err:.2e}", flush=True)
    return out


def check_layout():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 8)).astype(np.float32)
    b = rng.standard_normal((64, 8)).astype(np.float32)
    trunc = lambda x: (x.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)
    stage = """    As = cuda.shared.array(512, float32, alignment=128)
    Bs = cuda.shared.array(512, float32, alignment=128)
    for e in range(t, 512, 128):
        m, k = e // 8, e % 8
        w = (m // 8) * 64 + (k // 4) * 32 + (m % 8) * 4 + k % 4
        As[w] = a[m, k]
        Bs[w] = b[m, k]"""
    k = one_wgmma_kernel("one", stage, 64, "wgmma_tf32_m64n64k8(({acc},), smem_desc(As, 0, lbo, sbo), "
                                            "smem_desc(Bs, 0, lbo, sbo))")
    return readings("layout", k, a, b, trunc(a) @ trunc(b).T,
                    (("leading=K(128) stride=M(256)", 128, 256), ("leading=M(256) stride=K(128)", 256, 128)))


def check_mn_major():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((64, 16)).astype(np.float16)
    b = rng.standard_normal((16, 128)).astype(np.float16)
    # A[m, k], k < 16 of 128-byte K-major rows, chunk k // 8 at (k // 8) ^ (m % 8); B[k, n]: rows of 64 n along k,
    # chunk (n % 64) // 8 at that ^ (k % 8), 64-column blocks 16 rows (2048 bytes) apart
    stage = """    As = cuda.shared.array(4096, float16, alignment=1024)
    Bs = cuda.shared.array(2048, float16, alignment=1024)
    for e in range(t, 1024, 128):
        m, k = e // 16, e % 16
        As[m * 64 + ((k // 8) ^ (m % 8)) * 8 + k % 8] = a[m, k]
    for e in range(t, 2048, 128):
        k, n = e // 128, e % 128
        Bs[(n // 64) * 1024 + (k // 8) * 512 + (k % 8) * 64 + (((n % 64) // 8) ^ (k % 8)) * 8 + n % 8] = b[k, n]"""
    try:
        k = one_wgmma_kernel("mn", stage, 128, "wgmma_f16_m64n128k16_bmn(({acc},), smem_desc_sw128(As, 0, 16, 1024), "
                                               "smem_desc_sw128(Bs, 0, lbo, sbo))")
    except Exception as e:  # report and go on to the ceilings
        print(f"mn-major: {type(e).__name__}: {e}", flush=True)
        return {"error": f"{type(e).__name__}: {e}"}
    return readings("mn-major B", k, a, b, a.astype(np.float64) @ b.astype(np.float64),
                    (("leading=N blocks(2048) stride=K atoms(1024)", 2048, 1024),
                     ("leading=K atoms(1024) stride=N blocks(2048)", 1024, 2048)))


def ceiling_kernel(n, wgs, barrier, pending):
    acc = _acc(n)
    rows = 64 * wgs
    a_words, b_words = rows * 32, n * 32  # BK = 32: 8 k-chunks of 16 bytes per row
    steps = []
    for ks in range(4):  # core matrices: [row // 8][k chunk][row % 8][k % 4]; lbo 128 B, sbo 8 chunks = 1024 B
        steps.append(f"        {acc} = wgmma_tf32_m64n{n}k8(({acc},), smem_desc(As, wg * 2048 + {ks * 64}, 128, 1024), "
                     f"smem_desc(Bs, {ks * 64}, 128, 1024))")
    body = "\n".join(steps)
    src = f'''
@cuda.jit
def ceil(out, seed):
    As = cuda.shared.array({a_words}, float32, alignment=128)
    Bs = cuda.shared.array({b_words}, float32, alignment=128)
    t = cuda.threadIdx.x
    wg = t // 128
    for e in range(t, {a_words}, {128 * wgs}):
        As[e] = seed + float32(e % 7)
    for e in range(t, {b_words}, {128 * wgs}):
        Bs[e] = seed - float32(e % 5)
    async_proxy_fence()
    cuda.syncthreads()
    {acc} = {", ".join(["float32(0.0)"] * (n // 2))}
    for it in range({ITERS}):
        wgmma_fence()
{body}
        wgmma_commit()
        {acc} = wgmma_wait(({acc},), {pending})
        {"cuda.syncthreads()" if barrier else ""}
    {acc} = wgmma_wait(({acc},), 0)
    s = float32(0.0)
    for v in ({acc},):
        s += v
    out[cuda.blockIdx.x * {128 * wgs} + t] = s
'''
    return build(src, "ceil")


def ceilings():
    rows = []
    for n, wgs, barrier, pending in ((64, 1, False, 0), (128, 1, False, 0), (256, 1, False, 0), (128, 2, False, 0),
                                     (128, 2, True, 0), (128, 1, False, 1), (256, 1, True, 0)):
        try:
            k = ceiling_kernel(n, wgs, barrier, pending)
        except Exception as e:  # report and go on
            print(f"n{n} wg{wgs}: {type(e).__name__}: {e}", flush=True)
            continue
        for per_sm in (1, 2, 3):
            blocks = SMS * per_sm
            out = cuda.device_array(blocks * 128 * wgs, np.float32)
            try:
                k[blocks, 128 * wgs](out, np.float32(0.5))
                cuda.synchronize()
            except Exception as e:
                print(f"n{n} wg{wgs} {per_sm}/SM: {type(e).__name__}: {e}", flush=True)
                break
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                k[blocks, 128 * wgs](out, np.float32(0.5))
                cuda.synchronize()
                best = min(best, time.perf_counter() - t0)
            flop = blocks * wgs * ITERS * 4 * 2 * 64 * n * 8
            regs = next(iter(k.get_regs_per_thread().values()))
            row = dict(n=n, warpgroups=wgs, barrier=barrier, pending=pending, blocks_per_sm=per_sm,
                       tflops=flop / best / 1e12, regs=regs)
            rows.append(row)
            print(f"m64n{n}k8 x{wgs} wg bar={int(barrier)} wait({pending}) {per_sm} blocks/SM "
                  f"{row['tflops']:7.1f} TFLOP/s regs {regs}", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="wgmma_check.json")
    ap.add_argument("--parts", default="layout,mn-major,ceiling", help="comma-separated: layout, mn-major, ceiling")
    args = ap.parse_args(argv)
    parts, report = args.parts.split(","), {}
    if "layout" in parts:
        report["layout"] = check_layout()
    if "mn-major" in parts:
        report["mn_major"] = check_mn_major()
    if "ceiling" in parts:
        report["ceilings"] = ceilings()
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
