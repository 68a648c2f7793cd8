"""Wide global loads (ir.VectorLoad) and asynchronous copies (ir.AsyncCopy, AsyncCommit, AsyncWait) for
generated CUDA kernels, imported by rendered modules.

load4(a, i, cond) -> (a[i], a[i + 1], a[i + 2], a[i + 3]) if cond else four zeros, for a float32 array a.
On a GPU that is one 16-byte ld.global.v4.f32 when a's data is 16-byte aligned (i is a multiple of 4 by
the template's promise): numba types a kernel's arrays as 4-byte aligned only, so NVVM never merges four
scalar loads into one, and a caller's array (a torch slice, say) may start anywhere; the kernel therefore
tests the pointer and otherwise issues four scalar loads, predicated, without branches.  In the
simulator it is plain Python indexing.

copy_async(dst, i, src, j, cond) / copy_async4(...): dst[i (.. i + 3)] = src[j (.. j + 3)] if cond else zeros,
for a float32 shared array dst and a float32 global array src, by cp.async (sm_80+): the words go from
global memory to shared memory without the thread's registers, and land some time before the thread's
copy_async_wait(n) returns for their group (copy_async_commit() closes one).  Where cond fails the copy
reads nothing (source size 0) and fills zeros.  copy_async4 is one 16-byte cp.async when src is 16-byte
aligned (dst is: its rows are 16-byte aligned shared arrays, alignment=16), else four 4-byte copies; as in
load4 the kernel tests src's pointer.  In the simulator the copies are immediate and commit/wait do nothing.

load4_aligned / copy_async16: the same for an array known to start 16-byte aligned (render_cuda's KERNEL; the
launcher checks each call's arrays and runs KERNEL_ANY_ALIGNMENT otherwise): the 16-byte access alone, with no
test and no 4-byte fallback, whose predicated-off instructions still occupy the load/store queue.
copy_async16_l2: copy_async16 through L2 only (cp.async.cg, nothing allocated in L1); not used by the templates
yet: scripts/tma_check.py measures its copy stream against the L1-allocating one (PERF_NOTES #34).

store_pair16(a, i, v0, v1): float16 a[i], a[i + 1] = v0, v1 (ir.Store.pair): one 4-byte store where aligned;
store_pair_bf16 the same into an array of bfloat16 bits.

load2h / load4h / load8h (and their _aligned forms): 2, 4 and 8 elements of a float16 array, widened to float32
(exact): one 4-byte ld.global.b32 / 8-byte ld.global.v2.b32 / 16-byte ld.global.v4.b32 where aligned, else 2-byte
loads, predicated as load4's.

bf16_widen(bits) / bf16_narrow(value): a bfloat16 element (its uint16 bit pattern) as float32, and a float32 as
bfloat16 bits rounded to nearest even (how generated kernels read and write bfloat16 storage).
"""
from __future__ import annotations

from kernelgen import settings

if settings.get("cuda_simulator"):
    import numpy as np

    def load4(a, i, cond):
        if cond:
            return a[i], a[i + 1], a[i + 2], a[i + 3]
        z = np.float32(0.0)
        return z, z, z, z

    def copy_async(dst, i, src, j, cond):
        dst[i] = src[j] if cond else np.float32(0.0)

    def copy_async4(dst, i, src, j, cond):
        for w in range(4):
            dst[i + w] = src[j + w] if cond else np.float32(0.0)

    def copy_async_commit():
        pass

    load4_aligned, copy_async16 = load4, copy_async4
    copy_async16_l2 = copy_async16

    def copy_async_wait(pending):
        pass

    def store_pair16(a, i, v0, v1):
        a[i], a[i + 1] = v0, v1

    def _halves(n):
        def load(a, i, cond):
            if cond:
                return tuple(np.float32(a[i + k]) for k in range(n))
            return (np.float32(0.0),) * n
        return load

    load2h = load2h_aligned = _halves(2)
    load4h = load4h_aligned = _halves(4)
    load8h = load8h_aligned = _halves(8)

    def bf16_widen(bits):
        return np.array([np.uint32(bits) << np.uint32(16)], np.uint32).view(np.float32)[0]

    def bf16_narrow(value):
        u = int(np.array([value], np.float32).view(np.uint32)[0])
        if (u & 0x7FFFFFFF) > 0x7F800000:
            return np.uint16(0x7FFF)  # cvt.rn.bf16.f32's NaN
        return np.uint16((u + 0x7FFF + ((u >> 16) & 1)) >> 16)

    def store_pair_bf16(a, i, v0, v1):
        a[i], a[i + 1] = bf16_narrow(v0), bf16_narrow(v1)
