"""TMA copies and mbarriers for generated CUDA kernels (imported by rendered modules): on a GPU the sm_90
intrinsics of _cuda_tma_intrinsics.py.  The simulator has no tensor maps, so there the operations raise:
kernels with ir.TensorCopy run on the CPU backend (kernelgen.cpu_tma) and on the GPU."""
from __future__ import annotations

from kernelgen import settings

if settings.get("cuda_simulator"):
    def _unavailable(*args):
        raise NotImplementedError("TMA copies have no CUDA-simulator stand-in: run such kernels on the cpu "
                                  "backend or an sm_90 GPU")

    mbarrier_init = mbarrier_init_fence = mbarrier_expect_tx = mbarrier_try_wait = mbarrier_arrive = _unavailable
    tma_load_2d = tma_load_4d = tma_load_im2col_4d = tma_load_im2col_5d = named_barrier = _unavailable
else:
    from ._cuda_tma_intrinsics import (mbarrier_arrive, mbarrier_expect_tx, mbarrier_init,  # noqa: F401
                                       mbarrier_init_fence, mbarrier_try_wait, named_barrier, tma_load_2d,
                                       tma_load_4d, tma_load_im2col_4d, tma_load_im2col_5d)
