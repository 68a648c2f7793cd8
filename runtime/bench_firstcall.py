"""First-call time per problem of a shape table: cold (empty kernel cache: render + numba compile)
or warm (a fresh process over a filled cache: import the cached module, numba loads its binary).

`python -m kernelgen.runtime.bench_firstcall TABLE [--directions fwd ...] [--out FILE]`.  Run it twice
in fresh processes over one KERNELGEN_CACHE_DIR: the first run is cold, the second warm.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

import kernelgen
from kernelgen.runtime.cache import KERNELS
from kernelgen.tuning.shapes import load_table

OPS = {"fwd": "conv", "bwd_data": "conv_backward_data", "bwd_weight": "conv_backward_weight"}


def _call(problem, arrays, kw):
    if problem.direction == "fwd":
        return kernelgen.conv(arrays["x"], arrays["w"], **kw)
    if problem.direction == "bwd_data":
        return kernelgen.conv_backward_data(arrays["dy"], arrays["w"], problem.x_shape, **kw)
    return kernelgen.conv_backward_weight(arrays["x"], arrays["dy"], problem.w_shape, **kw)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table")
    ap.add_argument("--directions", nargs="+", default=["fwd"], choices=sorted(OPS))
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    from numba import cuda
    name, layers = load_table(args.table)
    rng = np.random.default_rng(0)
    rows, start_all = [], time.perf_counter()
    for layer in layers:
        for d in args.directions:
            p, kw = layer.problem(d), layer.shapes()[2]
            if layer.transposed:
                continue  # deconv layers are timed through their convolution's passes
            arrays = {k: cuda.to_device(rng.standard_normal(s).astype(np.float32))
                      for k, s in (("x", p.x_shape), ("w", p.w_shape), ("dy", p.y_shape))}
            cuda.synchronize()
            t0 = time.perf_counter()
            _call(p, arrays, kw)
            cuda.synchronize()
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            _call(p, arrays, kw)
            cuda.synchronize()
            rows.append({"problem": p.key(), "first_call_s": first, "second_call_s": time.perf_counter() - t0})
            print(f"{p.key():70s} first {first * 1e3:9.1f} ms   second {rows[-1]['second_call_s'] * 1e3:7.2f} ms")
    total = time.perf_counter() - start_all
    stats = dict(KERNELS.stats.__dict__)
    print(f"{name}: {len(rows)} problems, total {total:.1f} s, cache {stats}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"table": name, "rows": rows, "total_s": total, "cache": stats}, f, indent=1)


if __name__ == "__main__":
    main()
