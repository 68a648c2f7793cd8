"""Pool bookkeeping over a fake backing allocator; the numba EMM test needs a real GPU."""
import random

import pytest

from kernelgen.runtime.arena import Pool, size_class
from harness import poisoned


class FakeBacking:
    def __init__(self, capacity):
        self.capacity, self.used, self.next_handle = capacity, 0, 1
        self.live = {}

    def alloc(self, nbytes):
        if self.used + nbytes > self.capacity:
            raise MemoryError("fake out of memory")
        handle = self.next_handle
        self.next_handle += 1
        self.live[handle] = nbytes
        self.used += nbytes
        return handle

    def free(self, handle):
        self.used -= self.live.pop(handle)


def test_size_class_rounds_up_with_bounded_waste():
    for n in [0, 1, 511, 512, 513, 4097, 10**6, 3 * 2**20 + 7]:
        c = size_class(n)
        assert c >= n and c % 512 == 0
        assert c - n <= max(512, n / 8)
    with pytest.raises(ValueError, match="nbytes"):
        size_class(-1)


def test_freed_block_is_reused_on_same_stream_only():
    backing = FakeBacking(1 << 30)
    pool = Pool(backing)
    a = pool.alloc(1000)
    pool.free(a)
    b = pool.alloc(900)                 # same class as 1000
    assert b.handle == a.handle and pool.stats()["served_from_pool"] == 1
    pool.free(b)
    c = pool.alloc(1000, stream=7)      # another stream must not take it without an event
    assert c.handle != a.handle
    assert pool.stats()["backing_allocs"] == 2
    with pytest.raises(ValueError, match="already freed"):
        pool.free(b)


def test_no_growth_over_10000_mixed_cycles():
    # a training-loop shape: each step allocates the same multiset of mixed sizes in a fresh order
    # and frees it in another; after the first step on each stream the backing must never grow
    backing = FakeBacking(1 << 34)
    pool = Pool(backing)
    rng = random.Random(0)
    sizes = [rng.choice([100, 4096, 70_000, 1 << 20, 3 << 20]) + rng.randrange(64) for _ in range(20)]
    for step in range(500):
        order = sizes[:]
        rng.shuffle(order)
        live = [pool.alloc(n, stream=step % 2) for n in order]
        rng.shuffle(live)
        for block in live:
            pool.free(block)
        if step == 1:
            warm_backing = backing.used
    assert warm_backing == 2 * sum(size_class(n) for n in sizes)
    assert backing.used == warm_backing == pool.stats()["cached"]
    assert pool.stats()["in_use"] == 0
    assert pool.stats()["backing_allocs"] == 40
    assert pool.stats()["served_from_pool"] == 500 * 20 - 40
    assert pool.release_cached() == warm_backing and backing.used == 0


def test_oom_releases_cache_then_retries_then_raises_with_stats():
    backing = FakeBacking(8192)
    pool = Pool(backing)
    small = pool.alloc(4096)
    pool.free(small)                    # 4096 cached, 4096 left in the backing
    big = pool.alloc(8000)              # needs the cached block released first
    assert pool.stats()["cached"] == 0 and pool.stats()["in_use"] == size_class(8000)
    with pytest.raises(MemoryError, match=r"1000 bytes.*in_use"):
        pool.alloc(1000)
    pool.free(big)
    assert pool.stats()["peak"] == size_class(8000)


