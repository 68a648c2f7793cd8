"""Pooled device memory: size-class free lists per stream over an abstract backing allocator.

The bookkeeping is pure Python so it is testable without a GPU; `CudaBacking` and the numba
External Memory Manager plug it into real device memory. Nothing is installed at import:
call `install()` (or set KERNELGEN_ARENA=1 and call `install_from_env()`) before numba creates
its CUDA context.

Out of memory: a failed backing allocation releases the pool's cache (and flushes numba's deferred frees),
retries once, then raises MemoryError naming the request and what the pool held.  Tests reach that path
with `inject_alloc_failures`, which makes chosen raw allocations fail (tests/runtime/test_arena_faults.py).
"""
from __future__ import annotations

import contextlib
import threading
from collections import defaultdict

from kernelgen import settings

# Small requests round to 512 B; larger ones to 1/8 of their power of two, so waste stays under
# ~12.5% while the number of distinct classes (and so of cached blocks that cannot be shared) stays small.
MIN_BLOCK = 512


def size_class(nbytes: int) -> int:
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if nbytes <= MIN_BLOCK:
        return MIN_BLOCK
    step = max(MIN_BLOCK, 1 << max(0, nbytes.bit_length() - 4))
    return (nbytes + step - 1) // step * step


class Block:
    __slots__ = ("handle", "size", "stream")

    def __init__(self, handle, size, stream):
        self.handle, self.size, self.stream = handle, size, stream


class Pool:
    """`backing.alloc(nbytes) -> handle` (raises MemoryError when out), `backing.free(handle)`.

    A freed block is cached on the free list of its (size class, stream): reuse on the same stream
    needs no synchronisation, because work on one stream runs in order. Blocks are never handed to a
    different stream (that would need an event wait), so cross-stream traffic allocates fresh.
    """

    def __init__(self, backing):
        self.backing = backing
        self._free = defaultdict(list)      # (size, stream) -> [Block]
        self._live = {}                     # id(handle) -> Block
        self.in_use = 0
        self.cached = 0
        self.peak = 0
        self.served_from_pool = 0
        self.backing_allocs = 0
        self.oom_retries = 0                # backing out of memory: cache released, allocation retried
        self.oom_errors = 0                 # ... and the retry failed too: MemoryError to the caller

    def stats(self) -> dict:
        return {"in_use": self.in_use, "cached": self.cached, "peak": self.peak,
                "served_from_pool": self.served_from_pool, "backing_allocs": self.backing_allocs,
                "cached_blocks": sum(map(len, self._free.values())), "live_blocks": len(self._live),
                "oom_retries": self.oom_retries, "oom_errors": self.oom_errors}

    def alloc(self, nbytes: int, stream=0) -> Block:
        return self.alloc_class(size_class(nbytes), nbytes, stream)

    def alloc_class(self, size: int, nbytes: int, stream=0) -> Block:
        """alloc of `nbytes` whose size class the caller already knows (size_class(nbytes)): the per-call route."""
        free = self._free.get((size, stream))
        if free:
            block = free.pop()
            self.cached -= size
            self.served_from_pool += 1
        else:
            block = Block(self._backing_alloc(size, nbytes), size, stream)
            self.backing_allocs += 1
        self._live[id(block.handle)] = block
        self.in_use += size
        if self.in_use > self.peak:
            self.peak = self.in_use
        return block

    def _backing_alloc(self, size, requested):
        try:
            return self.backing.alloc(size)
        except MemoryError:
            # what the pool held when the backing ran out, for the message if the retry fails too
            held = (f"in_use={self.in_use} bytes in {len(self._live)} blocks, cached={self.cached} bytes "
                    f"in {sum(map(len, self._free.values()))} blocks")
            self.oom_retries += 1
            released = self.reclaim()
        try:
            return self.backing.alloc(size)
        except MemoryError as e:
            self.oom_errors += 1
            # chained from the driver's own error where the backing converted one (CudaBacking does)
            raise MemoryError(f"device allocation of {requested} bytes (size class {size}) failed: out of memory "
                              f"with the pool holding {held}; released the {released} cached bytes and retried "
                              f"once, still out of memory") from (e.__cause__ or e)

    def free(self, block: Block) -> None:
        if self._live.pop(id(block.handle), None) is None:
            raise ValueError("block was not allocated by this pool or was already freed")
        self.in_use -= block.size
        self.cached += block.size
        self._free[(block.size, block.stream)].append(block)

    def release_cached(self) -> int:
        """Every cached block back to the backing; returns the bytes released.  Block by block, so that if
        a free raises, the blocks not yet freed are still cached and the counts still add up."""
        released = 0
        for key in list(self._free):
            blocks = self._free[key]
            while blocks:
                self.backing.free(blocks[-1].handle)
                size = blocks.pop().size
                self.cached -= size
                released += size
            del self._free[key]
        return released

    def reclaim(self) -> int:
        """Out of memory: release the cache, then let a backing that frees lazily (numba queues frees of
        its own allocations) flush, so the retry sees every byte nobody uses.  Returns the bytes released."""
        released = self.release_cached()
        flush = getattr(self.backing, "flush", None)
        if flush is not None:
            flush()
        return released


