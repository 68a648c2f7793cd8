"""Driver-level launch primitives: configuring a numba kernel quietly, raw cuLaunchKernel calls on prepacked
arguments (_FastLaunch), device pointers and streams, zeroing and filling device memory, the shared-memory
opt-in.  Below both runtime.launch (whole kernel modules) and runtime.elementwise (its small kernels), so neither
imports the other's internals.
"""
from __future__ import annotations

import contextlib
import functools
import math
import sys
import threading
import warnings

import numpy as np

from kernelgen import arrays, numba_speedups, settings

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


def copy_device(dst, src, stream=None):
    """dst[...] = src, two C-contiguous device arrays of one size and dtype, on `stream` (a numba stream; None: the
    default one): the driver's copy at once.  numba's copy_to_device spends ~0.2 ms of Python per call on checks
    (measured on the H100 pair: DDP's copy of each gradient into its bucket was half of a step's host time)."""
    if dst.size != src.size or dst.dtype != src.dtype:
        raise ValueError(f"src must match dst's {dst.size} elements of {dst.dtype}, got {src.size} of {src.dtype}")
    if not src.size:
        return dst
    if settings.get("cuda_simulator"):
        dst.copy_to_device(src, stream=stream or 0)
    else:
        from numba.cuda.cudadrv import driver
        driver.device_to_device(dst, src, src.size * src.dtype.itemsize, stream or 0)
    return dst


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
            return _external_stream(handle, cuda)
    raise TypeError(f"stream must be None, a numba CUDA stream, or an object with a cuda_stream/ptr handle, "
                    f"got {type(stream).__name__}")


_EXTERNAL_STREAMS: dict = {}  # raw handle -> numba's stream object for it


def _external_stream(handle, cuda):
    """numba's stream object for a raw handle, one per handle: the launcher's buffers and launches are kept per
    stream, and numba's stream objects compare by identity, so a new object per call (torch's current stream is
    looked up on every call) missed every such cache - a new device buffer per call on a side stream."""
    found = _EXTERNAL_STREAMS.get(handle)
    if found is None:
        if len(_EXTERNAL_STREAMS) >= 1024:  # (handles of streams long gone: start again)
            _EXTERNAL_STREAMS.clear()
        found = _EXTERNAL_STREAMS[handle] = cuda.external_stream(handle)
    return found


def _fast_launch_available():
    return not settings.get("cuda_simulator") and settings.get("fast_launch")


def configure(dispatcher, grid, block, stream=0, shared=0):
    """`dispatcher[grid, block, stream, shared]` without numba's low-occupancy warning ("Grid size 9 will likely
    result in GPU under-utilization"): kernelgen sizes its own grids (a small problem has a small grid), so
    the warning would tell a user nothing they can act on.  Configure once and keep the result where it is
    hot: the warnings filter is swapped while numba builds the configuration."""
    with quiet_launches():
        return dispatcher[grid, block, stream, shared]


@contextlib.contextmanager
def quiet_launches():
    """numba's performance warnings off for the block: around launches whose grids kernelgen chose, or that numba
    makes for kernelgen (a device array's slice assignment)."""
    with warnings.catch_warnings():
        for category in _performance_warnings():
            warnings.simplefilter("ignore", category)
        yield


