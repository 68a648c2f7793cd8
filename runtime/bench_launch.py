"""Microseconds per kernelgen.conv call on a tiny shape (launch overhead), against torch when present.

`python -m kernelgen.runtime.bench_launch [--calls N]`: on a GPU it times the CUDA path with device
inputs (and torch.nn.functional.conv2d on CUDA if torch has CUDA); without one, the CPU path only.
"""
from __future__ import annotations

import argparse
import time

import numpy as np


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
    args = ap.parse_args(argv)
    import kernelgen
    from kernelgen.api import gpu_present
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 8, 8, 4)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 4)).astype(np.float32)
    rows = []
    if gpu_present():
        from numba import cuda
        dx, dw = cuda.to_device(x), cuda.to_device(w)
        rows.append(("kernelgen.conv cuda (device arrays)",
                     per_call_us(lambda: kernelgen.conv(dx, dw, padding=1), args.calls, cuda.synchronize)))
        try:
            import torch
            if torch.cuda.is_available():
                tx = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous().cuda()
                tw = torch.from_numpy(w).permute(0, 3, 1, 2).contiguous().cuda()
                rows.append(("torch conv2d cuda", per_call_us(
                    lambda: torch.nn.functional.conv2d(tx, tw, padding=1), args.calls, torch.cuda.synchronize)))
        except ImportError:
            pass
    rows.append(("kernelgen.conv cpu (numpy arrays)",
                 per_call_us(lambda: kernelgen.conv(x, w, padding=1, backend="cpu"), args.calls)))
    print(f"{'path':40s} {'us/call':>10s}")
    for name, us in rows:
        print(f"{name:40s} {us:10.1f}")
    return rows


if __name__ == "__main__":
    main()
