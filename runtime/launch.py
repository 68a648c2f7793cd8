"""Launching a compiled kernel module: argument order, output zeroing, grid geometry, streams.

Everything here is fixed when the module is built, so a call does no IR work at all.  On a real GPU
the second and later calls skip numba's dispatcher (argument typing, array wrapping, per-argument
ctypes) and hand the prepared cuda.core kernel its flattened arguments directly.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

_fill_kernel = None


def _fill_body(a, v):
    # module-level so the simulator can swap this module's `cuda` global for its fake one
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < a.size:
        a[i] = v


def fill_device(arr, value, stream=None):
    """Set every element of a 1D device array (split-K outputs start from zero)."""
    global _fill_kernel, cuda
    from numba import cuda
    if _fill_kernel is None:
        _fill_kernel = cuda.jit(_fill_body)
    n = arr.size
    launch = _fill_kernel[(n + 255) // 256, 256] if stream is None else _fill_kernel[(n + 255) // 256, 256, stream]
    launch(arr, arr.dtype.type(value))


def as_numba_stream(stream):
    """numba stream for `stream=`: None/0 (default stream), a numba stream, or any object exposing a
    raw CUstream handle (torch.cuda.Stream's `cuda_stream`, CuPy's `ptr`), wrapped without a copy."""
    if stream is None or stream == 0:
        return None
    from numba import cuda
    if type(stream).__module__.split(".")[0] in ("numba", "numba_cuda"):
        return stream  # a numba stream (real or simulated)
    for attr in ("cuda_stream", "ptr"):
        handle = getattr(stream, attr, None)
        if isinstance(handle, int):
            return cuda.external_stream(handle)
    raise TypeError(f"stream must be None, a numba CUDA stream, or an object with a cuda_stream/ptr handle, "
                    f"got {type(stream).__name__}")


def _fast_launch_available():
    return os.environ.get("NUMBA_ENABLE_CUDASIM") != "1" and os.environ.get("KERNELGEN_FAST_LAUNCH", "1") == "1"


class _FastLaunch:
    """cuda.core launch of the one compiled overload: what numba's _Kernel.launch does, minus the
    per-call typing and wrapping (a 1D C-contiguous array argument flattens to meminfo, parent,
    size, itemsize, data, shape, stride)."""

    def __init__(self, dispatcher, grid, threads):
        from cuda.core import LaunchConfig, launch
        kernel = next(iter(dispatcher.overloads.values()))
        self.kernel = kernel._codelibrary.get_cufunc().kernel
        grid = grid if isinstance(grid, tuple) else (grid,)
        self.config = LaunchConfig(grid=grid, block=threads, shmem_size=0)
        self.launch = launch
        self._streams = {}

    def core_stream(self, stream):
        s = self._streams.get(stream)
        if s is None:
            from numba.cuda.cudadrv import driver
            s = self._streams[stream] = driver._to_core_stream(stream or 0)
        return s

    def __call__(self, ptr_sizes, itemsize, stream):
        args = []
        for ptr, n in ptr_sizes:
            args += (0, 0, n, itemsize, ptr, n, itemsize)
        self.launch(self.core_stream(stream), self.config, self.kernel, *args)


@dataclass
class Launcher:
    """A ready-to-call kernel: `launcher(args)` with args a dict of flat (1D) arrays by name."""
    kernel: object
    params: tuple
    outputs: tuple
    grid: tuple
    threads: int
    zero_output: bool
    backend: str
    source_path: str = ""
    # configured kernels by stream: `kernel[grid, threads]` builds a new launch object each time
    _configured: dict = field(default_factory=dict, repr=False, compare=False)
    _fast: object = field(default=None, repr=False, compare=False)

    @classmethod
    def from_module(cls, module, backend):
        return cls(module.KERNEL, module.PARAMS, module.OUTPUTS, module.GRID, module.THREADS,
                   module.ZERO_OUTPUT, backend, getattr(module, "__file__", ""))

    def __call__(self, args: dict, stream=None):
        ordered = [args[name] for name in self.params]
        if self.backend == "cuda":
            if self.zero_output:
                for name in self.outputs:
                    fill_device(args[name], 0, stream)
            launch = self._configured.get(stream)
            if launch is None:
                launch = self.kernel[self.grid, self.threads] if stream is None else \
                    self.kernel[self.grid, self.threads, stream]
                self._configured[stream] = launch
            launch(*ordered)
            if self._fast is None and _fast_launch_available():
                self._fast = _FastLaunch(self.kernel, self.grid, self.threads)
        else:
            if self.zero_output:
                for name in self.outputs:
                    args[name][:] = 0
            self.kernel(*ordered)

    def launch_pointers(self, ptr_sizes, itemsize, stream=None, zero=None):
        """Fast path (real GPU, after the first call compiled the kernel): `ptr_sizes` is one
        (device pointer, element count) per parameter, in PARAMS order, all C-contiguous.  `zero`
        is a callable that clears the outputs when the kernel accumulates into them."""
        if self.zero_output:
            zero()
        self._fast(ptr_sizes, itemsize, stream)

    @property
    def fast(self) -> bool:
        return self._fast is not None
