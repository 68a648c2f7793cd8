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


POOL: Pool | None = None


def _make_emm_class():
    from numba import cuda
    from numba.cuda.cudadrv import driver

    class ArenaMemoryManager(cuda.HostOnlyCUDAMemoryManager):
        """numba EMM: device allocations come from POOL; host/pinned memory stays numba's."""

        def initialize(self):
            global POOL
            if POOL is None:
                POOL = Pool(CudaBacking())

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
