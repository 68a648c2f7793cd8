"""The dispatch cache: a repeated kernelgen call with the same signature is one dictionary lookup away from its
prepared route (kernelgen.api builds the routes; this module only says what a signature is, and keeps them).

A signature is everything that decides the plan and the route: the op, each argument's kind (its type, and for
an array its shape, dtype, strides and, for torch, its device), every other argument's value with its type (1,
1.0 and True are three signatures, so a value never seen is validated before it is used), and
settings.dispatch_token() (every setting that changes what a call does: a scope, set() or environment change
misses).  Array values never enter a key, so the cache holds no caller's memory.  An argument that cannot be
put in a key (an unhashable or unknown object) makes the call take the full route, as the first call of every
signature does: validation, planning, then the kernel.

Thread safety: the cache is a dict whose reads, writes and clear() are atomic; an entry is built only after a
call with its signature succeeded and is never changed after, so two threads that miss together both plan and
one entry wins, equal to the other.
"""
from __future__ import annotations

import numpy as np

from kernelgen import arrays, settings

MAX_ENTRIES = 4096  # signatures kept; past it the cache starts again (a sweep over many shapes, say)

# plain values that may enter a key as themselves (with their type); anything else is not a signature
_VALUE_TYPES = (int, float, bool, str, type(None), np.integer, np.floating)


class Unkeyable(Exception):
    """An argument this cache cannot key: the call takes the full route."""


def array_signature(a):
    """What the dispatch needs of an array: its type, shape, dtype and layout (and a torch tensor's device),
    read from attributes (a NumPy, numba, CuPy array's strides; a torch tensor's stride()) by a reader chosen
    once per type: this runs for every array of every call."""
    signer = _SIGNERS.get(type(a))
    if signer is None:
        signer = _SIGNERS[type(a)] = _signer_for(a)
    return signer(a)


def _signer_for(a):
    t = type(a)
    if t is np.ndarray:
        return _numpy_signature
    if t.__module__.startswith("torch"):
        return _torch_signature
    if t.__module__.startswith("numba") and hasattr(t, "__cuda_array_interface__") and hasattr(a, "_dummy"):
        return _numba_signature
    return _any_signature


def _numpy_signature(a):
    return np.ndarray, a.shape, a.dtype, a.strides


def _torch_signature(a):
    if a.requires_grad:  # (the full route reads it through a detached view: torch refuses its CUDA interface)
        raise Unkeyable("a torch tensor that requires grad")
    return type(a), a.shape, a.dtype, a.stride(), a.device


def _numba_signature(a):
    """A numba device array (shape and strides are tuples already); one whose dtype is read through DLPack
    (bfloat16) takes the full route, as any such array does."""
    t, dtype = type(a), a.dtype
    if dtype not in _NUMBA_DTYPES_SIGNED and _viewed_through_dlpack(a, t, dtype):
        raise Unkeyable(t.__name__)
    return t, a.shape, dtype, a.strides


# the dtypes of numba arrays that are read through their CUDA array interface (float32 and float16): asked once
_NUMBA_DTYPES_SIGNED = frozenset((np.dtype("float32"), np.dtype("float16")))


def _any_signature(a):
    t = type(a)
    dtype = getattr(a, "dtype", None)
    if _viewed_through_dlpack(a, t, dtype):  # (each call needs its own DLPack view: the full route)
        raise Unkeyable(t.__name__)
    return t, tuple(a.shape), dtype, getattr(a, "strides", None)


_SIGNERS: dict = {}  # array type -> its signature reader (a dict's reads and writes are atomic: thread-safe)


# (type, dtype) -> arrays.viewed_through_dlpack: asked once per kind of array (it reads the dtype's name and the
# type's interfaces, microseconds on every call otherwise); the same for every array of a type and dtype
_DLPACK_VIEWED: dict = {}


def _viewed_through_dlpack(a, t, dtype) -> bool:
    try:
        return _DLPACK_VIEWED[t, dtype]
    except KeyError:
        viewed = _DLPACK_VIEWED[t, dtype] = arrays.viewed_through_dlpack(a)
        return viewed
    except TypeError:  # an unhashable dtype: asked every time
        return arrays.viewed_through_dlpack(a)


def value_signature(v):
    """A non-array argument as it enters a key: ints and None as themselves, other plain values with their type
    (1 == 1.0 == True as dict keys), tuples and lists element by element; Unkeyable for anything else."""
    t = type(v)
    if t is int or v is None:
        return v
    if t is tuple or t is list:  # (ints, the common case - strides, paddings - enter as themselves, at once)
        return t, tuple(v) if all(type(e) is int for e in v) else tuple(map(value_signature, v))
    if isinstance(v, _VALUE_TYPES):
        return t, v
    raise Unkeyable(t.__name__)


def _positional(a):
    """A positional argument: an array (it has a shape) or a value (conv_backward_data's x_shape)."""
    signer = _SIGNERS.get(type(a))
    if signer is not None:
        return signer(a)
    return array_signature(a) if hasattr(a, "shape") else value_signature(a)


def _keyword(item):
    """A keyword argument: bias and out are arrays (or None), a stream enters by its type only (it is passed
    through to the launch and checked there on every call), the rest are values."""
    k, v = item
    if v is None:
        return k, None
    if k in _ARRAY_KEYWORDS:
        signer = _SIGNERS.get(type(v))
        if signer is not None:
            return k, signer(v)
        if not hasattr(v, "shape"):
            raise Unkeyable(k)
        return k, array_signature(v)
    if k == "stream":
        return k, type(v)
    return k, value_signature(v)


_ARRAY_KEYWORDS = frozenset(("bias", "out"))


def signature(name, args, kwargs):
    """The key of `name(*args, **kwargs)`, or None if an argument cannot be keyed.  (Whether the key hashes -
    an unhashable dtype, say - is found out by DispatchCache.get.)"""
    try:
        if kwargs:
            return name, settings.dispatch_token(), *map(_positional, args), *map(_keyword, kwargs.items())
        return name, settings.dispatch_token(), *map(_positional, args)
    except Unkeyable:
        return None


class DispatchCache:
    """signature -> route.  get() returns None on a miss (or for a None key)."""

    def __init__(self, max_entries=MAX_ENTRIES):
        self._routes: dict = {}
        self.max_entries = max_entries
        self.hits = 0  # (counted without a lock: statistics, never control flow)
        self.misses = 0

    def get(self, key):
        try:
            route = None if key is None else self._routes.get(key)
        except TypeError:  # an unhashable part (put() then keeps nothing either)
            route = None
        if route is None:
            self.misses += 1
        else:
            self.hits += 1
        return route

    def put(self, key, route):
        if key is None:
            return
        if len(self._routes) >= self.max_entries:
            self._routes.clear()
        try:
            self._routes[key] = route
        except TypeError:
            pass

    def clear(self):
        self._routes.clear()

    def __len__(self):
        return len(self._routes)

    def stats(self) -> dict:
        return {"entries": len(self._routes), "hits": self.hits, "misses": self.misses}
