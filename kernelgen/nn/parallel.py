"""DistributedDataParallel: one model replica per rank, gradients averaged across ranks during backward.

At construction the parameters (and buffers) are broadcast from rank 0, so every replica starts equal.
Gradients travel in buckets of about `bucket_mb` MB, parameters taken in reverse order (roughly the order in
which backward produces their gradients).  A parameter's gradient is copied into its bucket as soon as
backward has accumulated it (Tensor.register_post_accumulate_grad_hook); the moment a bucket is full it is
averaged across ranks (all_reduce "avg") on the communicator's own stream, after an event that marks the
copies done on the compute stream, so the all-reduce overlaps the rest of backward.  Buckets are issued in
bucket order on every rank: NCCL needs every rank to issue its collectives in the same order.  When
backward ends (Tensor.register_backward_end_hook on the forward's output) the compute stream waits for
every bucket's event and each parameter's .grad becomes a view of its bucket (no copy back).

Inside no_sync() nothing is communicated: gradients accumulate locally, and the next synchronised backward
averages the accumulated sum.  Parameters that took no part in a synchronised backward count with a zero
gradient, so every rank still reduces every bucket.
"""
from __future__ import annotations

import contextlib

import numpy as np

from kernelgen.distributed.process_group import get_default
from kernelgen.nn.modules import Module
from kernelgen.nn.sync_batchnorm import SyncBatchNorm
from kernelgen.nn.tensor import Tensor, _on_device, device_kernels

MB = 1 << 20


def assign_buckets(params, bucket_bytes):
    """Lists of indices into `params`, in reverse parameter order, each list one bucket: a bucket closes when
    the next parameter would take it past bucket_bytes (a larger parameter gets a bucket of its own) or has
    another dtype (a bucket is one flat array)."""
    buckets, size, dtype = [], 0, None
    for i in reversed(range(len(params))):
        p = params[i]
        nbytes = int(np.prod(p.shape, dtype=np.int64)) * p.dtype.itemsize
        if not buckets or p.dtype != dtype or (size + nbytes > bucket_bytes and size > 0):
            buckets.append([])
            size, dtype = 0, p.dtype
        buckets[-1].append(i)
        size += nbytes
    return buckets


class _Bucket:
    """A flat array holding some parameters' gradients back to back; `views` are those gradients' shapes."""

    def __init__(self, index, params, device):
        self.index, self.params = index, params
        self.offsets, n = {}, 0
        for p in params:
            size = int(np.prod(p.shape, dtype=np.int64))
            self.offsets[id(p)] = (n, size)
            n += size
        self.size, dtype = n, params[0].dtype
        if device == "cuda":
            ops = device_kernels()
            self.buffer = ops.empty((n,), dtype)
            self.segments = {k: self.buffer[a:a + s] for k, (a, s) in self.offsets.items()}
            self.views = {id(p): ops.view(self.segments[id(p)], p.shape) for p in params}
        else:
            self.buffer = np.zeros(n, dtype)
            self.segments = {k: self.buffer[a:a + s] for k, (a, s) in self.offsets.items()}
            self.views = {id(p): self.segments[id(p)].reshape(p.shape) for p in params}
        self.pending, self.issued, self.done = set(), False, None

    def arm(self):
        self.pending, self.issued, self.done = {id(p) for p in self.params}, False, None

    def put(self, p, grad):
        """Copy p's gradient into its segment (on the compute stream, for device arrays)."""
        seg = self.segments[id(p)]
        if _on_device(seg):
            ops = device_kernels()
            ops.copy_into(seg, ops.view(grad, (seg.size,)))
        else:
            seg[...] = np.reshape(grad, -1)
        self.pending.discard(id(p))

    def zero_missing(self):
        """Zero the segments of parameters that got no gradient this pass (unused in the graph)."""
        for p in self.params:
            if id(p) in self.pending:
                seg = self.segments[id(p)]
                if _on_device(seg):
                    device_kernels().fill(seg, 0.0)
                else:
                    seg[...] = 0
        self.pending.clear()


