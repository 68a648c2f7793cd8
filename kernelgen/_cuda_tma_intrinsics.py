"""Tensor Memory Accelerator (sm_90 TMA) and shared-memory barrier intrinsics for numba kernels: inline PTX
through llvmlite.  Not used by generated kernels yet: scripts/tma_check.py probes them on the H100 (PERF_NOTES
#34: the warpgroup-MMA kernels wait on their per-thread cp.async copies, cuDNN's copy with TMA).

A TMA copy moves one box of a global tensor, described by a 128-byte tensor map (runtime/tensor_map.py builds
it on the host and puts it in global memory), into shared memory, issued by one thread; the copy counts its
bytes on a shared mbarrier, and the threads that need the data wait on that barrier's phase.

mbarrier_init(bar, i, count): bar[i] (an int64 shared array) expects `count` arrivals per phase; then
          mbarrier_init_fence() and a block barrier before any other thread uses it.
mbarrier_expect_tx(bar, i, nbytes): one arrival that also announces nbytes of copies still to land this phase.
mbarrier_arrive(bar, i): one plain arrival.
mbarrier_try_wait(bar, i, parity) -> int32: 1 once the phase with this parity (0, 1, 0, ...) has completed
          (arrivals and bytes), else 0 after a bounded wait: loop on it.
named_barrier(id, count): bar.sync id, count - a barrier among `count` threads (a multiple of 32) that use
          the same id (1..15; 0 is __syncthreads), e.g. the consumer warpgroups without the producer warp.
tma_load_2d(dst, i, tmap, c0, c1, bar, j): the box at element coordinates (c0 innermost, c1) of the tiled
          tensor map (a device array holding it) into shared dst[i...] (128-byte aligned), completing on bar[j].
          Out-of-bounds elements arrive as zeros.
tma_load_4d(dst, i, tmap, c0, c1, c2, c3, bar, j): the same for a 4-D tiled map (a filter seen as (k, w, h, c),
          where a tap coordinate below 0 is a tap the filter lacks: zeros, KS-deconv's sub-filters).
tma_load_im2col_4d(dst, i, tmap, c, w, h, n, dw, dh, bar, j): the im2col tensor map's column of
          pixelsPerColumn pixels x channelsPerPixel channels starting at channel c of base pixel (n, h, w)
          (walking w, then h, then n through the map's bounding box) each read at (h + dh, w + dw): one filter
          tap of an implicit-GEMM A tile, padding included (zeros).
tma_load_im2col_5d(dst, i, tmap, c, w, h, d, n, dw, dh, dd, bar, j): the same for a 5-D map (C, W, H, D, N), a 3-D
          convolution's x: base pixel (n, d, h, w) walking w, h, d, then n, each read at (d + dd, h + dh, w + dw).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.cuda.extending import intrinsic

from ._cuda_wgmma_intrinsics import shared_address

_I16, _I32, _I64 = ir.IntType(16), ir.IntType(32), ir.IntType(64)


def _global_address(context, builder, aty, value):
    """The generic 64-bit address of a (device) array's first byte: where its tensor map lives."""
    return builder.ptrtoint(context.make_array(aty)(context, builder, value).data, _I64)


def _is_int(*tys):
    return all(isinstance(t, types.Integer) for t in tys)


@intrinsic
def mbarrier_init_fence(typingctx):
    def codegen(context, builder, sig, args):
        builder.asm(ir.FunctionType(ir.VoidType(), []), "fence.mbarrier_init.release.cluster;", "~{memory}", [],
                    side_effect=True, name="mbarrier_init_fence")
        return context.get_dummy_value()
    return types.void(), codegen


def _barrier_codegen(text, name, operands):
    """An instruction on mbarrier bar[i] (its shared address is $0), with `operands` (0 or 1) more: args[2] as the
    int32 $1."""
    def codegen(context, builder, sig, args):
        addr = shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        extra = [context.cast(builder, args[2], sig.args[2], types.int32)] if operands else []
        builder.asm(ir.FunctionType(ir.VoidType(), [_I32] * (1 + operands)), text,
                    ",".join(["r"] * (1 + operands)) + ",~{memory}", [addr, *extra], side_effect=True, name=name)
        return context.get_dummy_value()
    return codegen


@intrinsic
def mbarrier_init(typingctx, bar, i, count):
    if not (isinstance(bar, types.Array) and _is_int(i, count)):
        return None
    return types.void(bar, i, count), _barrier_codegen("mbarrier.init.shared::cta.b64 [$0], $1;", "mbarrier_init", 1)


@intrinsic
def mbarrier_expect_tx(typingctx, bar, i, nbytes):
    if not (isinstance(bar, types.Array) and _is_int(i, nbytes)):
        return None
    return types.void(bar, i, nbytes), _barrier_codegen(
        "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;", "mbarrier_expect_tx", 1)


@intrinsic
def mbarrier_arrive(typingctx, bar, i):
    if not (isinstance(bar, types.Array) and _is_int(i)):
        return None
    return types.void(bar, i), _barrier_codegen("mbarrier.arrive.shared::cta.b64 _, [$0];", "mbarrier_arrive", 0)


@intrinsic
def mbarrier_try_wait(typingctx, bar, i, parity):
    if not (isinstance(bar, types.Array) and _is_int(i, parity)):
        return None

    def codegen(context, builder, sig, args):
        addr = shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        par = context.cast(builder, args[2], sig.args[2], types.int32)
        text = ("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [$1], $2; "
                "selp.b32 $0, 1, 0, p; }")
        return builder.asm(ir.FunctionType(_I32, [_I32, _I32]), text, "=r,r,r,~{memory}", [addr, par],
                           side_effect=True, name="mbarrier_try_wait")
    return types.int32(bar, i, parity), codegen


