"""One kernelgen op on the CUDA backend: inputs in, pooled output out, on the caller's stream.

Two routes.  The fast one (real GPU, device inputs, kernel already compiled) reads each input's
address from its __cuda_array_interface__ and launches through `Launcher.launch_pointers`: no numba
typing, no wrapping.  The general one (first call, host inputs, the simulator) goes through numba's
dispatcher; host inputs are staged through the pinned pool, outputs come from the device pool.
"""
from __future__ import annotations

import math

import numpy as np

from kernelgen import arrays

from .arena import device_empty, to_device_staged
from .launch import as_numba_stream, fill_device


def run_cuda(prep, inputs: dict, template, stream=None, out=None):
    problem, launcher = prep.problem, prep.launcher
    nstream = as_numba_stream(stream)
    on_device = arrays.is_cuda_array(template)
    shape = problem.output_shape
    if out is not None:
        arrays.check_out(out, shape, problem.dtype, on_device)
    out_name = launcher.outputs[0]
    if on_device and launcher.fast and all(hasattr(a, "__cuda_array_interface__") for a in inputs.values()):
        return _fast(launcher, inputs, out_name, shape, problem.dtype, nstream, template, out)

    args = {}
    for name, a in inputs.items():
        d = arrays.to_device_view(a, name) if on_device else \
            to_device_staged(arrays.to_host(a, name, problem.dtype), nstream)
        args[name] = d.reshape(d.size)
    dev_out = arrays.to_device_view(out, "out") if (out is not None and on_device) else \
        device_empty(shape, problem.dtype, nstream)
    args[out_name] = dev_out.reshape(dev_out.size)
    launcher(args, nstream)
    if on_device:
        return out if out is not None else arrays.like_input(dev_out, template)
    host = dev_out.copy_to_host(stream=nstream or 0)
    if nstream is not None:
        nstream.synchronize()  # a NumPy result must be complete when it is returned
    if out is not None:
        np.copyto(out, host)
        return out
    return host


def _fast(launcher, inputs, out_name, shape, dtype, nstream, template, out):
    result = out if out is not None else device_empty(shape, dtype, nstream)
    n_out = math.prod(shape)
    ptr_sizes = []
    for name in launcher.params:
        if name == out_name:
            ptr_sizes.append((arrays.pointer(result, "out"), n_out))
        else:
            a = inputs[name]
            ptr_sizes.append((arrays.pointer(a, name), math.prod(a.shape)))

    def zero():
        flat = arrays.to_device_view(result, "out")
        fill_device(flat.reshape(flat.size), 0, nstream)
    launcher.launch_pointers(ptr_sizes, np.dtype(dtype).itemsize, nstream, zero)
    return out if out is not None else arrays.like_input(result, template)
