"""Tensor-core intrinsics for generated CUDA kernels (real GPU only): inline PTX through llvmlite.

tf32(x):  round like cvt.rna.tf32.f32 (integer form), handed back as the float32 whose low 13 bits are zero.
mma_m16n8k8_tf32(d0..d3, a0..a3, b0, b1) -> (d0', d1', d2', d3'):
          mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32, operands in the fragment layout of
          kernelgen/mma_layout.py, already TF32 (the hardware reads only their top 19 bits).
fp16(x), bf16(x): cvt.rn.f16.f32 / cvt.rn.bf16x2.f32, handed back as the float32 of the same value.
mma_m16n8k16_f16(d0..d3, a0..a7, b0..b3), mma_m16n8k16_bf16(...) -> (d0', d1', d2', d3'):
          mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32; a and b are two m16n8k8 steps'
          float32 fragments, packed into the 16-bit MMA's registers here (mma_layout.pack16).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.cuda.extending import intrinsic

from .mma_layout import pack16

_F32, _I32 = ir.FloatType(), ir.IntType(32)


def _as_f32(context, builder, ty, val):
    return context.cast(builder, val, ty, types.float32)


@intrinsic
def tf32(typingctx, x):
    if not isinstance(x, (types.Float, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        v = _as_f32(context, builder, sig.args[0], args[0])
        # cvt.rna.tf32.f32 is emulated on sm_90 (4 SASS instructions per value: add, |x| = inf test, select,
        # mask); half an ulp added to the magnitude bits, then truncated, is the same rounding for every
        # non-NaN float (mma_layout.tf32_round, the CPU emulation's formula) in 2 integer instructions
        bits = builder.add(builder.bitcast(v, _I32), ir.Constant(_I32, 0x1000))
        return builder.bitcast(builder.and_(bits, ir.Constant(_I32, 0xFFFFE000)), _F32)
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


def _round16(asm, name):
    @intrinsic
    def round16(typingctx, x):
        if not isinstance(x, (types.Float, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            v = _as_f32(context, builder, sig.args[0], args[0])
            bits = builder.asm(ir.FunctionType(_I32, [_F32]), asm, "=r,f", [v], side_effect=False, name=name)
            return builder.bitcast(bits, _F32)
        return types.float32(x), codegen
    return round16


# f16 -> f32 is an exact cvt; a bf16 is the top half of the float32 of the same value, so keeping the high half
# of cvt.rn.bf16x2.f32 (which puts its first source there) is the round trip, sm_80's PTX included
fp16 = _round16("{ .reg .b16 h; .reg .f32 f; cvt.rn.f16.f32 h, $1; cvt.f32.f16 f, h; mov.b32 $0, f; }",
                "cvt_rn_f16")
bf16 = _round16("{ .reg .b32 p; cvt.rn.bf16x2.f32 p, $1, $1; and.b32 $0, p, 0xFFFF0000; }", "cvt_rn_bf16")


def _mma16(kind):
    # cvt.rn.{kind}x2.f32 d, hi, lo: the first source goes to the upper half, i.e. the higher k
    pack = f"cvt.rn.{kind}x2.f32 $0, $2, $1;"
    mma = (f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 "
           "{$0, $1, $2, $3}, {$8, $9, $10, $11}, {$12, $13}, {$4, $5, $6, $7};")

    @intrinsic
    def mma16(typingctx, d0, d1, d2, d3, a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3):
        args = (d0, d1, d2, d3, a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3)
        if not all(isinstance(a, types.Float) for a in args):
            return None
        ret = types.UniTuple(types.float32, 4)

        def codegen(context, builder, sig, vals):
            f = [_as_f32(context, builder, t, v) for t, v in zip(sig.args, vals)]
            a_pairs, b_pairs = pack16(f[4:12], f[12:])
            # pure and separate from the MMA: LLVM packs each fragment pair once, however many MMAs reuse it
            regs = [builder.asm(ir.FunctionType(_I32, [_F32, _F32]), pack, "=r,f,f", list(pair),
                                side_effect=False, name=f"pack_{kind}x2") for pair in a_pairs + b_pairs]
            for r in regs:  # without readnone LLVM keeps every copy (an asm call might touch memory)
                r.attributes.add("readnone")
                r.attributes.add("nounwind")
            fnty = ir.FunctionType(ir.LiteralStructType([_F32] * 4), [_F32] * 4 + [_I32] * 6)
            out = builder.asm(fnty, mma, "=f,=f,=f,=f,f,f,f,f,r,r,r,r,r,r", f[:4] + regs, side_effect=True,
                              name=f"mma_{kind}")
            return context.make_tuple(builder, ret, [builder.extract_value(out, i) for i in range(4)])
        return ret(*args), codegen
    return mma16


mma_m16n8k16_f16 = _mma16("f16")
mma_m16n8k16_bf16 = _mma16("bf16")