@intrinsic
def tma_load_2d(typingctx, dst, i, tmap, c0, c1, bar, j):
    if not (all(isinstance(a, types.Array) for a in (dst, tmap, bar)) and _is_int(i, c0, c1, j)):
        return None

    def codegen(context, builder, sig, args):
        d = shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        m = _global_address(context, builder, sig.args[2], args[2])
        c = [context.cast(builder, args[k], sig.args[k], types.int32) for k in (3, 4)]
        b = shared_address(context, builder, sig.args[5], args[5], sig.args[6], args[6])
        text = ("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                "[$0], [$1, {$2, $3}], [$4];")
        builder.asm(ir.FunctionType(ir.VoidType(), [_I32, _I64, _I32, _I32, _I32]), text, "r,l,r,r,r,~{memory}",
                    [d, m, *c, b], side_effect=True, name="tma_load_2d")
        return context.get_dummy_value()
    return types.void(dst, i, tmap, c0, c1, bar, j), codegen


@intrinsic
def tma_load_4d(typingctx, dst, i, tmap, c0, c1, c2, c3, bar, j):
    if not (all(isinstance(a, types.Array) for a in (dst, tmap, bar)) and _is_int(i, c0, c1, c2, c3, j)):
        return None

    def codegen(context, builder, sig, args):
        d = shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        m = _global_address(context, builder, sig.args[2], args[2])
        c = [context.cast(builder, args[k], sig.args[k], types.int32) for k in (3, 4, 5, 6)]
        b = shared_address(context, builder, sig.args[7], args[7], sig.args[8], args[8])
        text = ("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                "[$0], [$1, {$2, $3, $4, $5}], [$6];")
        builder.asm(ir.FunctionType(ir.VoidType(), [_I32, _I64, _I32, _I32, _I32, _I32, _I32]), text,
                    "r,l,r,r,r,r,r,~{memory}", [d, m, *c, b], side_effect=True, name="tma_load_4d")
        return context.get_dummy_value()
    return types.void(dst, i, tmap, c0, c1, c2, c3, bar, j), codegen


@intrinsic
def tma_load_im2col_4d(typingctx, dst, i, tmap, c, w, h, n, dw, dh, bar, j):
    if not (all(isinstance(a, types.Array) for a in (dst, tmap, bar)) and _is_int(i, c, w, h, n, dw, dh, j)):
        return None

    def codegen(context, builder, sig, args):
        d = shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        m = _global_address(context, builder, sig.args[2], args[2])
        coords = [context.cast(builder, args[k], sig.args[k], types.int32) for k in (3, 4, 5, 6)]
        offsets = [context.cast(builder, args[k], sig.args[k], types.int16) for k in (7, 8)]
        b = shared_address(context, builder, sig.args[9], args[9], sig.args[10], args[10])
        text = ("cp.async.bulk.tensor.4d.shared::cluster.global.im2col.mbarrier::complete_tx::bytes "
                "[$0], [$1, {$2, $3, $4, $5}], [$6], {$7, $8};")
        builder.asm(ir.FunctionType(ir.VoidType(), [_I32, _I64, _I32, _I32, _I32, _I32, _I32, _I16, _I16]), text,
                    "r,l,r,r,r,r,r,h,h,~{memory}", [d, m, *coords, b, *offsets], side_effect=True,
                    name="tma_load_im2col_4d")
        return context.get_dummy_value()
    return types.void(dst, i, tmap, c, w, h, n, dw, dh, bar, j), codegen


@intrinsic
def tma_load_im2col_5d(typingctx, dst, i, tmap, c, w, h, d, n, dw, dh, dd, bar, j):
    if not (all(isinstance(a, types.Array) for a in (dst, tmap, bar)) and _is_int(i, c, w, h, d, n, dw, dh, dd, j)):
        return None

    def codegen(context, builder, sig, args):
        dst_addr = shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        m = _global_address(context, builder, sig.args[2], args[2])
        coords = [context.cast(builder, args[k], sig.args[k], types.int32) for k in (3, 4, 5, 6, 7)]
        offsets = [context.cast(builder, args[k], sig.args[k], types.int16) for k in (8, 9, 10)]
        b = shared_address(context, builder, sig.args[11], args[11], sig.args[12], args[12])
        text = ("cp.async.bulk.tensor.5d.shared::cluster.global.im2col.mbarrier::complete_tx::bytes "
                "[$0], [$1, {$2, $3, $4, $5, $6}], [$7], {$8, $9, $10};")
        builder.asm(ir.FunctionType(ir.VoidType(), [_I32, _I64, _I32, _I32, _I32, _I32, _I32, _I32, _I16, _I16, _I16]),
                    text, "r,l,r,r,r,r,r,r,h,h,h,~{memory}", [dst_addr, m, *coords, b, *offsets], side_effect=True,
                    name="tma_load_im2col_5d")
        return context.get_dummy_value()
    return types.void(dst, i, tmap, c, w, h, d, n, dw, dh, dd, bar, j), codegen


@intrinsic
def named_barrier(typingctx, ident, count):
    if not _is_int(ident, count):
        return None

    def codegen(context, builder, sig, args):
        vals = [context.cast(builder, v, t, types.int32) for v, t in zip(args, sig.args)]
        builder.asm(ir.FunctionType(ir.VoidType(), [_I32, _I32]), "bar.sync $0, $1;", "r,r,~{memory}", vals,
                    side_effect=True, name="named_barrier")
        return context.get_dummy_value()
    return types.void(ident, count), codegen
