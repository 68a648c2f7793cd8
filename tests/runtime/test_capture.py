"""What a kernelgen call does under CUDA stream capture (runtime/capture.py), on the CPU with a stand-in driver that
keeps its memory in host buffers and records the copies a graph would replay: a capture's buffers and map slots
are its own and allocated with the thread's capture mode relaxed (then restored); a slot's host words are written
once and never rewritten, so every replay of the captured copies gives every map; the launcher's captured launch
takes them and never the eager ring.  The GPU side: tests/interop/test_torch_graphs_gpu.py."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kernelgen.runtime import capture


class StandInDriver:
    """The driver calls capture.py makes.  Device and page-locked memory are ctypes buffers; a copy on a stream
    is recorded (a captured node) and done at once; status[handle] is the capture status of each stream."""

    def __init__(self):
        self.status, self.ids = {}, {}
        self.mode = 0  # the thread's capture mode (0: global)
        self.modes_at_alloc, self.copies, self.freed, self._keep = [], [], [], []

    def _buffer(self, nbytes):
        buf = ctypes.create_string_buffer(nbytes)
        self._keep.append(buf)
        return ctypes.addressof(buf)

    def cuStreamGetCaptureInfo_v2(self, handle, status, ident, graph, deps, n):
        status._obj.value = self.status.get(handle, 0)
        ident._obj.value = self.ids.get(handle, 0)
        return 0

    def cuThreadExchangeStreamCaptureMode(self, mode):
        mode._obj.value, self.mode = self.mode, mode._obj.value
        return 0

    def cuMemAlloc_v2(self, ptr, nbytes):
        self.modes_at_alloc.append(self.mode)
        ptr._obj.value = self._buffer(nbytes)
        return 0

    def cuMemHostAlloc(self, ptr, nbytes, flags):
        self.modes_at_alloc.append(self.mode)
        ptr._obj.value = self._buffer(nbytes)
        return 0

    def cuMemcpyHtoDAsync_v2(self, device, host, nbytes, stream):
        self.copies.append((device, host, nbytes, stream))
        ctypes.memmove(device, host, nbytes)
        return 0

    def cuMemFree_v2(self, ptr):
        self.freed.append(ptr)

    def cuMemFreeHost(self, ptr):
        self.freed.append(ptr)

    def replay(self):
        """What a graph's replay of the recorded copies does: each reads its host words again."""
        for device, host, nbytes, _ in self.copies:
            ctypes.memmove(device, host, nbytes)


def _words(device, n=16):
    return np.frombuffer((ctypes.c_uint64 * n).from_address(device), np.uint64).copy()


def test_capture_id_reads_the_stream_status():
    cu = StandInDriver()
    cu.status, cu.ids = {7: 1, 8: 0, 9: 2}, {7: 41}
    assert capture.capture_id(7, cu) == 41
    assert capture.capture_id(8, cu) is None
    assert capture.capture_id(0, cu) is None  # the legacy stream: never asked
    with pytest.raises(RuntimeError, match="invalidated"):
        capture.capture_id(9, cu)


def test_buffers_are_the_captures_own_and_allocated_relaxed():
    cu = StandInDriver()
    state = capture.CaptureState(1, cu)
    a = state.buffer(("launcher", "w", 10), 40)
    assert state.buffer(("launcher", "w", 10), 40) == a  # one per key within the capture
    b = state.buffer(("launcher", "dw", 10), 40)
    assert b != a
    assert cu.modes_at_alloc == [2, 2] and cu.mode == 0  # relaxed for each allocation, global again after
    other = capture.CaptureState(2, cu)
    assert other.buffer(("launcher", "w", 10), 40) not in (a, b)  # another capture: its own


def test_map_slots_are_written_once_and_every_replay_gives_every_map(rng):
    cu = StandInDriver()
    state = capture.CaptureState(1, cu)
    n = 2 * capture.SLOTS_PER_CHUNK + 5  # three chunks
    maps = {("spec", i): rng.integers(0, 2 ** 63, 16, dtype=np.uint64) for i in range(n)}
    encodes = []

    def encode(key):
        def words():
            encodes.append(key)
            return maps[key]
        return words
    addresses = {key: state.map_address(key, encode(key), 5) for key in maps}
    assert len(set(addresses.values())) == n
    assert state.map_address(("spec", 3), encode(("spec", 3)), 5) == addresses[("spec", 3)]  # held: no new copy
    assert len(encodes) == n and len(cu.copies) == n and {c[3] for c in cu.copies} == {5}  # on the capture stream
    for device in addresses.values():  # the device words poisoned, as if anything else had run meanwhile
        ctypes.memset(device, 0xFF, capture.MAP_BYTES)
    cu.replay()
    for key, device in addresses.items():
        assert (_words(device) == maps[key]).all(), key
    assert all(mode == 2 for mode in cu.modes_at_alloc) and cu.mode == 0


def test_state_for_keys_captures_by_id_and_release_frees_them(monkeypatch):
    cu = StandInDriver()
    monkeypatch.setattr(capture, "_STATES", {})
    cu.status, cu.ids = {3: 1, 4: 1, 5: 1}, {3: 100, 4: 101, 5: 100}
    s3, s4, s5 = capture.state_for(3, cu), capture.state_for(4, cu), capture.state_for(5, cu)
    assert s3 is s5 and s3 is not s4  # (a capture forked onto a second stream: one state)
    assert capture.state_for(6, cu) is None  # not capturing
    blocks = [s3.buffer("a", 8), s4.buffer("b", 8)]
    capture.release()
    assert set(blocks) <= set(cu.freed) and capture.captures() == 0


