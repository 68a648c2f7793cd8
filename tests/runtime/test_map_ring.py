"""The tensor-map ring's bookkeeping (runtime/map_ring.py) on the CPU, through a stand-in driver whose stream runs
its copies only when an event is waited for (as late as a real stream may): a map is encoded once while its slot
holds it, the ring comes round in order, and a slot's host words are rewritten only after the copy that read them
ran - else the map a queued kernel reads would be the next one.  The GPU test (test_map_ring_gpu.py) runs the real
thing under TMA kernels."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kernelgen.runtime.map_ring import MAP_BYTES, MapRing


class LazyStream:
    """A driver stand-in: copies and event records queue up; cuEventSynchronize runs the queue up to the event.
    Each copy reads the host words when it runs, and `ran` lists (slot, first word) in the order copies ran."""

    def __init__(self, host, device_at):
        self.host, self.device_at, self.host_at = host, device_at, host.ctypes.data
        self.queue, self.ran, self.events, self.streams = [], [], 0, set()

    def cuEventCreate(self, handle, flags):
        self.events += 1
        handle._obj.value = self.events
        return 0

    def cuMemcpyHtoDAsync_v2(self, dst, src, nbytes, stream):
        assert nbytes == MAP_BYTES and (dst - self.device_at) == (src - self.host_at)
        self.queue.append(("copy", (dst - self.device_at) // MAP_BYTES))
        self.streams.add(stream)
        return 0

    def cuEventRecord(self, event, stream):
        self.queue.append(("event", event))
        self.streams.add(stream)
        return 0

    def cuEventSynchronize(self, event):
        while self.queue:
            kind, what = self.queue.pop(0)
            if kind == "copy":
                self.ran.append((what, int(self.host[what, 0])))
            elif what == event:
                break
        return 0


def ring_of(slots, stream=7):
    host = np.zeros((slots, 16), np.uint64)
    cu = LazyStream(host, 0x10000)
    return MapRing(stream, host=host, device=None, device_at=0x10000, cu=cu), cu


def encoder(value, log):
    def words():
        log.append(value)
        return np.full(16, value, np.uint64)
    return words


def test_a_map_is_encoded_once_while_its_slot_holds_it():
    ring, cu = ring_of(3)
    log = []
    first = ring.address(("map", 0xA00), encoder(1, log))
    assert ring.address(("map", 0xA00), encoder(1, log)) == first == 0x10000 and log == [1]
    second = ring.address(("map", 0xB00), encoder(2, log))
    assert second == first + MAP_BYTES and log == [1, 2] and cu.streams == {7}


def test_the_ring_comes_round_in_order_and_forgets_what_it_overwrites():
    ring, _ = ring_of(2)
    log = []
    a = ring.address("a", encoder(1, log))
    ring.address("b", encoder(2, log))
    assert ring.address("c", encoder(3, log)) == a  # the third map takes the first slot
    assert ring.address("a", encoder(1, log)) == a + MAP_BYTES and log == [1, 2, 3, 1]  # "a" was forgotten
    assert ring.address("c", encoder(3, log)) == a and log == [1, 2, 3, 1]  # "c" still held


def test_a_slot_s_host_words_wait_for_the_copy_that_reads_them():
    """Two slots, three maps, nothing run yet: before slot 0's host words become map 3, its copy of map 1 has run."""
    ring, cu = ring_of(2)
    log = []
    for value in (1, 2, 3):
        ring.address(value, encoder(value, log))
    assert cu.ran == [(0, 1)]  # map 1's copy ran (waited for) before its host words were rewritten
    cu.cuEventSynchronize(None)  # run the rest
    assert cu.ran == [(0, 1), (1, 2), (0, 3)]


def test_an_encode_that_fails_leaves_the_ring_consistent():
    """A map the driver refuses (ValueError from the encode) changes nothing: no slot taken, no map forgotten."""
    ring, _ = ring_of(2)
    log = []

    def refused():
        raise ValueError("tensor map refused")
    ring.address("a", encoder(1, log))
    with pytest.raises(ValueError, match="refused"):
        ring.address("bad", refused)
    assert ring.address("b", encoder(2, log)) == 0x10000 + MAP_BYTES
    assert ring.address("a", encoder(1, log)) == 0x10000 and log == [1, 2]


def test_stand_in_event_handles_are_written_through_byref():
    cu = LazyStream(np.zeros((1, 16), np.uint64), 0)
    handle = ctypes.c_void_p()
    cu.cuEventCreate(ctypes.byref(handle), 2)
    assert handle.value == 1


def test_an_eager_launch_takes_its_maps_from_its_streams_ring(monkeypatch):
    """Launcher._derived_pointers outside a capture: the stream's ring asked once per launch, each map keyed by (the
    map's token, the array's address) and encoded for that address where the ring lacks it."""
    from kernelgen.runtime import launch

    class StandInRing:
        def __init__(self):
            self.held = {}

        def address(self, key, encode):
            if key not in self.held:
                self.held[key] = 0x9000 + 128 * len(self.held)
                assert int(encode()[0]) == key[1] + len("x_map")  # (the stand-in encoding: address + name length)
            return self.held[key]
    rings, asked = {5: StandInRing()}, []
    monkeypatch.setattr(launch, "ring_for", lambda handle: asked.append(handle) or rings[handle])
    spec_x = ("x_map", "x", "tiled", (64, 8), (128,), (64, 8), (), (), 128, False, (), "float16", ())
    spec_w = ("w_map", "w", "tiled", (64, 8), (128,), (64, 8), (), (), 128, False, (), "float16", ())
    launcher = launch.Launcher(None, ("x", "w", "y", "x_map", "w_map"), ("y",), (1,), 128, False, "cuda",
                               tensor_maps=(spec_x, spec_w))
    monkeypatch.setattr(launcher, "_encoded", lambda spec, ptr: np.full(16, ptr + len(spec[0]), np.uint64))

    class Stream:
        handle = 5
    first = launcher._derived_pointers([(0x1000, 512), (0x2000, 512), (0x3000, 512)], Stream())
    assert first[3:] == [(0x9000, 16, 8), (0x9080, 16, 8)] and asked == [5]
    again = launcher._derived_pointers([(0x1000, 512), (0x2000, 512), (0x3000, 512)], Stream())
    moved = launcher._derived_pointers([(0x4000, 512), (0x2000, 512), (0x3000, 512)], Stream())
    assert again == first and moved[3:] == [(0x9100, 16, 8), (0x9080, 16, 8)] and asked == [5, 5, 5]
