"""Fault injection into the arena's raw allocations: out of memory mid-step makes the pool release its cache
and retry once, then raise a MemoryError that says what was asked and what the pool held; nothing leaks.

The CPU tests run the pool over a fake device (handles -> bytearrays, a capacity).  The `gpu` tests run the
same scenarios on the real device in a child process (a fresh CUDA context, so the driver's free memory has
a clean baseline and the EMM can be installed); the child is this file run as a script.  cuMemGetInfo's free
memory is the whole device's, so the `gpu` tests want no other process allocating on it meanwhile
(scripts/gpu_run.sh without TEST_SHARDS).
"""
import json
import random
import subprocess
import sys

import pytest

from kernelgen.runtime.arena import CudaBacking, InjectedAllocError, Pool, inject_alloc_failures, size_class


class FakeDevice:
    """A backing of fake pointers with a capacity: over it, alloc raises MemoryError as CudaBacking would.
    Each pointer owns the first bytes of its block (a bytearray), enough to see that a block in use is never
    released or handed out twice, without zeroing megabytes per allocation."""

    def __init__(self, capacity):
        self.capacity, self.used, self.next_handle = capacity, 0, 1
        self.live = {}                  # handle -> bytearray (the block's head)
        self.sizes = {}                 # handle -> bytes

    def alloc(self, nbytes):
        if self.used + nbytes > self.capacity:
            raise MemoryError(f"fake device out of memory ({nbytes} bytes asked, {self.used} used)")
        handle, self.next_handle = self.next_handle, self.next_handle + 1
        self.live[handle], self.sizes[handle] = bytearray(min(nbytes, 64)), nbytes
        self.used += nbytes
        return handle

    def free(self, handle):
        del self.live[handle]
        self.used -= self.sizes.pop(handle)


def _warm_pool(device, sizes):
    """A pool whose cache holds one block of each size (allocated, then freed)."""
    pool = Pool(device)
    for block in [pool.alloc(n) for n in sizes]:
        pool.free(block)
    return pool


def test_transient_failure_releases_the_cache_then_the_retry_succeeds():
    device = FakeDevice(1 << 30)
    pool = _warm_pool(device, [1000, 5000, 70_000])
    live = pool.alloc(3000)
    device.live[live.handle][:4] = b"keep"
    cached = pool.cached
    assert cached == sum(size_class(n) for n in [1000, 5000, 70_000])   # 3000 is a class of its own
    with inject_alloc_failures(pool, count=1) as inj:
        block = pool.alloc(1 << 20)     # a size nothing cached fits: a raw allocation, which fails once
    # the failed call saw the cache full; the retry came after it had all gone back to the device
    assert inj.attempts == [(1, size_class(1 << 20), True, cached), (2, size_class(1 << 20), False, 0)]
    assert pool.stats()["oom_retries"] == 1 and pool.stats()["oom_errors"] == 0
    assert pool.cached == 0 and set(device.live) == {live.handle, block.handle}
    assert device.live[live.handle][:4] == b"keep"          # blocks in use are never touched
    assert pool.in_use == size_class(3000) + size_class(1 << 20)
    pool.free(block)
    pool.free(live)
    assert pool.in_use == 0


def test_persistent_failure_raises_a_memoryerror_naming_the_request_and_the_pool():
    device = FakeDevice(1 << 30)
    pool = _warm_pool(device, [2000, 9000])
    live = [pool.alloc(600), pool.alloc(40_000)]
    in_use, cached = pool.in_use, pool.cached
    with inject_alloc_failures(pool) as inj:
        with pytest.raises(MemoryError) as err:
            pool.alloc(123_457)
    msg = str(err.value)
    assert "123457 bytes" in msg and f"size class {size_class(123_457)}" in msg
    assert f"in_use={in_use} bytes in 2 blocks" in msg and f"cached={cached} bytes in 2 blocks" in msg
    assert f"released the {cached} cached bytes" in msg
    # chained from the (injected) driver error itself, not from an intermediate conversion
    assert isinstance(err.value.__cause__, InjectedAllocError) and err.value.__cause__.code == 2
    assert [a[2] for a in inj.attempts] == [True, True] and inj.attempts[1][3] == 0
    # consistent afterwards: the failed request changed nothing but the (released) cache
    assert pool.in_use == in_use and pool.cached == 0 and set(device.live) == {b.handle for b in live}
    st = pool.stats()
    assert st["live_blocks"] == 2 and st["cached_blocks"] == 0 and st["oom_errors"] == 1
    # once the failures stop, allocation works again, and everything can be returned
    late = pool.alloc(123_457)
    for block in live + [late]:
        pool.free(block)
    assert pool.in_use == 0
    pool.release_cached()
    assert device.live == {} and device.used == 0


