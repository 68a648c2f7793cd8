"""One kernelgen op on the CUDA backend: inputs in, pooled output out, on the caller's stream.

Two routes.  The fast one (real GPU, device inputs, kernel already compiled) reads each input's
address from its __cuda_array_interface__ and launches through `Launcher.launch_pointers`: no numba
typing, no wrapping.  The general one (first call, host inputs, the simulator) goes through numba's
dispatcher; host inputs are staged through the pinned pool, outputs come from the device pool.
"""
from __future__ import annotations

import numpy as np

from kernelgen import arrays
from kernelgen.runtime.arena import device_empty, to_device_staged
from kernelgen.runtime.driver import as_numba_stream, pointer_size, stream_handle


def run_cuda(prep, inputs: dict, template, stream=None, out=None):
    problem, launcher = prep.problem, prep.launcher
    nstream = as_numba_stream(stream)
    on_device = arrays.is_cuda_array(template)
    shape = problem.output_shape
    if out is not None:
        arrays.check_out(out, shape, problem.dtype, on_device)
    out_name = launcher.outputs[0]
    if on_device and launcher.fast and all(hasattr(type(a), "__cuda_array_interface__") for a in inputs.values()):
        return _fast(launcher, inputs, out_name, shape, problem.dtype, nstream, template, out)

    args = {}
    for name, a in inputs.items():
        d = arrays.to_device_view(a, name) if on_device else \
            to_device_staged(arrays.to_host(a, name, problem.dtype), nstream)
        args[name] = d.reshape(d.size)
    if out is not None and on_device:
        pointer_size(out, "out") if hasattr(type(out), "__cuda_array_interface__") else arrays.to_device_view(out, "out")
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


def _new_output(template, shape, dtype, nstream):
    """The output in the caller's currency: a torch tensor from torch's caching allocator for torch
    inputs, otherwise a numba array from kernelgen's pool (returned as CuPy by like_input)."""
    if type(template).__module__.startswith("torch"):
        import torch
        return torch.empty(shape, dtype=getattr(torch, dtype), device=template.device)  # float32 or float16
    return device_empty(shape, dtype, nstream)


def _fast(launcher, inputs, out_name, shape, dtype, nstream, template, out):
    result = out if out is not None else _new_output(template, shape, dtype, nstream)
    ptr_sizes = [pointer_size(result if name == out_name else inputs[name], name) for name in launcher.caller_params]
    if not launcher.aligned([p for p, _ in ptr_sizes]):  # the alignment-specialised kernel cannot take these
        args = {name: arrays.to_device_view(result if name == out_name else inputs[name], name)
                for name in launcher.caller_params}
        launcher({name: d.reshape(d.size) for name, d in args.items()}, nstream)
        return result if out is not None or type(result) is type(template) else arrays.like_input(result, template)

    launcher.launch_pointers(ptr_sizes, np.dtype(dtype).itemsize, nstream)
    if out is not None or type(result) is type(template):
        return result
    return arrays.like_input(result, template)


def bound_call(prep, inputs: dict, template, stream=None, out=None):
    """kernelgen.bind on the CUDA backend: run once (compiling, allocating the output unless `out`
    is given), then return a zero-argument callable that relaunches on the same buffers and returns
    that output.  On a real GPU the relaunch is a prepacked cuLaunchKernel; in the simulator (no raw
    launches) it is an ordinary call with out=."""
    result = run_cuda(prep, inputs, template, stream, out)
    launcher, nstream = prep.launcher, as_numba_stream(stream)
    out_name = launcher.outputs[0]
    ptr_sizes = [pointer_size(result if name == out_name else inputs[name], name) for name in launcher.caller_params] \
        if launcher.fast else None
    if not launcher.fast or launcher.tensor_maps or not launcher.aligned([p for p, _ in ptr_sizes]):
        def call():
            return run_cuda(prep, inputs, template, stream, result)
        return call
    itemsize = np.dtype(prep.problem.dtype).itemsize
    launch = launcher._fast.bound(ptr_sizes, itemsize, stream_handle(nstream))

    def call():
        if launcher.zero_output:
            launcher.zero_pointers(ptr_sizes, itemsize, nstream)
        launch()
        return result
    return call
