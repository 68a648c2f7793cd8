"""`python -m kernelgen demo`: one real convolution through kernelgen on whatever this machine has.

Runs forward, backward-data and backward-weight of a ResNet-style 3x3 layer on the default backend
(the GPU when there is one, else the CPU), checks each against the float64 reference and prints
the first-call time and the steady-state time.  The three kernels are compiled first, side by side in
worker processes (kernelgen.precompile; --no-precompile: each by its first call, one after another), so a
first call loads its kernel from the disk cache.  The CPU's default problem is small enough that its
kernels are compiled without numba's parallel=True, which costs seconds of compile time per kernel.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import kernelgen
from kernelgen import reference
from kernelgen.planner import gpu_present
from kernelgen.precompile import precompile


# N, H, W, C, K on the CPU: 1.2M multiply-adds a pass, under render_cpu's PARALLEL_MIN_WORK (2M)
CPU_SIZE = (2, 16, 16, 16, 16)
MAX_ELEMENTS = 1 << 28  # per array: 1 GiB of float32, so a typo in --size fails here, not in the allocator


def size_arg(text: str) -> tuple:
    """--size N,H,W,C,K: five positive integers, each array within MAX_ELEMENTS (argparse reports the error)."""
    parts = text.split(",")
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        dims = ()
    if len(dims) != 5:
        raise argparse.ArgumentTypeError(f"expected five comma-separated integers N,H,W,C,K, got {text!r}")
    if min(dims) < 1:
        raise argparse.ArgumentTypeError(f"every dimension of N,H,W,C,K must be at least 1, got {text!r}")
    N, H, W, C, K = dims
    largest = max(N * H * W * C, N * H * W * K, K * 9 * C)
    if largest > MAX_ELEMENTS:
        raise argparse.ArgumentTypeError(f"{text!r} needs an array of {largest} elements; the demo allows "
                                         f"{MAX_ELEMENTS} (1 GiB of float32)")
    return dims


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m kernelgen demo", description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["cpu", "cuda"], default=None)
    ap.add_argument("--size", type=size_arg, default=None, help="N,H,W,C,K (default: larger on a GPU)")
    ap.add_argument("--no-precompile", action="store_true",
                    help="compile each kernel at its first call, in this process (not in parallel beforehand)")
    args = ap.parse_args(argv)
    if args.backend == "cuda" and not gpu_present():
        ap.error("--backend cuda: no CUDA GPU is visible here (use --backend cpu)")
    backend = args.backend or ("cuda" if gpu_present() else "cpu")
    N, H, W, C, K = args.size or ((32, 32, 32, 64, 64) if backend == "cuda" else CPU_SIZE)
    rng = np.random.default_rng()
    x = rng.standard_normal((N, H, W, C), dtype=np.float32)
    w = (rng.standard_normal((K, 3, 3, C)) / np.sqrt(9 * C)).astype(np.float32)
    dy = rng.standard_normal((N, H, W, K), dtype=np.float32)
    kw = dict(padding=1, backend=backend)
    runs = {
        "forward": (lambda: kernelgen.conv(x, w, **kw), lambda: reference.conv_forward(x, w, padding=1)),
        "backward-data": (lambda: kernelgen.conv_backward_data(dy, w, x.shape, **kw),
                          lambda: reference.conv_backward_data(dy, w, x.shape, padding=1)),
        "backward-weight": (lambda: kernelgen.conv_backward_weight(x, dy, w.shape, **kw),
                            lambda: reference.conv_backward_weight(x, dy, w.shape, padding=1)),
    }
    flops = 2 * N * H * W * K * C * 9
    print(f"kernelgen {kernelgen.__version__}: 3x3 conv, x {x.shape} -> {K} channels, padding 1, backend={backend}")
    if not args.no_precompile:
        report = precompile([(kernelgen.conv, (x, w), kw), (kernelgen.conv_backward_data, (dy, w, x.shape), kw),
                             (kernelgen.conv_backward_weight, (x, dy, w.shape), kw)])
        where = f"in {report.workers} worker processes" if report.workers else "here"
        print(f"kernels: {report.kernels}, {report.cached} from the disk cache, {report.compiled} compiled {where} "
              f"({report.seconds:.2f} s)")
    print(f"{'pass':<16}{'rel err vs fp64':>16}{'first call s':>14}{'steady ms':>11}{'GFLOP/s':>10}")
    worst = 0.0
    for name, (run, ref) in runs.items():
        t = time.perf_counter()
        out = run()
        first = time.perf_counter() - t
        err = float(np.linalg.norm(out - ref()) / np.linalg.norm(ref()))
        worst = max(worst, err)
        times = []
        for _ in range(5):
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
        ms = 1e3 * float(np.median(times))  # includes host<->device copies for NumPy inputs on a GPU
        print(f"{name:<16}{err:>16.2e}{first:>14.2f}{ms:>11.2f}{flops / ms / 1e6:>10.1f}")
    ok = worst < 1e-4
    print("OK: all passes match the float64 reference" if ok else f"FAILED: relative error {worst:.2e}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
