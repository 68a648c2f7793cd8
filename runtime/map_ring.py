"""Encoded TMA tensor maps in device memory, uploaded without waiting: one ring of slots per (CUDA context, stream).

A TMA kernel reads its tensor maps (128-byte CUtensorMap descriptors, encoded on the host by the driver:
runtime/tensor_map.py) from global memory.  A map depends on its array's address, and a training step's activations
move between steps (torch's caching allocator hands out other blocks), so maps are encoded again and again.  A
synchronous `cuda.to_device` per map drained the stream each time: the converted ResNet-18's bf16 step spent 10 of
its 42 ms (cProfile, BENCHMARKS.md 2026-11-27) there, the GPU idle while the host waited.

Here each map is encoded into a slot of page-locked host memory and copied into the same slot of a device array
by an asynchronous copy on the launch's stream, ahead of the kernel that reads it:
- the kernels enqueued earlier on the stream that read the slot's previous map run before the copy (stream
  order), so a slot is reused safely on its own stream - hence one ring per stream;
- the host words of a slot are rewritten only after its previous copy is done (an event per slot, recorded
  after the copy; with SLOTS slots that wait is almost never a wait);
- (map key, address) -> slot is remembered until the slot is reused, so the maps of arrays that come back cost a
  dict lookup.
"""
from __future__ import annotations

import ctypes
import threading

import numpy as np

from kernelgen.runtime.driver import check_driver as _check, libcuda

SLOTS = 512  # maps per ring: ~ the distinct (map, array) pairs of a few training steps; 64 KiB each side
MAP_BYTES = 128

_RINGS: dict = {}
_RINGS_LOCK = threading.Lock()
_EVENT_DISABLE_TIMING = 2



class MapRing:
    """SLOTS encoded maps of one stream: address(key, encode) -> the device address of key's map, encode() (16
    uint64 words) called and uploaded only where the ring does not hold key."""

    def __init__(self, stream_handle: int, host=None, device=None, device_at=None, cu=None):
        """host, device, device_at, cu: the page-locked words, the device words, their address and the driver
        (tests pass stand-ins; by default numba's pinned and device arrays of SLOTS x 16 words, and libcuda)."""
        if host is None:
            from numba import cuda
            host = cuda.pinned_array((SLOTS, 16), np.uint64)  # page-aligned: every 128-byte slot 64-byte aligned
            device = cuda.device_array((SLOTS, 16), np.uint64)
            device_at = device.device_ctypes_pointer.value
        self.stream, self.host, self.device, self._cu = stream_handle, host, device, cu
        self._host_at, self._device_at = self.host.ctypes.data, device_at
        self._slots = len(host)
        self._events = [None] * self._slots
        self._slot_of: dict = {}
        self._key_at = [None] * self._slots
        self._next = 0
        self._lock = threading.Lock()
        # maps uploaded so far: a slot is only ever reused by an upload, so where this has not moved since a map's
        # address was read, the map is still there (runtime/program.py reads it instead of asking again)
        self.uploads = 0
        self._uploads_word = (ctypes.c_int64 * 1)()  # the same count where C++ reads it (kernelgen/torch/native.cpp)
        self.uploads_at = ctypes.addressof(self._uploads_word)

    def slot(self, key, encode) -> int:
        with self._lock:
            found = self._slot_of.get(key)
            return self._upload(key, encode) if found is None else found

    def address(self, key, encode) -> int:
        return self._device_at + MAP_BYTES * self.slot(key, encode)

    def _upload(self, key, encode) -> int:
        cu = self._cu or libcuda()
        words = encode()  # first: a map the driver refuses (ValueError) changes nothing here
        slot, self._next = self._next, (self._next + 1) % self._slots
        old = self._key_at[slot]
        if old is not None:
            del self._slot_of[old]
            self._key_at[slot] = None
        event = self._events[slot]
        if event is not None:  # the slot's host words: copied by its last upload before they are rewritten
            _check(cu.cuEventSynchronize(event), "cuEventSynchronize")
        else:
            handle = ctypes.c_void_p()
            _check(cu.cuEventCreate(ctypes.byref(handle), _EVENT_DISABLE_TIMING), "cuEventCreate")
            event = self._events[slot] = handle.value
        self.host[slot] = words
        _check(cu.cuMemcpyHtoDAsync_v2(self._device_at + MAP_BYTES * slot, self._host_at + MAP_BYTES * slot,
                                       MAP_BYTES, self.stream), "cuMemcpyHtoDAsync")
        _check(cu.cuEventRecord(event, self.stream), "cuEventRecord")
        self._key_at[slot], self._slot_of[key] = key, slot
        self.uploads += 1
        self._uploads_word[0] = self.uploads
        return slot


def ring_for(stream_handle: int) -> MapRing:
    """The ring of the current CUDA context and this stream (made at its first map)."""
    cu = libcuda()
    ctx = ctypes.c_void_p()
    _check(cu.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    key = (ctx.value, stream_handle)
    ring = _RINGS.get(key)
    if ring is None:
        with _RINGS_LOCK:
            ring = _RINGS.get(key)
            if ring is None:
                ring = _RINGS[key] = MapRing(stream_handle)
    return ring