def test_refused_calls_name_what_cannot_be_captured(monkeypatch):
    monkeypatch.setattr(capture, "capture_id", lambda handle, cu=None: 9 if handle == 12 else None)
    capture.refuse_if_capturing(11, "anything")  # not capturing: nothing
    with pytest.raises(RuntimeError, match="a pooled output cannot be captured into a CUDA graph; run the call once"):
        capture.refuse_if_capturing(12, "a pooled output")


def test_raw_handle_of_the_stream_arguments():
    class TorchLike:
        cuda_stream = 77

    class CupyLike:
        ptr = 78

    class NumbaLike:
        handle = ctypes.c_void_p(79)
    assert [capture.raw_handle(s) for s in (None, TorchLike(), CupyLike(), NumbaLike(), object())] == [0, 77, 78, 79, 0]


def test_a_captured_launch_takes_the_captures_maps_not_the_ring(monkeypatch):
    """Launcher._derived_pointers under a capture: the maps come from the capture's slots (encoded for the arrays'
    addresses), and the eager ring is never asked."""
    from kernelgen.runtime import launch
    cu = StandInDriver()
    state = capture.CaptureState(1, cu)
    spec_x = ("x_map", "x", "tiled", (64, 8), (128,), (64, 8), (), (), 128, False, (), "float16", ())
    spec_w = ("w_map", "w", "tiled", (64, 8), (128,), (64, 8), (), (), 128, False, (), "float16", ())
    launcher = launch.Launcher(None, ("x", "w", "y", "x_map", "w_map"), ("y",), (1,), 128, False, "cuda",
                               tensor_maps=(spec_x, spec_w))
    monkeypatch.setattr(launch, "ring_for", lambda handle: pytest.fail("the eager ring was asked under capture"))
    monkeypatch.setattr(launcher, "_encoded", lambda spec, ptr: np.full(16, ptr + len(spec[0]), np.uint64))
    args = launcher._derived_pointers([(0x1000, 512), (0x2000, 512), (0x3000, 512)], None, state)
    assert args[:3] == [(0x1000, 512), (0x2000, 512), (0x3000, 512)]
    (x_at, *_), (w_at, *_) = args[3:]
    assert _words(x_at)[0] == 0x1000 + 5 and _words(w_at)[0] == 0x2000 + 5
    assert [c[0] for c in cu.copies] == [x_at, w_at]


def test_one_numba_stream_object_per_raw_handle(monkeypatch):
    """torch's current stream is looked up on every call, and numba's stream objects compare by identity: one object
    per handle keeps the launcher's per-stream buffers (a new object per call had allocated a buffer per call)."""
    from numba import cuda

    from kernelgen.runtime import driver
    made = []
    monkeypatch.setattr(cuda, "external_stream", lambda handle: made.append(handle) or object(), raising=False)
    monkeypatch.setattr(driver, "_EXTERNAL_STREAMS", {})

    class TorchLike:
        def __init__(self, handle):
            self.cuda_stream = handle
    first = driver.as_numba_stream(TorchLike(1001))
    assert driver.as_numba_stream(TorchLike(1001)) is first
    assert driver.as_numba_stream(TorchLike(1002)) is not first
    assert made == [1001, 1002]


def test_a_dispatcher_launch_of_a_kernel_with_stream_buffers_is_refused_under_capture(monkeypatch):
    """A launcher with tensor maps or a widened output goes through numba's dispatcher for an unaligned array (and on
    a first call), with the stream's copies and workspaces, not the capture's: refused while the stream captures."""
    from kernelgen.runtime import launch
    monkeypatch.setattr(capture, "capture_id", lambda handle, cu=None: 3 if handle == 21 else None)
    launcher = launch.Launcher(None, ("x", "dy", "dw"), ("dw",), (1,), 128, True, "cuda", widened=("dw",))
    monkeypatch.setattr(launcher, "_call_widened", lambda args, stream: "launched")

    class Stream:
        def __init__(self, handle):
            self.handle = handle
    assert launcher({"x": None, "dy": None, "dw": None}, Stream(20)) == "launched"
    with pytest.raises(RuntimeError, match="numba's dispatcher cannot be captured"):
        launcher({"x": None, "dy": None, "dw": None}, Stream(21))


def test_a_pooled_output_is_captured_only_on_a_stream_whose_pool_is_a_graph_s_own(monkeypatch):
    """A route's pooled output under capture: refused on a stream whose pool others draw from (a dropped block would
    be handed out while the graph still writes it), taken from the pool on one a captured nn step owns
    (set_private_pool), and refused again once the graph is gone."""
    from kernelgen.runtime import cuda_call
    monkeypatch.setattr(capture, "capture_id", lambda handle, cu=None: 5 if handle in (31, 32) else None)
    monkeypatch.setattr(cuda_call, "pooled_array", lambda shape, dtype, stream: ("pooled", shape, stream.handle))
    route = cuda_call.CudaRoute.__new__(cuda_call.CudaRoute)
    route.torch_empty, route.shape, route.dtype = None, (2, 3), np.float32

    class Stream:
        def __init__(self, handle):
            self.handle = handle
    assert route._output(None, Stream(30)) == ("pooled", (2, 3), 30)  # not capturing
    with pytest.raises(RuntimeError, match="an output from kernelgen's pool cannot be captured"):
        route._output(None, Stream(31))
    capture.set_private_pool(32, True)
    try:
        assert capture.has_private_pool(32) and not capture.has_private_pool(31)
        assert route._output(None, Stream(32)) == ("pooled", (2, 3), 32)
    finally:
        capture.set_private_pool(32, False)
    with pytest.raises(RuntimeError, match="an output from kernelgen's pool cannot be captured"):
        route._output(None, Stream(32))
