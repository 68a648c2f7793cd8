"""Microseconds per kernelgen.conv call on a tiny shape (launch overhead), against torch when present.

`python -m kernelgen.runtime.bench_launch [--calls N]`: on a GPU it times the CUDA path with device
inputs (and torch.nn.functional.conv2d on CUDA if torch has CUDA); without one, the CPU path only.
`--python-only` (any machine, no GPU needed): the dispatch's own Python cost, with the kernel launch stubbed
(stubbed_launch) - the CUDA route on stand-in device arrays and the CPU route with the numba kernel a no-op.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import threading
import time

import numpy as np

import kernelgen
from kernelgen import api, settings
from kernelgen.dlpack import c_strides
from kernelgen.planner import gpu_present, make_plan
from kernelgen.runtime import arena, cuda_call
from kernelgen.runtime.driver import _FastLaunch
from kernelgen.tuning.timing import time_cuda


def per_call_us(fn, calls, sync=lambda: None, blocks=5):
    """Microseconds per call: the least over `blocks` blocks of calls // blocks calls, each block synchronised at
    its end (on the GPU machine's shared host one block in several runs slow; the least is the code's own cost)."""
    fn()
    sync()
    n = max(1, calls // blocks)
    best = float("inf")
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        best = min(best, (time.perf_counter() - start) / n * 1e6)
    return best


class StandInDeviceArray:
    """A device array as the dispatch sees one (shape, dtype, strides, __cuda_array_interface__), with no device
    memory behind it: the --python-only route never launches anything."""
    _next = 1 << 20

    def __init__(self, shape, dtype=np.float32):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.size = math.prod(self.shape)
        self.strides = c_strides(self.shape, self.dtype.itemsize)
        StandInDeviceArray._next += 1 << 16
        self._interface = {"data": (StandInDeviceArray._next, False), "shape": self.shape, "typestr": self.dtype.str,
                           "strides": None, "version": 3}

    @property
    def __cuda_array_interface__(self):
        return self._interface


def _stub_fast_launch(launcher):
    """The launcher's prepacked cuLaunchKernel route with the driver call replaced by a no-op: the argument
    packing (_FastLaunch.__call__) still runs."""
    import ctypes
    fast = _FastLaunch.__new__(_FastLaunch)
    n_words = 7 * len(launcher.params)
    fast.words = (ctypes.c_int64 * n_words)()
    base = ctypes.addressof(fast.words)
    fast.params = (ctypes.c_void_p * n_words)(*[base + 8 * i for i in range(n_words)])
    fast.handle, fast.grid, fast.threads, fast.shared = 0, tuple(launcher.grid) + (1,) * (3 - len(launcher.grid)), \
        launcher.threads, launcher.shared_bytes
    fast.thread = threading.get_ident()
    fast.launch = fast.raw_launch = lambda *a: 0
    fast.pack_constants()
    fast.layout = None
    launcher._fast = fast


@contextlib.contextmanager
def stubbed_launch():
    """A GPU as far as kernelgen's dispatch can tell (api.gpu_present, the device pool's allocation), with
    nothing behind it; undone on exit."""
    saved = api.gpu_present, cuda_call.device_empty, cuda_call.pooled_array
    api.gpu_present = lambda: True
    cuda_call.device_empty = cuda_call.pooled_array = lambda shape, dtype, stream=None: StandInDeviceArray(shape, dtype)
    try:
        yield
    finally:
        api.gpu_present, cuda_call.device_empty, cuda_call.pooled_array = saved


@contextlib.contextmanager
def fake_device_pool():
    """numba's own device arrays over made-up addresses: the device pool's backing hands out addresses and
    never touches a driver, and this thread's CUDA context is a stand-in (numba's driver is imported, not
    initialised; not under the simulator).  So the route's numba costs - the pointer, the array's clone, the
    pool - are timed as they run on a GPU.  Undone on exit."""
    from numba.cuda.cudadrv import driver
    addresses = iter(range(1 << 32, 1 << 48, 1 << 16))
    key = threading.get_ident()
    saved = arena.POOL, arena._CONTEXT.get(key)
    arena.POOL = arena.Pool(arena.CudaBacking(raw_alloc=lambda n: driver.binding.CUdeviceptr(next(addresses)),
                                              raw_free=lambda handle: None))
    arena._CONTEXT[key] = object()
    try:
        yield
    finally:
        arena.POOL = saved[0]
        if saved[1] is None:
            arena._CONTEXT.pop(key, None)
        else:
            arena._CONTEXT[key] = saved[1]


def python_only_rows(calls, profile=False):
    """Per-call Python cost of the dispatch, no kernel run: the CUDA route on stand-in device arrays (launch and
    allocation stubbed) and the CPU route with the compiled kernel replaced by a no-op."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 8, 8, 4)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 4)).astype(np.float32)
    rows = []
    with stubbed_launch():
        dx, dw, out = StandInDeviceArray(x.shape), StandInDeviceArray(w.shape), StandInDeviceArray(x.shape)
        problem = api.conv.plan_call(x, w, padding=1, backend="cuda").prep.problem
        _stub_fast_launch(api.get_launcher(make_plan(problem, "cuda")))
        conv_new = lambda: kernelgen.conv(dx, dw, padding=1)  # noqa: E731
        rows.append(("dispatch cuda, launch stubbed (new output)", best_us(conv_new, calls)))
        rows.append(("dispatch cuda, launch stubbed (out=)",
                     best_us(lambda: kernelgen.conv(dx, dw, padding=1, out=out), calls)))
        if profile:
            _print_profile(conv_new, calls)
    if not settings.get("cuda_simulator"):
        rows += _numba_array_rows(x, w, calls, profile)
    cpu_launcher = api.get_launcher(make_plan(api.conv.plan_call(x, w, padding=1, backend="cpu").prep.problem, "cpu"))
    kernel, cpu_launcher.kernel = cpu_launcher.kernel, lambda *a: None
    try:
        rows.append(("dispatch cpu, kernel stubbed (numpy)",
                     best_us(lambda: kernelgen.conv(x, w, padding=1, backend="cpu"), calls)))
        if profile:
            _print_profile(lambda: kernelgen.conv(x, w, padding=1, backend="cpu"), calls)
    finally:
        cpu_launcher.kernel = kernel
    rows.append(("plan only: conv.plan_call (numpy, cpu)",
                 best_us(lambda: api.conv.plan_call(x, w, padding=1, backend="cpu"), calls)))
    return rows