class DistributedDataParallel(Module):
    """module's replica on this rank.  comm: a communicator (default: init_process_group's); bucket_mb: the
    gradient buckets' size; broadcast_buffers: copy rank 0's buffers (batch-norm running statistics) to every
    rank at each forward, as PyTorch does; timeline: record timing events per bucket (GPU), read with
    timeline_ms()."""

    def __init__(self, module, comm=None, bucket_mb=25, broadcast_buffers=True, timeline=False):
        if not isinstance(module, Module):
            raise TypeError(f"module must be a kernelgen.nn Module, got {type(module).__name__}")
        if not isinstance(bucket_mb, (int, float)) or isinstance(bucket_mb, bool) or bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be a positive number, got {bucket_mb!r}")
        comm = get_default() if comm is None else comm
        if comm is None:
            raise RuntimeError("DistributedDataParallel needs a communicator: call "
                               "kernelgen.distributed.init_process_group() first, or pass comm=")
        self.module, self.comm = module, comm
        params = list({id(p): p for p in module.parameters()}.values())
        device = _check_device(params, comm)
        self._params = params
        self._buckets = [_Bucket(k, [params[i] for i in idx], device)
                         for k, idx in enumerate(assign_buckets(params, bucket_mb * MB))]
        self._bucket_of = {id(p): b for b in self._buckets for p in b.params}
        self._stream = comm.new_stream()
        self._sync, self._active, self._next = True, False, 0
        self.broadcast_buffers, self._timeline, self._events = broadcast_buffers, timeline, []
        # in a dict: a bare array attribute would count as this module's own buffer (state_dict, to())
        self._flat = {"buffers": _flatten_buffers(module, device)}
        for p in params:  # in place, outside autograd: .data is the parameter's storage
            comm.broadcast(p.data, 0)
        if self._flat["buffers"] is not None:
            comm.broadcast(self._flat["buffers"], 0)
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in params]
        _give_comm(module, comm)

    def precompile_target(self):
        """None: a first call's trace would run SyncBatchNorm's collectives, and a rank whose batch differs (the
        last one of an epoch) would trace alone.  Call self.module.precompile(shape) on every rank instead."""
        return None

    @property
    def bucket_sizes(self):
        """Each bucket's parameter count and element count, in the order they are reduced."""
        return [(len(b.params), b.size) for b in self._buckets]

    def forward(self, *args):
        if self.broadcast_buffers and self._flat["buffers"] is not None and self.comm.world_size > 1:
            self.comm.broadcast(self._flat["buffers"], 0)
        out = self.module(*args)
        if self._sync and isinstance(out, Tensor) and out.requires_grad:
            for b in self._buckets:
                b.arm()
            self._active, self._next, self._events = True, 0, []
            if self._timeline:
                self._events.append(("forward_end", -1, self.comm.record_event(None, timing=True)))
            out.register_backward_end_hook(self._finish)
        return out

    @contextlib.contextmanager
    def no_sync(self):
        """Forward and backward inside accumulate gradients locally, without communicating."""
        prev, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = prev

    def _grad_ready(self, p):
        if not self._active:
            return  # a no_sync pass, or a backward of a graph this wrapper's forward did not arm
        b = self._bucket_of[id(p)]
        b.put(p, p.grad)
        if not b.pending:
            self._issue_ready()

    def _issue_ready(self):
        """Issue, in bucket order, every bucket whose gradients are all in."""
        while self._next < len(self._buckets) and not self._buckets[self._next].pending:
            self._issue(self._buckets[self._next])
            self._next += 1

    def _issue(self, b):
        comm, timing = self.comm, self._timeline
        copied = comm.record_event(None, timing=timing)  # the segment copies, on the compute stream
        comm.wait_event(copied, self._stream)
        start = comm.record_event(self._stream, timing=True) if timing else None
        comm.all_reduce(b.buffer, stream=self._stream, op="avg")
        b.done, b.issued = comm.record_event(self._stream, timing=timing), True
        if timing:
            self._events += [("ready", b.index, copied), ("start", b.index, start), ("end", b.index, b.done)]

    def _finish(self):
        """backward has ended: reduce what is left, make the compute stream wait, point .grad at the buckets."""
        if not self._active:
            return
        self._active = False
        for b in self._buckets[self._next:]:
            b.zero_missing()
        self._issue_ready()
        if self._timeline:
            self._events.append(("backward_end", -1, self.comm.record_event(None, timing=True)))
        for b in self._buckets:
            self.comm.wait_event(b.done, None)
            for p in b.params:
                p.grad = b.views[id(p)]

    def timeline_ms(self):
        """The last synchronised step's events, in ms after the forward's end: (what, bucket, ms) per event,
        "ready" (gradients copied, compute stream), "start" / "end" (the all-reduce, communication stream),
        "backward_end".  Synchronises; empty unless timeline=True on a GPU communicator."""
        if not self._events or not hasattr(self.comm, "elapsed_ms"):
            return []
        t0 = self._events[0][2]
        return [(what, k, self.comm.elapsed_ms(t0, ev)) for what, k, ev in self._events]

    def remove_hooks(self):
        for h in self._hooks:
            h.remove()
        self._hooks = []