def test_failure_schedule_after_every_count():
    device = FakeDevice(1 << 30)
    pool = Pool(device)
    blocks = []
    with inject_alloc_failures(pool, after=2, every=3, count=2) as inj:
        for i in range(9):              # each a new size class: every call is a raw allocation
            blocks.append(pool.alloc(10_000 * (i + 1)))
    failed = [n for n, _, f, _ in inj.attempts if f]
    assert failed == [5, 8]             # after 2, every 3rd: 5, 8, (11: but count=2 stops there)
    assert inj.calls == 11 and pool.stats()["oom_retries"] == 2 and pool.stats()["oom_errors"] == 0
    assert pool.backing is device       # the hook is gone after the block
    for block in blocks:
        pool.free(block)
    assert pool.in_use == 0 and len(device.live) == pool.stats()["cached_blocks"] == 9


def test_a_full_device_releases_the_cache_too():
    device = FakeDevice(64 * 1024)
    pool = _warm_pool(device, [30_000, 20_000])   # 51200 cached of 65536: a 40000 request needs them gone
    block = pool.alloc(40_000)
    assert pool.cached == 0 and pool.stats()["oom_retries"] == 1
    with pytest.raises(MemoryError, match=r"30000 bytes .* in_use=40960 bytes"):
        pool.alloc(30_000)
    pool.free(block)


class _DriverError(Exception):
    """numba's CudaAPIError as far as CudaBacking looks: a .code (under the simulator there is none)."""

    def __init__(self, code, msg):
        super().__init__(code, msg)
        self.code = code


def test_cuda_backing_converts_driver_out_of_memory_and_flushes_numba_before_the_retry():
    device, events, flushed = FakeDevice(1 << 30), [], []
    fail = {"n": 0}

    def raw_alloc(nbytes):
        events.append("alloc")
        if fail["n"]:
            fail["n"] -= 1
            raise _DriverError(2, "Call to cuMemAlloc results in CUDA_ERROR_OUT_OF_MEMORY")
        return device.alloc(nbytes)

    backing = CudaBacking(raw_alloc, device.free, flush=lambda: (events.append("flush"), flushed.append(1)))
    pool = _warm_pool(backing, [5000])
    fail["n"] = 1
    pool.alloc(10_000)                  # transient: release, flush, retry
    assert events[-3:] == ["alloc", "flush", "alloc"] and pool.cached == 0
    fail["n"] = 2
    with pytest.raises(MemoryError, match="10000 bytes") as err:
        pool.alloc(10_000)
    assert isinstance(err.value.__cause__, _DriverError) and err.value.__cause__.code == 2
    fail["n"] = 0

    def broken(nbytes):
        raise _DriverError(700, "CUDA_ERROR_ILLEGAL_ADDRESS")
    other = Pool(CudaBacking(broken, device.free, flush=lambda: flushed.append(1)))
    with pytest.raises(_DriverError):   # not out of memory: no retry, no conversion
        other.alloc(100)
    assert other.stats()["oom_retries"] == 0 and len(flushed) == 2


def _run_steps(pool, steps, seed, alloc, free, sizes):
    """steps of a training loop over `pool`: each allocates a few buffers (alloc(pool, nbytes, stream)) and
    frees them in another order; a MemoryError abandons the step.  Returns counts and the largest cache."""
    rng = random.Random(seed)
    stats = {"steps_failed": 0, "max_cached": 0}
    for _ in range(steps):
        stream = rng.randrange(2)
        live = []
        try:
            for _ in range(rng.randint(2, 6)):
                live.append(alloc(pool, sizes(rng), stream))
        except MemoryError:
            stats["steps_failed"] += 1
        rng.shuffle(live)
        while live:                     # popped: a device array's last reference goes with it
            free(pool, live.pop())
        stats["max_cached"] = max(stats["max_cached"], pool.cached)
    return stats


def _random_failures(rng, rate=0.01):
    """when= for inject_alloc_failures: `rate` of raw allocations fail; half of those failures persist
    through the retry (the step sees MemoryError), half are transient (the retry succeeds)."""
    state = {"burst": 0}

    def when(n):
        if state["burst"]:
            state["burst"] -= 1
            return True
        if rng.random() < rate:
            state["burst"] = rng.randrange(2)
            return True
        return False
    return when


def _log_uniform(lo, hi):
    return lambda rng: int(lo * (hi / lo) ** rng.random())


def test_ten_thousand_steps_with_random_failures_leak_nothing():
    capacity = 48 << 20
    device = FakeDevice(capacity)
    pool = Pool(device)
    params = [pool.alloc(n) for n in (3 << 20, 700_000, 4096)]   # the model: lives through every step
    for i, block in enumerate(params):
        device.live[block.handle][:8] = bytes([i]) * 8
    kept = pool.in_use

    def alloc(pool, nbytes, stream):
        block = pool.alloc(nbytes, stream)
        device.live[block.handle][:1] = b"x"                    # the step writes its buffers
        return block

    with inject_alloc_failures(pool, when=_random_failures(random.Random(1))) as inj:
        run = _run_steps(pool, 10_000, 0, alloc, lambda pool, b: pool.free(b), _log_uniform(16, 4 << 20))
        assert pool.in_use == kept                             # every abandoned step gave its buffers back
        st = pool.stats()
        # no leak: every raw allocation made in the run and still alive is a cached block
        assert len(inj.live) == st["cached_blocks"] and sum(inj.live.values()) == pool.cached
    # the scenario did what it claims: raw allocations kept happening, faults of both kinds were hit
    assert inj.calls > 2000 and inj.failures > 20, (inj.calls, inj.failures)
    assert st["oom_retries"] > st["oom_errors"] > 5 and run["steps_failed"] >= st["oom_errors"]
    for i, block in enumerate(params):                          # releases never touched blocks in use
        assert device.live[block.handle][:8] == bytes([i]) * 8
        pool.free(block)
    # and on the device's side too; the cache never outgrew the device
    assert pool.in_use == 0 and st["live_blocks"] == len(params)
    assert len(device.live) == pool.stats()["cached_blocks"] and device.used == pool.cached
    assert run["max_cached"] <= capacity
    pool.release_cached()
    assert device.live == {} and device.used == 0


