"""bfloat16 tensors through kernelgen's ops: widened to float32, computed with precision="bf16", narrowed back.

The generated kernels store float32 or float16, not bfloat16.  A call whose tensors are all bfloat16 (torch
tensors, ml_dtypes NumPy arrays, DLPack arrays: kernelgen.dlpack's BFloat16Array) is rerun here on float32
copies with precision="bf16": the tensor cores round each operand to bfloat16, which leaves a bfloat16 input
exactly as it was, and accumulate in float32; the float32 result is rounded to bfloat16 once (to nearest, ties
to even), as PyTorch's bfloat16 convolution rounds its float32 accumulators.  So the results are those of a
kernel with bfloat16 storage; what is not free is the widening and narrowing copy (one pass over each tensor).

The result is in the inputs' currency: a torch bfloat16 tensor, an ml_dtypes NumPy array, or a BFloat16Array
(host: NumPy uint16 bit patterns; CUDA: a numba uint16 device array) for DLPack inputs.
"""
from __future__ import annotations

import contextlib
import inspect
import threading

import numpy as np

from kernelgen import arrays
from kernelgen.dlpack import BFloat16Array
from kernelgen.runtime.driver import as_numba_stream, configure, stream_handle

_TENSORS = ("x", "w", "bias", "dy")  # the array arguments of conv, conv_backward_data / _weight, deconv
_THREADS = 256


def call(op, args, kwargs):
    """op(*args, **kwargs) for all-bfloat16 tensors (arrays.BFloat16Storage sent it here)."""
    bound = inspect.signature(op).bind(*args, **kwargs)
    given = bound.arguments
    precision, stream, out = given.get("precision"), given.get("stream"), given.get("out")
    if precision not in (None, "bf16"):
        raise ValueError(f'precision must be "bf16" (or None) for bfloat16 tensors, got {precision!r}')
    template = given["x"] if "x" in given else given["dy"]
    if out is not None:
        out = arrays.as_array_arg(out, "out")
        if not arrays.is_bfloat16(out):
            raise TypeError(f"out must have dtype bfloat16 like the inputs, got {arrays.dtype_name(out)}")
    with _torch_stream(template, stream):
        nstream = None if arrays.is_torch(template) else as_numba_stream(stream)
        for name in _TENSORS:
            if given.get(name) is not None:
                given[name] = widen(arrays.as_array_arg(given[name], name), name, nstream)
        given["precision"], given["out"] = "bf16", None
        result = op(*bound.args, **bound.kwargs)
        return narrow(result, template, out, nstream)


def _torch_stream(template, stream):
    """torch's casts on the call's stream (a torch stream, or any stream= kernelgen takes), so that they are
    ordered with the kernel."""
    if stream is None or not arrays.is_torch(template) or not template.is_cuda:
        return contextlib.nullcontext()
    import torch  # (the caller passed torch tensors: torch is there)
    if not isinstance(stream, torch.cuda.Stream):
        nstream = as_numba_stream(stream)
        stream = torch.cuda.ExternalStream(stream_handle(nstream)) if nstream is not None else None
    return torch.cuda.stream(stream)


def widen(a, name, nstream=None):
    """A float32 copy of the bfloat16 tensor `a`, of the same kind (torch, NumPy, numba device array)."""
    if arrays.is_torch(a):
        return a.float()
    if isinstance(a, np.ndarray):
        return widen_bits(np.ascontiguousarray(a).view(np.uint16))
    if isinstance(a, BFloat16Array):
        return widen_device(a.bits, nstream) if a.on_device else widen_bits(np.ascontiguousarray(a.bits))
    raise TypeError(f"{name} must not be bfloat16 of type {type(a).__name__}: kernelgen takes bfloat16 torch "
                    f"tensors, ml_dtypes NumPy arrays and DLPack arrays")


def narrow(result, template, out=None, nstream=None):
    """The float32 `result` rounded to bfloat16, in template's currency (written into `out` when given)."""
    if arrays.is_torch(result):
        import torch  # (result is a torch tensor: torch is there)
        return result.to(torch.bfloat16) if out is None else out.copy_(result)
    if isinstance(result, np.ndarray):
        bits = narrow_bits(result)
        if out is not None:
            target = out.bits if isinstance(out, BFloat16Array) else out.view(np.uint16)
            np.copyto(target, bits)
            return out
        return bits.view(template.dtype) if isinstance(template, np.ndarray) else BFloat16Array(bits, False)
    bits = narrow_device(result, None if out is None else out.bits, nstream)
    return out if out is not None else BFloat16Array(bits, True)


def widen_bits(bits):
    """float32 values of bfloat16 bit patterns (uint16): the upper half of each float32, exactly."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def narrow_bits(values):
    """bfloat16 bit patterns (uint16) of float32 values, rounded to nearest, ties to even; NaN stays NaN."""
    words = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (words + 0x7FFF + ((words >> 16) & 1)) >> 16
    nan = (words & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, (words >> 16) | 0x40, rounded).astype(np.uint16)


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