CUDA_ERROR_OUT_OF_MEMORY = 2


def _is_out_of_memory(err) -> bool:
    """numba's CudaAPIError carries the CUresult (an int enum) as .code."""
    try:
        return int(getattr(err, "code", -1)) == CUDA_ERROR_OUT_OF_MEMORY
    except (TypeError, ValueError):
        return False


def _flush_numba_deallocations():
    """numba frees its own device and pinned memory lazily, through queues flushed when full.  In
    numba-cuda the context (streams, events, modules) and its memory manager (allocations) have separate
    queues: flush both, as numba itself does before retrying an allocation that ran out."""
    ctx = _context()
    for owner in (ctx, getattr(ctx, "memory_manager", None)):
        queue = getattr(owner, "deallocations", None)
        if queue is not None:
            queue.clear()


class CudaBacking:
    """cuMemAlloc / cuMemFree through numba's driver API; out-of-memory becomes MemoryError chained from the
    driver's error.  `raw_alloc`, `raw_free` and `flush` replace the driver calls and numba's deallocation
    flush: a fake device, for testing the conversion without a GPU."""

    def __init__(self, raw_alloc=None, raw_free=None, flush=None):
        self._raw_alloc, self._raw_free = raw_alloc, raw_free
        self.flush = flush or _flush_numba_deallocations

    def alloc(self, nbytes):
        if self._raw_alloc is None:
            from numba.cuda.cudadrv import driver
            raw = driver.driver.cuMemAlloc
        else:
            raw = self._raw_alloc
        try:
            return raw(nbytes)
        except Exception as e:  # numba's CudaAPIError; any other failure is not ours to translate
            if _is_out_of_memory(e):
                raise MemoryError(f"cuMemAlloc of {nbytes} bytes: {e}") from e
            raise

    def free(self, handle):
        if self._raw_free is None:
            from numba.cuda.cudadrv import driver
            driver.driver.cuMemFree(handle)
        else:
            self._raw_free(handle)


class PinnedBacking:
    """Page-locked host buffers (cuMemHostAlloc through numba) as flat uint8 NumPy arrays."""

    def alloc(self, nbytes):
        from numba import cuda
        try:
            return cuda.pinned_array(nbytes, dtype="uint8")
        except Exception as e:
            raise MemoryError(str(e)) from e

    def free(self, handle):
        pass  # numba frees pinned memory when the array is collected

    def flush(self):
        # a released array's cuMemFreeHost waits in numba's queue: run it before the retry
        _flush_numba_deallocations()


POOL: Pool | None = None          # device memory (also numba's, once install() ran)
PINNED: Pool | None = None        # host staging buffers for host<->device copies


def device_pool() -> Pool:
    global POOL
    if POOL is None:
        POOL = Pool(CudaBacking())
    return POOL


def pinned_pool() -> Pool:
    global PINNED
    if PINNED is None:
        PINNED = Pool(PinnedBacking())
    return PINNED


class InjectedAllocError(RuntimeError):
    """Stands for the driver's CUDA_ERROR_OUT_OF_MEMORY (same .code and .msg as numba's CudaAPIError)."""

    def __init__(self, msg):
        self.code, self.msg = CUDA_ERROR_OUT_OF_MEMORY, msg
        super().__init__(self.code, msg)


