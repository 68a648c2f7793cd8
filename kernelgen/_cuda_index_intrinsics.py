"""The numba intrinsics behind kernelgen.cuda_index (real GPU only): i32 arithmetic, sign-extended back."""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.cuda.extending import intrinsic

_I32, _I64 = ir.IntType(32), ir.IntType(64)


def _narrow(context, builder, ty, val):
    return builder.trunc(context.cast(builder, val, ty, types.int64), _I32)


def _binary(build):
    def template(typingctx, a, b):
        if not (isinstance(a, types.Integer) and isinstance(b, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            x, y = (_narrow(context, builder, t, v) for t, v in zip(sig.args, args))
            return builder.sext(build(builder, x, y), _I64)
        return types.int64(a, b), codegen
    return intrinsic(template)


def _floordiv(builder, x, y):
    q, r = builder.sdiv(x, y), builder.srem(x, y)
    # Python floors: step down when the remainder is non-zero and its sign differs from the divisor's
    fix = builder.and_(builder.icmp_signed("!=", r, ir.Constant(_I32, 0)),
                       builder.icmp_signed("<", builder.xor(r, y), ir.Constant(_I32, 0)))
    return builder.sub(q, builder.zext(fix, _I32))


def _floormod(builder, x, y):
    r = builder.srem(x, y)
    fix = builder.and_(builder.icmp_signed("!=", r, ir.Constant(_I32, 0)),
                       builder.icmp_signed("<", builder.xor(r, y), ir.Constant(_I32, 0)))
    return builder.add(r, builder.select(fix, y, ir.Constant(_I32, 0)))


add32 = _binary(lambda b, x, y: b.add(x, y, flags=["nsw"]))
sub32 = _binary(lambda b, x, y: b.sub(x, y, flags=["nsw"]))
mul32 = _binary(lambda b, x, y: b.mul(x, y, flags=["nsw"]))
floordiv32 = _binary(_floordiv)
mod32 = _binary(_floormod)
# for a non-negative numerator and a positive divisor (the renderer proves both): no floor fix-ups,
# and a division by a constant becomes one multiply-high and a shift
udiv32 = _binary(lambda b, x, y: b.udiv(x, y))
umod32 = _binary(lambda b, x, y: b.urem(x, y))


@intrinsic
def uidx(typingctx, a):
    """A non-negative index as uint64: array accesses then skip numba's wraparound."""
    if not isinstance(a, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.zext(_narrow(context, builder, sig.args[0], args[0]), _I64)
    return types.uint64(a), codegen


