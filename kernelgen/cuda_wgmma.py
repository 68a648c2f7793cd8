"""Warpgroup MMA operations for generated CUDA kernels (imported by rendered modules): on a GPU the sm_90a
intrinsics of _cuda_wgmma_intrinsics.py.  The simulator has no warpgroups or descriptors, so there the
operations raise: warpgroup-MMA kernels are tested on the CPU backend (the same IR, emulated per thread by
kernelgen.cpu_round.wgmma_tf32) and on the GPU."""
from __future__ import annotations

import re

from kernelgen import settings

if settings.get("cuda_simulator"):
    def _unavailable(*args):
        raise NotImplementedError("wgmma has no CUDA-simulator stand-in: run warpgroup-MMA kernels on the cpu "
                                  "backend or an sm_90 GPU")

    smem_desc = smem_desc_sw128 = wgmma_fence = wgmma_commit = wgmma_wait = async_proxy_fence = _unavailable
    globals().update({f"wgmma_tf32_m64n{n}k8": _unavailable for n in range(8, 257, 8)})
    globals().update({f"wgmma_f16_m64n{n}k16": _unavailable for n in range(8, 257, 8)})
    globals().update({f"wgmma_f16_m64n{n}k16_bmn": _unavailable for n in range(64, 257, 64)})
    globals().update({f"wgmma_bf16_m64n{n}k16": _unavailable for n in range(8, 257, 8)})
    globals().update({f"wgmma_bf16_m64n{n}k16_bmn": _unavailable for n in range(64, 257, 64)})
    globals().update({f"wgmma_{k}_m64n{n}k16_amn_bmn": _unavailable for n in range(64, 257, 64) for k in ("f16", "bf16")})
else:
    from ._cuda_wgmma_intrinsics import (async_proxy_fence, smem_desc, smem_desc_sw128, wgmma_commit,  # noqa: F401
                                         wgmma_fence, wgmma_wait)
    from ._cuda_wgmma_intrinsics import WGMMA_F16, WGMMA_F16_BMN, WGMMA_TF32, wgmma_16bit
    globals().update({f"wgmma_tf32_m64n{n}k8": f for n, f in WGMMA_TF32.items()})
    globals().update({f"wgmma_f16_m64n{n}k16": f for n, f in WGMMA_F16.items()})
    globals().update({f"wgmma_f16_m64n{n}k16_bmn": f for n, f in WGMMA_F16_BMN.items()})

    def __getattr__(name):
        """wgmma_bf16_m64n{N}k16[_bmn] and wgmma_{f16|bf16}_m64n{N}k16_amn_bmn (both operands MN-major:
        backward-weight): made on first import (a kernel that uses one), not with the module."""
        m = re.fullmatch(r"wgmma_(f16|bf16)_m64n(\d+)k16(_amn)?(_bmn)?", name)
        if m is None or m.group(1) == "f16" and not m.group(3):
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        kind = {"f16": "fp16", "bf16": "bf16"}[m.group(1)]
        f = globals()[name] = wgmma_16bit(kind, int(m.group(2)), bool(m.group(4)), bool(m.group(3)))
        return f
