"""Launch programs (runtime/program.py): a launcher with tensor maps, widened outputs or outputs to clear packs its
driver calls once per (stream, arrays) and replays them; the maps are asked of the ring on every run.  Stand-ins for
the driver's steps record what would be launched (the GPU tests run the real ones:
tests/runtime/test_map_ring_gpu.py, tests/templates/test_bf16_gpu.py)."""
from __future__ import annotations

import numpy as np
import pytest

from kernelgen.runtime import launch
from kernelgen.runtime.program import LaunchProgram, ProgramCache

SPEC_X = ("x_map", "x", "tiled", (64, 8), (128,), (64, 8), (), (), 128, False, (), "bfloat16", ())


class StandInRing:
    """address(key, encode): where the ring holds key's map; move(key) is a wrap that reused its slot."""

    def __init__(self):
        self.held, self.encoded, self.next, self.uploads, self.asked = {}, [], 0x9000, 0, 0

    def address(self, key, encode):
        self.asked += 1
        if key not in self.held:
            self.encoded.append(int(encode()[0]))
            self.held[key], self.next = self.next, self.next + 128
            self.uploads += 1
        return self.held[key]

    def move(self, key):
        """Another map's upload reused key's slot."""
        del self.held[key]
        self.uploads += 1


class StandInFast:
    """driver._FastLaunch's step(): the kernel's words as the real one packs them (7 a parameter, the address 5th)."""

    def __init__(self, log):
        self.log = log

    def step(self, entries, itemsize, handle, scalars=()):
        words = [0] * (7 * len(entries))
        for i, entry in enumerate(entries):
            words[7 * i + 4] = entry[0]
            words[7 * i + 2] = entry[1]
        return (lambda: self.log.append(("kernel", handle, list(words))) or 0), (), words, "cuLaunchKernel"


@pytest.fixture
def stand_ins(monkeypatch):
    log, ring, captures = [], StandInRing(), {}
    monkeypatch.setattr(launch, "ring_for", lambda handle: ring)
    monkeypatch.setattr(launch, "capture_state", lambda handle: captures.get(handle))
    monkeypatch.setattr(launch, "zero_step", lambda ptr, n, size, handle: (
        lambda: log.append(("zero", ptr, n, size)) or 0, (), None, "memset"))
    monkeypatch.setattr(launch, "narrow_step", lambda wide, ptr, n, handle, bf16: (
        lambda: log.append(("narrow", wide, ptr, n, bf16)) or 0, (), None, "narrow"))

    def make(**kwargs):
        launcher = launch.Launcher(None, ("x", "dy", "dw", "x_map"), ("dw",), (1,), 128, True, "cuda",
                                   tensor_maps=(SPEC_X,), **kwargs)
        launcher._fast = StandInFast(log)
        monkeypatch.setattr(launcher, "_encoded", lambda spec, ptr: np.full(16, ptr, np.uint64))
        monkeypatch.setattr(launcher, "_workspace", lambda name, n, stream: WorkspaceStandIn(0x7000))
        return launcher
    return make, log, ring, captures


class WorkspaceStandIn:
    def __init__(self, address):
        self.device_ctypes_pointer = type("Pointer", (), {"value": address})()


class Stream:
    def __init__(self, handle):
        self.handle = handle


def test_a_widened_launch_is_packed_once_and_replayed(stand_ins):
    make, log, ring, _ = stand_ins
    launcher = make(widened=("dw",), bfloat16=True)
    built = []
    real_program = launcher.program
    launcher.program = lambda *a: built.append(a) or real_program(*a)
    arrays = ((0x1000, 512), (0x2000, 256), (0x3000, 72))
    for _ in range(3):
        launcher.launch_pointers(arrays, 2, Stream(5))
    assert len(built) == 1  # packed on the first call only
    one_call = [("zero", 0x7000, 72, 4), ("kernel", 5, [0, 0, 512, 0, 0x1000, 0, 0] + [0, 0, 256, 0, 0x2000, 0, 0] +
                                          [0, 0, 72, 0, 0x7000, 0, 0] + [0, 0, 16, 0, 0x9000, 0, 0]),
                ("narrow", 0x7000, 0x3000, 72, True)]
    assert log == one_call * 3 and ring.encoded == [0x1000]
    assert ring.asked == 2  # (built, and its first run; no upload since, so the later runs did not ask)
    launcher.launch_pointers(((0x4000, 512), (0x2000, 256), (0x3000, 72)), 2, Stream(5))  # x moved: a new program
    assert len(built) == 2 and log[-2][2][4] == 0x4000 and log[-2][2][25] == 0x9080


