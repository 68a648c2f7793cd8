"""Launching a compiled kernel module: argument order, output zeroing, grid geometry, streams.

Everything here is fixed when the module is built, so a call does no IR work at all.  On a real GPU
the second and later calls skip numba's dispatcher (argument typing, array wrapping, per-argument
ctypes) and hand the prepared cuda.core kernel its flattened arguments directly.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import threading
from dataclasses import MISSING, dataclass, field, fields, replace

import numpy as np

from kernelgen import compile_profile, numba_speedups, settings
from kernelgen.arrays import cpu_kernel_arg, to_device_view
from kernelgen.runtime.driver import (_FastLaunch, _fast_launch_available, allow_deep_cfg_walks, allow_dynamic_shared,
                                      configure, fill_device, itemsize_of, needs_opt_in, pointer_size, stream_handle,
                                      zero_step)
from kernelgen.runtime.elementwise import (flip16_device, flip16_step, flip_host, round_tf32_device,
                                           round_tf32_flipped_device, round_tf32_flipped_host, round_tf32_flipped_step,
                                           round_tf32_host, round_tf32_pair_device, round_tf32_pair_step,
                                           round_tf32_step)
from kernelgen.runtime.capture import raw_handle, refuse_if_capturing
from kernelgen.runtime.capture import state_for as capture_state
from kernelgen.runtime.map_ring import ring_for
from kernelgen.runtime.narrow import narrow_device, narrow_host, narrow_step
from kernelgen.runtime.program import LaunchProgram, ProgramCache
from kernelgen.runtime.tensor_map import encode_im2col, encode_tiled
from kernelgen.storage import WIDE_SUFFIX

_NO_TENSOR_MAP = np.zeros(16, np.uint64)  # what CPU kernels get for a tensor map: they read the array itself
_MAP_TOKENS = itertools.count()  # Launcher._map_tokens' source


def _flip_of(spec) -> tuple:
    """A TENSOR_MAPS entry's TensorMap.flip (absent from modules older than the field)."""
    return tuple(spec[10]) if len(spec) > 10 else ()


def _device_pointer(a) -> int:
    cai = getattr(a, "__cuda_array_interface__", None)  # (the simulator's arrays may lack one: no alignment there)
    return (cai["data"][0] or 0) if cai else 0


def _fresh_state() -> dict:
    """A new value of each of Launcher's per-launcher fields (named with a leading underscore: configured kernels,
    tensor maps, copies, the prepacked launch, locks): what a copy of a launcher on another grid must not share."""
    return {f.name: f.default_factory() if f.default_factory is not MISSING else f.default
            for f in fields(Launcher) if f.name.startswith("_")}


