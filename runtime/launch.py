"""Launching a compiled kernel module: argument order, output zeroing, grid geometry, streams.

Everything here is fixed when the module is built, so a call does no IR work at all.  On a real GPU
the second and later calls skip numba's dispatcher (argument typing, array wrapping, per-argument
ctypes) and hand the prepared cuda.core kernel its flattened arguments directly.
"""
from __future__ import annotations

import functools
import math
import sys
import warnings
from dataclasses import dataclass, field

import numpy as np

from kernelgen import settings
from kernelgen.arrays import cpu_kernel_arg

_fill_kernel = None


def _fill_body(a, v):
    # module-level so the simulator can swap this module's `cuda` global for its fake one
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < a.size:
        a[i] = v


def fill_device(arr, value, stream=None):
    """Set every element of a 1D device array (split-K outputs start from zero)."""
    global _fill_kernel, cuda
    from numba import cuda
    if _fill_kernel is None:
        _fill_kernel = cuda.jit(_fill_body)
    n = arr.size
    launch = configure(_fill_kernel, (n + 255) // 256, 256, stream or 0)
    launch(arr, arr.dtype.type(value))


def as_numba_stream(stream):
    """numba stream for `stream=`: None/0 (default stream), a numba stream, or any object exposing a
    raw CUstream handle (torch.cuda.Stream's `cuda_stream`, CuPy's `ptr`), wrapped without a copy."""
    if stream is None or stream == 0:
        return None
    from numba import cuda
    if type(stream).__module__.split(".")[0] in ("numba", "numba_cuda"):
        return stream  # a numba stream (real or simulated)
    for attr in ("cuda_stream", "ptr"):
        handle = getattr(stream, attr, None)
        if isinstance(handle, int):
            return cuda.external_stream(handle)
    raise TypeError(f"stream must be None, a numba CUDA stream, or an object with a cuda_stream/ptr handle, "
                    f"got {type(stream).__name__}")


def _fast_launch_available():
    return not settings.get("cuda_simulator") and settings.get("fast_launch")


def configure(dispatcher, grid, block, stream=0, shared=0):
    """`dispatcher[grid, block, stream, shared]` without numba's low-occupancy warning ("Grid size 9 will likely
    result in GPU under-utilization"): kernelgen sizes its own grids (a small problem has a small grid), so
    the warning would tell a user nothing they can act on.  Configure once and keep the result where it is
    hot: the warnings filter is swapped while numba builds the configuration."""
    from numba.core.errors import NumbaPerformanceWarning
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NumbaPerformanceWarning)
        return dispatcher[grid, block, stream, shared]


def _libcuda():
    import ctypes
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuLaunchKernel
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    fn.restype = ctypes.c_int
    for name, value in (("cuMemsetD32Async", ctypes.c_uint), ("cuMemsetD16Async", ctypes.c_ushort)):
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_uint64, value, ctypes.c_size_t, ctypes.c_void_p]
        fn.restype = ctypes.c_int
    return lib


def zero_pointer(ptr, n, itemsize, stream_handle=0):
    """Clear n elements of 4 or 2 bytes at a raw device address with the driver's memset (a split-K output
    before its kernel adds into it): no kernel of ours, no dispatcher."""
    if _FastLaunch._lib is None:
        _FastLaunch._lib = _libcuda()
    memset = _FastLaunch._lib.cuMemsetD32Async if itemsize == 4 else _FastLaunch._lib.cuMemsetD16Async
    err = memset(ptr, 0, n, stream_handle)
    if err:
        raise RuntimeError(f"cuMemsetD{8 * itemsize}Async failed with CUDA error {err}")


