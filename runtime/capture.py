"""kernelgen calls under CUDA stream capture (CUDA graphs: torch.cuda.graph, torch.cuda.make_graphed_callables,
torch.compile's "reduce-overhead"): what the launch path does differently while the caller's stream is captured.

A graph replays its kernels with the parameters they were captured with, on any stream, any number of times, long
after the capture.  So whatever a captured call reads besides the caller's arrays must stay as it was at capture
for the graph's life, and nothing outside the graph may change it:
- the copies a TMA kernel reads (TF32-rounded or flipped operands) and the float32 workspaces of widened outputs
  are buffers of the capture's own, never the per-stream buffers eager calls share (a later eager call on the
  capture stream - or on a stream torch hands out again with the same handle - would rewrite them between replays);
- tensor maps go into slots of the capture's own, filled by a copy captured into the graph from host words that
  are never rewritten (a captured copy from page-locked memory reads that memory again at every replay, and the
  eager ring, runtime/map_ring.py, rewrites its slots); no event of the eager ring is recorded or waited on (an
  event recorded in a capture cannot be waited on after it);
- the capture's memory is allocated with the calling thread's capture mode relaxed for the call, as PyTorch's
  caching allocator does around cudaMalloc: an allocation is not a stream operation, and what must not happen is
  its release while a graph may replay.  So it is kept for the process's life, or until release().

What cannot be captured is refused with a RuntimeError before anything runs (refuse_if_capturing): a call's first
run (it plans, compiles and loads its kernel: warm up before capturing, as torch asks), host arrays, outputs from
kernelgen's pool (pass out= or torch tensors) - except on a stream whose pool is a graph's own (set_private_pool:
kernelgen.nn's captured steps).  Measured on the H100 before this module (twelfth session): a global
capture failed on the first workspace allocation; a relaxed one captured, and a replay after the eager ring had
wrapped read overwritten maps (an illegal instruction).
"""
from __future__ import annotations

import ctypes
import threading

from kernelgen.runtime.driver import check_driver as _check, libcuda

_ACTIVE, _INVALIDATED = 1, 2  # CUstreamCaptureStatus
_RELAXED = 2  # CUstreamCaptureMode
MAP_BYTES = 128
SLOTS_PER_CHUNK = 64

_STATES: dict = {}
_LOCK = threading.Lock()



def capture_id(handle: int, cu=None):
    """The id of the capture under way on the raw stream `handle`, or None where it is not being captured (the
    legacy default stream, 0, never is)."""
    if not handle:
        return None
    if cu is None:
        try:
            cu = libcuda()
        except OSError:  # no CUDA driver here: nothing is captured
            return None
    status, ident = ctypes.c_int(), ctypes.c_uint64()
    _check(cu.cuStreamGetCaptureInfo_v2(handle, ctypes.byref(status), ctypes.byref(ident), None, None, None),
           "cuStreamGetCaptureInfo")
    if status.value == _INVALIDATED:
        raise RuntimeError("the stream's CUDA graph capture was invalidated by an earlier call (not kernelgen's)")
    return ident.value if status.value == _ACTIVE else None


class relaxed_capture_mode:
    """The calling thread's capture mode relaxed for the block (cuThreadExchangeStreamCaptureMode), so that it may
    allocate while a stream captures; the mode it had is restored after."""

    def __init__(self, cu=None):
        self._cu = cu

    def __enter__(self):
        self._cu = self._cu or libcuda()
        self._mode = ctypes.c_int(_RELAXED)
        _check(self._cu.cuThreadExchangeStreamCaptureMode(ctypes.byref(self._mode)), "cuThreadExchangeStreamCaptureMode")
        return self

    def __exit__(self, *exc):
        _check(self._cu.cuThreadExchangeStreamCaptureMode(ctypes.byref(self._mode)), "cuThreadExchangeStreamCaptureMode")