def _numba_array_rows(x, w, calls, profile):
    """The route as a GPU runs it for numba arrays: real DeviceNDArrays over fake_device_pool, launch stubbed."""
    api.clear_caches()
    saved = api.gpu_present
    api.gpu_present = lambda: True
    try:
        with fake_device_pool():
            dx, dw, out = (arena.pooled_array(a.shape, "float32") for a in (x, w, x))
            problem = api.conv.plan_call(x, w, padding=1, backend="cuda").prep.problem
            launcher = api.get_launcher(make_plan(problem, "cuda"))
            _stub_fast_launch(launcher)
            conv_new = lambda: kernelgen.conv(dx, dw, padding=1)  # noqa: E731
            rows = [("dispatch cuda, numba arrays, stubbed (new output)", best_us(conv_new, calls)),
                    ("dispatch cuda, numba arrays, stubbed (out=)",
                     best_us(lambda: kernelgen.conv(dx, dw, padding=1, out=out), calls))]
            if profile:
                _print_profile(conv_new, calls)
            launcher._fast = None
    finally:
        api.gpu_present = saved
        api.clear_caches()
    return rows


def _repeat(fn, calls):
    """fn() `calls` times, each result dropped at once (as the timed rows do: a list of them would keep every output
    alive, and each call would then allocate fresh device memory)."""
    for _ in range(calls):
        fn()


def _print_profile(fn, calls):
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.runcall(_repeat, fn, calls)
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)


