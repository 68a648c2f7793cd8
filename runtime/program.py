"""Launch programs: the driver calls of one launch, packed once and replayed while the launch's arrays stay put.

A kernel with tensor maps, a float32 workspace for a 16-bit output or a split-K output that must start from zero is
several driver calls, not one: clear the workspace or the output, round or flip an operand into its copy, launch
the kernel with its maps' addresses, round the workspace into the caller's array.  Building those calls (the
arguments packed into ctypes words, the maps looked up, the copies and workspaces found) took most of a repeated
call's host time - 60-90 µs of a converted ResNet-18's bf16 convolution on the H100 machine, where the kernel itself
is 10-40 µs (BENCHMARKS.md, 2026-11-27, fourteenth session).  A training step calls each convolution on the same
addresses step after step (torch's caching allocator hands the same blocks back), so the Launcher keeps the program
of each (stream, addresses) and a repeated call runs it: one call per step, each on arguments packed already.

What may change between two runs of a program, and is looked at again on each: the tensor maps' slots.  A map lives
in its stream's ring (runtime/map_ring.py) until the ring wraps and reuses the slot, which only an upload does; where
the ring has uploaded anything since the program last read its maps' addresses, a run asks the ring for each map
again (a dict lookup; encoded and uploaded again where the slot was reused) and writes its address into the
kernel's parameter words before the launch.  Everything else a program holds is fixed by its key: the caller's
addresses and sizes, the stream, and the launcher's own copies and workspaces (one per stream and size, never freed
while the launcher lives).  A program built under a CUDA graph capture takes the capture's buffers and maps and is
not kept.
"""
from __future__ import annotations

from kernelgen.runtime.driver import check_driver

WORDS_PER_ARRAY = 7  # a 1D array parameter's words in the kernel's parameter block (driver._FastLaunch)
ADDRESS_WORD = 4  # the data pointer's word among them


class LaunchProgram:
    """Driver steps (runtime.driver's step tuples) run in order, and the tensor maps whose addresses the kernel step's
    words take on each run.  `kept`: may the launcher keep it for later calls (not under a capture)."""
    __slots__ = ("steps", "maps", "kernel_words", "kept", "seen")

    def __init__(self, kept=True):
        self.steps = []
        self.maps = []  # (ring, key, encode, word index in the kernel step's parameter words)
        self.kernel_words = None
        self.kept = kept
        self.seen = None  # (ring, its upload count) when the maps' addresses were last read (one ring a program)

    def add(self, step):
        self.steps.append(step)

    def add_map(self, ring, key, encode, index):
        """The kernel's parameter `index` is the map `key` of `ring` (encoded by encode() where the ring lacks it):
        run() writes its address into the kernel step's words."""
        self.maps.append((ring, key, encode, WORDS_PER_ARRAY * index + ADDRESS_WORD))

    def add_kernel(self, step):
        """The kernel's launch step (driver._FastLaunch.step: its parameter words are the step's third item)."""
        self.kernel_words = step[2]
        self.steps.append(step)

    def run(self):
        maps, seen = self.maps, self.seen
        if maps and (seen is None or seen[0].uploads != seen[1]):  # (no upload since: every map where it was)
            self.seen = self._read_maps()
        for fn, args, _, what in self.steps:
            err = fn(*args)
            if err:
                check_driver(err, what)

    def prepare(self):
        """Write the maps' addresses into the kernel's words now, for a replay outside Python
        (kernelgen/torch/native.cpp) that checks, before each run, that the ring uploaded nothing since: (the
        address of the ring's upload count, its value now), or (0, 0) for a program without maps."""
        if not self.maps:
            return 0, 0
        self.seen = self._read_maps()
        ring, count = self.seen
        return ring.uploads_at, count

    def _read_maps(self):
        """Write each map's address into the kernel's words, uploading the ones the ring no longer holds; again
        while an upload of this very pass may have reused the slot of a map read before it.  (ring, upload count)."""
        words, ring = self.kernel_words, self.maps[0][0]
        while True:
            before = ring.uploads
            for ring_of_map, key, encode, at in self.maps:
                words[at] = ring_of_map.address(key, encode)
            if ring.uploads == before:
                return ring, before


class ProgramCache:
    """(stream handle, itemsize, (address, elements) per parameter) -> LaunchProgram, at most `limit` of them (then it
    starts again: a sweep over many arrays, say).  Reads and writes are single dict operations (atomic); a launcher's
    fast route is used by one thread only (driver._FastLaunch.usable)."""

    def __init__(self, limit=64):
        self._programs: dict = {}
        self.limit = limit

    def get(self, key):
        return self._programs.get(key)

    def keep(self, key, program):
        if len(self._programs) >= self.limit:
            self._programs.clear()
        self._programs[key] = program

    def __len__(self):
        return len(self._programs)
