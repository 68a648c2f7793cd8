"""Communicators: the collectives data-parallel training needs (all_reduce(sum) in place, broadcast, barrier)
plus the stream and event calls that let gradient buckets travel while backward computes.

- NcclCommunicator (nccl.py): GPU arrays through NCCL, on its own non-blocking stream.
- NumpyCommunicator: NumPy arrays between processes, over the rendezvous store's TCP star around rank 0.
- LoopbackGroup(n).communicators(): n communicators for n threads of one process (tests, and single-process
  CPU runs of the multi-rank code paths).

The host communicators are synchronous: their streams are None and events are no-ops, so the same
data-parallel code (kernelgen.nn.parallel) drives all three.  Sums add rank 0's array, then rank 1's, ...,
in that order on every backend here, so every rank gets bitwise the same result.
"""
from __future__ import annotations

import threading

import numpy as np

from kernelgen.distributed import wire
from kernelgen.distributed.store import RendezvousError


class Communicator:
    """The interface; `rank` and `world_size` are ints."""
    rank = 0
    world_size = 1
    device = "cpu"  # where the arrays it reduces live: "cpu" (NumPy) or "cuda"

    def all_reduce(self, array, stream=None, op="sum"):
        """Sum `array` over the ranks, in place; op="avg" divides the sum by world_size."""
        raise NotImplementedError

    def broadcast(self, array, root=0, stream=None):
        """Overwrite `array` with rank `root`'s, in place."""
        raise NotImplementedError

    def barrier(self):
        raise NotImplementedError

    # streams and events: a synchronous communicator has none
    def new_stream(self):
        """A stream for communication, or None when collectives are synchronous."""
        return None

    def record_event(self, stream=None, timing=False):
        """An event recorded on `stream` (None: the compute stream), or None."""
        return None

    def wait_event(self, event, stream=None):
        """Make `stream` (None: the compute stream) wait for `event` before its later work."""

    def close(self):
        pass


def _check_host(array, what):
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{what}: array must be a NumPy array for the CPU communicator, got {type(array).__name__}")
    if not array.flags.c_contiguous:
        raise ValueError(f"{what}: array must be C-contiguous (it is reduced in place)")


def _check_op(op, array):
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
    if op == "avg" and array.dtype.kind != "f":
        raise TypeError(f"op='avg' needs a floating-point array, got {array.dtype}")


def _finish_op(array, op, world_size):
    if op == "avg":
        array /= world_size  # the sum divided once, as NCCL's ncclAvg (exact for a power-of-two world)
    return array


def _check_root(root, world_size):
    if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < world_size:
        raise ValueError(f"root must be a rank in [0, {world_size}), got {root!r}")


class NumpyCommunicator(Communicator):
    """Collectives between processes over a TCPStore: each array goes to rank 0, which sums in rank order and
    sends the result back (a star: fine for the CPU backend's sizes and process counts)."""

    def __init__(self, store):
        self.store, self.rank, self.world_size = store, store.rank, store.world_size

    def _peer(self, r):
        return self.store.peers[r]

    def _recv_into(self, r, array, op):
        try:
            a, header = wire.recv_array(self._peer(r), f"rank {r}", self.store.timeout, expect=array)
        except wire.PeerError as e:
            raise RendezvousError(f"rank {self.rank} in {op}: {e}") from None
        if header.get("op") != op:
            raise RendezvousError(f"rank {r} sent {header.get('op')!r} while rank {self.rank} is in {op!r}: the "
                                  f"ranks are running different collectives")
        return a

    def all_reduce(self, array, stream=None, op="sum"):
        _check_host(array, "all_reduce")
        _check_op(op, array)
        if self.world_size == 1:
            return array
        if self.rank != 0:
            wire.send_array(self._peer(0), array, op="all_reduce")
            array[...] = self._recv_into(0, array, "all_reduce")
            return _finish_op(array, op, self.world_size)
        total = array.copy()
        for r in range(1, self.world_size):
            total += self._recv_into(r, array, "all_reduce")
        for r in range(1, self.world_size):
            wire.send_array(self._peer(r), total, op="all_reduce")
        array[...] = total
        return _finish_op(array, op, self.world_size)

    def broadcast(self, array, root=0, stream=None):
        _check_host(array, "broadcast")
        _check_root(root, self.world_size)
        if self.world_size == 1:
            return array
        if self.rank == root and root != 0:
            wire.send_array(self._peer(0), array, op="broadcast")
        elif self.rank != 0:
            array[...] = self._recv_into(0, array, "broadcast")
        if self.rank == 0:
            if root != 0:
                array[...] = self._recv_into(root, array, "broadcast")
            for r in range(1, self.world_size):
                if r != root:
                    wire.send_array(self._peer(r), array, op="broadcast")
        return array

    def barrier(self):
        self.store.barrier()

    def close(self):
        self.store.close()


class LoopbackGroup:
    """`world_size` communicators that meet through shared memory: one per thread.  A collective waits at a
    barrier (with `timeout`, naming nothing more than the group, as threads cannot die alone) for every rank."""

    def __init__(self, world_size, timeout=120.0):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        self.world_size, self.timeout = world_size, timeout
        self._barrier = threading.Barrier(world_size)
        self._slots = [None] * world_size

    def communicators(self):
        return [_LoopbackCommunicator(self, r) for r in range(self.world_size)]

    def wait(self):
        try:
            self._barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            raise RendezvousError(f"a loopback collective timed out after {self.timeout} s (or another rank's thread "
                                  f"failed): not every rank reached it") from None


class _LoopbackCommunicator(Communicator):
    def __init__(self, group, rank):
        self.group, self.rank, self.world_size = group, rank, group.world_size

    def _exchange(self, array, what):
        """Every rank's array, in rank order, once all have arrived; each rank reads, then all move on."""
        _check_host(array, what)
        g = self.group
        g._slots[self.rank] = array.copy()
        g.wait()
        arrays = list(g._slots)
        g.wait()  # nobody overwrites a slot before every rank has read them all
        for r, a in enumerate(arrays):
            if a.shape != array.shape or a.dtype != array.dtype:
                raise RendezvousError(f"{what}: rank {r} has a {a.dtype} {a.shape} array, rank {self.rank} "
                                      f"{array.dtype} {array.shape}")
        return arrays

    def all_reduce(self, array, stream=None, op="sum"):
        _check_host(array, "all_reduce")
        _check_op(op, array)
        arrays = self._exchange(array, "all_reduce")
        total = arrays[0].copy()
        for a in arrays[1:]:
            total += a
        array[...] = total
        return _finish_op(array, op, self.world_size)

    def broadcast(self, array, root=0, stream=None):
        _check_root(root, self.world_size)
        array[...] = self._exchange(array, "broadcast")[root]
        return array

    def barrier(self):
        self.group.wait()
