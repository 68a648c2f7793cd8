"""The device half of kernelgen.nn: numba.cuda kernels for everything but the convolutions (those are
kernelgen's), on C-contiguous channels-last float32 arrays seen as flat (rows, channels) buffers - or float16
ones, the activations of fp16 training: the elementwise and batch-norm ops write their input's dtype (the
statistics, parameters and their gradients stay float32).  The ops a ResNet trains with are here; the other
element-wise ops (cuda_elementwise.py) and the pools (cuda_pool.py) are re-exported, so the ops modules reach
every kernel through this one module (tensor.device_kernels).

Memory comes from kernelgen's arena (runtime/arena.py), so its `peak` is the training step's peak.
A numba launch from Python costs tens of microseconds, mostly argument typing and packing: after a
kernel's first (dispatched) call, later calls go straight to cuLaunchKernel with the arguments packed
by cuda_launch.kernel, and ops are fused where the data allow (batch norm + ReLU, add + ReLU, the loss).

Per-channel sums (batch-norm statistics and gradients, bias gradients) are two-level: each block of
(TC channels x TR row-threads) sums a strided share of the rows in float64, one partial per block row,
and a second kernel adds the partials per channel - float64 throughout, so the float32 statistics
are correctly rounded in practice (the CPU path gets there with Kahan sums in float32)."""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float64

# 32-bit unsigned division and modulo (numba's are 64-bit and signed: a runtime-divisor `i % c` is ~100
# integer instructions, enough to make a memory-bound pass compute-bound); _grid keeps every index < 2**31
from kernelgen.cuda_index import udiv32, umod32

# the array helpers and the other ops' kernels are re-exported: this module is the whole device half for its
# callers (tensor.device_kernels)
from kernelgen.nn import cuda_elementwise
from kernelgen.nn.cuda_elementwise import (activation, activation_backward, add, cast, concat,  # noqa: F401
                                           dropout, fill, mul, mul_backward, relu_backward, split, zeros)
from kernelgen.nn.cuda_launch import (  # noqa: F401
    BLOCK,
    MAX_PARTIALS,
    SIM,
    TC,
    TR,
    _grid,
    _vgrid,
    consecutive,
    copy_into,
    current_stream,
    empty,
    graph_mode,
    in_graph_mode,
    is_device,
    kernel,
    new_stream,
    on_stream,
    thread_elements,
    to_device,
    to_host,
    view,
)
from kernelgen.nn.cuda_optim import (adam_step, scale_by, sgd_steps, unscale_all_, update_scale,  # noqa: F401
                                     zero_flag)
from kernelgen.nn.cuda_pool import (adaptive_avg_pool2d, adaptive_avg_pool2d_backward, avg_pool2d,  # noqa: F401
                                    avg_pool2d_backward, max_pool2d, max_pool2d_backward)

relu = cuda_elementwise.relu  # re-exported as the others are (imported by name, the kernels' `relu` flag would
# shadow it)


@cuda.jit(device=True)
def _sum_over_thread_rows(a, b, tx, ty):
    """A pair of per-thread float64 sums added over the block's TR thread rows (one column per channel), in a
    fixed order: complete in thread row 0."""
    sh_a = cuda.shared.array((TR, TC), float64)
    sh_b = cuda.shared.array((TR, TC), float64)
    sh_a[ty, tx] = a
    sh_b[ty, tx] = b
    cuda.syncthreads()
    if ty == 0:
        for k in range(1, TR):
            a += sh_a[k, tx]
            b += sh_b[k, tx]
    return a, b


@cuda.jit(device=True)
def _block_column_sums(a, b, part_a, part_b, c, ch, tx, ty):
    """A pair of per-thread float64 sums added over the block's TR thread rows and stored in the block's slot of
    the partial-sum arrays."""
    a, b = _sum_over_thread_rows(a, b, tx, ty)
    if ty == 0 and ch < c:
        part_a[cuda.blockIdx.y * c + ch] = a
        part_b[cuda.blockIdx.y * c + ch] = b