class FailingBacking:
    """A backing that fails chosen raw allocations of the one it wraps, as out-of-memory would: MemoryError
    chained from an InjectedAllocError, the shape CudaBacking gives a real one.  Installed and removed by
    inject_alloc_failures; the pool's own code is unchanged (and pays nothing) outside it.

    attempts: (number, nbytes, failed, pool's cached bytes at the call) per raw allocation, numbered from 1;
    live: the raw allocations made through it and not freed yet (handle id -> nbytes)."""

    def __init__(self, inner, pool, should_fail):
        self.inner, self.pool, self._should_fail = inner, pool, should_fail
        self.calls = self.failures = 0
        self.attempts = []
        self.live = {}

    def alloc(self, nbytes):
        self.calls += 1
        failed = bool(self._should_fail(self.calls))
        self.attempts.append((self.calls, nbytes, failed, self.pool.cached))
        if failed:
            self.failures += 1
            cause = InjectedAllocError(f"injected CUDA_ERROR_OUT_OF_MEMORY at raw allocation {self.calls} "
                                       f"({nbytes} bytes)")
            raise MemoryError(str(cause)) from cause
        handle = self.inner.alloc(nbytes)
        self.live[id(handle)] = nbytes
        return handle

    def free(self, handle):
        self.inner.free(handle)
        self.live.pop(id(handle), None)  # a block allocated before the injection began is not counted

    def flush(self):
        flush = getattr(self.inner, "flush", None)
        if flush is not None:
            flush()


@contextlib.contextmanager
def inject_alloc_failures(pool=None, *, after=None, every=None, count=None, when=None):
    """For tests: make `pool`'s (default: the device pool's) raw allocations fail inside the block.

    Raw allocations (pool misses, and the pool's retry after one fails) are numbered 1, 2, ... from the
    block's start; number n fails when n > after, (n - after) is a multiple of `every`, fewer than `count`
    have failed so far and `when(n)` is true (each None: no condition).  So the defaults fail every raw
    allocation (persistent out-of-memory: MemoryError), count=1 only the next (transient: the retry
    succeeds), after=k lets k succeed first, when=lambda n: rng.random() < 0.01 fails a random 1%.
    Yields the FailingBacking (its attempts, failures, live)."""
    pool = device_pool() if pool is None else pool
    after, every = after or 0, every or 1

    def should_fail(n):
        if n <= after or (n - after) % every:
            return False
        if count is not None and injector.failures >= count:
            return False
        return when is None or when(n)

    injector = FailingBacking(pool.backing, pool, should_fail)
    pool.backing = injector
    try:
        yield injector
    finally:
        pool.backing = injector.inner


def _stream_key(stream):
    if stream is None or stream == 0:
        return 0
    try:
        return int(stream.handle)
    except (AttributeError, TypeError, ValueError):
        return id(stream)


_CONTEXT = {}


def _context():
    """numba's context object for this thread, looked up once (cuda.current_context() asks the driver)."""
    key = threading.get_ident()
    ctx = _CONTEXT.get(key)
    if ctx is None:
        from numba import cuda
        ctx = _CONTEXT[key] = cuda.current_context()
    return ctx


_PROTOTYPES = {}  # (shape, dtype) -> _prototype's tuple, for cheap clones
_NUMBA = None     # (DeviceNDArray, PooledPointer), made on the first allocation (numba.cuda is slow to import)


def _numba_classes():
    from numba.cuda.cudadrv import devicearray, driver

    class PooledPointer(driver.MemoryPointer):
        """numba's memory pointer over a block of the pool, which takes the block back when the pointer (shared
        by every view of the array) is collected.  It frees in __del__ where numba's own pointer registers a
        weakref.finalize: on a call that returns a new array, that registration alone cost more than the rest of
        the allocation."""

        def free(self):
            owned = self.__dict__.pop("_pool_block", None)
            if owned is not None:
                owned[0].free(owned[1])

        def __del__(self):
            try:
                self.free()
            except Exception:  # (at interpreter exit the pool may be gone before its arrays: nothing to return)
                pass

    return devicearray.DeviceNDArray, PooledPointer


