"""Warpgroup MMA intrinsics (sm_90a wgmma) for generated CUDA kernels: inline PTX through llvmlite.

numba-cuda compiles for the arch-specific target (sm_90a) on a compute-capability 9.x device, which is what
wgmma needs.  A warpgroup is 4 consecutive warps (128 threads); its wgmma reads both operands from shared
memory through 64-bit matrix descriptors and accumulates into registers spread over the 128 threads.

smem_desc(arr, i, lbo, sbo) -> uint64: descriptor of the operand tile starting at shared arr[i] (16-byte
          aligned) in the no-swizzle ("interleave") K-major layout: 8 x 16-byte core matrices, 128 contiguous
          bytes each; lbo = bytes between core matrices adjacent along K, sbo = along M (or N).
          smem_desc_sw128: the same for the 128-byte swizzled layout that TMA copies write.
wgmma_tf32_m64n{N}k8(acc, da, db) -> acc': acc (N / 2 float32) += A (64 x 8) B (8 x N) in TF32; the hardware
          reads the top 19 bits of each float32 operand (truncation).  acc[4 j + r] of thread 32 w + 4 g + t is
          D[16 w + g + 8 (r // 2), 8 j + 2 t + r % 2], the m16n8 layout of mma.sync repeated along N.
          Asynchronous: valid only after wgmma_wait, which also hands the registers back.
wgmma_f16_m64n{N}k16(acc, da, db) -> acc': the same with A (64 x 16) B (16 x N) of fp16 operands (exact),
          float32 accumulators in the same layout; a K-major row of the 128-byte swizzled layout holds 64 of them.
          wgmma_f16_m64n{N}k16_bmn (N a multiple of 64): B MN-major (its transpose immediate set).
wgmma_fence(): wgmma.fence (before the first wgmma of a batch: orders earlier register and shared accesses).
wgmma_commit(): closes a batch;  wgmma_wait(acc, n) -> acc: waits until at most n batches are in flight,
          threading acc through so no use of the accumulators moves above the wait.
async_proxy_fence(): fence.proxy.async.shared::cta - this thread's shared-memory writes (st.shared, cp.async)
          become visible to wgmma's operand reads (the async proxy); then a barrier makes everyone's visible.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core.errors import RequireLiteralValue
from numba.cuda.extending import intrinsic

_F32, _I32, _I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)


def _asm_void(builder, text, name):
    builder.asm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}", [], side_effect=True, name=name)


def shared_address(context, builder, aty, value, ity, index):
    """The 32-bit shared-window address of shared array element value[index] (what PTX's [addr] operands of
    .shared instructions and descriptors take)."""
    ary = context.make_array(aty)(context, builder, value)
    ptr = builder.gep(ary.data, [context.cast(builder, index, ity, types.intp)])
    return builder.ptrtoint(builder.addrspacecast(ptr, ir.PointerType(ptr.type.pointee, 3)), _I32)


def _descriptor(swizzle128):
    def codegen(context, builder, sig, args):
        aty, ity, lty, sty = sig.args
        addr = builder.zext(shared_address(context, builder, aty, args[0], ity, args[1]), _I64)
        lbo_ = context.cast(builder, args[2], lty, types.uint64)
        sbo_ = context.cast(builder, args[3], sty, types.uint64)
        four = ir.Constant(_I64, 4)
        field = lambda v, shift: builder.shl(builder.and_(builder.lshr(v, four), ir.Constant(_I64, 0x3FFF)),
                                             ir.Constant(_I64, shift))
        # bits 0-13 start address >> 4, 16-29 leading byte offset >> 4, 32-45 stride byte offset >> 4,
        # 49-51 base offset 0 (swizzled tiles start 1024-byte aligned), 62-63 layout: 0 none, 1 128-byte swizzle
        desc = builder.or_(builder.or_(field(addr, 0), field(lbo_, 16)), field(sbo_, 32))
        return builder.or_(desc, ir.Constant(_I64, 1 << 62)) if swizzle128 else desc
    return codegen


@intrinsic
def smem_desc(typingctx, arr, i, lbo, sbo):
    if not (isinstance(arr, types.Array) and all(isinstance(a, types.Integer) for a in (i, lbo, sbo))):
        return None
    return types.uint64(arr, i, lbo, sbo), _descriptor(False)


@intrinsic
def smem_desc_sw128(typingctx, arr, i, lbo, sbo):
    """The descriptor of a K-major tile in the 128-byte swizzled layout (what a TMA copy with
    CU_TENSOR_MAP_SWIZZLE_128B writes): rows of 128 bytes, 8-row atoms of 1024 bytes (sbo), the 16-byte
    chunk j of row r at chunk j ^ (r % 8).  A k step inside the 128-byte row moves the start address."""
    if not (isinstance(arr, types.Array) and all(isinstance(a, types.Integer) for a in (i, lbo, sbo))):
        return None
    return types.uint64(arr, i, lbo, sbo), _descriptor(True)


def _wgmma(n, kind="tf32", b_mn_major=False, a_mn_major=False):
    regs = n // 2
    # fp16 takes two more immediates, the operands' transposes: 0 0 = both K-major, as for tf32 (which has no choice);
    # 0 1 = B MN-major (n contiguous: TileConfig.b_mn); 1 1 = A MN-major too (m contiguous: TileConfig.a_mn)
    transposes = f", {int(a_mn_major)}, {int(b_mn_major)}"
    shape, extra = {"tf32": (f"m64n{n}k8.f32.tf32.tf32", ""), "fp16": (f"m64n{n}k16.f32.f16.f16", transposes),
                    "bf16": (f"m64n{n}k16.f32.bf16.bf16", transposes)}[kind]
    text = (f"{{ .reg .pred p; setp.ne.b32 p, ${regs + 2}, 0; "
            f"wgmma.mma_async.sync.aligned.{shape} "
            "{" + ", ".join(f"${i}" for i in range(regs)) + f"}}, ${regs}, ${regs + 1}, p, 1, 1{extra}; }}")
    ret = types.UniTuple(types.float32, regs)

    @intrinsic
    def wgmma(typingctx, acc, da, db):
        if not (isinstance(acc, types.UniTuple) and acc.count == regs and isinstance(acc.dtype, types.Float)):
            return None

        def codegen(context, builder, sig, args):
            vals = [context.cast(builder, builder.extract_value(args[0], i), sig.args[0].dtype, types.float32)
                    for i in range(regs)]
            descs = [context.cast(builder, v, t, types.uint64) for v, t in zip(args[1:], sig.args[1:])]
            fnty = ir.FunctionType(ir.LiteralStructType([_F32] * regs), [_I64, _I64, _I32] + [_F32] * regs)
            cons = ",".join(["=f"] * regs + ["l", "l", "r"] + [str(i) for i in range(regs)]) + ",~{memory}"
            out = builder.asm(fnty, text, cons, descs + [ir.Constant(_I32, 1)] + vals, side_effect=True,
                              name=f"wgmma_{kind}_n{n}" + ("_amn" if a_mn_major else "")
                              + ("_bmn" if b_mn_major else ""))
            return context.make_tuple(builder, ret, [builder.extract_value(out, i) for i in range(regs)])
        return ret(acc, da, db), codegen
    return wgmma


WGMMA_TF32 = {n: _wgmma(n) for n in range(8, 257, 8)}  # every n wgmma has for TF32
WGMMA_F16 = {n: _wgmma(n, "fp16") for n in range(8, 257, 8)}  # ... and for fp16 operands, fp32 accumulators
# fp16 with B MN-major (ir.WarpgroupMma.b_mn: backward-data reading w as stored, TileConfig.b_mn)
WGMMA_F16_BMN = {n: _wgmma(n, "fp16", b_mn_major=True) for n in range(64, 257, 64)}
wgmma_f16_m64n128k16_bmn = WGMMA_F16_BMN[128]


def wgmma_16bit(kind, n, b_mn_major=False, a_mn_major=False):
    """The bf16 operand form of WGMMA_F16 / WGMMA_F16_BMN, and either kind with A MN-major (made when a kernel first
    imports one: kernelgen.cuda_wgmma)."""
    return _wgmma(n, kind, b_mn_major, a_mn_major)  # scripts/wgmma_check.py's mn-major probe
wgmma_tf32_m64n64k8, wgmma_tf32_m64n128k8, wgmma_tf32_m64n256k8 = WGMMA_TF32[64], WGMMA_TF32[128], WGMMA_TF32[256]


@intrinsic
def wgmma_fence(typingctx):
    def codegen(context, builder, sig, args):
        _asm_void(builder, "wgmma.fence.sync.aligned;", "wgmma_fence")
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def wgmma_commit(typingctx):
    def codegen(context, builder, sig, args):
        _asm_void(builder, "wgmma.commit_group.sync.aligned;", "wgmma_commit")
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def async_proxy_fence(typingctx):
    def codegen(context, builder, sig, args):
        _asm_void(builder, "fence.proxy.async.shared::cta;", "fence_proxy_async")
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def wgmma_wait(typingctx, acc, pending):
    if not isinstance(pending, types.IntegerLiteral):
        raise RequireLiteralValue(pending)
    if not (isinstance(acc, types.UniTuple) and isinstance(acc.dtype, types.Float)):
        return None
    regs, n = acc.count, pending.literal_value

    def codegen(context, builder, sig, args):
        vals = [builder.extract_value(args[0], i) for i in range(regs)]
        fnty = ir.FunctionType(ir.LiteralStructType([_F32] * regs), [_F32] * regs)
        cons = ",".join(["=f"] * regs + [str(i) for i in range(regs)]) + ",~{memory}"
        out = builder.asm(fnty, f"wgmma.wait_group.sync.aligned {n};", cons, vals, side_effect=True,
                          name="wgmma_wait")
        return context.make_tuple(builder, sig.return_type, [builder.extract_value(out, i) for i in range(regs)])
    return acc(acc, pending), codegen
