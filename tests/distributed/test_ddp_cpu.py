"""Data-parallel training on the CPU equals one process on the combined batch: 2 and 3 ranks as threads over the
loopback communicator, 2 ranks as processes started by the launcher over the NumPy/TCP communicator.
The reference is the same model stepped once on the whole batch, and its gradients are checked against
float64 finite differences first, so both sides are checked against float64."""
from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from ddp_models import TinyNet, assert_grads_close, assert_state_close, batch, sgd_step

from kernelgen.distributed import LoopbackGroup
from kernelgen.nn import Tensor
from kernelgen.nn import functional as F
from kernelgen.nn.parallel import DistributedDataParallel
from kernelgen.nn.sync_batchnorm import convert_sync_batchnorm

HERE = Path(__file__).resolve().parent


def run_ranks(world, fn):
    """fn(rank, comm) in one thread per rank; the first exception is raised here."""
    comms, results, errors = LoopbackGroup(world, timeout=60).communicators(), [None] * world, []

    def body(r):
        try:
            results[r] = fn(r, comms[r])
        except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread)
            errors.append(e)
            comms[r].group._barrier.abort()  # the other ranks must not wait for this one
    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def reference(n=12):
    x, y = batch(n=n)
    return x, y, sgd_step(TinyNet(seed=0), x, y)


def test_reference_gradient_against_float64_differences():
    """The single-process reference's loss gradient for one weight entry, against a float64 central difference."""
    x, y = batch(n=12)
    model = TinyNet(seed=0)
    for p in model.parameters():
        p.data = p.data.astype(np.float64)
    F.cross_entropy(model(Tensor(x.astype(np.float64))), y).backward()
    w = model.head.weight
    h, (i, j) = 1e-6, (1, 3)

    def loss():
        return float(F.cross_entropy(model(Tensor(x.astype(np.float64))), y).data)
    base = w.data[i, j]
    w.data[i, j] = base + h
    up = loss()
    w.data[i, j] = base - h
    down = loss()
    w.data[i, j] = base
    assert abs((up - down) / (2 * h) - w.grad[i, j]) < 1e-6


@pytest.mark.parametrize("world", [2, 3])
def test_threads_equal_combined_batch(world):
    x, y, (want, want_grads) = reference(n=12)
    share = len(x) // world

    def rank(r, comm):
        model = DistributedDataParallel(convert_sync_batchnorm(TinyNet(seed=0 if r == 0 else 100 + r)), comm=comm, bucket_mb=60 / 2**20)
        for b in model._buckets:
            b.buffer[...] = np.nan  # poisoned: every gradient must be written into its bucket before the reduce
        mine = slice(r * share, (r + 1) * share)
        return sgd_step(model, x[mine], y[mine])
    for state, grads in run_ranks(world, rank):
        assert_state_close(state, want)
        assert_grads_close(grads, want_grads)


def test_no_sync_accumulates_then_averages():
    """Two micro-batches per rank, the first under no_sync: the synchronised gradient is the average over ranks of
    each rank's accumulated sum, as one process accumulating all four micro-batches (plain batch norm: local
    statistics per micro-batch, as both sides compute them)."""
    x, y = batch(n=16)
    parts = [slice(4 * k, 4 * k + 4) for k in range(4)]
    ref = TinyNet(seed=0)
    for s in parts:
        F.cross_entropy(ref(Tensor(x[s])), y[s]).backward()
    want = [p.grad / 2 for p in ref.parameters()]  # two ranks: the sum of 4 micro-batch gradients, halved

    def rank(r, comm):
        model = DistributedDataParallel(TinyNet(seed=0), comm=comm, broadcast_buffers=False)
        first, second = parts[2 * r], parts[2 * r + 1]
        with model.no_sync():
            F.cross_entropy(model(Tensor(x[first])), y[first]).backward()
        F.cross_entropy(model(Tensor(x[second])), y[second]).backward()
        return [np.array(p.grad) for p in model.parameters()]
    for grads in run_ranks(2, rank):
        assert_grads_close(grads, want)


def test_parameters_broadcast_from_rank_0():
    def rank(r, comm):
        model = DistributedDataParallel(TinyNet(seed=r), comm=comm)
        return model.module.state_dict()
    a, b = run_ranks(2, rank)
    assert_state_close(b, a, rtol=0)
    assert_state_close(a, TinyNet(seed=0).state_dict(), rtol=0)


def test_two_processes_equal_combined_batch(tmp_path):
    x, y, (want, _) = reference(n=8)
    proc = subprocess.run([sys.executable, "-m", "kernelgen.distributed", "--nproc-per-node", "2",
                           str(HERE / "ddp_worker.py"), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in range(2):
        with np.load(tmp_path / f"rank{r}.npz") as f:
            assert_state_close({k: f[k] for k in f.files}, want)


def test_dead_rank_stops_the_job_and_is_named(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kernelgen.distributed", "--nproc-per-node", "2",
                           str(HERE / "ddp_worker.py"), str(tmp_path), "die"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 3
    assert "rank 1" in proc.stderr and "exited with code 3" in proc.stderr
    assert not list(tmp_path.iterdir())  # rank 0 was stopped, never got past its barrier