class _FastLaunch:
    """cuLaunchKernel through ctypes on the one compiled overload: what numba's _Kernel.launch does,
    minus argument typing, array wrapping and cuda.core's parameter packing.  A 1D C-contiguous
    array argument is seven 8-byte words: meminfo, parent, size, itemsize, data, shape, stride.
    Each thread packs into its own buffers; only the creating thread (whose CUDA context numba made
    current) uses this route."""

    _lib = None

    def __init__(self, dispatcher, grid, threads, n_params, shared_bytes=0, scalars=0):
        """n_params arrays, then `scalars` int64 scalar parameters (one word each)."""
        import ctypes
        import threading
        if _FastLaunch._lib is None:
            _FastLaunch._lib = _libcuda()
        kernel = next(iter(dispatcher.overloads.values()))
        self.handle = int(kernel._codelibrary.get_cufunc().handle)
        grid = tuple(grid) if isinstance(grid, tuple) else (grid,)
        self.grid = grid + (1,) * (3 - len(grid))
        self.threads = threads
        self.shared = shared_bytes
        n_words = 7 * n_params + scalars
        self.words = (ctypes.c_int64 * n_words)()
        base = ctypes.addressof(self.words)
        self.params = (ctypes.c_void_p * n_words)(*[base + 8 * i for i in range(n_words)])
        self.thread = threading.get_ident()
        self.launch = self._lib.cuLaunchKernel

    def usable(self):
        import threading
        return threading.get_ident() == self.thread

    def bound(self, ptr_sizes, itemsize, stream_handle):
        """A zero-argument launch with these arguments packed once into its own parameter block
        (kernelgen.bind): a call is the cuLaunchKernel and nothing else."""
        import ctypes
        words = (ctypes.c_int64 * len(self.words))()
        for i, (ptr, n) in enumerate(ptr_sizes):
            words[7 * i + 2: 7 * i + 7] = [n, itemsize, ptr, n, itemsize]
        base = ctypes.addressof(words)
        params = (ctypes.c_void_p * len(words))(*[base + 8 * i for i in range(len(words))])
        launch, handle, (gx, gy, gz), threads, shared = self.launch, self.handle, self.grid, self.threads, self.shared

        def call():
            err = launch(handle, gx, gy, gz, threads, 1, 1, shared, stream_handle, params, None)
            if err:
                raise RuntimeError(f"cuLaunchKernel failed with CUDA error {err}")
        call.keep_alive = (words, params)
        return call

    def __call__(self, ptr_sizes, itemsize, stream_handle, scalars=()):
        """ptr_sizes: (pointer, elements) per array parameter, or (pointer, elements, itemsize) where it differs;
        scalars: the int64 parameters after them."""
        words = self.words
        i = 0
        for entry in ptr_sizes:
            ptr, n = entry[0], entry[1]
            size = entry[2] if len(entry) > 2 else itemsize
            words[i + 2] = n
            words[i + 3] = size
            words[i + 4] = ptr
            words[i + 5] = n
            words[i + 6] = size
            i += 7
        for value in scalars:
            words[i] = value
            i += 1
        gx, gy, gz = self.grid
        err = self.launch(self.handle, gx, gy, gz, self.threads, 1, 1, self.shared, stream_handle, self.params, None)
        if err:
            raise RuntimeError(f"cuLaunchKernel failed with CUDA error {err}")


def pointer_size(a, name):
    """(device address, element count) of a C-contiguous device array, by the cheapest route its type offers
    (this runs on every call of the fast route)."""
    kind = type(a).__module__
    if kind.startswith("torch"):
        if not a.is_contiguous():
            raise ValueError(f"{name} must be C-contiguous (channels-last, dense), got strides {a.stride()}")
        return a.data_ptr(), a.numel()
    if kind.startswith("numba") and hasattr(a, "_dummy"):
        if not a._dummy.is_c_contig:
            raise ValueError(f"{name} must be C-contiguous (channels-last, dense), got strides {a.strides}")
        return a.device_ctypes_pointer.value or 0, a.size
    from kernelgen import arrays
    return arrays.pointer(a, name), math.prod(a.__cuda_array_interface__["shape"])


