"""DLPack import: an array of any framework that speaks DLPack (`__dlpack__` / `__dlpack_device__`: JAX, CuPy,
torch, NumPy >= 1.22, TensorFlow) seen by kernelgen without a copy.

`view(a, name)` reads a's DLPack capsule and returns
- on the host, a NumPy array over the producer's memory (numpy.from_dlpack, which owns the capsule);
- on a CUDA device, a `DeviceView`: the pointer, shape, strides and dtype as a `__cuda_array_interface__`, which
  every CUDA path of kernelgen already reads (numba's as_cuda_array, the fast launch route's pointers);
- for bfloat16 (DLPack's kDLBfloat, which NumPy and the CUDA array interface lack), a `BFloat16Array` around a
  uint16 view of the same memory (the bit patterns: bfloat16 is float32's upper half).

The capsule is consumed (renamed "used_dltensor", as the protocol asks) and its DLManagedTensor deleter runs when
the last view of the memory goes: `_Owner` holds it and every view holds the owner, so the producer's buffer
outlives whatever kernelgen builds over it.  Nothing here imports a framework.
"""
from __future__ import annotations

import ctypes

import numpy as np

CPU, CUDA, CUDA_HOST, CUDA_MANAGED = 1, 2, 3, 13  # DLDeviceType
INT, UINT, FLOAT, BFLOAT, BOOL = 0, 1, 2, 4, 6  # DLDataTypeCode
READ_ONLY = 1  # DLManagedTensorVersioned.flags bit


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int32), ("dtype", _DataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _Managed(ctypes.Structure):  # DLManagedTensor (the unversioned capsule "dltensor")
    _fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _ManagedVersioned(ctypes.Structure):  # DLManagedTensorVersioned (DLPack 1.x, capsule "dltensor_versioned")
    _fields_ = [("version", _Version), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER),
                ("flags", ctypes.c_uint64), ("dl_tensor", _Tensor)]


_api = ctypes.pythonapi
_api.PyCapsule_IsValid.restype, _api.PyCapsule_IsValid.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_SetName.restype, _api.PyCapsule_SetName.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]
_USED = b"used_dltensor"  # (a module constant: the capsule keeps a pointer to its name)
_USED_VERSIONED = b"used_dltensor_versioned"

_TYPESTR = {(FLOAT, 16): "<f2", (FLOAT, 32): "<f4", (FLOAT, 64): "<f8", (BFLOAT, 16): "<u2", (BOOL, 8): "|b1",
            **{(INT, b): f"<i{b // 8}" for b in (8, 16, 32, 64)}, **{(UINT, b): f"<u{b // 8}" for b in (8, 16, 32, 64)}}


def speaks_dlpack(a) -> bool:
    """a's type exports DLPack (asked of the type: cheap, and evaluates nothing)."""
    t = type(a)
    return hasattr(t, "__dlpack__") and hasattr(t, "__dlpack_device__")


class _Owner:
    """The consumed capsule's DLManagedTensor: its deleter runs (once) when the last view over it goes."""

    def __init__(self, managed):
        self._managed = managed

    def __del__(self):
        managed, self._managed = self._managed, None
        if managed is not None and managed.deleter:
            managed.deleter(ctypes.addressof(managed))


class DeviceView:
    """A CUDA array received through DLPack, presented as `__cuda_array_interface__` (no copy).  Holds the capsule's
    owner, so the memory lives as long as this view and anything built over it (numba keeps it as the owner)."""
    __slots__ = ("shape", "dtype", "strides", "_cai", "_owner", "__weakref__")

    def __init__(self, ptr, shape, strides, typestr, owner):
        self.shape, self.dtype, self._owner = shape, np.dtype(typestr), owner
        self.strides = strides if strides is not None else c_strides(shape, self.dtype.itemsize)
        self._cai = {"shape": shape, "strides": strides, "typestr": typestr, "data": (ptr, False), "version": 3,
                     "stream": None}  # the producer's stream was ordered before ours by __dlpack__(stream=...)

    @property
    def __cuda_array_interface__(self):
        return self._cai

    @property
    def ptr(self) -> int:
        return self._cai["data"][0]


