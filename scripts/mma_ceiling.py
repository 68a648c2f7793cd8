"""How fast can a generated numba kernel issue TF32 mma.sync on this GPU?  Ceilings for PERF_NOTES, not tests.

    python scripts/mma_ceiling.py [--out mma_ceiling.json]

Three kernels, each warp holding a 64 x 32 tile (4 x 4 m16n8k8 accumulators, 64 registers, as the default
tensor-core tile), `iters` times per launch:
  hmma       32 MMAs per iteration from fixed registers: the tensor-core issue ceiling of mma.sync
  lds_hmma   + the fragment feed of one BK-16 slice per iteration (12 LDS.128 of a swizzled shared tile, 48
             operands rounded to TF32): the compute phase of implicit_gemm_tc with no global memory or barrier
  lds_hmma_bar  + one block barrier per iteration (the per-slice barrier of the pipelined kernels)
each at 1..4 blocks of 4 warps per SM (one wave of 132 x that many blocks).  TFLOP/s counts 2 * 16 * 8 * 8 per MMA.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
from numba import cuda, float32

from kernelgen.cuda_mma import mma_m16n8k8_tf32, tf32

ITERS = 2048
SMS = 132


def make(kind):
    lds, bar = kind != "hmma", kind == "lds_hmma_bar"

    @cuda.jit
    def kernel(out, seed):
        sh = cuda.shared.array(4096, float32)
        tid = cuda.threadIdx.x
        for i in range(tid, 4096, 128):
            sh[i] = seed + float32(i % 7)
        cuda.syncthreads()
        lane = tid % 32
        g, t = lane // 4, lane % 4
        base = ((tid // 32) * 16 + g) * 16 + ((t + g // 2) % 4) * 4
        a = cuda.local.array(32, float32)  # fully unrolled below: registers
        b = cuda.local.array(16, float32)
        for i in range(32):
            a[i] = tf32(seed + float32(i))
        for i in range(16):
            b[i] = tf32(seed - float32(i))
        acc = cuda.local.array(64, float32)
        for i in range(64):
            acc[i] = float32(0.0)
        for it in range(ITERS):
            if lds:
                off = (it % 2) * 2048  # two stages; the largest index is 2048 + 1794
                for r in range(8):
                    for w in range(4):
                        a[r * 4 + w] = tf32(sh[off + base + r * 128 + w])
                for r in range(4):
                    for w in range(4):
                        b[r * 4 + w] = tf32(sh[off + base + 512 + r * 128 + w])
            for ks in range(2):
                for mt in range(4):
                    for nt in range(4):
                        j = (mt * 4 + nt) * 4
                        acc[j], acc[j + 1], acc[j + 2], acc[j + 3] = mma_m16n8k8_tf32(
                            acc[j], acc[j + 1], acc[j + 2], acc[j + 3],
                            a[mt * 8 + ks * 2], a[mt * 8 + 4 + ks * 2], a[mt * 8 + ks * 2 + 1],
                            a[mt * 8 + 4 + ks * 2 + 1], b[nt * 4 + ks * 2], b[nt * 4 + ks * 2 + 1])
            if bar:
                cuda.syncthreads()
        s = float32(0.0)
        for i in range(64):
            s += acc[i]
        out[cuda.blockIdx.x * 128 + tid] = s
    return kernel


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="mma_ceiling.json")
    args = ap.parse_args(argv)
    rows = []
    for kind in ("hmma", "lds_hmma", "lds_hmma_bar"):
        k = make(kind)
        for per_sm in (1, 2, 3, 4):
            blocks = SMS * per_sm  # one wave: per_sm resident blocks of 4 warps on every SM
            out = cuda.device_array(blocks * 128, np.float32)
            k[blocks, 128](out, np.float32(0.5))
            cuda.synchronize()
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                k[blocks, 128](out, np.float32(0.5))
                cuda.synchronize()
                best = min(best, time.perf_counter() - t0)
            flop = blocks * 4 * ITERS * 32 * 2 * 16 * 8 * 8
            regs = next(iter(k.get_regs_per_thread().values()))
            rows.append(dict(kind=kind, blocks_per_sm=per_sm, tflops=flop / best / 1e12, regs=regs,
                             ms=best * 1e3))
            print(f"{kind:14s} {per_sm:2d} blocks/SM  {flop / best / 1e12:7.1f} TFLOP/s  regs {regs}",
                  flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