# ---- per-channel reductions: batch norm, bias gradients ---------------------------------------------------

def _partials(rows):
    """Blocks along the rows: enough to fill the GPU, each thread still summing several rows."""
    return max(1, min(MAX_PARTIALS, rows // (TR * 8)))


@kernel
def _stats_partial_k(x, rows, c, part_s, part_q):
    # sums of d and d^2, d = x - x[0, ch]: the shift keeps E[d^2] - E[d]^2 from cancelling when |mean| >> std
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    ch = cuda.blockIdx.x * TC + tx
    s = float64(0.0)
    q = float64(0.0)
    if ch < c:
        shift = float64(x[ch])
        r = cuda.blockIdx.y * TR + ty
        while r < rows:
            d = float64(x[r * c + ch]) - shift
            s += d
            q += d * d
            r += cuda.gridDim.y * TR
    _block_column_sums(s, q, part_s, part_q, c, ch, tx, ty)


@cuda.jit(device=True)
def _channel_partials(part_a, part_b, n_part, c, ch, tx, ty):
    """Channel ch's sums over the n_part per-block partials of two quantities, complete in thread row 0: each of
    the block's TR thread rows adds every TR-th partial, then row 0 adds the rows' sums - a fixed order (the same
    result every run), and TR times fewer dependent loads a thread than one thread a channel (those final kernels
    took ~22 us each on the H100, 0.85 ms of a ResNet-18 step)."""
    a = float64(0.0)
    b = float64(0.0)
    if ch < c:
        p = ty
        while p < n_part:
            a += part_a[p * c + ch]
            b += part_b[p * c + ch]
            p += TR
    return _sum_over_thread_rows(a, b, tx, ty)


@kernel
def _stats_final_k(x, part_s, part_q, n_part, rows, c, momentum, eps, rmean, rvar, mean, inv_std):
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    ch = cuda.blockIdx.x * TC + tx
    s, q = _channel_partials(part_s, part_q, n_part, c, ch, tx, ty)
    if ty == 0 and ch < c:
        md = s / rows
        var = max(q / rows - md * md, 0.0)
        mu = float64(x[ch]) + md
        mean[ch] = mu
        inv_std[ch] = 1.0 / math.sqrt(var + eps)
        rmean[ch] = (1.0 - momentum) * rmean[ch] + momentum * mu
        rvar[ch] = (1.0 - momentum) * rvar[ch] + momentum * var * rows / max(rows - 1, 1)  # unbiased


@kernel
def _inv_std_k(var, eps, inv_std, c):
    ch = cuda.grid(1)
    if ch < c:
        inv_std[ch] = 1.0 / math.sqrt(float64(var[ch]) + eps)


@cuda.jit(device=True, inline=True)
def _channel_after(ch, skip, c):
    """The channel of the element `skip` (< c) elements after one of channel ch (rows of c channels)."""
    ch += skip
    return ch - c if ch >= c else ch


@cuda.jit(device=True, inline=True)
def _channels(e, k, c):
    """The channels of a thread's 4 elements e + j k (thread_elements) in rows of c channels: one division."""
    skip = umod32(k, c)
    c0 = umod32(e, c)
    c1 = _channel_after(c0, skip, c)
    c2 = _channel_after(c1, skip, c)
    return c0, c1, c2, _channel_after(c2, skip, c)


@cuda.jit(device=True, inline=True)
def _bn_value(v, ch, mean, inv_std, w, b, r, has_res, relu):
    v = (v - mean[ch]) * inv_std[ch] * w[ch] + b[ch]
    if has_res:
        v += r
    if relu and v < 0:
        v = np.float32(0)
    return v


@kernel
def _bn_apply_k(x, mean, inv_std, w, b, res, has_res, y, n, c, relu, run):
    # 4 elements a thread (cuda_launch.VEC); y may be res's own buffer: every load comes before the thread's stores
    e, k = thread_elements(run)
    if e + 3 * k < n:
        x0, x1, x2, x3 = x[e], x[e + k], x[e + 2 * k], x[e + 3 * k]
        r0 = r1 = r2 = r3 = np.float32(0)
        if has_res:
            r0, r1, r2, r3 = res[e], res[e + k], res[e + 2 * k], res[e + 3 * k]
        c0, c1, c2, c3 = _channels(e, k, c)
        y[e] = _bn_value(x0, c0, mean, inv_std, w, b, r0, has_res, relu)
        y[e + k] = _bn_value(x1, c1, mean, inv_std, w, b, r1, has_res, relu)
        y[e + 2 * k] = _bn_value(x2, c2, mean, inv_std, w, b, r2, has_res, relu)
        y[e + 3 * k] = _bn_value(x3, c3, mean, inv_std, w, b, r3, has_res, relu)
    else:
        for i in range(e, n, k):
            y[i] = _bn_value(x[i], umod32(i, c), mean, inv_std, w, b, res[i], has_res, relu)


@kernel
def _grad_partial_k(g, x, y, relu, mean, inv_std, rows, c, part_a, part_b):
    # sum(g) and sum(g * x_hat) per channel, g masked by y > 0 when a ReLU followed; x_hat recomputed
    # from x: it is not kept (the memory of one more activation per layer)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    ch = cuda.blockIdx.x * TC + tx
    a = float64(0.0)
    b = float64(0.0)
    if ch < c:
        mu, istd = mean[ch], inv_std[ch]
        r = cuda.blockIdx.y * TR + ty
        while r < rows:
            i = r * c + ch
            if not relu or y[i] > 0:
                ge = float64(g[i])
                a += ge
                b += ge * ((x[i] - mu) * istd)
            r += cuda.gridDim.y * TR
    _block_column_sums(a, b, part_a, part_b, c, ch, tx, ty)


@kernel
def _grad_final_k(part_a, part_b, n_part, c, out_a, out_b):
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    ch = cuda.blockIdx.x * TC + tx
    a, b = _channel_partials(part_a, part_b, n_part, c, ch, tx, ty)
    if ty == 0 and ch < c:
        out_a[ch] = a
        out_b[ch] = b


@cuda.jit(device=True, inline=True)
def _bn_dx_value(ge, yv, xv, ch, relu, mean, inv_std, w, dw, db, inv_rows, training):
    if relu and yv <= 0:
        ge = np.float32(0)
    k = w[ch] * inv_std[ch]
    if training:  # the batch statistics depend on x as well
        xhat = (xv - mean[ch]) * inv_std[ch]
        return k * (ge - db[ch] * inv_rows - xhat * (dw[ch] * inv_rows))
    return k * ge


@kernel
def _bn_dx_k(g, x, y, relu, mean, inv_std, w, dw, db, inv_rows, training, dx, n, c, run):
    # 4 elements a thread (cuda_launch.VEC); x is read in training only, y (the output: the ReLU mask) with relu only
    e, k = thread_elements(run)
    if e + 3 * k < n:
        g0, g1, g2, g3 = g[e], g[e + k], g[e + 2 * k], g[e + 3 * k]
        x0 = x1 = x2 = x3 = y0 = y1 = y2 = y3 = np.float32(0)
        if training:
            x0, x1, x2, x3 = x[e], x[e + k], x[e + 2 * k], x[e + 3 * k]
        if relu:
            y0, y1, y2, y3 = y[e], y[e + k], y[e + 2 * k], y[e + 3 * k]
        c0, c1, c2, c3 = _channels(e, k, c)
        dx[e] = _bn_dx_value(g0, y0, x0, c0, relu, mean, inv_std, w, dw, db, inv_rows, training)
        dx[e + k] = _bn_dx_value(g1, y1, x1, c1, relu, mean, inv_std, w, dw, db, inv_rows, training)
        dx[e + 2 * k] = _bn_dx_value(g2, y2, x2, c2, relu, mean, inv_std, w, dw, db, inv_rows, training)
        dx[e + 3 * k] = _bn_dx_value(g3, y3, x3, c3, relu, mean, inv_std, w, dw, db, inv_rows, training)
    else:
        for i in range(e, n, k):
            dx[i] = _bn_dx_value(g[i], y[i], x[i], umod32(i, c), relu, mean, inv_std, w, dw, db, inv_rows, training)


def bn_dx(g, x, y, relu, mean, inv_std, w, dw, db, rows, training, dx):
    """dx of batch norm (ReLU-masked by y > 0 where relu) from the channel sums dw = sum(g' x_hat), db = sum(g') over
    `rows` rows (all ranks' for a synchronised batch norm), into dx."""
    c = int(tuple(x.shape)[-1])  # Python ints: the fast launch route keys on argument types
    _bn_dx_k(_vgrid(x.size), BLOCK, g, x, y if relu else g, int(relu), mean, inv_std, w, dw, db, 1.0 / rows,
             int(training), dx, x.size, c, consecutive(x))
    return dx


def _channel_grid(rows, c):
    n_part = _partials(rows)
    return n_part, ((c + TC - 1) // TC, n_part), (TC, TR)


def batch_norm_forward(x, w, b, running_mean, running_var, training, momentum, eps, relu, residual=None, out=None):
    """(y, mean, inv_std), y = [relu](batch_norm(x) [+ residual]), into `out` when given (it may be the
    residual itself: each element is read before it is written, by the same thread); in training the running
    statistics are updated in place."""
    c = int(tuple(x.shape)[-1])  # Python ints: the fast launch route keys on argument types
    rows = x.size // c
    mean, inv_std = empty(c), empty(c)
    if training:
        n_part, grid, block = _channel_grid(rows, c)
        part_s, part_q = empty(n_part * c, np.float64), empty(n_part * c, np.float64)
        _stats_partial_k(grid, block, x, rows, c, part_s, part_q)
        _stats_final_k(grid[0], block, x, part_s, part_q, n_part, rows, c, float(momentum), float(eps),
                       running_mean, running_var, mean, inv_std)
    else:
        mean = running_mean
        _inv_std_k(_grid(c), BLOCK, running_var, float(eps), inv_std, c)
    return batch_norm_apply(x, w, b, mean, inv_std, relu, residual, out), mean, inv_std


def batch_norm_apply(x, w, b, mean, inv_std, relu, residual=None, out=None):
    """[relu](batch_norm(x) [+ residual]) on the given statistics, into `out` when given: batch_norm_forward's
    output, and the same bits when computed again (kernelgen.nn's recomputed activations)."""
    c = int(tuple(x.shape)[-1])
    y = empty(x.shape, x.dtype) if out is None else out
    _bn_apply_k(_vgrid(x.size), BLOCK, x, mean, inv_std, w, b, x if residual is None else residual,
                int(residual is not None), y, x.size, c, int(relu), consecutive(x))
    return y


def channel_sums(g, x=None, y=None, mean=None, inv_std=None):
    """(sum(g'), sum(g' * (x - mean) * inv_std)) over rows, per channel, g' = g masked by y > 0 when y
    is given; with x None only the first is meaningful (a bias gradient)."""
    c = int(tuple(g.shape)[-1])
    rows = g.size // c
    n_part, grid, block = _channel_grid(rows, c)
    part_a, part_b = empty(n_part * c, np.float64), empty(n_part * c, np.float64)
    if x is None:  # x_hat of g against mean 0, inv_std 0: the second sum is 0, cheaply
        mean = inv_std = zeros(c)
        x = g
    _grad_partial_k(grid, block, g, x, g if y is None else y, int(y is not None), mean, inv_std, rows, c,
                    part_a, part_b)
    out_a, out_b = empty(c), empty(c)
    _grad_final_k(grid[0], block, part_a, part_b, n_part, c, out_a, out_b)
    return out_a, out_b


def batch_norm_backward(g, x, y, relu, w, mean, inv_std, training):
    """(dx, dweight, dbias); y (the output) is read only for the ReLU mask."""
    c = int(tuple(x.shape)[-1])  # Python ints: the fast launch route keys on argument types
    db, dw = channel_sums(g, x, y if relu else None, mean, inv_std)
    dx = bn_dx(g, x, y, relu, mean, inv_std, w, dw, db, x.size // c, training, empty(x.shape, x.dtype))
    return dx, dw, db


# ---- pooling, loss ---------------------------------------------------------------------------------------

@kernel
def _gap_k(x, y, nc, c, hw):
    i = cuda.grid(1)
    if i < nc:
        base = udiv32(i, c) * hw * c + umod32(i, c)
        s = float64(0.0)
        for j in range(hw):
            s += x[base + j * c]
        y[i] = s / hw


@kernel
def _gap_bwd_k(g, dx, n, c, hw):
    i = cuda.grid(1)
    if i < n:
        dx[i] = g[udiv32(i, hw * c) * c + umod32(i, c)] / np.float32(hw)


def global_avg_pool(x):
    n, c = int(tuple(x.shape)[0]), int(tuple(x.shape)[-1])
    hw = x.size // (n * c)
    y = empty((n, c))
    _gap_k(_grid(n * c), BLOCK, x, y, n * c, c, hw)
    return y


def global_avg_pool_backward(g, x_shape):
    dx = empty(x_shape)
    n, c = int(x_shape[0]), int(x_shape[-1])
    _gap_bwd_k(_grid(dx.size), BLOCK, g, dx, dx.size, c, dx.size // (n * c))
    return dx


@cuda.jit(device=True)
def _row_max_sumexp(logits, row, k):
    """(max, sum of exp(logit - max)) over the k logits of a row: a log-sum-exp that cannot overflow."""
    mx = logits[row]
    for j in range(1, k):
        mx = max(mx, logits[row + j])
    se = float64(0.0)
    for j in range(k):
        se += math.exp(float64(logits[row + j] - mx))
    return mx, se


@kernel
def _ce_k(logits, labels, n, k, loss):
    # one block: each thread takes rows tid, tid + BLOCK, ...; the per-row losses are summed in float64,
    # in shared memory by halves
    tid = cuda.threadIdx.x
    s = float64(0.0)
    for i in range(tid, n, BLOCK):
        row = i * k
        mx, se = _row_max_sumexp(logits, row, k)
        s += math.log(se) - float64(logits[row + labels[i]] - mx)
    sh = cuda.shared.array(BLOCK, float64)
    sh[tid] = s
    cuda.syncthreads()
    half = BLOCK // 2
    while half > 0:
        if tid < half:
            sh[tid] += sh[tid + half]
        cuda.syncthreads()
        half //= 2
    if tid == 0:
        loss[0] = sh[0] / n


@kernel
def _ce_bwd_k(logits, labels, g, n, k, dl):
    i = cuda.grid(1)
    if i < n * k:
        r = udiv32(i, k)
        row = r * k
        mx, se = _row_max_sumexp(logits, row, k)
        p = math.exp(float64(logits[i] - mx)) / se
        if i - row == labels[r]:
            p -= 1.0
        dl[i] = p * g[0] / n


def cross_entropy(logits, labels):
    """(mean loss as a 1-element array, labels on the device); labels a host or device int64 array."""
    n, k = map(int, tuple(logits.shape))
    if is_device(labels) and np.dtype(labels.dtype) != np.int64:
        raise TypeError(f"labels on the device must be int64, got {labels.dtype}")
    if not is_device(labels):
        labels = np.asarray(labels)
        if labels.size and (labels.min() < 0 or labels.max() >= k):
            raise ValueError(f"labels must be in [0, {k}), got values in [{labels.min()}, {labels.max()}]")
        labels = to_device(labels.astype(np.int64))
    loss = empty(())
    _ce_k(1, BLOCK, logits, labels, n, k, loss)
    return loss, labels


def cross_entropy_backward(logits, labels, g):
    n, k = map(int, tuple(logits.shape))
    dl = empty((n, k))
    _ce_bwd_k(_grid(n * k), BLOCK, logits, labels, g, n, k, dl)
    return dl
