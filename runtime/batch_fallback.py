"""A new batch size runs at once, on the kernel of a larger batch (issue 27).

Kernels are specialised to their shape, the batch size included, so a network's first step on a new batch size
(an epoch's last, shorter batch; 128 -> 96) would compile each of its kernels again, seconds each.  Where this
process has already run the same convolution (every field of the problem but N, the same precision and settings)
on a larger batch, a call whose own kernel is not compiled yet runs that kernel instead:
- on fewer blocks, where the kernel says it can (Launcher.on_images: its GEMM rows, or its split-K reduction, are
  image-major, so the blocks past the call's images are simply not launched) and the call's images fill whole
  blocks: then that is the call's kernel from now on - nothing compiles, nothing is copied, it runs as fast as the
  larger batch's own (kernelgen.explain still shows the plan the call's own kernel would have);
- otherwise on its batched inputs zero-extended, to the images the fewer blocks read (or to the larger batch):
  - forward and backward-data: the first N images of the larger result are the call's result (images do not mix);
  - backward-weight: the zero images add zero products, so the larger problem's gradient is the call's;
  meanwhile the call's own kernel compiles in a background process (tuning.compile_pool.compile_in_background),
  into the disk cache; the first call after it is there loads it and runs as usual, and only then is the call's
  dispatch route kept.  The price, while it compiles: the extra images' arithmetic and a copy of each input.
  Where the fewer blocks read at most KEEP_PADDED more images than the call's own (a split-K backward-weight whose
  last split ends a few images past them: 97-99 for 96), the call stays on the larger batch's kernel and nothing
  compiles: its own kernel would save that share of one kernel's arithmetic, and compiling it in the background
  costs the steps around it more (CPUs, module loads) than the share ever would in a run of minutes.

Only device arrays take this path (host arrays pay a copy anyway); the batch_fallback setting turns it off.
Nothing compiles in numba's simulator, so there it is off too.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from typing import NamedTuple

from kernelgen import arrays, settings
from kernelgen.runtime.arena import device_empty
from kernelgen.runtime.cache import KERNELS, key_digest
from kernelgen.runtime.cuda_call import new_output, run_cuda
from kernelgen.runtime.driver import (as_numba_stream, copy_device, copy_pointer, fill_device, itemsize_of,
                                      pointer_size, stream_handle, zero_pointer)
from kernelgen.tuning.compile_pool import compile_in_background

log = logging.getLogger(__name__)
# the most extra images (a share of the call's own) a borrowed kernel may read and still be kept for good (issue 27:
# where specialising on the batch is worth < 3 %, the batch is not specialised on)
KEEP_PADDED = 0.03
# the inputs that carry the batch, per direction (deconv runs as backward-data on dy)
BATCHED = {"fwd": ("x",), "bwd_data": ("dy",), "bwd_weight": ("x", "dy")}

_LOCK = threading.Lock()
_RAN: dict = {}      # batchless key -> {N: Prepared} of the calls whose kernels ran in this process
_PENDING: dict = {}  # cache digest -> the Future of the background compile of that kernel


def _batchless(prep) -> tuple:
    return dataclasses.replace(prep.problem, N=0), prep.plan.precision, settings.dispatch_token()


def run(prep, inputs: dict, template, stream=None, out=None):
    """(result, borrowed) of a CUDA call: on its own kernel (noted: a smaller batch may borrow it from now on),
    or, while that kernel is not compiled, on a larger batch's (borrowed; its own compiling in the background, or
    not at all where the larger batch's fewer blocks read few more images: then borrowed for good)."""
    big = prep.kept_borrow
    if big is None:
        big = larger_batch(prep, inputs)
        fewer = None if big is None else big.launcher.on_images(prep.problem.N)
        if fewer is not None and fewer[1] == prep.problem.N:
            prep.adopt(fewer[0])  # the call's images fill whole blocks of the larger batch's kernel: its own now
        if big is None or prep.has_launcher:
            result = run_cuda(prep, inputs, template, stream, out)
            note_ran(prep)
            return result, False
        if fewer is not None and fewer[1] - prep.problem.N <= KEEP_PADDED * prep.problem.N:
            prep.kept_borrow = big  # (two threads may both set it: to the same)
        else:
            start_compile(prep.plan)
    try:
        return run_on_larger_batch(prep, big, inputs, template, stream, out), True
    except Exception as e:  # noqa: BLE001 (a head start only: the call runs as it would without it, and says so)
        log.debug("no batch fallback for %s: %s: %s", prep.problem.key(), type(e).__name__, e)
        prep.kept_borrow = None
        return run_cuda(prep, inputs, template, stream, out), False