@dataclass
class Launcher:
    """A ready-to-call kernel: `launcher(args)` with args a dict of flat (1D) arrays by name."""
    kernel: object
    params: tuple
    outputs: tuple
    grid: tuple
    threads: int
    zero_output: bool
    backend: str
    source_path: str = ""
    shared_bytes: int = 0  # dynamic shared memory per block (CUDA; the module's DYNAMIC_SHARED)
    # the same kernel without the assumption that every array starts 16-byte aligned (KERNEL assumes it when
    # the module defines this; render_cuda): run for arrays that do not
    kernel_any: object = None
    # TMA tensor maps the kernel takes as parameters, derived from the arrays they describe (ir.TensorMap fields
    # as tuples: name, source, mode, dims, strides, box, lower, upper, swizzle, rounding, flip, dtype, traversal;
    # older modules end at rounding, flip or dtype); encoded per device pointer
    tensor_maps: tuple = ()
    # outputs the kernel writes in float32 where the caller's array is float16 (split float16 backward-weight adds
    # atomically, and there are no 16-bit atomic adds): the launcher passes its own zeroed float32 workspace and
    # rounds it into the caller's array after the kernel.  params and outputs name the caller's arrays.
    widened: tuple = ()
    label: str = ""  # the kernel's name in kernelgen.profile_compile's report (its problem's key)
    # (grid axis, items per image, items a block) where fewer blocks along that axis compute fewer images (the
    # module's BATCH_GRID: templates.tiled_gemm.batch_grid); () where they do not.  on_images reads it.
    batch_grid: tuple = ()
    bfloat16: bool = False  # the kernel's 16-bit arrays hold bfloat16 bit patterns (the module's BFLOAT16)
    # configured kernels by stream: `kernel[grid, threads]` builds a new launch object each time
    _configured: dict = field(default_factory=dict, repr=False, compare=False)
    _rounded: dict = field(default_factory=dict, repr=False, compare=False)  # _copy_of's buffers
    # (stream, sizes of the rounded sources) -> their copies' addresses (the maps live in runtime/map_ring.py)
    _derived: dict = field(default_factory=dict, repr=False, compare=False)
    _fast: object = field(default=None, repr=False, compare=False)
    _general_path: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)
    _fewer: dict = field(default_factory=dict, repr=False, compare=False)  # on_images' answers by image count
    _programs: ProgramCache = field(default_factory=ProgramCache, repr=False, compare=False)  # launch_pointers'

    @classmethod
    def from_module(cls, module, backend, label=""):
        if backend == "cuda" and not settings.get("cuda_simulator"):
            numba_speedups.install()  # numba-cuda's quadratic lowering and SSA steps, linear (same LLVM IR)
        allow_deep_cfg_walks(backend)
        def caller(name):  # the kernel names a widened output's workspace: name + WIDE_SUFFIX
            return name[:-len(WIDE_SUFFIX)] if name.endswith(WIDE_SUFFIX) else name
        widened = tuple(caller(name) for name in module.OUTPUTS if name.endswith(WIDE_SUFFIX))
        return cls(module.KERNEL, tuple(map(caller, module.PARAMS)), tuple(map(caller, module.OUTPUTS)),
                   module.GRID, module.THREADS, module.ZERO_OUTPUT, backend, getattr(module, "__file__", ""),
                   getattr(module, "DYNAMIC_SHARED", 0), getattr(module, "KERNEL_ANY_ALIGNMENT", None),
                   getattr(module, "TENSOR_MAPS", ()), widened=widened, label=label,
                   batch_grid=tuple(getattr(module, "BATCH_GRID", ())), bfloat16=getattr(module, "BFLOAT16", False))

    def on_images(self, images: int):
        """(launcher, images read): this kernel on a batch of `images` images, fewer than it was built for - the same
        compiled kernel over fewer blocks along BATCH_GRID's axis - and the images its last block reads: `images`
        where they fill whole blocks, else up to the next block's end (the caller zero-extends its arrays to that).
        None where the kernel cannot (no BATCH_GRID) or it would take every block."""
        if not self.batch_grid:
            return None
        found = self._fewer.get(images)
        if found is None:
            axis, per_image, unit = self.batch_grid
            blocks = -(-images * per_image // unit)
            if blocks >= self.grid[axis]:
                return None
            grid = self.grid[:axis] + (blocks,) + self.grid[axis + 1:]
            fewer = replace(self, grid=grid, label=f"{self.label} (on {images} images)", **_fresh_state())
            found = self._fewer[images] = (fewer, -(-blocks * unit // per_image))  # (two threads: either is right)
        return found

    @property
    def caller_params(self) -> tuple:
        """The parameters the caller passes (PARAMS less the tensor maps the launcher derives, which come last)."""
        return self.params[:len(self.params) - len(self.tensor_maps)]

    @functools.cached_property
    def _copied_sources(self) -> dict:
        """The caller's arrays that some map reads through a copy the launcher makes (TensorMap.copied: rounded to
        TF32, flipped, or both), each with its TensorMap.flip (() for a copy in the source's own layout)."""
        return {spec[1]: _flip_of(spec) for spec in self.tensor_maps if spec[9] or _flip_of(spec)}

    @functools.cached_property
    def _rounds(self) -> bool:
        """Are the copies rounded to TF32 (float32 maps)?  Else they are 16-bit filters, flipped unchanged."""
        return any(spec[9] for spec in self.tensor_maps)

    @functools.cached_property
    def _rounding_pair(self) -> tuple:
        """(a, b): two rounded sources, b the flipped one if either is, which one launch rounds
        (elementwise.round_tf32_pair_device); () otherwise."""
        sources = self._copied_sources
        if not self._rounds or len(sources) != 2 or all(sources.values()):
            return ()
        return tuple(sorted(sources, key=lambda name: bool(sources[name])))

    @functools.cached_property
    def _map_tokens(self) -> tuple:
        """One int per tensor map, unique in the process: a map's key in its stream's ring is (token, address), two
        ints to hash on every launch where (spec, address) hashed the spec's nested tuples each time."""
        return tuple(next(_MAP_TOKENS) for _ in self.tensor_maps)

    @staticmethod
    def _encoded(spec, ptr):
        """The 16 words of the map `spec` describes over the array at device address `ptr` (runtime/tensor_map.py)."""
        name, source, mode, dims, strides, box, lower, upper, swizzle = spec[:9]
        dtype = spec[11] if len(spec) > 11 else "float32"
        if ptr % 16:
            raise ValueError(f"{source}: a TMA tensor map needs the array 16-byte aligned, got address {ptr:#x}")
        swz = swizzle or None
        traversal = tuple(spec[12]) if len(spec) > 12 else ()
        return (encode_tiled(ptr, dtype, dims, strides, box, swizzle=swz) if mode == "tiled" else
                encode_im2col(ptr, dtype, dims, strides, lower, upper, box[0], box[1], swizzle=swz,
                              traversal=traversal))

    def _tensor_map(self, index, ptr, stream):
        """The map tensor_maps[index] over the array at `ptr` as a device array (numba's dispatcher takes arrays),
        from the stream's ring (runtime/map_ring.py) as _derived_pointers' maps."""
        ring, spec = ring_for(stream_handle(stream)), self.tensor_maps[index]
        return ring.device[ring.slot((self._map_tokens[index], ptr), lambda: self._encoded(spec, ptr))]

    def _copy_of(self, source, size, stream):
        """The device buffer this launcher rounds or flips `source` into, one per (source, size, stream): its maps
        stay encoded, and the work on one stream runs in order, so the next call may overwrite it."""
        key = (source, size, stream)
        copy = self._rounded.get(key)
        if copy is None:
            from numba import cuda
            dtype = np.float32 if self._rounds else np.uint16 if self.bfloat16 else np.float16
            copy = self._rounded[key] = cuda.device_array(size, dtype, stream=stream or 0)
        return copy

    @property
    def _copy_itemsize(self) -> int:
        """Bytes per element of _copy_of's buffers: TF32-rounded float32, or flipped 16-bit operands."""
        return 4 if self._rounds else 2

    def _with_tensor_maps(self, args, stream):
        """args with each source a map reads through a copy (TensorMap.copied) replaced by that copy, and the maps
        added (CPU: the copy is a NumPy array, and the kernel reads it itself through a placeholder map)."""
        args = dict(args)
        sources = self._copied_sources
        if self.backend != "cuda":
            for source, flip in sources.items():
                if not self._rounds:
                    args[source] = flip_host(args[source], flip)
                else:
                    args[source] = round_tf32_flipped_host(args[source], flip) if flip else round_tf32_host(args[source])
        elif self._rounding_pair:  # as the fast route does: one launch
            a, b = self._rounding_pair
            copies = {name: self._copy_of(name, args[name].size, stream) for name in (a, b)}
            round_tf32_pair_device(args[a], copies[a], args[b], copies[b], sources[b], stream)
            args.update(copies)
        else:
            for source, flip in sources.items():
                copy = self._copy_of(source, args[source].size, stream)
                if not self._rounds:
                    flip16_device(args[source], copy, flip, stream)
                elif flip:
                    round_tf32_flipped_device(args[source], copy, flip, stream)
                else:
                    round_tf32_device(args[source], copy, stream)
                args[source] = copy
        for index, spec in enumerate(self.tensor_maps):
            args[spec[0]] = (self._tensor_map(index, _device_pointer(args[spec[1]]), stream) if self.backend == "cuda"
                             else _NO_TENSOR_MAP)
        return args

    def _derived_pointers(self, ptr_sizes, stream, capture=None, program=None):
        """launch_pointers' arguments for the caller's parameters, completed as _with_tensor_maps completes
        args: the copies made, the maps' addresses appended.  capture: the CaptureState of the capture under way
        on the stream (runtime/capture.py), whose own copies and map slots a captured launch takes.  program: the
        LaunchProgram being built, which takes the copies as steps and each eager map's ring and key (a run looks
        the map up again); without one the copies are made at once."""
        named = dict(zip(self.caller_params, ptr_sizes))
        sources = self._copied_sources
        handle = stream_handle(stream)
        steps = program if program is not None else LaunchProgram(kept=False)
        ring = None
        if capture is not None:  # (the capture's own buffers and map slots: nothing an eager call rewrites)
            copies = {source: capture.buffer((id(self), source, named[source][1]),
                                             named[source][1] * self._copy_itemsize) for source in sources}
            map_address = functools.partial(capture.map_address, handle=handle)
        else:
            key = (stream, tuple(named[source][1] for source in sources))
            copies = self._derived.get(key)
            if copies is None:
                copies = {source: self._copy_of(source, named[source][1], stream).device_ctypes_pointer.value
                          for source in sources}
                if len(self._derived) >= 16:
                    self._derived.clear()
                self._derived[key] = copies
            ring = ring_for(handle)  # (runtime/map_ring.py: uploaded where the ring lacks the map)
            map_address = ring.address
        # (a map of the caller's own array follows its address; a copy's stays put: both a lookup)
        maps, first = [], len(self.caller_params)
        for index, spec in enumerate(self.tensor_maps):
            ptr = copies.get(spec[1]) or named[spec[1]][0]
            map_key, encode = (self._map_tokens[index], ptr), functools.partial(self._encoded, spec, ptr)
            maps.append((map_address(map_key, encode), 16, 8))
            if ring is not None and program is not None:
                program.add_map(ring, map_key, encode, first + index)
        pair = self._rounding_pair
        if pair:  # both operands in one launch
            a, b = pair
            steps.add(round_tf32_pair_step(named[a][0], copies[a], named[a][1], named[b][0], copies[b], named[b][1],
                                           sources[b], handle))
        else:
            for source, flip in sources.items():
                ptr, n = named[source][:2]
                if not self._rounds:
                    steps.add(flip16_step(ptr, copies[source], flip, handle))
                elif flip:
                    steps.add(round_tf32_flipped_step(ptr, copies[source], flip, handle))
                else:
                    steps.add(round_tf32_step(ptr, copies[source], n, handle))
        if program is None:
            steps.run()
        for source in sources:
            named[source] = (copies[source], named[source][1])
        return [named[name] for name in self.caller_params] + maps

    def _workspace(self, name, size, stream):
        """The float32 buffer a widened output is computed in, one per (name, size, stream) as _copy_of's: the
        work on one stream runs in order, so the next call may reuse it (calls hold _general_path)."""
        key = (name + WIDE_SUFFIX, size, stream)
        buf = self._rounded.get(key)
        if buf is None:
            from numba import cuda
            buf = self._rounded[key] = cuda.device_array(size, np.float32, stream=stream or 0)
        return buf

    def _call_widened(self, args, stream):
        """The kernel on float32 workspaces for the widened outputs (zeroed as every split output is), each then
        rounded into the caller's array."""
        if self.backend != "cuda":  # (a fresh workspace per call: CPU calls may run in several threads)
            wide = {name: np.zeros(args[name].size, np.float32) for name in self.widened}
            self._call(dict(args, **wide), stream)
            for name in self.widened:
                narrow_host(wide[name], args[name], self.bfloat16)
            return
        with self._general_path:
            wide = {name: self._workspace(name, args[name].size, stream) for name in self.widened}
            self._call(dict(args, **wide), stream)
            for name in self.widened:
                narrow_device(wide[name], to_device_view(args[name], name).reshape(args[name].size), stream,
                              self.bfloat16)

    def __call__(self, args: dict, stream=None):
        if self.backend == "cuda" and self.fast and all(hasattr(type(args[n]), "__cuda_array_interface__")
                                                        for n in self.caller_params):
            ptr_sizes = [pointer_size(args[n], n) for n in self.caller_params]
            if self.aligned([p for p, _ in ptr_sizes]):
                return self.launch_pointers(ptr_sizes, itemsize_of(args[self.outputs[0]]), stream)
        if self.backend == "cuda" and (self.tensor_maps or self.widened):  # (its buffers are the stream's: see
            refuse_if_capturing(raw_handle(stream), "a launch through numba's dispatcher")  # runtime/capture.py)
        if self.widened:
            return self._call_widened(args, stream)
        return self._call(args, stream)

    def _call(self, args: dict, stream=None):
        """Through numba's dispatcher (CUDA), or the CPU kernel: args as the kernel takes them."""
        if self.backend == "cuda":
            # numba-cuda's first launch (compile, load) is unsafe in two threads at once; so are the map caches
            with self._general_path:
                args = self._with_tensor_maps(args, stream) if self.tensor_maps else args
                return self._launch_general(args, [args[name] for name in self.params], stream)
        if self.tensor_maps:
            args = self._with_tensor_maps(args, stream)
        if self.zero_output:
            for name in self.outputs:
                args[name][:] = 0
        ordered = [cpu_kernel_arg(args[name]) for name in self.params]
        with self._profiled_first_launch(ordered):
            self.kernel(*ordered)

    def _profiled_first_launch(self, ordered):
        """Under kernelgen.profile_compile, a first launch's numba compile on its own (stage numba), then a context
        for the launch that follows it (stage load: on a GPU, NVVM, ptxas and the module load); otherwise a
        context that does nothing."""
        kernel = self.kernel
        if not compile_profile.active() or getattr(kernel, "overloads", True):  # (compiled, or the simulator's)
            return contextlib.nullcontext()
        with compile_profile.stage("numba", self.label):
            kernel.compile(tuple(kernel.typeof_pyval(a) for a in ordered))
        return compile_profile.stage("load", self.label)

    def _launch_general(self, args, ordered, stream):
        """Through numba's dispatcher: the first call (which compiles), unaligned arrays, the simulator."""
        if self.zero_output:
            self._zero_outputs(args, stream)
        if self.kernel_any is not None and not self.aligned([_device_pointer(a) for a in ordered]):
            return self._launch_any_alignment(ordered, stream)
        launch = self._configured.get(stream)
        first = contextlib.nullcontext()
        if launch is None:
            first = self._profiled_first_launch(ordered)
            if needs_opt_in(self.shared_bytes):
                allow_dynamic_shared(self.kernel, ordered, self.shared_bytes)
            launch = configure(self.kernel, self.grid, self.threads, stream or 0, self.shared_bytes)
            self._configured[stream] = launch
        with first:
            launch(*ordered)
        if self._fast is None and _fast_launch_available():
            self._fast = _FastLaunch(self.kernel, self.grid, self.threads, len(self.params), self.shared_bytes)

    def _zero_outputs(self, args, stream):
        for name in self.outputs:
            flat = to_device_view(args[name], name)
            fill_device(flat.reshape(flat.size), 0, stream)

    def aligned(self, pointers) -> bool:
        """May KERNEL run on arrays at these device addresses (True unless it assumes 16-byte alignment and one
        of them is not)?"""
        return self.kernel_any is None or not any(p & 15 for p in pointers)

    def _launch_any_alignment(self, ordered, stream):
        if needs_opt_in(self.shared_bytes):
            allow_dynamic_shared(self.kernel_any, ordered, self.shared_bytes)
        configure(self.kernel_any, self.grid, self.threads, stream or 0, self.shared_bytes)(*ordered)

    def launch_pointers(self, ptr_sizes, itemsize, stream=None):
        """Fast path (real GPU, after the first call compiled the kernel): `ptr_sizes` is one
        (device pointer, element count) tuple per caller parameter, in PARAMS order, all C-contiguous.  A kernel
        with tensor maps, widened outputs or outputs to clear first is several driver calls: its launch program for
        these arrays and stream, kept for the next call on them (runtime/program.py; not under a capture)."""
        handle = stream_handle(stream)
        if not (self.tensor_maps or self.widened or self.zero_output):
            self._fast(ptr_sizes, itemsize, handle)
            return
        key = (handle, itemsize, *ptr_sizes)
        program = self._programs.get(key) if capture_state(handle) is None else None
        if program is None:
            program = self.program(ptr_sizes, itemsize, stream)
            if program.kept:
                self._programs.keep(key, program)
        program.run()

    def program(self, ptr_sizes, itemsize, stream=None) -> LaunchProgram:
        """launch_pointers' driver steps on these arrays: each widened output's float32 workspace cleared (one per
        name, size and stream, as _call_widened's: the work on one stream runs in order), or the outputs cleared for a
        split kernel that adds into them; the operands' copies made and the maps derived (_derived_pointers); the
        kernel; each workspace rounded into the caller's array.  Under a capture, with the capture's own workspaces
        and maps, and not kept."""
        handle = stream_handle(stream)
        capture = capture_state(handle)
        program = LaunchProgram(kept=capture is None)
        entries, rounded = [], []
        for name, entry in zip(self.caller_params, ptr_sizes):
            ptr, n = entry[0], entry[1]
            if name in self.widened:
                wide = capture.buffer((id(self), name + WIDE_SUFFIX, n), 4 * n) if capture is not None else \
                    self._workspace(name, n, stream).device_ctypes_pointer.value
                program.add(zero_step(wide, n, 4, handle))
                entries.append((wide, n, 4))
                rounded.append((wide, ptr, n))
            else:
                if self.zero_output and not self.widened and name in self.outputs:
                    program.add(zero_step(ptr, n, itemsize, handle))
                entries.append((ptr, n, itemsize))
        if self.tensor_maps:
            entries = self._derived_pointers(entries, stream, capture, program)
        program.add_kernel(self._fast.step(entries, itemsize, handle))
        for wide, ptr, n in rounded:
            program.add(narrow_step(wide, ptr, n, handle, self.bfloat16))
        return program

    @property
    def fast(self) -> bool:
        return self._fast is not None and self._fast.usable()
