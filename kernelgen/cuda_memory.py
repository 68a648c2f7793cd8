"""Wide global loads for generated CUDA kernels (ir.VectorLoad), imported by rendered modules.

load4(a, i, cond) -> (a[i], a[i + 1], a[i + 2], a[i + 3]) if cond else four zeros, for a float32 array a.
On a GPU that is one 16-byte ld.global.v4.f32 when a's data is 16-byte aligned (i is a multiple of 4 by
the template's promise): numba types a kernel's arrays as 4-byte aligned only, so NVVM never merges four
scalar loads into one, and a caller's array (a torch slice, say) may start anywhere; the kernel therefore
tests the pointer and otherwise issues four scalar loads, predicated, without branches.  In the
simulator it is plain Python indexing.
"""
from __future__ import annotations

import os

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    import numpy as np

    def load4(a, i, cond):
        if cond:
            return a[i], a[i + 1], a[i + 2], a[i + 3]
        z = np.float32(0.0)
        return z, z, z, z
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    _F32, _I32, _I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
    _V4 = ir.LiteralStructType([_F32] * 4)
    # One predicated block, no branches: zeros, then the 16-byte load when the element address is aligned,
    # else four 4-byte loads ($5: cond, $6: array aligned; generic -> global is the identity on every CUDA
    # GPU, but the PTX ISA asks for cvta).  Not .nc: an output may alias an input of the same call.
    _LOAD4 = ("{ .reg .pred c, w, n; .reg .u64 g;"
              " setp.ne.b32 c, $5, 0; setp.ne.and.b32 w, $6, 0, c; setp.eq.and.b32 n, $6, 0, c;"
              " cvta.to.global.u64 g, $4;"
              " mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0;"
              " @w ld.global.v4.f32 {$0, $1, $2, $3}, [g];"
              " @n ld.global.f32 $0, [g]; @n ld.global.f32 $1, [g+4]; @n ld.global.f32 $2, [g+8];"
              " @n ld.global.f32 $3, [g+12]; }")

    @intrinsic
    def load4(typingctx, a, i, cond):
        if not (isinstance(a, types.Array) and a.dtype == types.float32 and isinstance(i, types.Integer)):
            return None
        ret = types.UniTuple(types.float32, 4)

        def codegen(context, builder, sig, args):
            aty, ity, cty = sig.args
            ary = context.make_array(aty)(context, builder, args[0])
            idx = context.cast(builder, args[1], ity, types.intp)
            ok = builder.zext(context.is_true(builder, cty, args[2]), _I32)
            # the template keeps i a multiple of 4, so the array's own alignment decides (one test per kernel
            # once LLVM has merged the copies)
            base = builder.ptrtoint(ary.data, _I64)
            aligned = builder.zext(builder.icmp_unsigned("==", builder.and_(base, ir.Constant(_I64, 15)),
                                                         ir.Constant(_I64, 0)), _I32)
            addr = builder.ptrtoint(builder.gep(ary.data, [idx]), _I64)
            out = builder.asm(ir.FunctionType(_V4, [_I64, _I32, _I32]), _LOAD4, "=f,=f,=f,=f,l,r,r",
                              [addr, ok, aligned], side_effect=False, name="load4")
            return context.make_tuple(builder, ret, [builder.extract_value(out, j) for j in range(4)])
        return ret(a, i, cond), codegen
