"""Arrays and kernel launches for kernelgen.nn's device path (cuda_ops): arena-backed device arrays, cheap
reshaped views, and `kernel`, a numba.cuda kernel whose calls after the first skip numba's dispatcher.  All of it
goes to the stream `on_stream` sets (the default stream otherwise), and `graph_mode` marks a step that a CUDA graph
captures (graphs.py)."""
from __future__ import annotations

import contextlib
import contextvars
import ctypes
import math
import struct
import threading

import numpy as np
from numba import cuda

from kernelgen import settings
from kernelgen.arrays import is_cuda_array
from kernelgen.runtime import arena
from kernelgen.runtime.capture import raw_handle
from kernelgen.runtime.driver import _libcuda, configure, copy_device

SIM = settings.get("cuda_simulator")
# the simulator runs one Python thread per CUDA thread (~ms each): small blocks keep the sim tests short
BLOCK = 32 if SIM else 256
TC, TR = (4, 2) if SIM else (32, 8)
MAX_PARTIALS = 256


# the stream nn's kernels, copies and allocations go to (a numba stream; None: the legacy default stream).  A
# captured step (graphs.py) sets its own for the capture and its warm-up: its memory then comes from that stream's
# pool, which nothing else draws from.  A context variable: another thread's or task's calls keep theirs.
_STREAM = contextvars.ContextVar("kernelgen_nn_stream", default=None)
_HANDLE = contextvars.ContextVar("kernelgen_nn_stream_handle", default=0)  # its raw CUstream, for cuLaunchKernel


def current_stream():
    """The numba stream nn's device work goes to now (None: the default stream)."""
    return _STREAM.get()


@contextlib.contextmanager
def on_stream(stream):
    """nn's device work - kernels, copies, allocations, the convolutions - on `stream` (a numba stream; None: the
    default stream) for the block."""
    tokens = _STREAM.set(stream), _HANDLE.set(raw_handle(stream))
    try:
        yield stream
    finally:
        _STREAM.reset(tokens[0])
        _HANDLE.reset(tokens[1])


# graph mode: the step being run is captured into a CUDA graph, or is its warm-up (graphs.py), so nothing may be read
# back to the host for a decision - the kernels decide (GradScaler's step skipped on the device, amp.py)
_GRAPH_MODE = contextvars.ContextVar("kernelgen_nn_graph_mode", default=False)


def in_graph_mode() -> bool:
    return _GRAPH_MODE.get()


@contextlib.contextmanager
def graph_mode():
    token = _GRAPH_MODE.set(True)
    try:
        yield
    finally:
        _GRAPH_MODE.reset(token)


def new_stream():
    """A new numba stream (blocking: its work and the default stream's wait for each other, as a torch side stream)."""
    return cuda.stream()


def is_device(a) -> bool:
    return not isinstance(a, np.ndarray) and is_cuda_array(a)


# ---- arrays -------------------------------------------------------------------------------------------

def empty(shape, dtype=np.float32):
    return arena.device_empty(shape, dtype, _STREAM.get())


def to_device(host):
    """A pooled device copy of a host array: float32 data, int64 indices.  One dtype per kind keeps every
    kernel at one compiled overload, which the fast launch route relies on."""
    host = np.asarray(host)
    if host.dtype.kind in "iub":
        host = host.astype(np.int64)
    elif host.dtype != np.float32:
        raise TypeError(f"device arrays must be float32 (kernelgen's CUDA kernels are float32-only), got {host.dtype}")
    return arena.to_device_staged(np.ascontiguousarray(host), _STREAM.get())


def to_host(a):
    return a.copy_to_host()


def copy_into(dst, src):
    """dst[...] = src on the stream the kernels run on, by the driver (runtime.driver.copy_device)."""
    return copy_device(dst, src, _STREAM.get())


_VIEWS = {}  # (shape, dtype) -> attributes of a DeviceNDArray of that shape (cloned: the constructor is slow)


