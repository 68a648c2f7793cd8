"""Where a kernelgen.conv call's microseconds go on the GPU, part by part (issue 27): the pooled output's
allocation and release, the pointer reads, the whole call with and without Python's cyclic GC, and the pool's
counters around it.  `python scripts/launch_parts.py [--calls N]`; prints one JSON line."""
from __future__ import annotations

import argparse
import gc
import json
import time

import numpy as np


def per_call_us(fn, calls, sync):
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) / calls * 1e6


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=3000)
    args = ap.parse_args(argv)
    from numba import cuda
    from numba.cuda.cudadrv import driver as numba_driver

    import kernelgen
    from kernelgen.runtime import arena, driver
    sync, n, out = cuda.synchronize, args.calls, {}
    x = cuda.to_device(np.ones((1, 8, 8, 4), np.float32))
    w = cuda.to_device(np.ones((4, 3, 3, 4), np.float32))
    y = kernelgen.conv(x, w, padding=1)
    pool = arena.device_pool()
    out["pointer_type"] = type(y.gpu_data.device_pointer).__name__
    out["gpu_data_type"] = type(y.gpu_data).__name__
    out["device_empty_us"] = per_call_us(lambda: arena.device_empty((1, 8, 8, 4), "float32"), n, sync)
    out["pooled_array_us"] = per_call_us(lambda: arena.pooled_array((1, 8, 8, 4), "float32"), n, sync)
    ctx = cuda.current_context()

    def finalizer_pointer():  # the allocation as numba's own pointer with its weakref.finalize (before 5fb7635)
        block = pool.alloc(256)
        return numba_driver.MemoryPointer(ctx, block.handle, 256, finalizer=lambda: pool.free(block))
    out["numba_pointer_with_finalizer_us"] = per_call_us(finalizer_pointer, n, sync)
    out["pointer_size_us"] = per_call_us(lambda: driver.pointer_size(y, "y"), n, sync)
    before = dict(pool.stats())
    out["conv_new_us"] = per_call_us(lambda: kernelgen.conv(x, w, padding=1), n, sync)
    after = dict(pool.stats())
    out["conv_new_backing_allocs"] = after["backing_allocs"] - before["backing_allocs"]
    out["conv_new_served"] = after["served_from_pool"] - before["served_from_pool"]
    gc.disable()
    out["conv_new_gc_off_us"] = per_call_us(lambda: kernelgen.conv(x, w, padding=1), n, sync)
    gc.enable()
    o = cuda.device_array((1, 8, 8, 4), np.float32)
    out["conv_out_us"] = per_call_us(lambda: kernelgen.conv(x, w, padding=1, out=o), n, sync)
    kept = []
    out["conv_new_kept_us"] = per_call_us(lambda: kept.append(kernelgen.conv(x, w, padding=1)), n, sync)
    del kept
    gc.collect()
    out["pool"] = pool.stats()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
