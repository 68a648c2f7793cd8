"""Small elementwise device kernels the API needs around the generated ones."""
from __future__ import annotations

_bias_kernel = None


def _add_channel_bias_body(y, bias, channels):
    # module-level so the simulator can swap this module's `cuda` global for its fake one
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < y.size:
        y[i] += bias[i % channels]


def add_channel_bias(y, bias, stream=None):
    """y[..., c] += bias[c] in place, for a C-contiguous channels-last device array y."""
    global _bias_kernel, cuda
    from numba import cuda

    from kernelgen.arrays import to_device_view
    if _bias_kernel is None:
        _bias_kernel = cuda.jit(_add_channel_bias_body)
    d = to_device_view(y, "y")
    flat = d.reshape(d.size)
    b = to_device_view(bias, "bias")
    grid = (flat.size + 255) // 256
    launch = _bias_kernel[grid, 256] if stream is None else _bias_kernel[grid, 256, stream]
    launch(flat, b, b.size)