# ---- the real device ----------------------------------------------------------------------------------------

def _run_child(mode, steps):
    proc = subprocess.run([sys.executable, __file__, mode, str(steps)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
def test_device_arrays_survive_faults_and_release_all_driver_memory():
    out = _run_child("device_empty", 10_000)
    assert out["steps_failed"] > 0 and out["oom_retries"] > out["oom_errors"] > 0, out
    # after the final release the driver has its memory back, to within the driver's own granularity
    assert out["free_after_release"] >= out["free_before"] - (8 << 20), out
    assert out["cached_before_release"] > (64 << 20), out       # so a missed release would have shown


@pytest.mark.gpu
def test_numba_emm_allocations_fail_cleanly_and_recover():
    out = _run_child("emm", 2000)
    assert out["steps_failed"] > 0 and out["oom_retries"] > out["oom_errors"] > 0, out
    assert out["free_after_release"] >= out["free_before"] - (8 << 20), out


def _child(mode, steps):
    """The device scenarios, in a fresh process: `device_empty` (the nn layer's arrays) or `emm` (numba's own
    allocations with the arena installed as its memory manager).  Prints a JSON summary last."""
    import gc

    import numpy as np
    from numba import cuda

    from kernelgen.runtime import arena
    if mode == "emm":
        arena.install()                 # before the context exists
    ctx = cuda.current_context()
    streams = [None, cuda.stream()]

    def alloc(pool, nbytes, stream):
        n = max(1, nbytes // 4)
        if mode == "emm":
            arr = cuda.device_array(n, np.float32, stream=streams[stream] or 0)
        else:
            arr = arena.device_empty(n, np.float32, streams[stream])
        arr[:1].copy_to_device(np.ones(1, np.float32))        # the step uses its memory
        return arr

    def settle():
        gc.collect()
        cuda.synchronize()
        arena.device_pool().reclaim()   # the cache and numba's deferred frees back to the driver

    pool = arena.device_pool()
    for arr in [alloc(pool, 1 << 20, 0), alloc(pool, 1 << 20, 1)]:   # the driver's first-use allocations
        del arr
    settle()
    free_before, total = ctx.get_memory_info()
    assert pool.in_use == 0, pool.stats()

    # a real CUDA_ERROR_OUT_OF_MEMORY: more than the device has
    with pytest.raises(MemoryError, match=f"{2 * total} bytes") as err:
        alloc(pool, 2 * total, 0)
    assert int(err.value.__cause__.code) == 2, repr(err.value.__cause__)

    # transient then persistent injected failures, with blocks cached and in use
    params = [alloc(pool, n, 0) for n in (3 << 20, 700_000, 4096)]
    host = [np.arange(p.size, dtype=np.float32) for p in params]
    for p, h in zip(params, host):
        p.copy_to_device(h)
    for arr in [alloc(pool, n, 0) for n in (5 << 20, 12_000)]:
        del arr
    kept = pool.in_use
    with inject_alloc_failures(count=1) as inj:
        arr = alloc(pool, 9 << 20, 0)
    assert [a[2] for a in inj.attempts] == [True, False] and inj.attempts[0][3] > 0 == inj.attempts[1][3]
    del arr
    with inject_alloc_failures() as inj, pytest.raises(MemoryError, match=r"in_use=.*cached="):
        alloc(pool, 11 << 20, 0)
    assert pool.in_use == kept and pool.cached == 0

    pool.release_cached()
    with inject_alloc_failures(when=_random_failures(random.Random(1))) as inj:
        run = _run_steps(pool, steps, 0, alloc, lambda pool, arr: None, _log_uniform(256, 16 << 20))
        gc.collect()
        st = pool.stats()
        assert pool.in_use == kept and len(inj.live) == st["cached_blocks"], (st, len(inj.live))
    for p, h in zip(params, host):      # releases never touched memory in use
        assert (p.copy_to_host() == h).all()
    del p, params
    gc.collect()
    assert pool.in_use == 0, pool.stats()
    cached_before_release = pool.cached
    settle()
    free_after_release, _ = ctx.get_memory_info()
    print(json.dumps({**run, **pool.stats(), "raw_calls": inj.calls, "injected": inj.failures,
                      "free_before": free_before, "free_after_release": free_after_release,
                      "cached_before_release": cached_before_release}))


if __name__ == "__main__":
    _child(sys.argv[1], int(sys.argv[2]))
