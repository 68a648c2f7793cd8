"""Tensor-core intrinsics for generated CUDA kernels (real GPU only): inline PTX through llvmlite.

tf32(x):  cvt.rna.tf32.f32, handed back as the float32 whose low 13 bits are zero.
mma_m16n8k8_tf32(d0..d3, a0..a3, b0, b1) -> (d0', d1', d2', d3'):
          mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32, operands in the fragment layout of
          kernelgen/mma_layout.py, already TF32 (the hardware reads only their top 19 bits).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.cuda.extending import intrinsic

_F32, _I32 = ir.FloatType(), ir.IntType(32)


def _as_f32(context, builder, ty, val):
    return context.cast(builder, val, ty, types.float32)


@intrinsic
def tf32(typingctx, x):
    if not isinstance(x, (types.Float, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        v = _as_f32(context, builder, sig.args[0], args[0])
        # pure: LLVM may merge or move it freely
        bits = builder.asm(ir.FunctionType(_I32, [_F32]), "cvt.rna.tf32.f32 $0, $1;", "=r,f", [v],
                           side_effect=False, name="cvt_rna_tf32")
        return builder.bitcast(bits, _F32)
    return types.float32(x), codegen


_MMA = ("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{$0, $1, $2, $3}, {$8, $9, $10, $11}, {$12, $13}, {$4, $5, $6, $7};")


@intrinsic
def mma_m16n8k8_tf32(typingctx, d0, d1, d2, d3, a0, a1, a2, a3, b0, b1):
    args = (d0, d1, d2, d3, a0, a1, a2, a3, b0, b1)
    if not all(isinstance(a, types.Float) for a in args):
        return None
    ret = types.UniTuple(types.float32, 4)

    def codegen(context, builder, sig, vals):
        f = [_as_f32(context, builder, t, v) for t, v in zip(sig.args, vals)]
        ops = f[:4] + [builder.bitcast(v, _I32) for v in f[4:]]
        fnty = ir.FunctionType(ir.LiteralStructType([_F32] * 4), [_F32] * 4 + [_I32] * 6)
        # side_effect: a warp-collective instruction must not be sunk into a branch some lanes skip
        out = builder.asm(fnty, _MMA, "=f,=f,=f,=f,f,f,f,f,r,r,r,r,r,r", ops, side_effect=True,
                          name="mma_tf32")
        return context.make_tuple(builder, ret, [builder.extract_value(out, i) for i in range(4)])
    return ret(*args), codegen