def itemsize_of(a) -> int:
    """Bytes per element of a device array, by the cheapest route its type offers (every fast-route call)."""
    dtype = getattr(a, "dtype", None)
    size = getattr(dtype, "itemsize", None)  # numba and CuPy: a NumPy dtype; torch's dtypes have itemsize too
    if isinstance(size, int):
        return size
    return np.dtype(a.__cuda_array_interface__["typestr"]).itemsize


def stream_handle(stream) -> int:
    """Raw CUstream of a numba stream (0: the default stream)."""
    return 0 if stream is None else int(stream.handle)


# numba-cuda orders a function's blocks by a recursive walk (CFGraph._find_topo_order), one Python frame per
# block of the longest chain; an unrolled kernel with many guarded stores (the 16-state, 12-wide
# Winograd epilogue in 4 state groups: > 1000 blocks under CPython 3.12's bytecode) exceeds the default
# limit of 1000.  Since 3.11 Python-to-Python calls take no C stack, so a much higher limit is safe there.
CFG_RECURSION_LIMIT = 20000 if sys.version_info >= (3, 11) else 8000


def allow_deep_cfg_walks():
    """Raise (never lower) the interpreter's recursion limit to CFG_RECURSION_LIMIT before numba compiles."""
    if sys.getrecursionlimit() < CFG_RECURSION_LIMIT:
        sys.setrecursionlimit(CFG_RECURSION_LIMIT)


STATIC_SHARED_LIMIT = 48 * 1024  # bytes of shared memory a block may use without opting in


def needs_opt_in(dynamic_bytes) -> bool:
    """Must a kernel with this much dynamic shared memory opt in?  render_cuda makes shared memory dynamic only
    when the block's total passes STATIC_SHARED_LIMIT, and the static rest (mbarriers) counts toward that total:
    exactly 48 KiB of tiles beside an mbarrier measured CUDA_ERROR_INVALID_VALUE without the opt-in."""
    return dynamic_bytes > 0


def allow_dynamic_shared(dispatcher, ordered, nbytes):
    """Compile the kernel for these arguments and let it launch with `nbytes` of dynamic shared memory:
    past STATIC_SHARED_LIMIT a CUDA function must opt in (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)."""
    from cuda.bindings import driver as binding
    from numba import cuda

    dispatcher.compile(tuple(dispatcher.typeof_pyval(a) for a in ordered))
    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    device = cuda.get_current_device().id
    for overload in dispatcher.overloads.values():
        cufunc = overload._codelibrary.get_cufunc()
        err, = binding.cuKernelSetAttribute(attr, nbytes, cufunc.handle, device)
        if err != binding.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cannot give {cufunc.name} {nbytes} bytes of dynamic shared memory: {err}")


_NO_TENSOR_MAP = np.zeros(16, np.uint64)  # what CPU kernels get for a tensor map: they read the array itself


def _flip_of(spec) -> tuple:
    """A TENSOR_MAPS entry's TensorMap.flip (absent from modules older than the field)."""
    return tuple(spec[10]) if len(spec) > 10 else ()


