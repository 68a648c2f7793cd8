"""The hand-written kernels of scripts/tma_check.py, as source text with the layer's constants filled in (the
counts are literals: wgmma_wait and copy_async_wait take literal arguments).  See tma_check.py for what each
measures; `kernels(bn, s)` lists them for one block tile width and stage count."""
from __future__ import annotations

import re

N, H, W, C, K, R, PAD = 32, 28, 28, 128, 128, 3, 1
HW, M, KTOT, BK, BM = H * W, N * H * W, R * R * C, 32, 128
SLICES, CCH = KTOT // BK, C // BK  # 36 k slices; 4 channel chunks of 32 per filter tap
THREADS = 256
SMS = 132
SPIN_LIMIT = 1 << 22  # mbarrier try_wait rounds before a wait gives up (each round is a bounded hardware wait)
FLOP = 2.0 * M * K * KTOT

PRELUDE = '''
from numba import cuda, float32, int64
from kernelgen._cuda_tma_intrinsics import (mbarrier_arrive, mbarrier_expect_tx, mbarrier_init, mbarrier_init_fence,
                                            mbarrier_try_wait, named_barrier, tma_load_2d, tma_load_im2col_4d)
from kernelgen._cuda_mma_intrinsics import tf32
from kernelgen._cuda_wgmma_intrinsics import (async_proxy_fence, smem_desc_sw128, wgmma_commit, wgmma_fence,
                                              wgmma_tf32_m64n64k8, wgmma_tf32_m64n128k8, wgmma_wait)
from kernelgen.cuda_memory import copy_async16, copy_async16_l2, copy_async_commit, copy_async_wait
'''


def bounded_waits(template):
    """The kernel template with each line `wait(bar, parity)` spelled out as a bounded wait on bar[stage] at that
    indentation: a wrong protocol ends with wrong numbers, not a hung GPU."""
    def spell(m):
        pad, bar, parity = m.groups()
        return (f"{pad}spins = 0  # bounded: a wrong protocol ends with wrong numbers, not a hung GPU\n"
                f"{pad}while mbarrier_try_wait({bar}, stage, {parity}) == 0 and spins < {{spin_limit}}:\n"
                f"{pad}    spins += 1\n")
    return re.sub(r"^( *)wait\((\w+), (.*)\)\n", spell, template, flags=re.M)

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

TMA_BLOCK = bounded_waits(TMA_HEAD + '''\
    if t == 0:
        for kt in range({s}):
{issue_first}
    {init}
    for kt in range({slices}):
        stage = kt % {s}
        wait(full, (kt // {s}) % 2)
{body}
        cuda.syncthreads()
        if t == 0 and kt + {s} < {slices}:
{issue_next}
{epilogue}
''')

# cuDNN's way (warp specialisation): an extra warp produces (one thread waits for a stage to be released and
# refills it), the two consumer warpgroups wait for a stage to fill, issue its MMAs, and release the previous
# stage once wgmma.wait_group 1 says its MMAs are done: no block barrier, one batch of MMAs always in flight
TMA_WS = bounded_waits(TMA_HEAD + '''\
    if t >= 256:
        if t == 256:
            for kt in range({slices}):
                stage = kt % {s}
                if kt >= {s}:
                    wait(empty, (kt // {s} - 1) % 2)
{issue}
    else:
        {init}
        for kt in range({slices}):
            stage = kt % {s}
            wait(full, (kt // {s}) % 2)
{rounding}
{body}
            if kt > 0:
                mbarrier_arrive(empty, (kt + {s} - 1) % {s})
        {acc} = wgmma_wait(({acc},), 0)
{epilogue}
''')

# ws, persistent as cuDNN's: one block per SM slot walks the tiles tile = block, block + grid, ...; the producer
# runs ahead into the next tile while the consumers store this one; stage and phase follow a running slice count
TMA_WS_PERSISTENT = bounded_waits(TMA_HEAD + '''\
    if t >= 256:
        if t == 256:
            it = 0
            for tile in range(cuda.blockIdx.x, {tiles}, cuda.gridDim.x):
{tile_coords_producer}
                for kt in range({slices}):
                    stage = it % {s}
                    if it >= {s}:
                        wait(empty, (it // {s} - 1) % 2)
{issue}
                    it += 1
    else:
        it = 0
        for tile in range(cuda.blockIdx.x, {tiles}, cuda.gridDim.x):
{tile_coords_consumer}
{init}
            for kt in range({slices}):
                stage = it % {s}
                wait(full, (it // {s}) % 2)
{body}
                if it > 0:
                    mbarrier_arrive(empty, (it + {s} - 1) % {s})
                it += 1
            {acc} = wgmma_wait(({acc},), 0)
{epilogue}
''')

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
    return dict(spin_limit=SPIN_LIMIT, threads=THREADS, cch=CCH, r=R, pad=PAD, hw=HW, h=H, w=W, c=C, ktot=KTOT,
                slices=SLICES, bn=bn, s=s,
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
        body, init = f"seen += sm[stage * {f['stage_words']} + t]", "seen = float32(0.0)"
        lines = [f"y[cuda.blockIdx.x * {THREADS} + t] = seen"]
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
