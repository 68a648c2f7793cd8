"""32-bit index arithmetic for generated CUDA kernels (numba intrinsics; imported by rendered modules).

numba types every integer expression as int64 (narrower ints are promoted to intp), so index math
in a generated kernel compiles to 64-bit PTX: a 64-bit multiply is several 32-bit instructions, a
division by a constant a 64-bit multiply-high plus fix-ups, and every array access adds a
negative-index wraparound.  These intrinsics do the arithmetic in i32 and hand back a
sign-extended i64, so LLVM folds chains of them (trunc of sext) into pure 32-bit code; `uidx` makes
an index unsigned, which numba takes as "no wraparound needed".

Only correct when every intermediate fits in int32 (render_cuda uses them only for problems whose
tensors have fewer than 2**30 elements: index32_safe), and udiv32/umod32/uidx only for values the
renderer proved non-negative.  The simulator runs kernels as Python, so there they are checked
Python functions that raise on any overflow or on a negative value where a proof said otherwise:
every simulator test of a CUDA kernel re-checks the renderer's proofs on real data.
"""
from __future__ import annotations

from kernelgen import settings

if settings.get("cuda_simulator"):
    def _i32(v):
        if not -2 ** 31 <= v < 2 ** 31:
            raise OverflowError(f"index arithmetic overflows int32: {v}")
        return v

    def _nonneg(v, what):
        if v < 0:
            raise ValueError(f"{what} of a negative value {v}: the renderer's non-negativity proof is wrong")
        return v

    def add32(a, b): return _i32(a + b)
    def sub32(a, b): return _i32(a - b)
    def mul32(a, b): return _i32(a * b)
    def floordiv32(a, b): return _i32(a // b)
    def mod32(a, b): return _i32(a % b)
    def udiv32(a, b): return _i32(_nonneg(a, "udiv32") // b)
    def umod32(a, b): return _i32(_nonneg(a, "umod32") % b)
    def uidx(a): return _i32(_nonneg(a, "uidx"))
else:
    from ._cuda_index_intrinsics import (add32, floordiv32, mod32, mul32, sub32, udiv32, uidx,  # noqa: F401
                                         umod32)
