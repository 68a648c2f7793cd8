"""Tensor-core operations for generated CUDA kernels (imported by rendered modules).

On a real GPU these are the inline-PTX intrinsics of _cuda_mma_intrinsics.py.  The simulator runs
each thread as a Python thread with no warp-level data exchange, so there is no faithful stand-in
for mma.sync: the simulator version raises, and tensor-core kernels are tested on the CPU backend
(the same IR, emulated per lane) and on the GPU.
"""
from __future__ import annotations

from kernelgen import settings

if settings.get("cuda_simulator"):
    import numpy as np

    from .mma_layout import bf16_round, fp16_round, tf32_round

    def tf32(x):
        return tf32_round(np.array([x], np.float32))[0]

    def fp16(x):
        return fp16_round(np.array([x], np.float32))[0]

    def bf16(x):
        return bf16_round(np.array([x], np.float32))[0]

    def mma_m16n8k8_tf32(*args):
        raise NotImplementedError("mma.sync has no CUDA-simulator stand-in: run tensor-core kernels on the "
                                  "cpu backend or a GPU")

    mma_m16n8k16_f16 = mma_m16n8k16_bf16 = mma_m16n8k8_tf32
else:
    from ._cuda_mma_intrinsics import (bf16, fp16, mma_m16n8k8_tf32, mma_m16n8k16_bf16,  # noqa: F401
                                       mma_m16n8k16_f16, tf32)


def jit_launch_bounds(bounds):
    """cuda.jit keyword arguments for launch bounds (max threads per block, min blocks per SM): ptxas then
    keeps registers at or under 65536 / (threads x min blocks), rounded to its allocation granularity.
    The simulator's jit takes no such option (and ignores registers): nothing there."""
    return {} if settings.get("cuda_simulator") else {"launch_bounds": tuple(bounds)}
