"""One kernelgen op on the CUDA backend: inputs in, pooled output out, on the caller's stream.

Two routes.  The fast one (real GPU, device inputs, kernel already compiled) reads each input's
address from its __cuda_array_interface__ and launches through `Launcher.launch_pointers`: no numba
typing, no wrapping.  The general one (first call, host inputs, the simulator) goes through numba's
dispatcher; host inputs are staged through the pinned pool, outputs come from the device pool.
"""
from __future__ import annotations

from threading import get_ident

import numpy as np

from kernelgen import arrays
from kernelgen.storage import numpy_dtype
from kernelgen.runtime.arena import device_empty, pooled_array, to_device_staged
from kernelgen.runtime.capture import has_private_pool, raw_handle, refuse_if_capturing
from kernelgen.runtime.driver import address_reader, as_numba_stream, pointer_size, stream_handle


def run_cuda(prep, inputs: dict, template, stream=None, out=None):
    problem, launcher = prep.problem, prep.launcher
    nstream = as_numba_stream(stream)
    if nstream is not None:  # (this route stages, allocates and may go through numba's dispatcher)
        refuse_if_capturing(raw_handle(nstream), "this call's route (host arrays, a first run, a pooled output)")
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
    # a bfloat16 torch result is made by torch (numba cannot hand torch a bfloat16 array)
    made = new_output(template, shape, problem.dtype, nstream) if out is None and on_device and \
        problem.dtype == "bfloat16" and arrays.is_torch(template) else None
    target = out if out is not None else made
    dev_out = arrays.to_device_view(target, "out") if (target is not None and on_device) else \
        device_empty(shape, numpy_dtype(problem.dtype), nstream)
    args[out_name] = dev_out.reshape(dev_out.size)
    launcher(args, nstream)
    if on_device:
        return target if target is not None else arrays.like_input(dev_out, template)
    host = dev_out.copy_to_host(stream=nstream or 0)
    if nstream is not None:
        nstream.synchronize()  # a NumPy result must be complete when it is returned
    if out is not None:
        np.copyto(arrays.bits_view(out) if problem.dtype == "bfloat16" else out, host)
        return out
    return arrays.like_input(host, template) if problem.dtype == "bfloat16" else host


def new_output(template, shape, dtype, nstream):
    """The output in the caller's currency: a torch tensor from torch's caching allocator for torch
    inputs, otherwise a numba array from kernelgen's pool (returned as CuPy by like_input)."""
    if type(template).__module__.startswith("torch"):
        import torch
        return torch.empty(shape, dtype=getattr(torch, dtype), device=template.device)  # float32, float16, bfloat16
    return device_empty(shape, numpy_dtype(dtype), nstream)


def _fast(launcher, inputs, out_name, shape, dtype, nstream, template, out):
    result = out if out is not None else new_output(template, shape, dtype, nstream)
    ptr_sizes = [pointer_size(result if name == out_name else inputs[name], name) for name in launcher.caller_params]
    if not launcher.aligned([p for p, _ in ptr_sizes]):  # the alignment-specialised kernel cannot take these
        args = {name: arrays.to_device_view(result if name == out_name else inputs[name], name)
                for name in launcher.caller_params}
        launcher({name: d.reshape(d.size) for name, d in args.items()}, nstream)
        return result if out is not None or type(result) is type(template) else arrays.like_input(result, template)

    launcher.launch_pointers(ptr_sizes, numpy_dtype(dtype).itemsize, nstream)
    if out is not None or type(result) is type(template):
        return result
    return arrays.like_input(result, template)