def _device_pointer(a) -> int:
    cai = getattr(a, "__cuda_array_interface__", None)  # (the simulator's arrays may lack one: no alignment there)
    return (cai["data"][0] or 0) if cai else 0


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
    # configured kernels by stream: `kernel[grid, threads]` builds a new launch object each time
    _configured: dict = field(default_factory=dict, repr=False, compare=False)
    _maps: dict = field(default_factory=dict, repr=False, compare=False)
    _rounded: dict = field(default_factory=dict, repr=False, compare=False)  # _copy_of's buffers
    # (stream, sizes of the rounded sources) -> (their copies' addresses, the maps' (address, 16, 8) words): the
    # maps read the launcher's own copies, so they stay the same from call to call
    _derived: dict = field(default_factory=dict, repr=False, compare=False)
    _fast: object = field(default=None, repr=False, compare=False)

    @classmethod
    def from_module(cls, module, backend):
        allow_deep_cfg_walks()
        return cls(module.KERNEL, module.PARAMS, module.OUTPUTS, module.GRID, module.THREADS,
                   module.ZERO_OUTPUT, backend, getattr(module, "__file__", ""), getattr(module, "DYNAMIC_SHARED", 0),
                   getattr(module, "KERNEL_ANY_ALIGNMENT", None), getattr(module, "TENSOR_MAPS", ()))

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
        """Are the copies rounded to TF32 (float32 maps)?  Else they are float16 filters, flipped unchanged."""
        return any(spec[9] for spec in self.tensor_maps)

    @functools.cached_property
    def _rounding_pair(self) -> tuple:
        """(a, b): two rounded sources, b the flipped one if either is, which one launch rounds
        (elementwise.round_tf32_pair_device); () otherwise."""
        sources = self._copied_sources
        if not self._rounds or len(sources) != 2 or all(sources.values()):
            return ()
        return tuple(sorted(sources, key=lambda name: bool(sources[name])))

    def _tensor_map(self, spec, ptr):
        """The map `spec` describes, over the array at device address `ptr`, as a device array (encoded once per
        address)."""
        name, source, mode, dims, strides, box, lower, upper, swizzle = spec[:9]
        dtype = np.dtype(spec[11] if len(spec) > 11 else "float32")
        found = self._maps.get((name, ptr))
        if found is None:
            from numba import cuda

            from .tensor_map import encode_im2col, encode_tiled
            if ptr % 16:
                raise ValueError(f"{source}: a TMA tensor map needs the array 16-byte aligned, got address {ptr:#x}")
            swz = swizzle or None
            traversal = tuple(spec[12]) if len(spec) > 12 else ()
            host = (encode_tiled(ptr, dtype, dims, strides, box, swizzle=swz) if mode == "tiled" else
                    encode_im2col(ptr, dtype, dims, strides, lower, upper, box[0], box[1], swizzle=swz,
                                  traversal=traversal))
            if len(self._maps) >= 64:  # arrays come and go: keep the recent ones
                self._maps.clear()
            found = self._maps[(name, ptr)] = cuda.to_device(host)
        return found

    def _copy_of(self, source, size, stream):
        """The device buffer this launcher rounds or flips `source` into, one per (source, size, stream): its maps
        stay encoded, and the work on one stream runs in order, so the next call may overwrite it."""
        key = (source, size, stream)
        copy = self._rounded.get(key)
        if copy is None:
            from numba import cuda
            dtype = np.float32 if self._rounds else np.float16
            copy = self._rounded[key] = cuda.device_array(size, dtype, stream=stream or 0)
        return copy

    def _with_tensor_maps(self, args, stream):
        """args with each source a map reads through a copy (TensorMap.copied) replaced by that copy, and the maps
        added (CPU: the copy is a NumPy array, and the kernel reads it itself through a placeholder map)."""
        from .elementwise import (flip16_device, flip_host, round_tf32_device, round_tf32_flipped_device,
                                  round_tf32_flipped_host, round_tf32_host, round_tf32_pair_device)
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
        for spec in self.tensor_maps:
            args[spec[0]] = (self._tensor_map(spec, _device_pointer(args[spec[1]])) if self.backend == "cuda"
                             else _NO_TENSOR_MAP)
        return args

    def _derived_pointers(self, ptr_sizes, stream):
        """launch_pointers' arguments for the caller's parameters, completed as _with_tensor_maps completes
        args: the copies made, the maps' addresses appended."""
        from .elementwise import (flip16_pointers, round_tf32_flipped_pointers, round_tf32_pair_pointers,
                                  round_tf32_pointers)
        named = dict(zip(self.caller_params, ptr_sizes))
        sources = self._copied_sources
        key = (stream, tuple(named[source][1] for source in sources))
        derived = self._derived.get(key)
        if derived is None:
            copies = {source: self._copy_of(source, named[source][1], stream).device_ctypes_pointer.value
                      for source in sources}
            maps = [(self._tensor_map(spec, copies.get(spec[1]) or named[spec[1]][0]).device_ctypes_pointer.value,
                     16, 8) for spec in self.tensor_maps]
            if len(self._derived) >= 16:
                self._derived.clear()
            derived = self._derived[key] = (copies, maps)
        copies, maps = derived
        if len(copies) < len(self.tensor_maps):  # a map of the caller's own array: its address may change
            maps = [(self._tensor_map(spec, copies.get(spec[1]) or named[spec[1]][0]).device_ctypes_pointer.value,
                     16, 8) for spec in self.tensor_maps]
        handle = stream_handle(stream)
        pair = self._rounding_pair
        if pair:  # both operands in one launch
            a, b = pair
            round_tf32_pair_pointers(named[a][0], copies[a], named[a][1], named[b][0], copies[b], named[b][1],
                                     sources[b], handle)
        else:
            for source, flip in sources.items():
                ptr, n = named[source][:2]
                if not self._rounds:
                    flip16_pointers(ptr, copies[source], flip, handle)
                elif flip:
                    round_tf32_flipped_pointers(ptr, copies[source], flip, handle)
                else:
                    round_tf32_pointers(ptr, copies[source], n, handle)
        for source in sources:
            named[source] = (copies[source], named[source][1])
        return [named[name] for name in self.caller_params] + maps

    def __call__(self, args: dict, stream=None):
        if self.backend == "cuda" and self.fast and all(hasattr(type(args[n]), "__cuda_array_interface__")
                                                        for n in self.caller_params):
            ptr_sizes = [pointer_size(args[n], n) for n in self.caller_params]
            if self.aligned([p for p, _ in ptr_sizes]):
                return self.launch_pointers(ptr_sizes, itemsize_of(args[self.outputs[0]]), stream)
        if self.tensor_maps:
            args = self._with_tensor_maps(args, stream)
        ordered = [args[name] for name in self.params]
        if self.backend == "cuda":
            if self.zero_output:
                self._zero_outputs(args, stream)
            if self.kernel_any is not None and not self.aligned([_device_pointer(a) for a in ordered]):
                return self._launch_any_alignment(ordered, stream)
            launch = self._configured.get(stream)
            if launch is None:
                if needs_opt_in(self.shared_bytes):
                    allow_dynamic_shared(self.kernel, ordered, self.shared_bytes)
                launch = configure(self.kernel, self.grid, self.threads, stream or 0, self.shared_bytes)
                self._configured[stream] = launch
            launch(*ordered)
            if self._fast is None and _fast_launch_available():
                self._fast = _FastLaunch(self.kernel, self.grid, self.threads, len(self.params), self.shared_bytes)
        else:
            if self.zero_output:
                for name in self.outputs:
                    args[name][:] = 0
            self.kernel(*map(cpu_kernel_arg, ordered))

    def zero_pointers(self, ptr_sizes, itemsize, stream=None):
        """Clear the outputs among `ptr_sizes` (one (pointer, elements) per caller parameter)."""
        for name, (ptr, n) in zip(self.caller_params, ptr_sizes):
            if name in self.outputs:
                zero_pointer(ptr, n, itemsize, stream_handle(stream))

    def _zero_outputs(self, args, stream):
        from kernelgen.arrays import to_device_view
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
        self.kernel_any[self.grid, self.threads, stream or 0, self.shared_bytes](*ordered)

    def launch_pointers(self, ptr_sizes, itemsize, stream=None):
        """Fast path (real GPU, after the first call compiled the kernel): `ptr_sizes` is one
        (device pointer, element count) per caller parameter, in PARAMS order, all C-contiguous; a kernel that
        accumulates into its outputs (split-K) gets them cleared first."""
        if self.zero_output:
            self.zero_pointers(ptr_sizes, itemsize, stream)
        if self.tensor_maps:
            ptr_sizes = self._derived_pointers(ptr_sizes, stream)
        self._fast(ptr_sizes, itemsize, stream_handle(stream))

    @property
    def fast(self) -> bool:
        return self._fast is not None and self._fast.usable()
