"""Small elementwise device kernels the API needs around the generated ones."""
from __future__ import annotations

import numpy as np

from kernelgen.arrays import to_device_view
from kernelgen.runtime.driver import _FastLaunch, configure

_bias_kernel = None


def _add_channel_bias_body(y, bias, channels):
    # module-level so the simulator can swap this module's `cuda` global for its fake one
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < y.size:
        y[i] += bias[i % channels]


def add_channel_bias(y, bias, stream=None):
    """y[..., c] += bias[c] in place, for a C-contiguous channels-last device array y."""
    global _bias_kernel, cuda
    from numba import cuda
    if _bias_kernel is None:
        _bias_kernel = cuda.jit(_add_channel_bias_body)
    d = to_device_view(y, "y")
    flat = d.reshape(d.size)
    b = to_device_view(bias, "bias")
    grid = (flat.size + 255) // 256
    configure(_bias_kernel, grid, 256, stream or 0)(flat, b, b.size)


_round_kernel = None
_round_fast = None
ROUND_GRID, ROUND_THREADS = 1056, 256  # 8 blocks per SM of an H100, striding over any size
PAIR_BLOCKS = 528  # blocks per plain operand of a pair: together at most the one-array grid
_flip_kernel = None
_flip_fast = {}
_flip16_kernel = None
_flip16_fast = {}
_pair_kernel = None
_pair_fast = {}


def _round_word(b):
    # a uint32 word: + half a TF32 unit in the last place, then drop the 13 low bits (ties away from zero); NaN as
    # the canonical NaN, inf as itself
    if b & 0x7F800000 == 0x7F800000:
        return 0x7FFFFFFF if b & 0x7FFFFF else b
    return (b + 0x1000) & 0xFFFFE000


def _round_range(src, dst, first, step):
    for i in range(first, src.size, step):
        dst[i] = round_word(src[i])