def test_a_replayed_program_asks_the_ring_for_its_maps_again(stand_ins):
    """A slot the ring reused since the program was built: the map is encoded again and the kernel gets its new
    address, the rest of the program unchanged."""
    make, log, ring, _ = stand_ins
    launcher = make()
    arrays = ((0x1000, 512), (0x2000, 256), (0x3000, 72))
    launcher.launch_pointers(arrays, 4, None)
    ring.move((launcher._map_tokens[0], 0x1000))
    launcher.launch_pointers(arrays, 4, None)
    assert ring.encoded == [0x1000, 0x1000]
    (_, _, first), (_, _, second) = [entry for entry in log if entry[0] == "kernel"]
    assert first[25] == 0x9000 and second[25] == 0x9080 and first[:21] == second[:21]
    assert [entry[0] for entry in log] == ["zero", "kernel"] * 2  # (zero_output: dw cleared before each launch)


def test_a_program_under_capture_is_not_kept(stand_ins):
    make, log, ring, captures = stand_ins

    class Capture:
        def buffer(self, key, nbytes):
            return 0x5000

        def map_address(self, key, encode, handle):
            return 0x6000
    captures[8] = Capture()
    launcher = make(widened=("dw",))
    arrays = ((0x1000, 512), (0x2000, 256), (0x3000, 72))
    launcher.launch_pointers(arrays, 2, Stream(8))
    launcher.launch_pointers(arrays, 2, Stream(8))
    assert len(launcher._programs) == 0 and ring.encoded == []
    kernels = [entry for entry in log if entry[0] == "kernel"]
    assert len(kernels) == 2 and all(k[2][18] == 0x5000 and k[2][25] == 0x6000 for k in kernels)


def test_an_upload_during_a_run_has_its_maps_read_again():
    """One map's upload may reuse the slot of a map read before it in the same pass: the pass is repeated until no
    upload happened in it."""
    class EvictingRing(StandInRing):
        def address(self, key, encode):
            new = key not in self.held
            found = super().address(key, encode)
            if key == "second" and new:  # its upload took the first map's slot
                self.move("first")
            return found
    ring, words = EvictingRing(), [0] * 14
    program = LaunchProgram()
    program.add_map(ring, "first", lambda: [1], 0)
    program.add_map(ring, "second", lambda: [2], 1)
    program.add_kernel((lambda: 0, (), words, "cuLaunchKernel"))
    program.run()
    assert ring.held["first"] == words[4] == 0x9100 and ring.held["second"] == words[11] == 0x9080
    assert ring.encoded == [1, 2, 1]


def test_program_cache_starts_again_when_full():
    cache = ProgramCache(limit=2)
    for key in range(3):
        cache.keep(key, LaunchProgram())
    assert len(cache) == 1 and cache.get(2) is not None and cache.get(0) is None


def test_a_failing_step_names_its_driver_call():
    program = LaunchProgram()
    program.add((lambda: 700, (), None, "cuMemsetD32Async"))
    with pytest.raises(RuntimeError, match="cuMemsetD32Async failed with CUDA error 700"):
        program.run()


def test_bind_relaunches_the_launchers_program_for_its_buffers(monkeypatch):
    """kernelgen.bind on a real GPU: after its first run, each call runs the launcher's program for the bound buffers
    (a split-K output's clear included), packed once."""
    from kernelgen.runtime import cuda_call
    ran, built = [], []

    class StandInLauncher:
        outputs, caller_params, fast, tensor_maps, widened, zero_output = ("y",), ("x", "y"), True, (), (), True

        def aligned(self, pointers):
            return True

        def program(self, ptr_sizes, itemsize, stream):
            built.append((list(ptr_sizes), itemsize))
            program = LaunchProgram()
            program.add((lambda: ran.append("run") or 0, (), None, "cuLaunchKernel"))
            return program
    prep = type("Prep", (), {"launcher": StandInLauncher(), "problem": type("P", (), {"dtype": "float32"})()})()
    monkeypatch.setattr(cuda_call, "run_cuda", lambda prep, inputs, template, stream, out: "y")
    monkeypatch.setattr(cuda_call, "pointer_size", lambda a, name: ({"x": 0x1000, "y": 0x2000}[a], 8))
    call = cuda_call.bound_call(prep, {"x": "x"}, "x")
    assert call() == "y" and call() == "y"
    assert built == [([(0x1000, 8), (0x2000, 8)], 4)] and ran == ["run", "run"]