def save_on_rank0(module, path, comm=None):
    """Write module's checkpoint (Module.save) from rank 0 only, then let every rank pass once it is written:
    one file per job, never N processes writing the same path."""
    comm = get_default() if comm is None else comm
    if comm is None or comm.rank == 0:
        module.save(path)
    if comm is not None:
        comm.barrier()


def _check_device(params, comm):
    if not params:
        raise ValueError("module has no parameters that require grad: nothing to synchronise")
    on = {_on_device(p.data) for p in params}
    if len(on) > 1:
        raise TypeError("module's parameters are on different devices: move the whole model first (model.to())")
    device = "cuda" if on.pop() else "cpu"
    if device != getattr(comm, "device", "cpu"):
        raise TypeError(f"module's parameters are on {device} but comm reduces {comm.device} arrays: move the model "
                        f"with model.to({comm.device!r}) before wrapping it")
    return device


def _give_comm(module, comm):
    """SyncBatchNorm layers without a communicator of their own reduce through this wrapper's."""
    if isinstance(module, SyncBatchNorm) and module.comm is None:
        module.comm = comm
    for c in module.children():
        _give_comm(c, comm)


def _buffer_slots(module):
    """(owner module, attribute) of every buffer (a plain array attribute: batch-norm running statistics)."""
    slots = []
    for k, v in sorted(vars(module).items()):
        if isinstance(v, np.ndarray) or _on_device(v):
            slots.append((module, k))
    for c in module.children():
        slots += _buffer_slots(c)
    return slots


def _flatten_buffers(module, device):
    """Every buffer moved into one flat array, each module's attribute becoming a view of its part, so one
    broadcast per forward keeps them all equal to rank 0's.  None when there are no float32 buffers."""
    slots = [(m, k) for m, k in _buffer_slots(module) if np.dtype(getattr(m, k).dtype) == np.float32]
    if not slots:
        return None
    total = sum(int(getattr(m, k).size) for m, k in slots)
    ops = device_kernels() if device == "cuda" else None
    flat = ops.empty((total,), np.float32) if ops else np.empty(total, np.float32)
    at = 0
    for m, k in slots:
        old = getattr(m, k)
        part = flat[at:at + old.size]
        if ops:
            part.copy_to_device(ops.view(old, (old.size,)))
            setattr(m, k, ops.view(part, old.shape))
        else:
            part[...] = old.reshape(-1)
            setattr(m, k, part.reshape(old.shape))
        at += old.size
    return flat