class BFloat16Array:
    """bfloat16 storage received through DLPack: `bits`, a uint16 view of the same memory (a NumPy array on the host,
    a DeviceView on a CUDA device).  dtype reads "bfloat16", which is how kernelgen.arrays recognises it."""
    __slots__ = ("bits", "shape", "on_device")
    dtype = "bfloat16"

    def __init__(self, bits, on_device):
        self.bits, self.shape, self.on_device = bits, tuple(bits.shape), on_device


def c_strides(shape, itemsize):
    strides, acc = [], itemsize
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def _capsule(a, name):
    """(capsule, versioned?): DLPack 1.x where the producer has it, else the unversioned protocol."""
    try:
        capsule = a.__dlpack__(max_version=(1, 0))
    except TypeError:  # a producer older than DLPack 1.0 takes no max_version
        capsule = a.__dlpack__()
    for versioned, cname in ((True, b"dltensor_versioned"), (False, b"dltensor")):
        if _api.PyCapsule_IsValid(capsule, cname):
            return capsule, versioned
    raise TypeError(f"{name}: {type(a).__name__}.__dlpack__() returned no DLPack capsule, got {capsule!r}")


def _consume(capsule, versioned):
    """The capsule's managed tensor, now ours (renamed, so the capsule's destructor leaves it to _Owner)."""
    cname, used = (b"dltensor_versioned", _USED_VERSIONED) if versioned else (b"dltensor", _USED)
    address = _api.PyCapsule_GetPointer(capsule, cname)
    managed = (_ManagedVersioned if versioned else _Managed).from_address(address)
    _api.PyCapsule_SetName(capsule, used)
    return managed


def view(a, name):
    """a (anything with __dlpack__ / __dlpack_device__) as a NumPy array, a DeviceView or a BFloat16Array over
    its own memory.  TypeError naming the argument for a device or dtype kernelgen cannot read."""
    device_type, _ = a.__dlpack_device__()
    if int(device_type) not in (CPU, CUDA, CUDA_HOST, CUDA_MANAGED):
        raise TypeError(f"{name} must be on the CPU or a CUDA device, got DLPack device type {int(device_type)}")
    if int(device_type) in (CPU, CUDA_HOST):
        try:
            return np.from_dlpack(a)  # NumPy owns the capsule from here
        except (BufferError, RuntimeError, TypeError):
            pass  # a dtype NumPy lacks (bfloat16): read the capsule ourselves
    managed = _consume(*_capsule(a, name))
    tensor, owner = managed.dl_tensor, _Owner(managed)
    dtype = (tensor.dtype.code, tensor.dtype.bits)
    if tensor.dtype.lanes != 1 or dtype not in _TYPESTR:
        raise TypeError(f"{name} has a DLPack dtype kernelgen cannot read (code {dtype[0]}, {dtype[1]} bits, "
                        f"{tensor.dtype.lanes} lanes)")
    typestr = _TYPESTR[dtype]
    itemsize = np.dtype(typestr).itemsize
    shape = tuple(tensor.shape[i] for i in range(tensor.ndim))
    strides = None if not tensor.strides else tuple(tensor.strides[i] * itemsize for i in range(tensor.ndim))
    ptr = (tensor.data or 0) + tensor.byte_offset
    read_only = bool(getattr(managed, "flags", 0) & READ_ONLY)
    on_device = int(tensor.device.device_type) in (CUDA, CUDA_MANAGED)
    result = DeviceView(ptr, shape, strides, typestr, owner) if on_device else \
        _host_array(ptr, shape, strides, typestr, owner, read_only)
    return BFloat16Array(result, on_device) if dtype == (BFLOAT, 16) else result


class _HostBuffer:
    """The host memory of a consumed capsule, as NumPy's array interface (the array keeps this object, and so
    the owner, as its base)."""

    def __init__(self, ptr, shape, strides, typestr, owner, read_only):
        self._owner = owner
        self.__array_interface__ = {"data": (ptr, read_only), "shape": shape, "strides": strides,
                                    "typestr": typestr, "version": 3}


def _host_array(ptr, shape, strides, typestr, owner, read_only):
    return np.asarray(_HostBuffer(ptr, shape, strides, typestr, owner, read_only))
