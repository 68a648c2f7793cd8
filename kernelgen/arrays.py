"""Array interop: NumPy on the host, anything with __cuda_array_interface__ on the device, and anything that
speaks DLPack (JAX, TensorFlow, ...: kernelgen.dlpack) on either.

Device inputs are viewed, never copied (numba's as_cuda_array wraps the interface); outputs come
back as the caller's array type where we can build one without a copy (torch, CuPy), else as a
numba device array.  bfloat16 arrays (torch, ml_dtypes, DLPack's BFloat16Array) reach the kernels as views of their
uint16 bit patterns (bits_view, device_bits_view) and their results return as bfloat16 (like_input).
"""
from __future__ import annotations

import numpy as np

from kernelgen import dlpack

_DTYPES = {"float32": np.float32, "float64": np.float64, "float16": np.float16, "bfloat16": np.uint16}


def is_torch(a) -> bool:
    return type(a).__module__.startswith("torch")


def is_cuda_array(a) -> bool:
    # asked of the type: on an instance, hasattr would evaluate the (costly) interface property.
    # numba device arrays say __cuda_ndarray__; the simulator's have no __cuda_array_interface__.
    # torch.Tensor has the interface as a class property whatever the device: ask a tensor where it is.
    if hasattr(type(a), "__cuda_array_interface__"):
        return a.is_cuda if is_torch(a) else True
    if bool(getattr(a, "__cuda_ndarray__", False)) or "__cuda_array_interface__" in getattr(a, "__dict__", ()):
        return True
    return type(a) is dlpack.BFloat16Array and a.on_device


def as_array_arg(a, name):
    """An array argument as kernelgen keeps it: NumPy arrays, torch tensors and __cuda_array_interface__ arrays as
    they are; another DLPack array as a view of its memory (kernelgen.dlpack: NumPy on the host, a DeviceView on
    CUDA, a BFloat16Array for bfloat16); anything else (nested lists, scalars) as a NumPy array, so that a
    call's memo key is its shape and dtype, never an object's id()."""
    if is_torch(a):  # detached: torch gives no __cuda_array_interface__ of a tensor that requires grad
        return a.detach() if a.requires_grad else a
    if a is None or type(a) is np.ndarray:
        return a
    if is_cuda_array(a) and not is_bfloat16(a):  # (the CUDA array interface has no bfloat16: DLPack reads those)
        return a
    if dlpack.speaks_dlpack(a):
        return dlpack.view(a, name)
    if hasattr(a, "shape"):
        return a
    try:
        return np.asarray(a)
    except (TypeError, ValueError) as e:  # a ragged nested list, say
        raise ValueError(f"{name} must be an array or a nested list of one shape, got {type(a).__name__}: {e}") from None


def viewed_through_dlpack(a) -> bool:
    """as_array_arg reads a through its DLPack capsule (a JAX CPU array, say): every call needs a view of its own,
    so a dispatch cache must not keep a route that would take `a` as it is."""
    return not (is_cuda_array(a) and not is_bfloat16(a)) and dlpack.speaks_dlpack(a)


def host_view(a):
    """A NumPy view of a host array or a torch CPU tensor (no copy)."""
    if is_torch(a):
        return a.detach().numpy()
    return np.asarray(a)


def is_bfloat16(a) -> bool:
    """a stores bfloat16: a torch tensor, an ml_dtypes NumPy array, a DLPack BFloat16Array."""
    return str(getattr(a, "dtype", "")).endswith("bfloat16")


def dtype_name(a) -> str:
    if str(getattr(a, "dtype", "")).endswith("bfloat16"):  # first: torch raises on a bf16 __cuda_array_interface__
        return "bfloat16"
    if is_cuda_array(a) and hasattr(a, "__cuda_array_interface__"):
        return np.dtype(a.__cuda_array_interface__["typestr"]).name
    if not hasattr(a, "dtype"):
        return np.asarray(a).dtype.name
    try:
        return np.dtype(a.dtype).name
    except TypeError:  # not a NumPy dtype (torch.int4, say): its own name
        return str(a.dtype).rpartition(".")[2]