class CudaRoute:
    """A repeated call's CUDA route (kernelgen.api's dispatch cache holds one per signature): everything the
    signature fixes is worked out once - the output's shape, dtype and kind (a torch tensor from torch's
    allocator for torch inputs, else the device pool; a CuPy result wrapped), the parameters' order, the
    element size - so a call reads its arrays' addresses, allocates its output and launches.  The first call of
    a signature went through run_cuda, which compiled the kernel and checked `out`; the signature fixes out's
    kind, shape and dtype, and each address read checks contiguity.  Where the prepacked launch cannot be used
    (the simulator, a thread other than the one that compiled, host inputs) it is run_cuda."""
    __slots__ = ("prep", "launcher", "shape", "dtype", "itemsize", "out_name", "params", "on_device", "torch_empty",
                 "torch_like", "wrap", "readers", "layout", "fast", "sizes")

    def __init__(self, prep, template, inputs: dict):
        self.prep, self.launcher = prep, prep.launcher
        problem = prep.problem
        self.shape, self.dtype = tuple(problem.output_shape), numpy_dtype(problem.dtype)  # (bfloat16: its bits)
        self.itemsize = self.dtype.itemsize
        self.out_name = self.launcher.outputs[0]
        self.params = self.launcher.caller_params
        # as run_cuda's own fast route asks: device arrays whose type has the interface (not the simulator's)
        self.on_device = arrays.is_cuda_array(template) and all(hasattr(type(a), "__cuda_array_interface__")
                                                                 for a in inputs.values())
        self.torch_empty = None
        if arrays.is_torch(template):
            self.torch_empty, self.torch_like = _torch_output_maker(template, self.shape, problem.dtype)
        # a numba result returned as CuPy, or as a BFloat16Array of its bits
        self.wrap = type(template).__module__.split(".")[0] == "cupy" or problem.dtype == "bfloat16" and \
            not arrays.is_torch(template)
        # (address reader per parameter, in order), the arrays' (elements, itemsize) and the launcher's prepacked
        # launch: learnt on the route's first call, where pointer_size checks each array; the signature fixes the
        # first two for every later call, and the launch is used by the thread that made it (_FastLaunch.usable)
        self.readers = self.layout = self.fast = None
        self.sizes = None  # the arrays' element counts, for a launcher that runs a launch program (else None)

    def __call__(self, inputs: dict, template, stream=None, out=None):
        fast = self.fast
        if fast is None or fast.thread != get_ident():
            return self._checked(inputs, template, stream, out)
        nstream = None if stream is None else as_numba_stream(stream)
        result = self._output(out, nstream)
        inputs[self.out_name] = result  # (the binding's own dict, made for this call)
        addresses = [read(inputs[name]) for name, read in self.readers]
        if not self.launch(addresses, nstream):
            self._any_alignment([(name, inputs[name]) for name in self.params], nstream)
        return arrays.like_input(result, template) if self.wrap and out is None else result

    def launch(self, addresses, nstream) -> bool:
        """Launch on these device addresses (one per parameter, in the launcher's order; the route's first call
        checked arrays of these shapes and layouts) from the thread that made the route's launch (self.fast);
        False, launching nothing, where an address is off the 16-byte alignment the kernel assumes."""
        launcher = self.launcher
        if launcher.kernel_any is not None and not launcher.aligned(addresses):
            return False
        if self.sizes is None:  # one kernel launch
            self.fast.launch_addresses(addresses, self.layout, stream_handle(nstream))
        else:  # maps, workspaces, clears: the launcher's program for these addresses (runtime/program.py)
            launcher.launch_pointers(tuple(zip(addresses, self.sizes)), self.itemsize, nstream)
        return True

    def _any_alignment(self, named_arrays, nstream):
        """An array off 16-byte alignment: the kernel compiled without that assumption, through numba."""
        self.launcher({name: arrays.to_device_view(a, name).reshape(-1) for name, a in named_arrays}, nstream)

    def _output(self, out, nstream):
        if out is not None:
            return out
        if self.torch_empty is not None:
            return self.torch_empty(self.torch_like)
        # a pooled block goes back to the pool when dropped, while a graph still writes it - unless the pool is the
        # graph's own (runtime/capture.py)
        if nstream is not None and not has_private_pool(handle := raw_handle(nstream)):
            refuse_if_capturing(handle, "an output from kernelgen's pool")
        return pooled_array(self.shape, self.dtype, nstream)  # (on_device: not the simulator)

    def _checked(self, inputs: dict, template, stream, out):
        """The route's first call (and any call from another thread): each array checked by pointer_size; where
        the launch can go by address alone later, the readers are learnt."""
        launcher = self.launcher
        if not (self.on_device and launcher.fast):
            return run_cuda(self.prep, inputs, template, stream, out)
        nstream = None if stream is None else as_numba_stream(stream)
        result = self._output(out, nstream)
        arrays_in_order = [result if name == self.out_name else inputs[name] for name in self.params]
        ptr_sizes = [pointer_size(a, name) for a, name in zip(arrays_in_order, self.params)]
        if launcher.kernel_any is None or launcher.aligned([p for p, _ in ptr_sizes]):
            launcher.launch_pointers(ptr_sizes, self.itemsize, nstream)
            if self.fast is None:
                self.layout = tuple((n, self.itemsize) for _, n in ptr_sizes)
                if launcher.zero_output or launcher.tensor_maps or launcher.widened:
                    self.sizes = tuple(n for _, n in ptr_sizes)
                self.readers = tuple((name, address_reader(a)) for name, a in zip(self.params, arrays_in_order))
                self.fast = launcher._fast
        else:
            self._any_alignment(zip(self.params, arrays_in_order), nstream)
        return arrays.like_input(result, template) if self.wrap and out is None else result


def _torch_output_maker(template, shape, dtype):
    """(make, like): make(like) is a new C-contiguous torch tensor of `shape` and `dtype` on template's device, from
    torch's caching allocator.  torch.empty_like of a one-element tensor expanded to `shape` (overlapping, so torch
    lays the copy out C-contiguous) parses one argument where torch.empty(shape, dtype=, device=) parses three: on
    every call that returns a new tensor.  Checked once here; where torch lays it out otherwise, torch.empty."""
    import torch  # (torch is optional: only where the caller's tensors are torch's)
    torch_dtype = getattr(torch, dtype)
    like = torch.empty((), dtype=torch_dtype, device=template.device).expand(shape)
    probe = torch.empty_like(like)
    if probe.is_contiguous() and tuple(probe.shape) == tuple(shape) and probe.dtype == torch_dtype:
        return torch.empty_like, like
    device = template.device
    return (lambda _: torch.empty(shape, dtype=torch_dtype, device=device)), None


def bound_call(prep, inputs: dict, template, stream=None, out=None):
    """kernelgen.bind on the CUDA backend: run once (compiling, allocating the output unless `out`
    is given), then return a zero-argument callable that relaunches on the same buffers and returns
    that output.  On a real GPU the relaunch is the launcher's program for those buffers (runtime/program.py: a
    prepacked cuLaunchKernel, after a split-K output's clear); in the simulator (no raw launches) it is an ordinary
    call with out=."""
    result = run_cuda(prep, inputs, template, stream, out)
    launcher, nstream = prep.launcher, as_numba_stream(stream)
    out_name = launcher.outputs[0]
    ptr_sizes = [pointer_size(result if name == out_name else inputs[name], name) for name in launcher.caller_params] \
        if launcher.fast else None
    if not launcher.fast or launcher.tensor_maps or launcher.widened or \
            not launcher.aligned([p for p, _ in ptr_sizes]):
        def call():
            return run_cuda(prep, inputs, template, stream, result)
        return call
    program = launcher.program(ptr_sizes, numpy_dtype(prep.problem.dtype).itemsize, nstream)  # (split-K: cleared)

    def call():
        program.run()
        return result
    return call
