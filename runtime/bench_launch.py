"""Microseconds per kernelgen.conv call on a tiny shape (launch overhead), against torch when present.

`python -m kernelgen.runtime.bench_launch [--calls N]`: on a GPU it times the CUDA path with device
inputs (and torch.nn.functional.conv2d on CUDA if torch has CUDA); without one, the CPU path only.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import kernelgen
from kernelgen import api
from kernelgen.planner import gpu_present
from kernelgen.runtime import arena
from kernelgen.tuning.timing import time_cuda


def per_call_us(fn, calls, sync=lambda: None):
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) / calls * 1e6


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--profile", action="store_true", help="also print where a GPU call's time goes (cProfile)")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 8, 8, 4)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 4)).astype(np.float32)
    rows = []
    if gpu_present():
        from numba import cuda  # only with a GPU: numba.cuda is slow to import
        dx, dw = cuda.to_device(x), cuda.to_device(w)
        out = cuda.device_array((1, 8, 8, 4), np.float32)
        rows.append(("kernelgen.conv cuda (numba arrays)",
                     per_call_us(lambda: kernelgen.conv(dx, dw, padding=1), args.calls, cuda.synchronize)))
        rows.append(("kernelgen.conv cuda (numba arrays, out=)",
                     per_call_us(lambda: kernelgen.conv(dx, dw, padding=1, out=out), args.calls, cuda.synchronize)))
        bound = kernelgen.bind(kernelgen.conv, dx, dw, padding=1, out=out)
        rows.append(("kernelgen.bind(conv, ...)() (numba arrays)", per_call_us(bound, args.calls, cuda.synchronize)))
        prep = [p for p in api._PREPARED.values() if p.problem.x_shape == x.shape][-1]
        ptrs = [(int(a.device_ctypes_pointer.value), a.size) for a in (dx, dw, out)]
        rows.append(("  of which: raw cuLaunchKernel of that kernel", per_call_us(
            lambda: prep.launcher._fast(ptrs, 4, 0), args.calls, cuda.synchronize)))
        rows.append(("  of which: the kernel's GPU time (events)", 1e3 * time_cuda(
            lambda: prep.launcher._fast(ptrs, 4, 0), repeat=200)))
        empty = cuda.jit(lambda a: None)
        rows.append(("empty numba kernel launch", per_call_us(lambda: empty[1, 32](out), args.calls,
                                                               cuda.synchronize)))
        try:
            import torch
            if torch.cuda.is_available():
                tx = torch.from_numpy(x).cuda()
                tw = torch.from_numpy(w).cuda()
                tout = torch.empty((1, 8, 8, 4), device="cuda")
                rows.append(("kernelgen.conv cuda (torch tensors)", per_call_us(
                    lambda: kernelgen.conv(tx, tw, padding=1), args.calls, torch.cuda.synchronize)))
                rows.append(("kernelgen.conv cuda (torch tensors, out=)", per_call_us(
                    lambda: kernelgen.conv(tx, tw, padding=1, out=tout), args.calls, torch.cuda.synchronize)))
                tbound = kernelgen.bind(kernelgen.conv, tx, tw, padding=1, out=tout)
                rows.append(("kernelgen.bind(conv, ...)() (torch tensors)", per_call_us(
                    tbound, args.calls, torch.cuda.synchronize)))
                nx = tx.permute(0, 3, 1, 2)
                nw = tw.permute(0, 3, 1, 2)
                rows.append(("torch conv2d cuda (channels_last)", per_call_us(
                    lambda: torch.nn.functional.conv2d(nx, nw, padding=1), args.calls, torch.cuda.synchronize)))
        except ImportError:
            pass
        if args.profile:
            import cProfile
            import pstats
            prof = cProfile.Profile()
            prof.runcall(lambda: [kernelgen.conv(dx, dw, padding=1) for _ in range(args.calls)])
            pstats.Stats(prof).sort_stats("tottime").print_stats(14)
        rows.append(("(device pool served_from_pool)", float(arena.device_pool().stats()["served_from_pool"])))
    rows.append(("kernelgen.conv cpu (numpy arrays)",
                 per_call_us(lambda: kernelgen.conv(x, w, padding=1, backend="cpu"), args.calls)))
    print(f"{'path':40s} {'us/call':>10s}")
    for name, us in rows:
        print(f"{name:40s} {us:10.1f}")
    return rows


if __name__ == "__main__":
    main()
