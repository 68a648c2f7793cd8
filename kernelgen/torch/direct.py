"""Direct launches: a repeated convolution of torch CUDA tensors launched by address, past kernelgen's dispatch.

A converted network calls each of its convolutions with the same shapes, layouts and dtypes step after step.
Through kernelgen's public op, each such call costs the channels-last views of its tensors (detach, permute, a
contiguity check: three torch calls a tensor), the dispatch signature (shape, dtype, strides and device of each view)
and the route - 110-160 µs of host time a call on the H100 machine, where a converted ResNet-18 step is host-bound
(BENCHMARKS.md, 2026-11-27, fourteenth session).  Here a call whose torch-side
key (the tensors' shapes, strides, dtypes and devices, the hyper-parameters, the precision and kernelgen's settings)
was seen before goes to the same CUDA route (runtime.cuda_call.CudaRoute) that kernelgen's dispatch would
give it: its output from torch's allocator, the tensors' addresses, the route's launch.

A key is kept only after kernelgen's own op ran the call with views and no copies (each tensor already
channels-last), so the route's checks hold for every later call with that key; anything else - another layout, a
recording (kernelgen.torch.precompile), a thread other than the one the route launches from, an unaligned address -
takes the op as before.
"""
from __future__ import annotations

from threading import get_ident

import torch

from kernelgen import api, settings
from kernelgen.runtime.driver import as_numba_stream

MAX_ROUTES = 1024  # keys kept; past it the table starts again

_ROUTES: dict = {}  # torch-side key -> DirectRoute


class DirectRoute:
    """One key's launch: `order` gives, per kernel parameter, the index of the call's tensor it reads (-1: the
    output, made here as channels-last (N, *spatial, C) of `shape` - as the route makes a torch output, from an
    expanded one-element `like` on the call's device - and seen as (N, C, *spatial))."""
    __slots__ = ("cuda", "order", "make", "like")

    def __init__(self, cuda, order, shape, dtype, device):
        self.cuda, self.order = cuda, order
        self.make, self.like = (cuda.torch_empty, cuda.torch_like) if cuda.torch_like is not None and \
            cuda.torch_like.device == device else (lambda _: torch.empty(shape, dtype=dtype, device=device), None)

    def __call__(self, tensors, stream):
        """The result, or None where this call cannot go directly (the caller runs the op)."""
        cuda = self.cuda
        fast = cuda.fast
        if fast is None or fast.thread != get_ident():
            return None
        out = self.make(self.like)
        addresses = [out.data_ptr() if i < 0 else tensors[i].data_ptr() for i in self.order]
        if not cuda.launch(addresses, as_numba_stream(stream)):
            return None
        return out.movedim(-1, 1)  # (fewer arguments to parse than permute's)


def key(op, tensors, hyper, precision):
    """What decides a call's route, read from torch's side: each tensor's shape, strides, dtype and device (None for
    an absent bias), the hyper-parameters (a tuple of hashable values), the precision and the settings in force."""
    return (op, hyper, precision, settings.dispatch_token(),
            *[None if t is None else (t.shape, t.stride(), t.dtype, t.device) for t in tensors])


def run(call_key, tensors, stream):
    """The direct launch of a call with this key, or None (no route kept for it, or it cannot go directly)."""
    if api.RECORDING.get() is not None:
        return None
    route = _ROUTES.get(call_key)
    return None if route is None else route(tensors, stream)


def keep(call_key, op, args, kwargs, tensors, names, views_only):
    """After op(*args, **kwargs) ran (args: the channels-last views of `tensors`, named `names` as the kernel's
    parameters are): keep its CUDA route for call_key, where every view was one without a copy."""
    if not views_only or api.RECORDING.get() is not None:
        return
    cuda = api.cuda_route_of(op, args, kwargs)
    if cuda is None:
        return
    index = {name: i for i, name in enumerate(names)}
    if any(name not in index and name != cuda.out_name for name in cuda.params):
        return
    order = tuple(index.get(name, -1) for name in cuda.params)
    if any(i >= 0 and tensors[i] is None for i in order):
        return
    dtype = torch.bfloat16 if str(cuda.dtype) == "uint16" else getattr(torch, str(cuda.dtype))
    if len(_ROUTES) >= MAX_ROUTES:
        _ROUTES.clear()
    _ROUTES[call_key] = DirectRoute(cuda, order, cuda.shape, dtype, tensors[0].device)


def clear():
    _ROUTES.clear()