def shape_of(a):
    if hasattr(a, "shape") and not isinstance(a, (list, tuple)):
        return tuple(a.shape)
    if is_cuda_array(a):
        return tuple(a.__cuda_array_interface__["shape"])
    return tuple(np.shape(a))


def check_arrays(named, backend):
    """Validate dtypes/placement of named arrays (before any kernel runs); return the dtype name."""
    _check_bfloat16(named)
    kinds = {n: is_cuda_array(a) for n, a in named.items() if a is not None}
    if len(set(kinds.values())) > 1:
        where = ", ".join(f"{n} on {'GPU' if c else 'host'}" for n, c in kinds.items())
        raise TypeError(f"arrays must all be NumPy arrays or all CUDA arrays, got {where}")
    dtypes = {n: dtype_name(a) for n, a in named.items() if a is not None}
    first = next(iter(dtypes))
    for n, dt in dtypes.items():
        if dt not in _DTYPES:
            raise TypeError(f"{n} must have dtype float32 (float16 / bfloat16 with precision=\"fp16\" / \"bf16\"; "
                            f"float64 on the CPU backend), got {dt}")
        if dt != dtypes[first]:
            raise TypeError(f"{n} must have the same dtype as {first} ({dtypes[first]}), got {dt}")
    dt = dtypes[first]
    if dt == "float64" and backend == "cuda":
        raise TypeError(f"{first} must be float32 on the cuda backend (float64 is CPU-only), got float64")
    if any(kinds.values()) and backend != "cuda":
        raise ValueError(f"backend must be 'cuda' (or None) for CUDA arrays, got {backend!r}")
    return dt


def _check_bfloat16(named):
    """Some tensors bfloat16, not all, or one whose bits kernelgen cannot view: TypeError (before dtype_name, which
    torch answers for bfloat16 alone)."""
    given = {n: a for n, a in named.items() if a is not None}
    bf16 = [n for n, a in given.items() if is_bfloat16(a)]
    for n in bf16:
        a = given[n]
        if not (is_torch(a) or type(a) in (np.ndarray, dlpack.BFloat16Array)):
            raise TypeError(f"{n} must not be bfloat16 of type {type(a).__name__}: kernelgen takes bfloat16 torch "
                            f"tensors, ml_dtypes NumPy arrays and DLPack arrays")
    if bf16 and len(bf16) < len(given):
        other = next(n for n in given if n not in bf16)
        raise TypeError(f"{bf16[0]} must not be bfloat16 unless every tensor of the call is ({other} is "
                        f"{dtype_name(given[other])})")


def bits_view(a):
    """The uint16 bit patterns of a host bfloat16 array (torch CPU tensor, ml_dtypes array, BFloat16Array): a view."""
    if type(a) is dlpack.BFloat16Array:
        return a.bits
    if is_torch(a):
        import torch  # (a is torch's)
        return a.detach().view(torch.int16).numpy().view(np.uint16)
    return np.asarray(a).view(np.uint16)


def device_bits_view(a):
    """A numba uint16 device array viewing the bit patterns of a CUDA bfloat16 array (torch, BFloat16Array)."""
    from numba import cuda
    if type(a) is dlpack.BFloat16Array:
        return cuda.as_cuda_array(a.bits) if not getattr(a.bits, "__cuda_ndarray__", False) else a.bits
    import torch  # (a CUDA bfloat16 array that is not a BFloat16Array is torch's)
    return cuda.as_cuda_array(a.detach().view(torch.int16)).view(np.uint16)


def to_device_view(a, name):
    """A numba device array viewing `a` (no copy); C-contiguous required."""
    from numba import cuda
    if is_bfloat16(a):
        d = device_bits_view(a)
    else:
        d = a if getattr(a, "__cuda_ndarray__", False) else cuda.as_cuda_array(a)
    if not d.is_c_contiguous():
        raise ValueError(f"{name} must be C-contiguous (channels-last, dense), got strides {d.strides}")
    return d