def note_ran(prep):
    """prep's kernel ran here: a smaller batch of its convolution may borrow it from now on."""
    if prep.plan is not None and prep.backend == "cuda":
        with _LOCK:
            _RAN.setdefault(_batchless(prep), {})[prep.problem.N] = prep


def larger_batch(prep, inputs: dict):
    """The Prepared of the smallest larger batch of prep's convolution that ran here, where prep's own kernel
    would be compiled by its first launch and every input is a device array; else None."""
    if prep.plan is None or prep.backend != "cuda" or prep.has_launcher or not settings.get("batch_fallback"):
        return None  # (a call with a launcher has its kernel: compiled, or a larger batch's on fewer blocks)
    with _LOCK:
        ran = _RAN.get(_batchless(prep))
        larger = sorted(n for n in ran or () if n > prep.problem.N)
        big = ran[larger[0]] if larger else None
    if big is None or not all(arrays.is_cuda_array(a) for a in inputs.values()):
        return None
    return big if _needs_compile(prep.plan) else None


def _needs_compile(plan) -> bool:
    """Would the plan's first launch compile its kernel (neither compiled on disk nor compiling in the
    background)?  A background compile that ended without a kernel on disk (it failed) says no: the call then
    compiles for itself and raises what is wrong."""
    if settings.get("cuda_simulator"):
        return False  # (the simulator compiles nothing)
    digest = key_digest(plan.key())
    with _LOCK:
        future = _PENDING.get(digest)
    if future is not None:
        return not future.done()
    return not KERNELS.compiled_on_disk(digest)


def start_compile(plan):
    """The plan's kernel compiling in a background process (once per kernel)."""
    digest = key_digest(plan.key())
    with _LOCK:
        if digest not in _PENDING:
            _PENDING[digest] = compile_in_background(plan)


class _OnImages(NamedTuple):
    """What run_cuda reads of a Prepared: the larger batch's kernel on fewer blocks, as a problem of `images`."""
    problem: object
    launcher: object


def run_on_larger_batch(prep, big, inputs: dict, template, stream=None, out=None):
    """prep's call computed by big's kernel (see the module): the batched inputs zero-extended to the images the
    kernel's fewer blocks read (Launcher.on_images), or to big's batch.  Copies and clears go to the driver by
    address: numba's slicing and fill kernel cost more than the rest of a borrowed call (which runs for every call
    until the call's own kernel is in)."""
    problem, nstream = prep.problem, as_numba_stream(stream)
    fewer = big.launcher.on_images(problem.N)
    if fewer is not None:
        big = _OnImages(dataclasses.replace(big.problem, N=fewer[1]), fewer[0])
    extended = {name: (_zero_extended(a, name, big.problem.N, nstream) if name in BATCHED[problem.direction]
                       else a) for name, a in inputs.items()}
    if problem.direction == "bwd_weight":
        return run_cuda(big, extended, template, stream, out)
    if out is not None:
        arrays.check_out(out, problem.output_shape, problem.dtype, True)
    larger = run_cuda(big, extended, template, stream, None)
    if settings.get("cuda_simulator"):  # (the tests' stand-in GPU has no driver to copy by address: numba's slicing)
        if out is None:
            return larger[:problem.N]
        copy_device(arrays.to_device_view(out, "out"), arrays.to_device_view(larger[:problem.N], "out"), nstream)
        return out
    result = out if out is not None else new_output(template, problem.output_shape, problem.dtype, nstream)
    (dst, n), (src, _) = pointer_size(result, "out"), pointer_size(larger, "out")
    copy_pointer(dst, src, n * itemsize_of(result), stream_handle(nstream))  # (the first N images of the larger)
    return result if out is not None or type(result) is type(template) else arrays.like_input(result, template)


def _zero_extended(a, name, batch, nstream):
    """A new device array of `batch` images: a's images first, zeros after."""
    view = arrays.to_device_view(a, name)
    ext = device_empty((batch,) + tuple(view.shape[1:]), view.dtype, nstream)
    if settings.get("cuda_simulator"):
        flat, n = ext.reshape(ext.size), view.size
        copy_device(flat[:n], view.reshape(n), nstream)
        fill_device(flat[n:], 0, nstream)
        return ext
    (dst, total), (src, n) = pointer_size(ext, name), pointer_size(view, name)
    itemsize, handle = view.dtype.itemsize, stream_handle(nstream)
    copy_pointer(dst, src, n * itemsize, handle)
    zero_pointer(dst + n * itemsize, total - n, itemsize, handle)
    return ext