def _flip_tile(src, dst, K, T, C, blk, tile, rounds):
    # tile blk of (32 c, 32 k, one tap): read src[k, t, :] along c, write dst[c, T - 1 - t, :] along k, through a
    # padded shared tile so that both sides are whole lines (8 warps, 4 rows each); rounds: TF32-round the words
    # (else move the elements as they are: float16 bit patterns)
    lane, row = cuda.threadIdx.x % 32, cuda.threadIdx.x // 32
    cs, ks = (C + 31) // 32, (K + 31) // 32
    c0, k0, t = (blk % cs) * 32, ((blk // cs) % ks) * 32, blk // (cs * ks)
    for j in range(row, 32, 8):
        k, c = k0 + j, c0 + lane
        if k < K and c < C:
            v = src[(k * T + t) * C + c]
            tile[j, lane] = round_word(v) if rounds else v
    cuda.syncthreads()
    for j in range(row, 32, 8):
        c, k = c0 + j, k0 + lane
        if c < C and k < K:
            dst[(c * T + (T - 1 - t)) * K + k] = tile[lane, j]


def _round_tf32_body(src, dst):
    round_range(src, dst, cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, cuda.gridDim.x * cuda.blockDim.x)


def _round_flip_body(src, dst, K, T, C):
    flip_tile(src, dst, K, T, C, cuda.blockIdx.x, cuda.shared.array((32, 33), np.uint32), True)


def _flip16_body(src, dst, K, T, C):
    flip_tile(src, dst, K, T, C, cuda.blockIdx.x, cuda.shared.array((32, 33), np.uint16), False)


def _round_pair_body(a_src, a_dst, b_src, b_dst, K, T, C, a_blocks):
    # one launch for both operands of a TMA kernel: blocks [0, a_blocks) round a, the rest b (flipped when K > 0)
    tile = cuda.shared.array((32, 33), np.uint32)
    blk = cuda.blockIdx.x
    if blk < a_blocks:
        round_range(a_src, a_dst, blk * cuda.blockDim.x + cuda.threadIdx.x, a_blocks * cuda.blockDim.x)
    elif K > 0:
        flip_tile(b_src, b_dst, K, T, C, blk - a_blocks, tile, True)
    else:
        round_range(b_src, b_dst, (blk - a_blocks) * cuda.blockDim.x + cuda.threadIdx.x,
                    (cuda.gridDim.x - a_blocks) * cuda.blockDim.x)


def _jit(body):
    """A rounding kernel, its device functions compiled first (module globals, so that the simulator can swap
    this module's `cuda` for its fake one)."""
    global cuda, round_word, round_range, flip_tile
    from numba import cuda
    if "round_word" not in globals():
        round_word = cuda.jit(device=True)(_round_word)
        round_range = cuda.jit(device=True)(_round_range)
        flip_tile = cuda.jit(device=True)(_flip_tile)
    return cuda.jit(body)


def _round_dispatcher():
    global _round_kernel
    if _round_kernel is None:
        _round_kernel = _jit(_round_tf32_body)
    return _round_kernel


def _flip_dispatcher():
    global _flip_kernel
    if _flip_kernel is None:
        _flip_kernel = _jit(_round_flip_body)
    return _flip_kernel


def _flip16_dispatcher():
    global _flip16_kernel
    if _flip16_kernel is None:
        _flip16_kernel = _jit(_flip16_body)
    return _flip16_kernel


def _pair_dispatcher():
    global _pair_kernel
    if _pair_kernel is None:
        _pair_kernel = _jit(_round_pair_body)
    return _pair_kernel


def _launch(kernel, grid, threads, stream):
    return configure(kernel, grid, threads, stream or 0)


def round_tf32_device(src, dst, stream=None):
    """dst[:] = src rounded to TF32 (what cvt.rna.tf32.f32 gives), both 1D float32 device arrays of one size: the
    operands of a TMA-fed tensor-core kernel, which reads them as they are (ir_async.TensorMap.rounding)."""
    _launch(_round_dispatcher(), _round_grid(src.size), ROUND_THREADS, stream)(src.view(np.uint32),
                                                                               dst.view(np.uint32))


def _round_grid(n):
    """Blocks for n words: ROUND_GRID striding over large arrays, no idle blocks for small ones."""
    return max(1, min(ROUND_GRID, -(-n // ROUND_THREADS)))


def round_tf32_step(src, dst, n, stream_handle=0):
    """round_tf32_device on raw device addresses of n float32 words as a driver step, launched without numba's
    dispatcher (a launch program's: runtime/program.py; this runs before every TF32 TMA kernel)."""
    return _round_launch().step([(src, n), (dst, n)], 4, stream_handle)


def _round_launch():
    global _round_fast
    if _round_fast is None or not _round_fast.usable():
        from numba import cuda
        kernel, scratch = _round_dispatcher(), cuda.device_array(1, np.uint32)
        configure(kernel, 1, ROUND_THREADS)(scratch, scratch)  # compiles its one overload
        _round_fast = _FastLaunch(kernel, ROUND_GRID, ROUND_THREADS, 2)
    return _round_fast


def _flip_tiles(K, T, C):
    return -(-C // 32) * -(-K // 32) * T


def round_tf32_flipped_device(src, dst, flip, stream=None):
    """dst (C, T, K) = src (K, T, C) with the taps reversed, rounded as round_tf32_device rounds (flip = (K, T,
    C); 1D float32 device arrays): a stride-1 backward-data's filter as the forward convolution it is reads it
    (ir_async.TensorMap.flip)."""
    _launch(_flip_dispatcher(), _flip_tiles(*flip), ROUND_THREADS, stream)(src.view(np.uint32), dst.view(np.uint32),
                                                                            *flip)


def _pair_grid(n_a, n_b, flip_b):
    a_blocks = min(PAIR_BLOCKS, -(-n_a // ROUND_THREADS))
    b_blocks = _flip_tiles(*flip_b) if flip_b else min(PAIR_BLOCKS, -(-n_b // ROUND_THREADS))
    return a_blocks, a_blocks + b_blocks


def round_tf32_pair_device(a_src, a_dst, b_src, b_dst, flip_b=(), stream=None):
    """round_tf32_device of a, and of b (round_tf32_flipped_device when flip_b), in one launch: a TMA kernel's two
    operands (each launch adds ~10-20 us to a call's latency on the H100 machine: PERF_NOTES #42)."""
    a_blocks, grid = _pair_grid(a_src.size, b_src.size, flip_b)
    _launch(_pair_dispatcher(), grid, ROUND_THREADS, stream)(
        a_src.view(np.uint32), a_dst.view(np.uint32), b_src.view(np.uint32), b_dst.view(np.uint32),
        *(flip_b or (0, 0, 0)), a_blocks)


def round_tf32_pair_step(a_src, a_dst, n_a, b_src, b_dst, n_b, flip_b=(), stream_handle=0):
    """round_tf32_pair_device on raw device addresses as a driver step, launched without numba's dispatcher."""
    a_blocks, grid = _pair_grid(n_a, n_b, flip_b)
    fast = _pair_fast.get(grid)
    if fast is None or not fast.usable():
        from numba import cuda
        scratch = cuda.device_array(1, np.uint32)
        kernel = _pair_dispatcher()
        configure(kernel, 1, ROUND_THREADS)(scratch, scratch, scratch, scratch, 0, 1, 0, 1)  # compiles its one overload
        fast = _pair_fast[grid] = _FastLaunch(kernel, grid, ROUND_THREADS, 4, scalars=4)
    return fast.step([(a_src, n_a), (a_dst, n_a), (b_src, n_b), (b_dst, n_b)], 4, stream_handle,
                     scalars=(*(flip_b or (0, 0, 0)), a_blocks))


def round_tf32_flipped_step(src, dst, flip, stream_handle=0):
    """round_tf32_flipped_device on raw device addresses as a driver step, launched without numba's dispatcher."""
    return _flip_step(_flip_fast, _flip_dispatcher, np.uint32, src, dst, flip, stream_handle)


def _flip_step(launches, dispatcher, word, src, dst, flip, stream_handle):
    """A flip kernel (dispatcher()) on raw addresses of `word` elements as a driver step, its launch cached per flip
    in `launches`."""
    fast = launches.get(flip)
    if fast is None or not fast.usable():
        from numba import cuda
        kernel, scratch = dispatcher(), cuda.device_array(1, word)
        configure(kernel, 1, ROUND_THREADS)(scratch, scratch, 0, 1, 0)  # compiles its one overload (nothing to do)
        fast = launches[flip] = _FastLaunch(kernel, _flip_tiles(*flip), ROUND_THREADS, 2, scalars=3)
    n = flip[0] * flip[1] * flip[2]
    return fast.step([(src, n), (dst, n)], np.dtype(word).itemsize, stream_handle, scalars=flip)


def flip16_device(src, dst, flip, stream=None):
    """dst (C, T, K) = src (K, T, C) with the taps reversed, elements unchanged (flip = (K, T, C); 1D float16
    device arrays): a stride-1 backward-data's fp16 filter as the forward convolution it is reads it."""
    _launch(_flip16_dispatcher(), _flip_tiles(*flip), ROUND_THREADS, stream)(src.view(np.uint16),
                                                                             dst.view(np.uint16), *flip)


def flip16_step(src, dst, flip, stream_handle=0):
    """flip16_device on raw device addresses as a driver step, launched without numba's dispatcher."""
    return _flip_step(_flip16_fast, _flip16_dispatcher, np.uint16, src, dst, flip, stream_handle)


def flip_host(a, flip):
    """The (K, T, C) filter `a` written as (C, T, K), taps reversed, as a flat copy (the CPU backend's copy)."""
    K, T, C = flip
    a = np.asarray(a)
    return np.ascontiguousarray(a.reshape(K, T, C)[:, ::-1, :].transpose(2, 1, 0)).reshape(a.shape)


def round_tf32_flipped_host(a, flip):
    """round_tf32_host of the (K, T, C) filter `a` written as (C, T, K), taps reversed (the CPU backend's copy)."""
    return round_tf32_host(flip_host(a, flip))


def round_tf32_host(a):
    """A copy of the float32 NumPy array `a` rounded as round_tf32_device rounds (the CPU backend's operands)."""
    b = np.ascontiguousarray(a, np.float32).view(np.uint32)
    rounded = (b + np.uint32(0x1000)) & np.uint32(0xFFFFE000)
    special = b & np.uint32(0x7F800000) == 0x7F800000  # inf or NaN, which cvt.rna.tf32.f32 does not round
    kept = np.where(b & np.uint32(0x7FFFFF), np.uint32(0x7FFFFFFF), b)
    return np.where(special, kept, rounded).view(np.float32)