@functools.lru_cache(maxsize=None)
def _performance_warnings() -> tuple:
    """numba's NumbaPerformanceWarning, and numba-cuda's own class of that name (numba.cuda.core.errors, not a
    subclass of numba's: the one its dispatcher warns with)."""
    from numba.core.errors import NumbaPerformanceWarning
    found = [NumbaPerformanceWarning]
    try:
        from numba.cuda.core.errors import NumbaPerformanceWarning as cuda_warning
        found.append(cuda_warning)
    except ImportError:  # older numba: the one class
        pass
    return tuple(found)


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
    fn = lib.cuMemcpyDtoDAsync_v2  # (the symbol cuda.h's cuMemcpyDtoDAsync names)
    fn.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    # the tensor-map ring's (runtime/map_ring.py): uploads from page-locked memory, and their events
    for name, args in (("cuMemcpyHtoDAsync_v2", [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]),
                       ("cuEventCreate", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]),
                       ("cuEventRecord", [ctypes.c_void_p, ctypes.c_void_p]),
                       ("cuEventSynchronize", [ctypes.c_void_p]),
                       ("cuCtxGetCurrent", [ctypes.POINTER(ctypes.c_void_p)]),
                       # stream capture (runtime/capture.py): its status, the thread's capture mode, its memory
                       ("cuStreamGetCaptureInfo_v2", [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int),
                                                      ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p,
                                                      ctypes.c_void_p, ctypes.c_void_p]),
                       ("cuThreadExchangeStreamCaptureMode", [ctypes.POINTER(ctypes.c_int)]),
                       ("cuMemAlloc_v2", [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]),
                       ("cuMemHostAlloc", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]),
                       ("cuMemFree_v2", [ctypes.c_uint64]),
                       ("cuMemFreeHost", [ctypes.c_void_p]),
                       # CUDA graphs of whole steps (kernelgen.nn.graphs): capture, instantiate, replay
                       ("cuStreamBeginCapture_v2", [ctypes.c_void_p, ctypes.c_int]),
                       ("cuStreamEndCapture", [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]),
                       ("cuGraphInstantiateWithFlags", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                                                        ctypes.c_uint64]),
                       ("cuGraphLaunch", [ctypes.c_void_p, ctypes.c_void_p]),
                       ("cuGraphExecDestroy", [ctypes.c_void_p]),
                       ("cuGraphDestroy", [ctypes.c_void_p])):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def libcuda():
    """The CUDA driver library with the signatures of every call made here by address (loaded once)."""
    if _FastLaunch._lib is None:
        _FastLaunch._lib = _libcuda()
    return _FastLaunch._lib


def check_driver(err, what):
    """A RuntimeError naming the driver call `what` where its CUresult `err` is not CUDA_SUCCESS."""
    if err:
        raise RuntimeError(f"{what} failed with CUDA error {err}")


def copy_pointer(dst, src, nbytes, stream_handle=0):
    """Copy nbytes between raw device addresses with the driver's asynchronous copy, on the raw stream."""
    check_driver(libcuda().cuMemcpyDtoDAsync_v2(dst, src, nbytes, stream_handle), "cuMemcpyDtoDAsync")


def zero_pointer(ptr, n, itemsize, stream_handle=0):
    """Clear n elements of 4 or 2 bytes at a raw device address with the driver's memset (a split-K output
    before its kernel adds into it): no kernel of ours, no dispatcher."""
    run_step(zero_step(ptr, n, itemsize, stream_handle))


# --- driver steps: one driver call with its arguments packed once, run again and again (runtime/program.py) ------
# A step is (function, ctypes arguments, what keeps the arguments' memory alive, the call's name): running it is
# `function(*arguments)`, no argument converted.  A launch program is a list of them.

_RAW: dict = {}  # driver function name -> a function object of its own, no argtypes (the caller packs ctypes values)


def raw_driver(name):
    """libcuda's `name` as a function object of its own, returning the CUresult, converting nothing."""
    fn = _RAW.get(name)
    if fn is None:
        import ctypes
        fn = libcuda()[name]  # (indexing makes a new object: lib.name's argtypes are not touched)
        fn.restype = ctypes.c_int
        _RAW[name] = fn
    return fn


def zero_step(ptr, n, itemsize, stream_handle=0):
    """zero_pointer as a step."""
    import ctypes
    name = "cuMemsetD32Async" if itemsize == 4 else "cuMemsetD16Async"
    value = ctypes.c_uint(0) if itemsize == 4 else ctypes.c_ushort(0)
    return (raw_driver(name), (ctypes.c_uint64(ptr), value, ctypes.c_size_t(n), ctypes.c_void_p(stream_handle)),
            None, name)


