"""Launching a compiled kernel module: argument order, output zeroing, grid geometry.

Everything here is fixed when the module is built, so a call does no IR work at all.
"""
from __future__ import annotations

from dataclasses import dataclass, field

_fill_kernel = None


def _fill_body(a, v):
    # module-level so the simulator can swap this module's `cuda` global for its fake one
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < a.size:
        a[i] = v


def fill_device(arr, value):
    """Set every element of a 1D device array (split-K outputs start from zero)."""
    global _fill_kernel, cuda
    from numba import cuda
    if _fill_kernel is None:
        _fill_kernel = cuda.jit(_fill_body)
    n = arr.size
    _fill_kernel[(n + 255) // 256, 256](arr, arr.dtype.type(value))


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

    @classmethod
    def from_module(cls, module, backend):
        return cls(module.KERNEL, module.PARAMS, module.OUTPUTS, module.GRID, module.THREADS,
                   module.ZERO_OUTPUT, backend, getattr(module, "__file__", ""))

    def __call__(self, args: dict, stream=None):
        ordered = [args[name] for name in self.params]
        if self.backend == "cuda":
            if self.zero_output:
                for name in self.outputs:
                    fill_device(args[name], 0)
            launch = self._configured.get(stream)
            if launch is None:
                launch = self.kernel[self.grid, self.threads] if stream is None else \
                    self.kernel[self.grid, self.threads, stream]
                self._configured[stream] = launch
            launch(*ordered)
        else:
            if self.zero_output:
                for name in self.outputs:
                    args[name][:] = 0
            self.kernel(*ordered)