def view(a, shape):
    """`a` (C-contiguous) reshaped, sharing its memory."""
    shape = tuple(int(s) for s in shape)
    if math.prod(shape) != a.size:
        raise ValueError(f"shape must have {a.size} elements, got {shape}")
    if SIM or tuple(a.shape) == shape:
        return a if tuple(a.shape) == shape else a.reshape(shape)
    from numba.cuda.cudadrv import devicearray
    proto = _VIEWS.get((shape, a.dtype))
    if proto is None:
        v = a.reshape(shape)
        _VIEWS[(shape, a.dtype)] = {k: x for k, x in v.__dict__.items() if k not in ("gpu_data", "stream")}
        return v
    out = devicearray.DeviceNDArray.__new__(devicearray.DeviceNDArray)
    out.__dict__.update(proto)
    out.gpu_data, out.stream = a.gpu_data, a.stream
    return out


def _flat(a):
    return a if a.ndim == 1 else view(a, (a.size,))


# ---- launching ----------------------------------------------------------------------------------------

_LIB = None
_HALF = np.dtype(np.float16)
_ARRAY_TYPES = frozenset()  # the device-array classes launches have seen: a signature names their dtype


def _signature(args):
    """A launch's argument signature: each array's dtype (a float16 array needs its own overload), each other
    argument's type.  One list pass: it runs on every launch (0.8 us for seven arguments, where a tuple of types
    and a tuple of dtypes took 1.7)."""
    arrays = _ARRAY_TYPES
    return tuple([a.dtype if type(a) in arrays else type(a) for a in args])


def _see_array_types(args):
    """Add the classes of `args`' arrays to those signatures name by dtype (replaced, not mutated)."""
    global _ARRAY_TYPES
    new = {type(a) for a in args if not isinstance(a, (int, float))} - _ARRAY_TYPES
    if new:
        _ARRAY_TYPES = _ARRAY_TYPES | new


class _Kernel:
    """A numba kernel whose later calls skip the dispatcher.  Arguments are device arrays (passed flat,
    1D: numba's seven-word array struct, packed here) or Python ints / floats (int64 / float64).  The
    fast route is kept per argument signature (Python types and array dtypes: a float16 array needs its own
    compiled overload) and used only on the thread that compiled it."""

    def __init__(self, fn):
        # cached on disk (numba's __pycache__ beside this package): a new process skips the compiles
        self.jit = cuda.jit(fn) if SIM else cuda.jit(fn, cache=True)
        # float16 arrays: numba links its fp16 library into such a kernel, and cannot cache a kernel with linked
        # files ("Cannot pickle CUDACodeLibrary with linking files"): compiled in each process, not cached
        self.jit_half = cuda.jit(fn)
        self.fast = {}

    def __call__(self, grid, block, *args):
        fast = self.fast.get(_signature(args))
        if fast is not None and fast[0] == threading.get_ident():
            return self._launch(fast, grid, block, args, _HANDLE.get())
        # numpy scalars as Python's (a call passing them keeps the dispatcher: no route has their types)
        args = tuple(a.item() if isinstance(a, np.generic) else a for a in args)
        _see_array_types(args)
        key = _signature(args)
        flat = [a if isinstance(a, (int, float)) else _flat(a) for a in args]
        jit = self.jit_half if any(d is _HALF for d in key) else self.jit
        configure(jit, grid, block, _STREAM.get() or 0)(*flat)
        if not SIM and key not in self.fast and settings.get("fast_launch"):
            self._prepare(jit, key, args, flat)

    def _prepare(self, jit, key, args, flat):
        global _LIB
        if _LIB is None:
            _LIB = _libcuda()
        overload = jit.overloads.get(tuple(jit.typeof_pyval(a) for a in flat))
        if overload is None:  # (not the signature numba keyed it by: this signature keeps the dispatcher)
            return
        n_words = sum(1 if isinstance(a, (int, float)) else 7 for a in args)
        words = (ctypes.c_int64 * n_words)()
        base = ctypes.addressof(words)
        params = (ctypes.c_void_p * n_words)(*[base + 8 * i for i in range(n_words)])
        handle = int(overload._codelibrary.get_cufunc().handle)
        self.fast = {**self.fast, key: (threading.get_ident(), words, params, handle)}  # (replaced, not mutated)

    @staticmethod
    def _launch(fast, grid, block, args, stream_handle=0):
        words, params, handle = fast[1], fast[2], fast[3]
        i = 0
        for a in args:
            if isinstance(a, int):
                words[i] = a
                i += 1
            elif isinstance(a, float):
                words[i] = struct.unpack("q", struct.pack("d", a))[0]
                i += 1
            else:
                n, itemsize, memory = a.size, a.dtype.itemsize, a.gpu_data
                # (the address device_ctypes_pointer reads, without its ctypes object: 0.34 us against 0.70)
                address = 0 if memory is None else memory.device_pointer_value or 0
                words[i + 2], words[i + 3], words[i + 4] = n, itemsize, address
                words[i + 5], words[i + 6] = n, itemsize
                i += 7
        g = grid if isinstance(grid, tuple) else (grid,)
        b = block if isinstance(block, tuple) else (block,)
        g, b = g + (1,) * (3 - len(g)), b + (1,) * (3 - len(b))
        err = _LIB.cuLaunchKernel(handle, g[0], g[1], g[2], b[0], b[1], b[2], 0, stream_handle or None, params, None)
        if err:
            raise RuntimeError(f"cuLaunchKernel failed with CUDA error {err}")