else:
    from llvmlite import ir
    from numba import types
    from numba.core.errors import RequireLiteralValue
    from numba.cuda.extending import intrinsic

    _F32, _I32, _I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
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

    _LOAD16 = ("{ .reg .pred c; .reg .u64 g; setp.ne.b32 c, $5, 0; cvta.to.global.u64 g, $4;"
               " mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0;"
               " @c ld.global.v4.f32 {$0, $1, $2, $3}, [g]; }")

    def _wide_load_codegen(n, text, align_mask, name):
        """The codegen of an n-float32 load by the inline PTX `text`: outputs $0..$n-1, the element's address $n, cond
        $n+1 and, unless align_mask is None (an array known to be aligned), $n+2: is the array's address & align_mask
        zero (the template keeps the index a multiple of n, so the array's own alignment decides: one test per
        kernel once LLVM has merged the copies)."""
        out_type = ir.LiteralStructType([_F32] * n)
        constraints = ",".join(["=f"] * n + ["l", "r"] + ([] if align_mask is None else ["r"]))

        def codegen(context, builder, sig, args):
            aty, ity, cty = sig.args
            ary = context.make_array(aty)(context, builder, args[0])
            idx = context.cast(builder, args[1], ity, types.intp)
            operands = [builder.ptrtoint(builder.gep(ary.data, [idx]), _I64),
                        builder.zext(context.is_true(builder, cty, args[2]), _I32)]
            if align_mask is not None:
                base = builder.ptrtoint(ary.data, _I64)
                operands.append(builder.zext(builder.icmp_unsigned(
                    "==", builder.and_(base, ir.Constant(_I64, align_mask)), ir.Constant(_I64, 0)), _I32))
            out = builder.asm(ir.FunctionType(out_type, [o.type for o in operands]), text, constraints, operands,
                              side_effect=False, name=name)
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(out, j) for j in range(n)])
        return codegen

    def _load_codegen(aligned):
        return _wide_load_codegen(4, _LOAD16 if aligned else _LOAD4, None if aligned else 15,
                                  "load16" if aligned else "load4")

    def _load_signature(a, i, cond):
        ok = isinstance(a, types.Array) and a.dtype == types.float32 and isinstance(i, types.Integer)
        return types.UniTuple(types.float32, 4)(a, i, cond) if ok else None

    def _half_load_asm(n, aligned):
        """PTX of load2h / load4h / load8h: n outputs $0..$n-1 (f32), the element address $n, cond $n+1 and
        (unaligned) the array's alignment $n+2; the words land in b32 registers (zeros where cond fails) and are split
        and widened."""
        words, a, c, al = n // 2, n, n + 1, n + 2
        r = ", ".join(f"r{j}" for j in range(words))
        h = ", ".join(f"h{j}" for j in range(n))
        vec = f"ld.global.v{words}.b32 {{{r}}}, [g];" if words > 1 else f"ld.global.b32 {r}, [g];"
        preds = "c" if aligned else "c, w, n"
        text = (f"{{ .reg .pred {preds}; .reg .u64 g; .reg .b32 {r}; .reg .b16 {h};"
                f" setp.ne.b32 c, ${c}, 0;")
        if not aligned:
            text += f" setp.ne.and.b32 w, ${al}, 0, c; setp.eq.and.b32 n, ${al}, 0, c;"
        text += f" cvta.to.global.u64 g, ${a};" + "".join(f" mov.b32 r{j}, 0;" for j in range(words))
        text += f" @{'c' if aligned else 'w'} {vec}"
        if not aligned:
            text += "".join(f" @n ld.global.b16 h{k}, [g+{2 * k}];" for k in range(n))
            text += "".join(f" @n mov.b32 r{j}, {{h{2 * j}, h{2 * j + 1}}};" for j in range(words))
        text += "".join(f" mov.b32 {{h{2 * j}, h{2 * j + 1}}}, r{j};" for j in range(words))
        text += "".join(f" cvt.f32.f16 ${k}, h{k};" for k in range(n)) + " }"
        return text

    def _half_load_codegen(n, aligned):
        # (the whole load's alignment: the bytes of n halves)
        return _wide_load_codegen(n, _half_load_asm(n, aligned), None if aligned else 2 * n - 1, f"load{n}h")

    def _half_load(n, aligned):
        def typer(typingctx, a, i, cond):
            ok = isinstance(a, types.Array) and a.dtype == types.float16 and isinstance(i, types.Integer)
            return ((types.UniTuple(types.float32, n)(a, i, cond), _half_load_codegen(n, aligned)) if ok
                    else None)
        return intrinsic(typer)

    load2h, load2h_aligned = _half_load(2, False), _half_load(2, True)
    load4h, load4h_aligned = _half_load(4, False), _half_load(4, True)
    load8h, load8h_aligned = _half_load(8, False), _half_load(8, True)

    @intrinsic
    def load4(typingctx, a, i, cond):
        sig = _load_signature(a, i, cond)
        return (sig, _load_codegen(False)) if sig else None

    @intrinsic
    def load4_aligned(typingctx, a, i, cond):
        """load4 for an array the launcher has checked to start 16-byte aligned: the 16-byte load only."""
        sig = _load_signature(a, i, cond)
        return (sig, _load_codegen(True)) if sig else None

    # cp.async with a source size: `cond ? width : 0` bytes are read, the rest of the destination is zero-filled.
    # The destination is a 32-bit shared-window address; the source, generic, goes through cvta.to.global.
    # .ca: cached in L1 too, as plain loads are: an implicit-GEMM block reads the same input rows for neighbouring
    # filter taps, and those repeats hit in L1 instead of costing L2 bandwidth (.cg would bypass L1).
    _COPY4 = ("{ .reg .pred w, n; .reg .u64 g; .reg .u32 s4;"
              " setp.ne.b32 w, $3, 0; setp.eq.b32 n, $3, 0; cvta.to.global.u64 g, $1; shr.u32 s4, $2, 2;"
              " @w cp.async.ca.shared.global [$0], [g], 16, $2;"
              " @n cp.async.ca.shared.global [$0], [g], 4, s4; @n cp.async.ca.shared.global [$0+4], [g+4], 4, s4;"
              " @n cp.async.ca.shared.global [$0+8], [g+8], 4, s4;"
              " @n cp.async.ca.shared.global [$0+12], [g+12], 4, s4; }")
    _COPY1 = "{ .reg .u64 g; cvta.to.global.u64 g, $1; cp.async.ca.shared.global [$0], [g], 4, $2; }"
    # the source is known 16-byte aligned (the launcher checked the array): one 16-byte copy, nothing else
    _COPY16 = "{ .reg .u64 g; cvta.to.global.u64 g, $1; cp.async.ca.shared.global [$0], [g], 16, $2; }"
    _COPY16_L2 = _COPY16.replace(".ca.", ".cg.")  # through L2 only: nothing allocated in L1

    def _element_address(context, builder, aty, ary_value, ity, index):
        ary = context.make_array(aty)(context, builder, ary_value)
        return ary, builder.gep(ary.data, [context.cast(builder, index, ity, types.intp)])

    def _copy_codegen(width, aligned=False, text=None):
        def codegen(context, builder, sig, args):
            dty, ity, sty, jty, cty = sig.args
            _, dptr = _element_address(context, builder, dty, args[0], ity, args[1])
            src, sptr = _element_address(context, builder, sty, args[2], jty, args[3])
            # the generic pointer of a shared array -> its shared-window address (NVVM folds the round trip)
            shared = builder.ptrtoint(builder.addrspacecast(dptr, ir.PointerType(_F32, 3)), _I32)
            ok = context.is_true(builder, cty, args[4])
            size = builder.select(ok, ir.Constant(_I32, 4 * width), ir.Constant(_I32, 0))
            operands = [shared, builder.ptrtoint(sptr, _I64), size]
            if width == 4 and not aligned:
                base = builder.ptrtoint(src.data, _I64)
                operands.append(builder.zext(builder.icmp_unsigned(
                    "==", builder.and_(base, ir.Constant(_I64, 15)), ir.Constant(_I64, 0)), _I32))
            ftype = ir.FunctionType(ir.VoidType(), [o.type for o in operands])
            text_ = text or (_COPY16 if aligned else _COPY4 if width == 4 else _COPY1)
            builder.asm(ftype, text_, ",".join(["r", "l", "r", "r"][:len(operands)])
                        + ",~{memory}", operands, side_effect=True, name="cp_async")
            return context.get_dummy_value()
        return codegen

    def _copy_signature(dst, i, src, j, cond):
        ok = all(isinstance(a, types.Array) and a.dtype == types.float32 for a in (dst, src)) \
            and isinstance(i, types.Integer) and isinstance(j, types.Integer)
        return types.void(dst, i, src, j, cond) if ok else None

    @intrinsic
    def copy_async(typingctx, dst, i, src, j, cond):
        sig = _copy_signature(dst, i, src, j, cond)
        return (sig, _copy_codegen(1)) if sig else None

    @intrinsic
    def copy_async4(typingctx, dst, i, src, j, cond):
        sig = _copy_signature(dst, i, src, j, cond)
        return (sig, _copy_codegen(4)) if sig else None

    @intrinsic
    def copy_async16(typingctx, dst, i, src, j, cond):
        sig = _copy_signature(dst, i, src, j, cond)
        return (sig, _copy_codegen(4, aligned=True)) if sig else None

    @intrinsic
    def copy_async16_l2(typingctx, dst, i, src, j, cond):
        sig = _copy_signature(dst, i, src, j, cond)
        return (sig, _copy_codegen(4, aligned=True, text=_COPY16_L2)) if sig else None

    @intrinsic
    def copy_async_commit(typingctx):
        def codegen(context, builder, sig, args):
            builder.asm(ir.FunctionType(ir.VoidType(), []), "cp.async.commit_group;", "~{memory}", [],
                        side_effect=True, name="cp_async_commit")
            return context.get_dummy_value()
        return types.void(), codegen

    @intrinsic
    def copy_async_wait(typingctx, pending):
        if not isinstance(pending, types.IntegerLiteral):
            raise RequireLiteralValue(pending)
        n = pending.literal_value

        def codegen(context, builder, sig, args):
            builder.asm(ir.FunctionType(ir.VoidType(), []), f"cp.async.wait_group {n};", "~{memory}", [],
                        side_effect=True, name="cp_async_wait")
            return context.get_dummy_value()
        return types.void(pending), codegen

    # float16 a[i], a[i + 1] = v0, v1 rounded to nearest even (cvt.rn, as numba's own float16 stores): one 4-byte
    # store where the address is 4-byte aligned (i even, the array's start decides), else two 2-byte ones, predicated
    # (store_pair_bf16: the same with cvt.rn.bf16.f32 into a uint16 array of bfloat16 bits)
    _PAIR16 = ("{ .reg .pred a, u; .reg .b16 l, h; .reg .b32 p; .reg .u64 g, t;"
               " cvta.to.global.u64 g, $0; and.b64 t, g, 3; setp.eq.u64 a, t, 0; setp.ne.u64 u, t, 0;"
               " cvt.rn.%s.f32 l, $1; cvt.rn.%s.f32 h, $2; mov.b32 p, {l, h};"
               " @a st.global.b32 [g], p; @u st.global.b16 [g], l; @u st.global.b16 [g+2], h; }")

    def _pair_store(element, ptx_type):
        def typer(typingctx, a, i, v0, v1):
            if not (isinstance(a, types.Array) and a.dtype == element and isinstance(i, types.Integer)
                    and all(isinstance(v, (types.Float, types.Integer)) for v in (v0, v1))):
                return None

            def codegen(context, builder, sig, args):
                aty, ity, t0, t1 = sig.args
                _, ptr = _element_address(context, builder, aty, args[0], ity, args[1])
                vals = [context.cast(builder, v, t, types.float32) for v, t in zip(args[2:], (t0, t1))]
                builder.asm(ir.FunctionType(ir.VoidType(), [_I64, _F32, _F32]), _PAIR16 % (ptx_type, ptx_type),
                            "l,f,f,~{memory}", [builder.ptrtoint(ptr, _I64)] + vals, side_effect=True,
                            name=f"store_pair_{ptx_type}")
                return context.get_dummy_value()
            return types.void(a, i, v0, v1), codegen
        return intrinsic(typer)

    store_pair16 = _pair_store(types.float16, "f16")
    store_pair_bf16 = _pair_store(types.uint16, "bf16")


    # bfloat16 storage (uint16 bit patterns: numba has no bfloat16): a bf16 is the upper half of a float32 word, so
    # widening is a shift; narrowing is cvt.rn.bf16.f32 (nearest even, overflow to inf, sm_80+)
    @intrinsic
    def bf16_widen(typingctx, bits):
        if not (isinstance(bits, types.Integer) and bits.bitwidth == 16):
            return None

        def codegen(context, builder, sig, args):
            word = builder.shl(builder.zext(args[0], _I32), ir.Constant(_I32, 16))
            return builder.bitcast(word, _F32)
        return types.float32(bits), codegen

    @intrinsic
    def bf16_narrow(typingctx, value):
        if not isinstance(value, (types.Float, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            f = context.cast(builder, args[0], sig.args[0], types.float32)
            return builder.asm(ir.FunctionType(ir.IntType(16), [_F32]), "cvt.rn.bf16.f32 $0, $1;", "=h,f", [f],
                               side_effect=False, name="bf16_narrow")
        return types.uint16(value), codegen