@pytest.mark.gpu
def test_numba_device_array_comes_from_pool():
    # the memory manager can only be swapped before the CUDA context exists: run in a child
    import subprocess
    import sys
    code = ("from kernelgen.runtime import arena; arena.install()\n"
            "from numba import cuda; import numpy as np\n"
            "a = cuda.device_array(1000, np.float32); assert arena.POOL.stats()['in_use'] >= 4000\n"
            "del a; import gc; gc.collect(); cuda.current_context().deallocations.clear()\n"
            "b = cuda.to_device(np.arange(1000, dtype=np.float32))\n"
            "assert arena.POOL.stats()['served_from_pool'] >= 1, arena.POOL.stats()\n"
            "assert (b.copy_to_host() == np.arange(1000)).all()\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bench_launch_measures_the_cpu_path():
    from kernelgen.runtime.bench_launch import main
    rows = dict(main(["--calls", "20"]))
    assert rows["kernelgen.conv cpu (numpy arrays)"] > 0


@pytest.mark.sim
def test_launcher_reuses_configured_kernel_per_stream(rng, assert_close):
    import numpy as np
    from numba import cuda

    from kernelgen import reference as ref
    from kernelgen.api import get_launcher, make_plan
    from kernelgen.problem import make_problem
    x = rng.standard_normal((1, 3, 3, 2)).astype(np.float32)
    w = rng.standard_normal((2, 1, 1, 2)).astype(np.float32)
    launcher = get_launcher(make_plan(make_problem("fwd", x.shape, w.shape), "cuda"))
    stream = cuda.stream()
    for s in (None, stream, None, stream):
        out = cuda.to_device(poisoned(2 * 9))
        launcher({"x": cuda.to_device(x.ravel()), "w": cuda.to_device(w.ravel()), launcher.outputs[0]: out},
                 stream=s)
        if s is not None:
            s.synchronize()
        assert_close(out.copy_to_host().reshape(1, 3, 3, 2), ref.conv_forward(x, w))
    assert set(launcher._configured) == {None, stream}


@pytest.mark.gpu
def test_pooled_array_as_the_first_cuda_call_of_a_process():
    """A fresh process whose first CUDA action is a pooled allocation (the nn layer moving a model to
    the GPU): the pool must make the context current before its raw cuMemAlloc."""
    import subprocess
    import sys
    code = ("import numpy as np; from kernelgen.runtime import arena\n"
            "host = np.arange(300, dtype=np.float32)\n"
            "a = arena.to_device_staged(host)\n"
            "assert (a.copy_to_host() == host).all()\n")
    subprocess.run([sys.executable, "-c", code], check=True)


_POOLED_ARRAY_CHILD = """
import gc, json
import numpy as np
from kernelgen.runtime import arena
from kernelgen.runtime.bench_launch import fake_device_pool
from kernelgen.runtime.driver import pointer_size
from numba.cuda.cudadrv import devicearray
with fake_device_pool():
    pool = arena.device_pool()
    a = arena.pooled_array((2, 3, 4), "float32")
    b = arena.pooled_array((2, 3, 4), "float32")  # the clone of the first one's prototype
    ok = [type(b) is devicearray.DeviceNDArray, b.shape == (2, 3, 4), b.strides == (48, 16, 4), b.size == 24]
    addresses = [pointer_size(x, "x") for x in (a, b)]
    handles = [int(x.gpu_data.device_pointer) for x in (a, b)]
    in_use = [pool.in_use]
    view = b.gpu_data.view(48)  # as numba's array views take b's memory (b[1]): it keeps b's block while it lives
    del a, b
    gc.collect()
    in_use.append(pool.in_use)
    view_pointer = int(view.device_pointer)
    del view
    gc.collect()
    in_use.append(pool.in_use)
    c = arena.pooled_array((2, 3, 4), "float32")
    c.gpu_data.free(); c.gpu_data.free()  # numba's free(): back to the pool once
    in_use.append(pool.in_use)
    print(json.dumps({"ok": ok, "addresses": addresses, "handles": handles, "in_use": in_use,
                      "view_offset": view_pointer - handles[1], "served": pool.served_from_pool,
                      "size": arena.size_class(96)}))
"""


def test_pooled_arrays_are_numba_arrays_that_return_their_block_when_collected():
    """The fast route's outputs (arena.pooled_array) over a stand-in device: numba DeviceNDArrays whose address
    pointer_size reads; the block goes back to the pool when the last array or view of it is collected (or
    free() is called, once).  In a child without the simulator: numba's own device arrays."""
    import json
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = subprocess.run([sys.executable, "-c", _POOLED_ARRAY_CHILD], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(r["ok"]), r
    assert [a for a, _ in r["addresses"]] == r["handles"] and [n for _, n in r["addresses"]] == [24, 24]
    size = r["size"]
    assert r["in_use"] == [2 * size, size, 0, 0], r  # a's block back at once, b's when its view went
    assert r["view_offset"] == 48 and r["served"] >= 1, r
