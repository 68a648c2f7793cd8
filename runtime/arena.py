"""Pooled device memory: size-class free lists per stream over an abstract backing allocator.

The bookkeeping is pure Python so it is testable without a GPU; `CudaBacking` and the numba
External Memory Manager plug it into real device memory. Nothing is installed at import:
call `install()` (or set KERNELGEN_ARENA=1 and call `install_from_env()`) before numba creates
its CUDA context.
"""
from __future__ import annotations

import os
from collections import defaultdict

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

    def stats(self) -> dict:
        return {"in_use": self.in_use, "cached": self.cached, "peak": self.peak,
                "served_from_pool": self.served_from_pool, "backing_allocs": self.backing_allocs}

    def alloc(self, nbytes: int, stream=0) -> Block:
        size = size_class(nbytes)
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
        self.peak = max(self.peak, self.in_use)
        return block

    def _backing_alloc(self, size, requested):
        try:
            return self.backing.alloc(size)
        except MemoryError:
            self.release_cached()
        try:
            return self.backing.alloc(size)
        except MemoryError as e:
            raise MemoryError(f"device allocation of {requested} bytes (class {size}) failed after "
                              f"releasing cached blocks; pool stats {self.stats()}") from e

    def free(self, block: Block) -> None:
        if self._live.pop(id(block.handle), None) is None:
            raise ValueError("block was not allocated by this pool or was already freed")
        self.in_use -= block.size
        self.cached += block.size
        self._free[(block.size, block.stream)].append(block)

    def release_cached(self) -> int:
        released = 0
        for blocks in self._free.values():
            for block in blocks:
                self.backing.free(block.handle)
                released += block.size
        self._free.clear()
        self.cached = 0
        return released


class CudaBacking:
    """cuMemAlloc / cuMemFree through numba's driver API; out-of-memory becomes MemoryError."""

    def alloc(self, nbytes):
        from numba.cuda.cudadrv import driver
        try:
            return driver.driver.cuMemAlloc(nbytes)
        except driver.CudaAPIError as e:
            if int(getattr(e, "code", -1)) == 2:   # CUDA_ERROR_OUT_OF_MEMORY
                raise MemoryError(str(e)) from e
            raise

    def free(self, handle):
        from numba.cuda.cudadrv import driver
        driver.driver.cuMemFree(handle)


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
    import threading
    key = threading.get_ident()
    ctx = _CONTEXT.get(key)
    if ctx is None:
        from numba import cuda
        ctx = _CONTEXT[key] = cuda.current_context()
    return ctx


_PROTOTYPES = {}  # (shape, dtype) -> (bytes, attributes of a DeviceNDArray of that shape), for cheap clones
_NUMBA = None     # (devicearray, driver) modules, imported on the first allocation


def _make_prototype(shape, dtype, mem):
    import numpy as np
    from numba.cuda.cudadrv import devicearray
    dtype = np.dtype(dtype)
    strides, acc = [], dtype.itemsize
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    arr = devicearray.DeviceNDArray(shape, tuple(reversed(strides)), dtype, gpu_data=mem)
    return {k: v for k, v in arr.__dict__.items() if k not in ("gpu_data", "stream")}


def device_empty(shape, dtype, stream=None):
    """A C-contiguous device array whose memory comes from the pool and goes back to it (on the
    same stream) when its memory pointer - shared by every view of it - is collected.  The simulator
    allocates plainly.  This runs on every call that returns a new array, so everything that depends
    only on (shape, dtype) is computed once."""
    global _NUMBA
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        from numba import cuda
        return cuda.device_array(shape, dtype=dtype)
    if _NUMBA is None:
        from numba.cuda.cudadrv import devicearray, driver
        _NUMBA = devicearray, driver
    devicearray, driver = _NUMBA
    proto = _PROTOTYPES.get((shape, dtype))
    if proto is None:
        import math

        import numpy as np
        nbytes = max(1, math.prod(shape) * np.dtype(dtype).itemsize)
    else:
        nbytes = proto[0]
    ctx = _context()  # before the raw cuMemAlloc: it needs a current context (the process's first CUDA call)
    pool = device_pool()
    block = pool.alloc(nbytes, _stream_key(stream))
    mem = driver.MemoryPointer(ctx, block.handle, nbytes, finalizer=lambda: pool.free(block))
    if proto is None:  # DeviceNDArray's constructor costs more than the kernel launch: build one, then clone
        proto = _PROTOTYPES[(shape, dtype)] = (nbytes, _make_prototype(shape, dtype, mem))
    arr = devicearray.DeviceNDArray.__new__(devicearray.DeviceNDArray)
    arr.__dict__.update(proto[1])
    arr.gpu_data = mem
    arr.stream = stream or 0
    return arr


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
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
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
    if os.environ.get("KERNELGEN_ARENA") == "1":
        install()
        return True
    return False