class CaptureState:
    """One capture's own buffers and tensor-map slots (see the module's docstring)."""

    def __init__(self, ident: int, cu=None):
        self.ident, self._cu = ident, cu
        self._buffers: dict = {}  # key -> device address
        self._maps: dict = {}  # (map key, address) -> device address of its slot
        self._free_slots: list = []  # (host address, device address) of slots not yet filled
        self._device_blocks: list = []
        self._host_blocks: list = []
        self._lock = threading.Lock()

    @property
    def cu(self):
        return self._cu or libcuda()

    def buffer(self, key, nbytes: int) -> int:
        """The device address of this capture's buffer for `key` (a launcher's copy or workspace) of nbytes: the
        same buffer for the same key within the capture, as an eager stream's buffer is reused in stream order."""
        with self._lock:
            found = self._buffers.get(key)
            if found is None:
                found = self._buffers[key] = self._alloc_device(nbytes)
            return found

    def map_address(self, key, encode, handle: int) -> int:
        """The device address of key's map (encode() -> its 16 uint64 words), uploaded by a copy on the capturing
        stream `handle` (captured: every replay copies the same words again) where this capture has not yet."""
        with self._lock:
            found = self._maps.get(key)
            if found is not None:
                return found
            words = (ctypes.c_uint64 * 16)(*[int(w) for w in encode()])  # first: a refused map changes nothing
            if not self._free_slots:
                self._add_chunk()
            host, device = self._free_slots.pop()
            ctypes.memmove(host, words, MAP_BYTES)  # written once: nothing rewrites a slot's host words
            _check(self.cu.cuMemcpyHtoDAsync_v2(device, host, MAP_BYTES, handle), "cuMemcpyHtoDAsync")
            self._maps[key] = device
            return device

    def _add_chunk(self):
        nbytes = SLOTS_PER_CHUNK * MAP_BYTES
        device = self._alloc_device(nbytes)
        host = ctypes.c_void_p()
        with relaxed_capture_mode(self._cu):
            _check(self.cu.cuMemHostAlloc(ctypes.byref(host), nbytes, 0), "cuMemHostAlloc")
        self._host_blocks.append(host.value)
        self._free_slots.extend((host.value + MAP_BYTES * i, device + MAP_BYTES * i)
                                for i in reversed(range(SLOTS_PER_CHUNK)))

    def _alloc_device(self, nbytes: int) -> int:
        ptr = ctypes.c_uint64()
        with relaxed_capture_mode(self._cu):
            _check(self.cu.cuMemAlloc_v2(ctypes.byref(ptr), max(int(nbytes), 16)), "cuMemAlloc")
        self._device_blocks.append(ptr.value)
        return ptr.value

    def free(self):
        cu = self.cu
        for ptr in self._device_blocks:
            cu.cuMemFree_v2(ptr)
        for ptr in self._host_blocks:
            cu.cuMemFreeHost(ptr)
        self._device_blocks, self._host_blocks, self._buffers, self._maps, self._free_slots = [], [], {}, {}, []


def state_for(handle: int, cu=None):
    """The CaptureState of the capture under way on stream `handle`, or None where none is."""
    ident = capture_id(handle, cu)
    if ident is None:
        return None
    state = _STATES.get(ident)
    if state is None:
        with _LOCK:
            state = _STATES.get(ident)
            if state is None:
                state = _STATES[ident] = CaptureState(ident, cu)
    return state


def raw_handle(stream) -> int:
    """The raw CUstream of a call's `stream=` argument as the API takes it (None, a numba stream, or an object
    with an int cuda_stream / ptr), without importing numba; 0 for anything else (validated elsewhere)."""
    if stream is None:
        return 0
    handle = getattr(stream, "handle", None)  # a numba stream
    if handle is not None:  # (a cuda-bindings CUstream converts with int(); a ctypes c_void_p holds .value)
        return int(handle.value or 0) if hasattr(handle, "value") else int(handle)
    for attr in ("cuda_stream", "ptr"):
        handle = getattr(stream, attr, None)
        if isinstance(handle, int):
            return handle
    return 0


_PRIVATE_POOLS: frozenset = frozenset()  # raw streams whose pooled memory is one graph's own (kernelgen.nn.graphs)


def set_private_pool(handle: int, private: bool):
    """Mark stream `handle`'s pool (runtime/arena.py keeps free lists per stream) as one graph's own - only that
    graph's capture and replays run on the stream - or no longer (the graph is gone).  A pooled output is then
    capturable there: a block the capture dropped goes back to a free list that only the graph's own work draws
    from, in the order the graph replays (torch.cuda.graph's private memory pool)."""
    global _PRIVATE_POOLS
    with _LOCK:
        _PRIVATE_POOLS = _PRIVATE_POOLS | {handle} if private else _PRIVATE_POOLS - {handle}


def has_private_pool(handle: int) -> bool:
    return handle in _PRIVATE_POOLS


def refuse_if_capturing(handle: int, what: str):
    """A RuntimeError where stream `handle` is being captured: `what` cannot be (see the module's docstring)."""
    if capture_id(handle) is not None:
        raise RuntimeError(f"kernelgen: {what} cannot be captured into a CUDA graph; run the call once before "
                           f"capturing (a warm-up, as torch.cuda.graph asks), with device arrays, and torch tensors "
                           f"or out= for the output")


def release():
    """Free the memory of every capture so far (their copies, workspaces and maps).  Only when none of their graphs
    will be replayed again: a replay after this reads freed memory."""
    with _LOCK:
        states = list(_STATES.values())
        _STATES.clear()
    for state in states:
        state.free()


def captures() -> int:
    """How many captures hold memory (statistics)."""
    return len(_STATES)