def run_step(step):
    fn, args, _, what = step
    check_driver(fn(*args), what)


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
        # launch_addresses' own function object: no argtypes to convert through, its constant arguments made once
        self.raw_launch = self._lib["cuLaunchKernel"]
        self.raw_launch.restype = ctypes.c_int
        self.pack_constants()
        self.layout = None  # the (elements, itemsize) per array that the words hold (launch_addresses)

    def pack_constants(self):
        """launch_addresses' constant arguments as ctypes values, made once: the function, grid, block and shared
        bytes (fixed_args), and with the default stream and the parameter block after them (default_stream_args)."""
        import ctypes
        self.fixed_args = (ctypes.c_void_p(self.handle),) + tuple(ctypes.c_uint(v) for v in (
            *self.grid, self.threads, 1, 1, self.shared))
        self.default_stream_args = (*self.fixed_args, ctypes.c_void_p(0), self.params, None)

    def usable(self):
        return threading.get_ident() == self.thread

    def step(self, ptr_sizes, itemsize, stream_handle, scalars=()):
        """This launch as a driver step: the arguments (as __call__ takes them) packed once into a parameter block
        of the step's own, so that steps of one kernel on other arrays do not overwrite each other.  The words are
        the step's third item (a launch program rewrites a tensor map's address there)."""
        import ctypes
        words = (ctypes.c_int64 * len(self.words))()
        _pack(words, ptr_sizes, itemsize, scalars)
        base = ctypes.addressof(words)
        params = (ctypes.c_void_p * len(words))(*[base + 8 * k for k in range(len(words))])
        return self.raw_launch, (*self.fixed_args, ctypes.c_void_p(stream_handle), params, None), words, \
            "cuLaunchKernel"

    def launch_addresses(self, addresses, layout, stream_handle):
        """The launch of a repeated call (runtime.cuda_call.CudaRoute): one device address per array parameter;
        `layout`, one (elements, itemsize) per array, is a tuple the caller keeps, written into the parameter
        words only when it is not the one they hold already (the same object).  A kernel is specialised to its
        shapes, so that is only on a route's first call, or after another route of the same kernel launched."""
        words = self.words
        if self.layout is not layout:
            i = 0
            for n, size in layout:
                words[i + 2] = n
                words[i + 3] = size
                words[i + 5] = n
                words[i + 6] = size
                i += 7
            self.layout = layout
        i = 4
        for ptr in addresses:
            words[i] = ptr
            i += 7
        if stream_handle:
            import ctypes
            err = self.raw_launch(*self.fixed_args, ctypes.c_void_p(stream_handle), self.params, None)
        else:
            err = self.raw_launch(*self.default_stream_args)
        if err:
            raise RuntimeError(f"cuLaunchKernel failed with CUDA error {err}")

    def __call__(self, ptr_sizes, itemsize, stream_handle, scalars=()):
        """ptr_sizes: (pointer, elements) per array parameter, or (pointer, elements, itemsize) where it differs;
        scalars: the int64 parameters after them."""
        self.layout = None  # (rewritten here: launch_addresses writes its layout again)
        _pack(self.words, ptr_sizes, itemsize, scalars)
        gx, gy, gz = self.grid
        err = self.launch(self.handle, gx, gy, gz, self.threads, 1, 1, self.shared, stream_handle, self.params, None)
        if err:
            raise RuntimeError(f"cuLaunchKernel failed with CUDA error {err}")


def _pack(words, ptr_sizes, itemsize, scalars=()):
    """A kernel's parameter words: seven a 1D array (meminfo, parent, size, itemsize, data, shape, stride) from its
    (pointer, elements[, itemsize]), then the int64 scalars."""
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


def pointer_size(a, name):
    """(device address, element count) of a C-contiguous device array, by the cheapest route its type offers
    (this runs for every array of every fast-route call: the route is looked up by type, chosen once)."""
    reader = _POINTER_READERS.get(type(a))
    if reader is None:
        reader = _POINTER_READERS[type(a)] = _pointer_reader(a)
    return reader(a, name)