def device_empty(shape, dtype, stream=None):
    """A C-contiguous device array whose memory comes from the pool and goes back to it (on the
    same stream) when its memory pointer - shared by every view of it - is collected.  The simulator
    allocates plainly.  This runs on every call that returns a new array, so everything that depends
    only on (shape, dtype) is computed once."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if settings.get("cuda_simulator"):
        from numba import cuda
        return cuda.device_array(shape, dtype=dtype)
    return pooled_array(shape, dtype, stream)


def pooled_array(shape: tuple, dtype, stream=None):
    """device_empty on a real GPU (the fast route's output: the caller knows it is not the simulator).  Everything
    that depends only on (shape, dtype) - the byte count, its size class, the array's attributes - is worked out once
    (_prototype); the pointer's and the array's attributes are then set as whole dicts: each attribute set one by one
    costs as much."""
    proto = _PROTOTYPES.get((shape, dtype))
    if proto is None:
        proto = _prototype(shape, dtype)
    nbytes, size, attributes, pointer_class, array_class = proto
    ctx = _context()  # before the raw cuMemAlloc: it needs a current context (the process's first CUDA call)
    pool = device_pool()
    block = pool.alloc_class(size, nbytes, 0 if stream is None else _stream_key(stream))
    mem = pointer_class.__new__(pointer_class)  # (MemoryPointer.__init__'s fields, without its finalizer)
    handle = block.handle
    mem.__dict__ = {"context": ctx, "device_pointer": handle, "handle": handle, "size": nbytes,
                    "_cuda_memsize_": nbytes, "is_managed": True, "refct": 1, "_owner": None,
                    "_pool_block": (pool, block)}
    attributes = attributes.copy()
    attributes["gpu_data"] = mem
    attributes["stream"] = stream or 0
    arr = array_class.__new__(array_class)
    arr.__dict__ = attributes
    return arr


def _prototype(shape, dtype):
    """(bytes, their size class, a DeviceNDArray's attributes but its memory and stream, the pointer class, the
    array class) of a (shape, dtype): DeviceNDArray's constructor costs more than the kernel launch, so one is
    built here, over a stand-in pointer, and later arrays clone its attributes."""
    global _NUMBA
    import math

    import numpy as np
    from numba.cuda.cudadrv import devicearray, driver
    if _NUMBA is None:
        _NUMBA = _numba_classes()
    array_class, pointer_class = _NUMBA
    np_dtype = np.dtype(dtype)
    nbytes = max(1, math.prod(shape) * np_dtype.itemsize)
    strides, acc = [], np_dtype.itemsize
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    stand_in = driver.MemoryPointer.__new__(driver.MemoryPointer)  # (never used: its attributes are dropped)
    stand_in.__dict__ = {"device_pointer": 0, "handle": 0, "size": nbytes, "_cuda_memsize_": nbytes, "refct": 1,
                         "is_managed": True, "_owner": None, "context": None}
    arr = devicearray.DeviceNDArray(shape, tuple(reversed(strides)), np_dtype, gpu_data=stand_in)
    attributes = {k: v for k, v in arr.__dict__.items() if k not in ("gpu_data", "stream")}
    proto = _PROTOTYPES[(shape, dtype)] = (nbytes, size_class(nbytes), attributes, pointer_class, array_class)
    return proto


_PENDING = []   # (event, pinned block): staging buffers whose async copy may still be running


def _reap_staging():
    still = []
    for event, block in _PENDING:
        if event.query():
            PINNED.free(block)
        else:
            still.append((event, block))
    _PENDING[:] = still


def to_device_staged(host, stream=None):
    """Copy a NumPy array into a pooled device array through a pooled pinned buffer.  On a stream the
    copy is asynchronous; its pinned block goes back to the pool only once an event recorded after
    the copy has completed, so a later host write into a reused block can never race the copy."""
    import numpy as np
    host = np.ascontiguousarray(host)
    out = device_empty(host.shape, host.dtype, stream)
    if settings.get("cuda_simulator"):
        out.copy_to_device(host)
        return out
    from numba import cuda
    pool = pinned_pool()
    _reap_staging()
    block = pool.alloc(max(1, host.nbytes), 0)
    staging = block.handle[:host.nbytes].view(host.dtype)
    np.copyto(staging, host.reshape(-1))
    out.copy_to_device(staging.reshape(host.shape), stream=stream or 0)
    if stream is None:
        pool.free(block)  # a default-stream copy from pinned memory has completed on return
    else:
        event = cuda.event(timing=False)
        event.record(stream)
        _PENDING.append((event, block))
    return out


def _make_emm_class():
    from numba import cuda
    from numba.cuda.cudadrv import driver

    class ArenaMemoryManager(cuda.HostOnlyCUDAMemoryManager):
        """numba EMM: device allocations come from POOL; host/pinned memory stays numba's."""

        def initialize(self):
            device_pool()

        def memalloc(self, size):
            block = POOL.alloc(size)

            def finalizer():
                POOL.free(block)
            # the pool, not numba, owns the device memory: the finalizer only returns the block
            return driver.MemoryPointer(self.context, block.handle, size, finalizer=finalizer)

        def get_memory_info(self):
            free, total = driver.driver.cuMemGetInfo()
            return driver.MemoryInfo(free=free, total=total)

        def get_ipc_handle(self, memory):
            raise NotImplementedError("IPC handles are not supported by the kernelgen arena")

        @property
        def interface_version(self):
            return 1

    return ArenaMemoryManager


def install():
    """Route numba's device allocations through the pool; must run before the CUDA context exists."""
    from numba import cuda
    cuda.set_memory_manager(_make_emm_class())


def install_from_env():
    if settings.get("arena"):
        install()
        return True
    return False