def kernel(fn):
    return _Kernel(fn)


def _grid(n):
    """Blocks of BLOCK threads covering n elements; indices stay below 2**31 (the ops' 32-bit index math)."""
    if n >= 2 ** 31:
        raise ValueError(f"device tensors must have fewer than 2**31 elements, got {n}")
    return max(1, (n + BLOCK - 1) // BLOCK)


# The memory-bound element-wise passes take VEC elements a thread, all loaded before any is stored: one element a
# thread kept one 4-byte load in flight per thread, too few bytes for HBM3 (batch-norm apply ran at ~1.8 of ~3 TB/s
# on the H100), and a store between two loads keeps the compiler from issuing the second early (an output may be an
# input's own buffer).  Where a thread's elements lie (thread_elements), measured on the H100 in a ResNet-18 step
# (BENCHMARKS.md): float32 arrays BLOCK apart - every load of a warp one coalesced 128-byte run (batch-norm apply
# 0.80 -> 0.64 ms a step; 4 consecutive float32 elements a thread made each load touch 4 times the lines: 1.00 ms);
# float16 arrays 4 consecutive ones - 8 bytes a thread, where BLOCK apart a warp's 2-byte loads fetch 64 bytes each
# (0.57 ms consecutive, 0.63 apart).
VEC = 4  # (the kernels are unrolled by hand for 4)


def _vgrid(n):
    """Blocks of BLOCK threads covering n elements, VEC a thread."""
    return _grid((n + VEC - 1) // VEC)


def consecutive(a) -> int:
    """The thread_elements layout for arrays of a's dtype: 1 (consecutive) for 16-bit elements, 0 (BLOCK apart)."""
    return int(a.dtype.itemsize < 4)


@cuda.jit(device=True, inline=True)
def thread_elements(consecutive):
    """(first, step): the thread's VEC elements are first + j * step, j < VEC (a launch of _vgrid(n) blocks): VEC
    consecutive ones (step 1), or BLOCK apart, the block covering BLOCK * VEC consecutive elements."""
    if consecutive:
        return (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) * VEC, 1
    step = cuda.blockDim.x
    return cuda.blockIdx.x * step * VEC + cuda.threadIdx.x, step