def _pointer_reader(a):
    kind = type(a).__module__
    if kind.startswith("torch"):
        return _torch_pointer
    if kind.startswith("numba") and hasattr(a, "_dummy"):
        return _numba_pointer
    return _interface_pointer


def _torch_pointer(a, name):
    if not a.is_contiguous():
        raise ValueError(f"{name} must be C-contiguous (channels-last, dense), got strides {a.stride()}")
    return a.data_ptr(), a.numel()


def _numba_pointer(a, name):
    """A numba DeviceNDArray: its memory pointer's address (numba's own property wraps it in a ctypes object
    first), or 0 for an empty array."""
    if not a._dummy.is_c_contig:
        raise ValueError(f"{name} must be C-contiguous (channels-last, dense), got strides {a.strides}")
    return _numba_address(a), a.size


def _interface_pointer(a, name):
    return arrays.pointer(a, name), math.prod(a.__cuda_array_interface__["shape"])


_POINTER_READERS: dict = {}  # array type -> its reader (a dict's reads and writes are atomic: thread-safe)


def address_reader(a):
    """address(a) -> the device address of an array of a's type, with no checks: for a route whose signature
    fixed its arrays' shapes and strides, checked (pointer_size) on the call that made it."""
    kind = type(a).__module__
    if kind.startswith("torch"):
        return type(a).data_ptr
    if kind.startswith("numba") and hasattr(a, "_dummy"):
        return _numba_address
    return lambda b: arrays.pointer(b, "array")


def _numba_address(a):
    mem = a.gpu_data
    if mem is None:  # (an empty array)
        return 0
    try:
        return int(mem.device_pointer)  # numba-cuda's CUdeviceptr (or a plain int)
    except TypeError:
        return mem.device_ctypes_pointer.value or 0  # an older numba's ctypes pointer


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


# numba-cuda 0.30.4 orders a function's blocks by a recursive walk (CFGraph._find_topo_order), one Python frame
# per block of the longest chain; an unrolled kernel with many guarded stores (the 16-state, 12-wide Winograd
# epilogue in 4 state groups: > 1000 blocks under CPython 3.12's bytecode) exceeds the default limit of 1000.
# kernelgen.numba_speedups replaces that walk with one on an explicit stack (the same order), and numba's own CPU
# pipeline has one since 0.61 (CFGraph._find_postorder); only where neither is in place is the limit raised.
# Since 3.11 Python-to-Python calls take no C stack, so a much higher limit is safe there.
CFG_RECURSION_LIMIT = 20000 if sys.version_info >= (3, 11) else 8000


def allow_deep_cfg_walks(backend="cuda"):
    """Before numba compiles a `backend` kernel: raise (never lower) the interpreter's recursion limit to
    CFG_RECURSION_LIMIT where numba would walk the kernel's blocks recursively (see above); else leave it."""
    if backend == "cuda":
        iterative = "_find_topo_order" in numba_speedups.installed_names()
    else:
        from numba.core.controlflow import CFGraph  # (numba is slow to import: only where a kernel is loaded)
        iterative = hasattr(CFGraph, "_find_postorder")
    if not iterative and sys.getrecursionlimit() < CFG_RECURSION_LIMIT:
        sys.setrecursionlimit(CFG_RECURSION_LIMIT)


def needs_opt_in(dynamic_bytes) -> bool:
    """Must a kernel with this much dynamic shared memory opt in?  render_cuda makes shared memory dynamic only
    when the block's total passes the target's static limit (Target.static_shared_per_block), and the static rest
    (mbarriers) counts toward that total: exactly 48 KiB of tiles beside an mbarrier measured
    CUDA_ERROR_INVALID_VALUE without the opt-in."""
    return dynamic_bytes > 0


def allow_dynamic_shared(dispatcher, ordered, nbytes):
    """Compile the kernel for these arguments and let it launch with `nbytes` of dynamic shared memory: past
    Target.static_shared_per_block a CUDA function must opt in (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)."""
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


