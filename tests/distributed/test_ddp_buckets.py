"""DistributedDataParallel's bucketing and overlap, with a fake communicator that records what it is asked to
do: buckets in reverse parameter order, capped by size; every bucket's all-reduce issued in bucket order;
the first bucket's all-reduce issued while backward still has gradients to produce."""
from __future__ import annotations

import numpy as np
import pytest
from ddp_models import TinyNet, batch

from kernelgen.distributed import Communicator
from kernelgen.nn import Linear, Sequential, Tensor
from kernelgen.nn import functional as F
from kernelgen.nn.parallel import DistributedDataParallel, assign_buckets


class RecordingComm(Communicator):
    """One rank of two that records its calls; all_reduce and broadcast leave the arrays as they are (the
    other rank is this one's twin), except "avg", which is a sum of two equal arrays halved: unchanged."""

    def __init__(self, log):
        self.rank, self.world_size, self.log = 0, 2, log

    def all_reduce(self, array, stream=None, op="sum"):
        self.log.append(("all_reduce", array.size, stream))
        return array

    def broadcast(self, array, root=0, stream=None):
        self.log.append(("broadcast", array.size))
        return array

    def barrier(self):
        pass

    def new_stream(self):
        return "comm-stream"

    def record_event(self, stream=None, timing=False):
        self.log.append(("record", stream))
        return object()

    def wait_event(self, event, stream=None):
        self.log.append(("wait", stream))


class P:
    def __init__(self, *shape, dtype=np.float32):
        self.shape, self.dtype = shape, np.dtype(dtype)


def test_assign_buckets_reverse_order_and_cap():
    params = [P(10), P(20), P(5), P(100), P(1)]  # float32: 40, 80, 20, 400, 4 bytes
    assert assign_buckets(params, 100) == [[4], [3], [2, 1], [0]]
    assert assign_buckets(params, 1 << 20) == [[4, 3, 2, 1, 0]]
    assert assign_buckets(params, 1) == [[4], [3], [2], [1], [0]]  # each larger than the cap: one each


def test_assign_buckets_splits_dtypes():
    params = [P(2), P(2, dtype=np.float64), P(2, dtype=np.float64), P(2)]
    assert assign_buckets(params, 1 << 20) == [[3], [2, 1], [0]]


def test_bucket_sizes_cover_every_parameter_once():
    model = TinyNet()
    ddp = DistributedDataParallel(model, comm=RecordingComm([]), bucket_mb=60 / 2**20)
    n = sum(int(np.prod(p.shape)) for p in model.parameters())
    assert sum(size for _, size in ddp.bucket_sizes) == n
    assert sum(k for k, _ in ddp.bucket_sizes) == len(model.parameters())
    assert len(ddp.bucket_sizes) > 2


def test_all_reduce_starts_before_backward_ends():
    """Three Linear layers, a bucket each: the head's bucket must be all-reduced (on the communication stream,
    after an event on the compute stream) before the first layer's gradient exists."""
    log = []
    rng = np.random.default_rng(0)
    model = Sequential(Linear(4, 8, rng=rng), Linear(8, 8, rng=rng), Linear(8, 3, rng=rng))
    ddp = DistributedDataParallel(model, comm=RecordingComm(log), bucket_mb=1e-9)
    assert [k for k, _ in ddp.bucket_sizes] == [1] * 6  # each weight and bias its own bucket
    first_weight = model.layers[0].weight
    first_weight.register_post_accumulate_grad_hook(lambda p: log.append(("first layer's gradient ready",)))
    log.clear()
    loss = F.cross_entropy(ddp(Tensor(np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32))),
                           np.array([0, 1, 2, 0, 1]))
    loss.backward()
    reduces = [i for i, e in enumerate(log) if e[0] == "all_reduce"]
    marker = log.index(("first layer's gradient ready",))
    assert len(reduces) == 6
    assert reduces[0] < marker, "the last layer's bucket waited for the end of backward"
    assert all(log[i][2] == "comm-stream" for i in reduces)
    # the last-layer bucket's sizes come first: reverse parameter order (head bias 3, head weight 24, ...)
    assert [log[i][1] for i in reduces][:2] in ([3, 24], [24, 3])
    # each all-reduce is preceded by: an event on the compute stream, the communication stream waiting for it
    for i in reduces:
        assert log[i - 2] == ("record", None) and log[i - 1] == ("wait", "comm-stream")
    # after backward the compute stream waits for every bucket
    assert log[-6:] == [("wait", None)] * 6


def test_grads_are_bucket_views_after_backward():
    model = TinyNet()
    ddp = DistributedDataParallel(model, comm=RecordingComm([]), bucket_mb=1)
    x, y = batch()
    F.cross_entropy(ddp(Tensor(x)), y).backward()
    ref = TinyNet()
    F.cross_entropy(ref(Tensor(x)), y).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        np.testing.assert_allclose(p.grad, q.grad, rtol=1e-6, atol=1e-7)
        assert p.grad.base is not None  # a view of the bucket: no copy back


def test_no_sync_communicates_nothing():
    log = []
    ddp = DistributedDataParallel(TinyNet(), comm=RecordingComm(log))
    log.clear()
    x, y = batch()
    with ddp.no_sync():
        F.cross_entropy(ddp(Tensor(x)), y).backward()
    assert not [e for e in log if e[0] == "all_reduce"]
    F.cross_entropy(ddp(Tensor(x)), y).backward()
    assert [e for e in log if e[0] == "all_reduce"]


def test_bad_arguments():
    with pytest.raises(TypeError, match="module"):
        DistributedDataParallel(object(), comm=RecordingComm([]))
    with pytest.raises(ValueError, match="bucket_mb"):
        DistributedDataParallel(TinyNet(), comm=RecordingComm([]), bucket_mb=0)
    with pytest.raises(RuntimeError, match="init_process_group"):
        DistributedDataParallel(TinyNet())
