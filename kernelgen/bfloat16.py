"""bfloat16 <-> float32 conversions of whole arrays: on the host (NumPy uint16 bit patterns, kernelgen.storage) and
on a CUDA device (two small kernels).

kernelgen's ops take bfloat16 tensors themselves (torch, ml_dtypes NumPy arrays, DLPack arrays:
kernelgen.dlpack's BFloat16Array): the generated kernels read and write their bit patterns (kernelgen.storage,
ir.STORAGE_DTYPES), with no copy.  These conversions are for what lies around the kernels: tests, references and
the arrays a caller wants widened.
"""
from __future__ import annotations

import threading

import numpy as np

from kernelgen import arrays
from kernelgen.runtime.driver import configure
from kernelgen.storage import narrow_bits, widen_bits  # noqa: F401 (kernelgen.bfloat16's host conversions)

_THREADS = 256


_KERNELS: dict = {}
_KERNELS_LOCK = threading.Lock()


# the kernels' bodies are module-level functions reading a module-level `cuda`, so that numba's simulator can swap
# that global for its own module (it swaps globals, not closures); _kernels() binds it on first use


def _widen_body(bits, words):
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < bits.size:
        words[i] = np.uint32(bits[i]) << np.uint32(16)


def _narrow_body(words, bits):
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < words.size:
        u = np.int64(words[i])
        if (u & 0x7FFFFFFF) > 0x7F800000:  # NaN: keep it one (quiet bit set)
            bits[i] = np.uint16((u >> 16) | 0x40)
        else:  # to nearest, ties to even
            bits[i] = np.uint16((u + 0x7FFF + ((u >> 16) & 1)) >> 16)


def _kernels():
    """The two device conversions, compiled on first use (numba.cuda only where a CUDA bfloat16 array is in
    hand: its import is slow)."""
    global cuda
    with _KERNELS_LOCK:
        if not _KERNELS:
            from numba import cuda
            _KERNELS.update(widen=cuda.jit(_widen_body), narrow=cuda.jit(_narrow_body))
        return _KERNELS


def _launch(kernel, src, dst, nstream):
    if src.size:
        grid = (src.size + _THREADS - 1) // _THREADS
        configure(kernel, grid, _THREADS, nstream or 0)(src, dst)


def widen_device(bits, nstream=None):
    """A numba float32 device array of the bfloat16 bit patterns `bits` (any CUDA array of uint16)."""
    from numba import cuda
    src = arrays.to_device_view(bits, "x")
    words = cuda.device_array(src.shape, np.float32, stream=nstream or 0)
    _launch(_kernels()["widen"], src.reshape(src.size), words.reshape(words.size).view(np.uint32), nstream)
    return words


def narrow_device(values, out_bits=None, nstream=None):
    """bfloat16 bit patterns of a float32 CUDA array, in a new numba uint16 device array or `out_bits`."""
    from numba import cuda
    src = arrays.to_device_view(values, "result")
    dst = arrays.to_device_view(out_bits, "out") if out_bits is not None else \
        cuda.device_array(src.shape, np.uint16, stream=nstream or 0)
    _launch(_kernels()["narrow"], src.reshape(src.size).view(np.uint32), dst.reshape(dst.size), nstream)
    return out_bits if out_bits is not None else dst