def best_us(fn, calls, repeat=7):
    """The least of `repeat` per_call_us blocks (timeit's rule: on a shared machine the other processes only add
    time, so the minimum is the figure closest to the code's own cost)."""
    return min(per_call_us(fn, max(1, calls // repeat)) for _ in range(repeat))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5,
                    help="GPU rows: every row timed once a round, the rounds one after another, each row's least "
                         "kept (a slow phase of the shared host then meets every row, not one)")
    ap.add_argument("--profile", action="store_true", help="also print where a GPU call's time goes (cProfile)")
    ap.add_argument("--python-only", action="store_true",
                    help="time the dispatch's Python with the kernel launch stubbed (no GPU needed)")
    args = ap.parse_args(argv)
    if args.python_only:
        return _print_rows(python_only_rows(args.calls, args.profile))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 8, 8, 4)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 4)).astype(np.float32)
    rows = []
    if gpu_present():
        timed, extra = _gpu_rows(x, w)
        best = {name: float("inf") for name, _, _ in timed}
        for _ in range(max(1, args.rounds)):
            for name, fn, sync in timed:
                best[name] = min(best[name], per_call_us(fn, args.calls, sync))
        rows += [(name, best[name]) for name, _, _ in timed] + extra()
        if args.profile:
            import cProfile
            import pstats
            prof = cProfile.Profile()
            prof.runcall(_repeat, timed[0][1], args.calls)
            pstats.Stats(prof).sort_stats("tottime").print_stats(14)
        rows.append(("(device pool served_from_pool)", float(arena.device_pool().stats()["served_from_pool"])))
    rows.append(("kernelgen.conv cpu (numpy arrays)",
                 per_call_us(lambda: kernelgen.conv(x, w, padding=1, backend="cpu"), args.calls)))
    return _print_rows(rows)


def _gpu_rows(x, w):
    """([(row, call, synchronise)] timed in rounds, extra() -> the rows measured once): kernelgen.conv on numba
    arrays and on torch tensors (new output, out=), bind, the raw launch, a pooled output, torch's conv2d."""
    from numba import cuda  # only with a GPU: numba.cuda is slow to import
    dx, dw = cuda.to_device(x), cuda.to_device(w)
    out = cuda.device_array((1, 8, 8, 4), np.float32)
    timed = [("kernelgen.conv cuda (numba arrays)", lambda: kernelgen.conv(dx, dw, padding=1), cuda.synchronize),
             ("kernelgen.conv cuda (numba arrays, out=)", lambda: kernelgen.conv(dx, dw, padding=1, out=out),
              cuda.synchronize)]
    timed[0][1]()  # (compiles, and makes the prepared call the rows below read)
    bound = kernelgen.bind(kernelgen.conv, dx, dw, padding=1, out=out)
    timed.append(("kernelgen.bind(conv, ...)() (numba arrays)", bound, cuda.synchronize))
    prep = [p for p in api._PREPARED.values() if p.problem.x_shape == x.shape][-1]
    ptrs = [(int(a.device_ctypes_pointer.value), a.size) for a in (dx, dw, out)]
    timed.append(("  of which: raw cuLaunchKernel of that kernel", lambda: prep.launcher._fast(ptrs, 4, 0),
                  cuda.synchronize))
    timed.append(("  a pooled output alone (allocate, drop)", lambda: arena.pooled_array((1, 8, 8, 4), "float32"),
                  lambda: None))
    empty = cuda.jit(lambda a: None)
    timed.append(("empty numba kernel launch", lambda: empty[1, 32](out), cuda.synchronize))
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        tx, tw = torch.from_numpy(x).cuda(), torch.from_numpy(w).cuda()
        tout = torch.empty((1, 8, 8, 4), device="cuda")
        tbound = kernelgen.bind(kernelgen.conv, tx, tw, padding=1, out=tout)
        nx, nw = tx.permute(0, 3, 1, 2), tw.permute(0, 3, 1, 2)
        sync = torch.cuda.synchronize
        timed += [("kernelgen.conv cuda (torch tensors)", lambda: kernelgen.conv(tx, tw, padding=1), sync),
                  ("kernelgen.conv cuda (torch tensors, out=)", lambda: kernelgen.conv(tx, tw, padding=1, out=tout),
                   sync),
                  ("kernelgen.bind(conv, ...)() (torch tensors)", tbound, sync),
                  ("torch conv2d cuda (channels_last)", lambda: torch.nn.functional.conv2d(nx, nw, padding=1), sync)]

    def extra():
        return [("  of which: the kernel's GPU time (events)",
                 1e3 * time_cuda(lambda: prep.launcher._fast(ptrs, 4, 0), repeat=200))]
    return timed, extra


def _print_rows(rows):
    print(f"{'path':52s} {'us/call':>10s}")
    for name, us in rows:
        print(f"{name:52s} {us:10.1f}")
    return rows


if __name__ == "__main__":
    main()