def to_host(a, name, dtype):
    """A C-contiguous host array of `dtype` viewing `a` where it can (copied only where it must be: other
    strides or dtype).  A read-only array is passed as a writable view of the same memory: the kernels
    never write their inputs, and numba types a read-only array differently, which would compile the
    same kernel a second time."""
    arr = np.ascontiguousarray(bits_view(a) if dtype == "bfloat16" else host_view(a), dtype=_DTYPES[dtype])
    if not arr.flags.writeable and arr.size:
        import ctypes
        raw = (ctypes.c_char * arr.nbytes).from_address(arr.ctypes.data)
        arr = np.frombuffer(raw, dtype=arr.dtype).reshape(arr.shape)
    return arr


def cpu_kernel_arg(a):
    """A host array as a generated CPU kernel takes it: float16 as its uint16 bit patterns (a view, no copy;
    numba's CPU target has no float16, the kernel decodes and encodes them: kernelgen.cpu_round)."""
    return a.view(np.uint16) if a.dtype == np.float16 else a


def like_input(out, template):
    """Return a result as the caller's array type (torch / CuPy) when that is free (no copy).  bfloat16: `out`
    holds the bit patterns (uint16), returned as the template's bfloat16 kind."""
    if is_bfloat16(template) and not is_bfloat16(out):
        return _as_bfloat16(out, template)
    mod = type(template).__module__.split(".")[0]
    if isinstance(out, np.ndarray):
        if mod == "torch":
            import torch
            return torch.from_numpy(out)
        return out
    if mod == "torch":
        import torch
        return torch.as_tensor(out, device="cuda")
    if mod == "cupy":
        import cupy
        return cupy.asarray(out)
    return out


def check_out(out, shape, dtype, on_device):
    """Validate a caller-provided output array (before any kernel runs) and return it.  Runs on every
    call that passes out=, so it reads attributes, not the __cuda_array_interface__ dict."""
    if on_device != is_cuda_array(out):
        raise TypeError(f"out must be a {'CUDA' if on_device else 'NumPy'} array like the inputs, "
                        f"got {type(out).__name__}")
    if shape_of(out) != tuple(shape):
        raise ValueError(f"out must have shape {tuple(shape)}, got {shape_of(out)}")
    got = str(getattr(out, "dtype", "")).rpartition(".")[2]  # numpy/numba 'float32', torch 'torch.float32'
    if got != dtype:
        raise TypeError(f"out must have dtype {dtype}, got {got or dtype_name(out)}")
    if on_device:
        return out  # contiguity is checked where its address is read
    view = bits_view(out) if dtype == "bfloat16" else host_view(out) if is_torch(out) else out
    if not (isinstance(view, np.ndarray) and view.flags.c_contiguous):
        raise ValueError("out must be a C-contiguous NumPy array")
    if not view.flags.writeable:
        raise ValueError("out must be writeable, got a read-only array")
    return view


def pointer(a, name):
    """Device address of a C-contiguous CUDA array (any __cuda_array_interface__ producer)."""
    cai = a.__cuda_array_interface__
    strides = cai.get("strides")
    if strides is not None:
        shape, itemsize = cai["shape"], np.dtype(cai["typestr"]).itemsize
        expect, acc = [], itemsize
        for n in reversed(shape):
            expect.append(acc)
            acc *= n
        if any(s != e for s, e, n in zip(strides, reversed(expect), shape) if n > 1):
            raise ValueError(f"{name} must be C-contiguous (channels-last, dense), got strides {strides}")
    return cai["data"][0]


def _as_bfloat16(bits, template):
    """bfloat16 bit patterns (a NumPy or numba uint16 array) as an array of the template's bfloat16 kind: no copy."""
    on_device = not isinstance(bits, np.ndarray)
    if is_torch(template):
        import torch  # (the template is torch's)
        t = torch.as_tensor(bits.view(np.int16), device="cuda") if on_device else torch.from_numpy(bits.view(np.int16))
        return t.view(torch.bfloat16)
    if type(template) is np.ndarray:  # ml_dtypes' bfloat16
        return bits.view(template.dtype)
    return dlpack.BFloat16Array(bits, on_device)
