"""Do TMA copies work from a numba kernel, and do they feed the tensor cores where cp.async does not?  A probe
for PERF_NOTES (#34), not a test: hand-written kernels for one layer (r50_3x3_28 forward: x 32x28x28x128,
w 128x3x3x128, padding 1), the shapes the tiled-GEMM template would generate.

    python scripts/tma_check.py [--out tma_check.json]      # on the H100 (scripts/gpu_run.sh tma-check)
    NUMBA_ENABLE_CUDASIM=0 python scripts/tma_check.py --compile-only   # anywhere: PTX -> ptxas sm_90a

1. copies: one im2col TMA copy (128 output pixels x 32 channels of one filter tap, padding as zeros) and one
   tiled copy (64 filters x 32 of their k) into shared memory, unswizzled and 128-byte swizzled, against NumPy;
   for the im2col offsets both readings ({dw, dh} and {dh, dw}) are reported.
2. streams: the layer's whole operand stream (392 blocks x 36 k slices of a 128 x 64 tile, 24 KiB a slice)
   copied global -> shared with no arithmetic, by TMA (one thread per block issues, mbarriers) and by
   16-byte cp.async from every thread (what the generated kernels do: .ca, allocating in L1; and .cg, through L2
   only): GB/s and the TFLOP/s the layer would run at if the copies were all it did.
3. conv: the layer computed by TMA copies feeding m64nBNk8 wgmma (two warpgroups, 128 x BN tiles, S stages;
   operands not rounded, see PERF_NOTES #35) in four schedules: a block barrier per slice (what the generated
   kernels do); warp-specialised as cuDNN's (a producer warp, full/empty mbarriers per stage, wait_group 1); the
   same with the consumers rounding each landed stage to TF32 in shared memory; the same persistent (one block
   per SM slot looping over the tiles); each checked on sampled outputs against float64 of exact, TF32-truncated
   and TF32-rounded operands, and timed beside cuDNN (torch, TF32 on, channels-last) in alternating rounds in the
   same process.  mbarrier waits give up after SPIN_LIMIT rounds: a wrong protocol shows as wrong numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

N, H, W, C, K, R, PAD = 32, 28, 28, 128, 128, 3, 1
HW, M, KTOT, BK, BM = H * W, N * H * W, R * R * C, 32, 128
SLICES, CCH = KTOT // BK, C // BK  # 36 k slices; 4 channel chunks of 32 per filter tap
THREADS = 256
SMS = 132
SPIN_LIMIT = 1 << 22  # mbarrier try_wait rounds before a wait gives up (each round is a bounded hardware wait)
FLOP = 2.0 * M * K * KTOT

# --- kernels, as source text (the constants are literals: wgmma_wait / copy_async_wait take literal counts) --

PRELUDE = '''
from numba import cuda, float32, int64
from kernelgen._cuda_tma_intrinsics import (mbarrier_arrive, mbarrier_expect_tx, mbarrier_init, mbarrier_init_fence,
                                            mbarrier_try_wait, named_barrier, tma_load_2d, tma_load_im2col_4d)
from kernelgen._cuda_mma_intrinsics import tf32
from kernelgen._cuda_wgmma_intrinsics import (async_proxy_fence, smem_desc_sw128, wgmma_commit, wgmma_fence, wgmma_tf32_m64n64k8,
                                              wgmma_tf32_m64n128k8, wgmma_wait)
from kernelgen.cuda_memory import copy_async16, copy_async16_l2, copy_async_commit, copy_async_wait
'''

# one block per 128 x BN output tile; thread 0 keeps S slices in flight; a block barrier per slice frees its stage
ISSUE_TMA = """tap = ({kt}) // {cch}
mbarrier_expect_tx(full, {stage}, {stage_bytes})
tma_load_im2col_4d(sm, {stage} * {stage_words}, xmap, (({kt}) % {cch}) * 32, wo - {pad}, ho - {pad}, n_img,
                   tap % {r}, tap // {r}, full, {stage})
tma_load_2d(sm, {stage} * {stage_words} + 4096, wmap, ({kt}) * 32, nb * {bn}, full, {stage})"""

# every TMA kernel's start: its tile, and the stages' mbarriers (full: the producer's arrival and the bytes;
# empty, when warp-specialised: the 256 consumers' arrivals)
TMA_HEAD = '''
@cuda.jit
def {name}(xmap, wmap, y):
    sm = cuda.shared.array(0, float32, alignment=1024)
    full = cuda.shared.array({s}, int64)
    empty = cuda.shared.array({s}, int64)
    t = cuda.threadIdx.x
    wg = t // 128
    mb = cuda.blockIdx.x // {nbs}
    nb = cuda.blockIdx.x % {nbs}
    m0 = mb * 128
    n_img = m0 // {hw}
    ho = (m0 % {hw}) // {w}
    wo = m0 % {w}
    if t == 0:
        for s in range({s}):
            mbarrier_init(full, s, 1)
            mbarrier_init(empty, s, 256)
        mbarrier_init_fence()
    cuda.syncthreads()
'''

TMA_BLOCK = TMA_HEAD + '''\
    if t == 0:
        for kt in range({s}):
{issue_first}
    {init}
    for kt in range({slices}):
        stage = kt % {s}
        spins = 0  # bounded: a wrong protocol ends with wrong numbers, not a hung GPU
        while mbarrier_try_wait(full, stage, (kt // {s}) % 2) == 0 and spins < {spin_limit}:
            spins += 1
{body}
        cuda.syncthreads()
        if t == 0 and kt + {s} < {slices}:
{issue_next}
{epilogue}
'''

# cuDNN's way (warp specialisation): an extra warp produces (one thread waits for a stage to be released and
# refills it), the two consumer warpgroups wait for a stage to fill, issue its MMAs, and release the previous
# stage once wgmma.wait_group 1 says its MMAs are done: no block barrier, one batch of MMAs always in flight
TMA_WS = TMA_HEAD + '''\
    if t >= 256:
        if t == 256:
            for kt in range({slices}):
                stage = kt % {s}
                if kt >= {s}:
                    spins = 0  # bounded: a wrong protocol ends with wrong numbers, not a hung GPU
                    while mbarrier_try_wait(empty, stage, (kt // {s} - 1) % 2) == 0 and spins < {spin_limit}:
                        spins += 1
{issue}
    else:
        {init}
        for kt in range({slices}):
            stage = kt % {s}
            spins = 0  # bounded: a wrong protocol ends with wrong numbers, not a hung GPU
            while mbarrier_try_wait(full, stage, (kt // {s}) % 2) == 0 and spins < {spin_limit}:
                spins += 1
{rounding}
{body}
            if kt > 0:
                mbarrier_arrive(empty, (kt + {s} - 1) % {s})
        {acc} = wgmma_wait(({acc},), 0)
{epilogue}
'''

# ws, persistent as cuDNN's: one block per SM slot walks the tiles tile = block, block + grid, ...; the producer
# runs ahead into the next tile while the consumers store this one; stage and phase follow a running slice count
TMA_WS_PERSISTENT = TMA_HEAD + '''\
    if t >= 256:
        if t == 256:
            it = 0
            for tile in range(cuda.blockIdx.x, {tiles}, cuda.gridDim.x):
{tile_coords_producer}
                for kt in range({slices}):
                    stage = it % {s}
                    if it >= {s}:
                        spins = 0  # bounded: a wrong protocol ends with wrong numbers, not a hung GPU
                        while mbarrier_try_wait(empty, stage, (it // {s} - 1) % 2) == 0 and spins < {spin_limit}:
                            spins += 1
{issue}
                    it += 1
    else:
        it = 0
        for tile in range(cuda.blockIdx.x, {tiles}, cuda.gridDim.x):
{tile_coords_consumer}
{init}
            for kt in range({slices}):
                stage = it % {s}
                spins = 0  # bounded: a wrong protocol ends with wrong numbers, not a hung GPU
                while mbarrier_try_wait(full, stage, (it // {s}) % 2) == 0 and spins < {spin_limit}:
                    spins += 1
{body}
                if it > 0:
                    mbarrier_arrive(empty, (it + {s} - 1) % {s})
                it += 1
            {acc} = wgmma_wait(({acc},), 0)
{epilogue}
'''

# the generated kernels' way: every thread copies 16-byte chunks with cp.async, S - 1 slices ahead
ISSUE_LDGSTS = """tap = ({kt}) // {cch}
r = tap // {r}
s = tap % {r}
c0 = (({kt}) % {cch}) * 32
base = ({stage}) * {stage_words}
for i in range(4):
    u = t + {threads} * i
    line = u // 8
    q = u % 8
    m = m0 + line
    n = m // {hw}
    hi = (m % {hw}) // {w} + r - {pad}
    wi = m % {w} + s - {pad}
    ok = hi >= 0 and hi < {h} and wi >= 0 and wi < {w}
    src = ((n * {h} + hi) * {w} + wi) * {c} + c0 + 4 * q
    {copy}(sm, base + line * 32 + (q ^ (line % 8)) * 4, x, src if ok else 0, ok)
for i in range({b_per}):
    u = t + {threads} * i
    line = u // 8
    q = u % 8
    {copy}(sm, base + 4096 + line * 32 + (q ^ (line % 8)) * 4, w,
                 (nb * {bn} + line) * {ktot} + ({kt}) * 32 + 4 * q, True)"""

LDGSTS_STREAM = '''
@cuda.jit
def {name}(x, w, y):
    sm = cuda.shared.array(0, float32, alignment=1024)
    t = cuda.threadIdx.x
    mb = cuda.blockIdx.x // {nbs}
    nb = cuda.blockIdx.x % {nbs}
    m0 = mb * 128
    for kt in range({s} - 1):
{issue_first}
        copy_async_commit()
    seen = float32(0.0)
    for kt in range({slices}):
        copy_async_wait({s} - 2)
        cuda.syncthreads()
        if kt + {s} - 1 < {slices}:
{issue_next}
        copy_async_commit()
        seen += sm[(kt % {s}) * {stage_words} + t]
    y[cuda.blockIdx.x * {threads} + t] = seen
'''


def _fields(bn, s):
    stage_words = 4096 + bn * 32
    return dict(spin_limit=SPIN_LIMIT, threads=THREADS, cch=CCH, r=R, pad=PAD, hw=HW, h=H, w=W, c=C, ktot=KTOT, slices=SLICES, bn=bn, s=s,
                nbs=K // bn, stage_words=stage_words, stage_bytes=stage_words * 4, b_per=bn * 8 // THREADS)


def _snippet(text, f, indent, kt, stage):
    """A copy-issuing snippet for slice kt into stage, indented into a kernel's source."""
    return "\n".join(" " * indent + line for line in text.format(kt=kt, stage=stage, **f).splitlines())


def _indent(text, spaces):
    return "\n".join(" " * spaces + line if line else line for line in text.splitlines())


def tma_source(bn, s, kind):
    """Source of the TMA kernel of this kind: "stream" (copies only), "barrier" (wgmma, a block barrier per
    slice), "ws" (wgmma, warp-specialised), "ws_round" (ws, operands rounded to TF32 in shared memory) or
    "ws_persistent" (ws, one block per SM slot looping over the tiles)."""
    f = _fields(bn, s)
    f.update(issue_first=_snippet(ISSUE_TMA, f, 12, "kt", "kt"),
             issue_next=_snippet(ISSUE_TMA, f, 12, f"kt + {s}", "stage"))
    regs = bn // 2
    acc = ", ".join(f"c{i}" for i in range(regs))  # named scalars: the accumulators stay in registers
    mmas = "\n".join(f"{acc} = wgmma_tf32_m64n{bn}k8(({acc},), smem_desc_sw128(sm, a0 + {8 * ks}, 16, 1024), "
                     f"smem_desc_sw128(sm, b0 + {8 * ks}, 16, 1024))" for ks in range(4))
    body = (f"wgmma_fence()\na0 = stage * {f['stage_words']} + wg * 2048\nb0 = stage * {f['stage_words']} + 4096\n"
            f"{mmas}\nwgmma_commit()\n{acc} = wgmma_wait(({acc},), {1 if kind.startswith('ws') else 0})")
    # acc[4 j + r] of lane 4 g + q in warp wq of the warpgroup: row 16 wq + g + 8 (r // 2), column 8 j + 2 q + r % 2
    lines = ["wq = (t % 128) // 32", "g = (t % 32) // 4", "q = t % 4", "row = m0 + wg * 64 + 16 * wq + g",
             f"col = nb * {bn} + 2 * q"]
    lines += [f"y[(row + {8 * (r // 2)}) * {K} + col + {8 * j + r % 2}] = c{4 * j + r}"
              for j in range(bn // 8) for r in range(4)]
    init = "\n".join(f"c{i} = float32(0.0)" for i in range(regs))
    if kind in ("ws", "ws_round"):
        # ws_round: the consumers round the landed stage to TF32 in place (wgmma would truncate it), 16 bytes a
        # thread at a time, then fence it for the async proxy and meet at a barrier of their own (id 1)
        rounding = "" if kind == "ws" else _indent(
            f"for e in range(t, {f['stage_words'] // 4}, 256):\n"
            f"    i = stage * {f['stage_words']} + 4 * e\n"
            + "".join(f"    sm[i + {j}] = tf32(sm[i + {j}])\n" for j in range(4))
            + "async_proxy_fence()\nnamed_barrier(1, 256)", 12)
        src = TMA_WS.format(name=f"conv_tma_{kind}", issue=_snippet(ISSUE_TMA, f, 16, "kt", "stage"),
                            init=_indent(init, 8).lstrip(), rounding=rounding, body=_indent(body, 12), acc=acc,
                            epilogue=_indent("\n".join(lines), 8), **f)
        return PRELUDE + src, f"conv_tma_{kind}"
    if kind == "ws_persistent":
        coords = (f"mb = tile // {f['nbs']}\nnb = tile % {f['nbs']}\nm0 = mb * 128\nn_img = m0 // {HW}\n"
                  f"ho = (m0 % {HW}) // {W}\nwo = m0 % {W}")
        src = TMA_WS_PERSISTENT.format(
            name="conv_tma_ws_persistent", tiles=(M // BM) * f["nbs"], tile_coords_producer=_indent(coords, 16),
            tile_coords_consumer=_indent(coords, 12), issue=_snippet(ISSUE_TMA, f, 20, "kt", "stage"),
            init=_indent(init, 12), body=_indent(body, 16), acc=acc, epilogue=_indent("\n".join(lines), 12), **f)
        return PRELUDE + src, "conv_tma_ws_persistent"
    if kind == "stream":
        body, lines, init = f"seen += sm[stage * {f['stage_words']} + t]", [f"y[cuda.blockIdx.x * {THREADS} + t] = seen"], \
            "seen = float32(0.0)"
    src = TMA_BLOCK.format(name="stream_tma" if kind == "stream" else "conv_tma_wgmma", init=_indent(init, 4).lstrip(),
                           body=_indent(body, 8), epilogue=_indent("\n".join(lines), 4), **f)
    return PRELUDE + src, "stream_tma" if kind == "stream" else "conv_tma_wgmma"


def build(src, name):
    ns = {}
    exec(compile(src, f"<{name}>", "exec"), ns)
    return ns[name]


def kernels(bn, s):
    """(label, source, kernel name, dynamic shared bytes, threads) of the probe's kernels for BN x S."""
    f = _fields(bn, s)
    nbytes = s * f["stage_bytes"]
    out = []
    for kind in ("stream", "barrier", "ws", "ws_round", "ws_persistent"):
        src, name = tma_source(bn, s, kind)
        out.append((f"{name}_bn{bn}_s{s}", src, name, nbytes, THREADS + 32 * kind.startswith("ws")))
    for name, copy in (("stream_ldgsts", "copy_async16"), ("stream_ldgsts_l2", "copy_async16_l2")):  # .ca / .cg
        g = dict(f, copy=copy)
        g.update(issue_first=_snippet(ISSUE_LDGSTS, g, 8, "kt", "kt"),
                 issue_next=_snippet(ISSUE_LDGSTS, g, 12, f"kt + {s - 1}", f"(kt + {s - 1}) % {s}"))
        out.append((f"{name}_bn{bn}_s{s}", PRELUDE + LDGSTS_STREAM.format(name=name, **g), name, nbytes, THREADS))
    return out


# --- host side ------------------------------------------------------------------------------------------------

def tensor_maps(x_dev, w_dev, bn, swizzle):
    from kernelgen.runtime.tensor_map import channels_last, encode_im2col, encode_tiled
    from numba import cuda
    dims, strides = channels_last((N, H, W, C))
    xmap = encode_im2col(x_dev.device_ctypes_pointer.value, np.float32, dims, strides, (-PAD, -PAD),
                         (PAD - (R - 1), PAD - (R - 1)), 32, 128, swizzle=swizzle)
    wmap = encode_tiled(w_dev.device_ctypes_pointer.value, np.float32, (KTOT, K), (KTOT * 4,), (32, bn),
                        swizzle=swizzle)
    return cuda.to_device(xmap), cuda.to_device(wmap)


def tap_row(x, m, dh, dw):
    """The C channels that output pixel m reads at filter tap (dh, dw): zeros in the padding."""
    n, ho, wo = m // HW, (m % HW) // W, m % W
    hi, wi = ho - PAD + dh, wo - PAD + dw
    return x[n, hi, wi] if 0 <= hi < H and 0 <= wi < W else np.zeros(C, x.dtype)


def expected_a(x, m0, c0, dh, dw):
    """The 128 x 32 im2col tile: pixels m0.. at tap (dh, dw), channels c0..c0 + 31."""
    return np.stack([tap_row(x, m0 + p, dh, dw)[c0:c0 + 32] for p in range(128)])


def check_copies(x, w2d, x_dev, w_dev):
    from numba import cuda

    from kernelgen.runtime.tensor_map import copy_kernel, unswizzle128
    k = copy_kernel()
    results = []
    for swizzle in (None, 128):
        xmap, wmap = tensor_maps(x_dev, w_dev, 64, swizzle)
        for m0, (r, s), c0, kb, nb0 in ((0, (0, 2), 0, 64, 0), (768, (2, 1), 96, 1120, 64), (M - 128, (1, 0), 32, 0, 64)):
            n, ho, wo = m0 // HW, (m0 % HW) // W, m0 % W
            coords = np.array([c0, wo - PAD, ho - PAD, n, s, r, kb, nb0], np.int32)
            out = cuda.to_device(np.full(6144, np.nan, np.float32))
            k[1, 128, 0, 6144 * 4](xmap, wmap, out, cuda.to_device(coords), 4096, 2048)
            got = out.copy_to_host()
            a, b = got[:4096].reshape(128, 32), got[4096:].reshape(64, 32)
            if swizzle:
                a, b = unswizzle128(a), unswizzle128(b)
            row = dict(swizzle=swizzle, m0=m0, tap=(r, s), c0=c0,
                       a_dw_dh=bool(np.array_equal(a, expected_a(x, m0, c0, r, s))),
                       a_dh_dw=bool(np.array_equal(a, expected_a(x, m0, c0, s, r))),
                       b=bool(np.array_equal(b, w2d[nb0:nb0 + 64, kb:kb + 32])))
            results.append(row)
            print(f"copy swizzle={swizzle} m0={m0} tap={r, s} c0={c0}: im2col offsets (dw, dh) "
                  f"{'ok' if row['a_dw_dh'] else 'WRONG'}, (dh, dw) {'ok' if row['a_dh_dw'] else 'wrong'}; "
                  f"tiled {'ok' if row['b'] else 'WRONG'}", flush=True)
    return results


def cudnn_conv(x, w):
    """cuDNN's convolution of the layer (torch, TF32 on, channels-last), or None without torch."""
    try:
        import torch
    except ImportError:
        return None
    torch.backends.cudnn.allow_tf32 = True
    xt = torch.from_numpy(x).cuda().permute(0, 3, 1, 2)  # NHWC storage = channels-last NCHW view
    wt = torch.from_numpy(w).cuda().permute(0, 3, 1, 2)
    return lambda: torch.nn.functional.conv2d(xt, wt, padding=PAD)


def check_conv(y, x, w2d, rng):
    """Max relative errors of 256 sampled output pixels against float64 of the exact, the TF32-truncated
    (what wgmma reads from float32) and the TF32-rounded (cvt.rna) operands."""
    ms = rng.choice(M, 256, replace=False)
    got = y.reshape(M, K)[ms].astype(np.float64)
    bits = lambda a, add: ((a.view(np.uint32) + np.uint32(add)) & np.uint32(0xFFFFE000)).view(np.float32)
    out = {}
    for label, op in (("exact", lambda a: a), ("truncated", lambda a: bits(a, 0)), ("rounded", lambda a: bits(a, 0x1000))):
        xr, wr = op(x).astype(np.float64), op(w2d).astype(np.float64)
        patches = np.stack([np.concatenate([tap_row(xr, m, r, s) for r in range(R) for s in range(R)]) for m in ms])
        ref = patches @ wr.T
        out[label] = float(np.max(np.abs(got - ref)) / np.abs(ref).max())
    return out


def run(args):
    from numba import cuda
    from kernelgen.runtime.launch import allow_dynamic_shared
    from kernelgen.tuning.timing import time_cuda, time_host, time_side_by_side
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, H, W, C)).astype(np.float32)
    w = rng.standard_normal((K, R, R, C)).astype(np.float32)
    w2d = w.reshape(K, KTOT)
    x_dev, w_dev = cuda.to_device(x.ravel()), cuda.to_device(w2d.ravel())
    report = {"runs": []}
    try:
        report["copies"] = check_copies(x, w2d, x_dev, w_dev)
    except Exception as e:  # e.g. the driver refuses a map: the cp.async streams can still run
        print(f"copies: {type(e).__name__}: {e}", flush=True)
        report["copies"] = f"{type(e).__name__}: {e}"
    cudnn = cudnn_conv(x, w)
    for bn, s in ((64, 4), (128, 4), (128, 6)):
        try:
            xmap, wmap = tensor_maps(x_dev, w_dev, bn, 128)
        except Exception as e:
            print(f"tensor maps for BN {bn}: {type(e).__name__}: {e}", flush=True)
            xmap = wmap = None
        tiles = (M // BM) * (K // bn)
        for label, src, name, nbytes, threads in kernels(bn, s):
            conv = name.startswith("conv_")
            # persistent: as many blocks as fit at once (228 KiB of shared memory per SM, 1 KiB reserved a block)
            blocks = SMS * min(2, 228 * 1024 // (nbytes + 2048)) if name.endswith("persistent") else tiles
            try:
                k = build(src, name)
                tma = not name.startswith("stream_ldgsts")
                if tma and xmap is None:
                    raise RuntimeError("no tensor maps")
                y = cuda.to_device(np.full(M * K if conv else tiles * THREADS, np.nan, np.float32))
                ordered = (xmap, wmap, y) if tma else (x_dev, w_dev, y)
                allow_dynamic_shared(k, ordered, nbytes)
                launch = lambda: k[blocks, threads, 0, nbytes](*ordered)
                # one checked call first: a kernel that computes nonsense, or crawls through its bounded waits,
                # is reported, not timed
                first_ms = time_host(lambda: (launch(), cuda.synchronize()), warmup=0, repeat=1)
                err = check_conv(y.copy_to_host(), x, w2d, rng) if conv else None  # exact / truncated / rounded
                if (err and not min(err.values()) <= 1e-2) or first_ms > 200:  # garbage is ~1 off
                    raise RuntimeError(f"not timed: first call {first_ms:.0f} ms, errors {err}")
                if conv and cudnn:  # side by side, alternating rounds (tuning.timing)
                    us, base_us = (1e3 * ms for ms in time_side_by_side([launch, cudnn]))
                else:
                    us, base_us = 1e3 * time_cuda(launch), None
            except Exception as e:  # report and go on to the next kernel
                print(f"{label}: {type(e).__name__}: {e}", flush=True)
                report["runs"].append(dict(kernel=label, error=f"{type(e).__name__}: {e}"))
                continue
            moved = tiles * SLICES * (4096 + bn * 32) * 4  # bytes landing in shared memory
            row = dict(kernel=label, bn=bn, stages=s, us=us, gb_s=moved / us / 1e3, tflops=FLOP / us / 1e6,
                       regs=next(iter(k.get_regs_per_thread().values())))
            if conv:
                row.update(max_rel_err=err, cudnn_us=base_us, vs_cudnn=base_us / us if base_us else None)
            report["runs"].append(row)
            print(f"{label:34s} {us:8.1f} us  {row['gb_s']:7.0f} GB/s into shared  {row['tflops']:6.1f} TFLOP/s"
                  + ("  err {exact:.1e} (truncated {truncated:.1e}, rounded {rounded:.1e})".format(**row["max_rel_err"])
                     + f"  {row['vs_cudnn'] or 0:.2f}x cuDNN" if 'max_rel_err' in row
                     else "  (copies alone)"), flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


def compile_only():
    """PTX and ptxas -arch=sm_90a for every kernel: syntax, registers, and the SASS census, without a GPU."""
    import re
    import subprocess
    import tempfile

    from numba import cuda, types

    from kernelgen.runtime.tensor_map import copy_kernel
    sys.path.insert(0, os.path.dirname(__file__))
    from ptx_check import _allow_missing_nvrtc, _disassembler, ptxas
    _allow_missing_nvrtc()
    workdir = tempfile.mkdtemp(prefix="kg_tma_")
    arr = lambda dt: types.Array(dt, 1, "C")
    maps = (arr(types.uint64), arr(types.uint64))
    todo = [("copy_kernel", copy_kernel(), (*maps, arr(types.float32), arr(types.int32), types.int64, types.int64))]
    for bn, s in ((64, 4), (128, 6)):
        for label, src, name, _, _ in kernels(bn, s):
            first = (arr(types.float32),) * 2 if name.startswith("stream_ldgsts") else maps
            todo.append((label, build(src, name), (*first, arr(types.float32))))
    tool = _disassembler()
    for label, k, sig in todo:
        ptx, _ = cuda.compile_ptx(k.py_func, sig, cc=(9, 0))
        path = os.path.join(workdir, f"{label}.ptx")
        with open(path, "w") as f:
            f.write(ptx.replace(".target sm_90\n", ".target sm_90a\n"))
        text, res = ptxas(path, path[:-4] + ".cubin")
        for advice in (line for line in text.splitlines() if "Performance" in line or "serializ" in line):
            print("  ptxas:", advice.strip())  # e.g. wgmma serialised by ptxas
        sass = subprocess.run([*tool, path[:-4] + ".cubin"], capture_output=True, text=True).stdout if tool else ""
        census = {op: len(re.findall(rf"\b{op}\b", sass)) for op in ("UTMALDG", "HGMMA", "SYNCS", "LDGSTS")}
        print(f"{label:34s} regs {res['registers']} spills {res['spill_stores']}/{res['spill_loads']} "
              f"stack {res['local_bytes']} {census}", flush=True)
    print("files in", workdir)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="tma_check.json")
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args(argv)
    if args.compile_only:
        os.environ.setdefault("NUMBA_FORCE_CUDA_CC", "9.0")
        os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")
        return compile_only()
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
