"""SyncBatchNorm: batch normalisation whose training statistics are over the whole data-parallel batch (every
rank's share), not this rank's alone.

BatchNorm2d normalises with the local batch's statistics, which is what DistributedDataParallel uses by
default (as PyTorch's).  With SyncBatchNorm the per-channel sums go through the communicator, so a run on
N ranks normalises exactly as one process would on the combined batch: forward all-reduces sum(x), then
sum((x - mean)^2) (two passes, as the single-process path's Kahan means: no cancellation of a sum of
squares); backward all-reduces sum(g) and sum(g * x_hat).  The weight and bias gradients stay local sums,
which DistributedDataParallel then averages like every other gradient.  Running statistics use the global
count (unbiased variance), the same on every rank.

On the GPU the per-channel sums are cuda_ops' float64-partial kernels and the dx pass is its batch-norm
backward kernel, given the global sums; the few per-channel numbers go through the host, so a SyncBatchNorm
layer synchronises the stream (correctness first: the local BatchNorm2d is the fast default).
"""
from __future__ import annotations

import numpy as np

from kernelgen.distributed.process_group import get_default
from kernelgen.nn.modules import BatchNorm2d, Module
from kernelgen.nn.tensor import Tensor, as_tensor, device_kernels, device_ops


def _all_reduce_host(comm, vec):
    """Sum a host vector (float64) over the ranks, through device memory for a GPU communicator."""
    if getattr(comm, "device", "cpu") == "cuda":
        d = device_kernels().to_device(vec.astype(np.float32))
        comm.all_reduce(d)
        return d.copy_to_host().astype(np.float64)
    return comm.all_reduce(np.ascontiguousarray(vec, np.float64))


def _update_running(running_mean, running_var, mean, var, count, momentum, to_device):
    unbiased = var * count / max(count - 1, 1)
    new_mean = (1 - momentum) * _host(running_mean) + momentum * mean
    new_var = (1 - momentum) * _host(running_var) + momentum * unbiased
    if to_device:
        running_mean.copy_to_device(new_mean.astype(np.float32))
        running_var.copy_to_device(new_var.astype(np.float32))
    else:
        running_mean[...] = new_mean
        running_var[...] = new_var


def _host(a):
    return a if isinstance(a, np.ndarray) else a.copy_to_host()


def sync_batch_norm(x, weight, bias, running_mean, running_var, comm, *, momentum=0.1, eps=1e-5, relu=False):
    """[relu](batch_norm(x)) in training mode with statistics over every rank's x (channels-last)."""
    x, weight, bias = as_tensor(x), as_tensor(weight), as_tensor(bias)
    c = weight.shape[0]
    rows = x.data.size // c
    count = int(_all_reduce_host(comm, np.array([rows], np.float64))[0])
    if ops := device_ops(x, weight, bias):
        return _device(ops, x, weight, bias, running_mean, running_var, comm, count, momentum, eps, relu)
    axes = tuple(range(x.data.ndim - 1))
    mean = _all_reduce_host(comm, x.data.sum(axis=axes, dtype=np.float64)) / count
    var = _all_reduce_host(comm, ((x.data - mean) ** 2).sum(axis=axes, dtype=np.float64)) / count
    _update_running(running_mean, running_var, mean, var, count, momentum, False)
    inv_std = 1.0 / np.sqrt(var + eps)
    x_hat = ((x.data - mean) * inv_std).astype(x.dtype)
    y = x_hat * weight.data + bias.data
    if relu:
        y = np.maximum(y, 0)

    def backward(g):
        if relu:
            g = g * (y > 0)
        dbias = g.sum(axis=axes, dtype=np.float64)
        dweight = (g * x_hat).sum(axis=axes, dtype=np.float64)
        both = _all_reduce_host(comm, np.concatenate([dbias, dweight]))
        dx = weight.data * inv_std * (g - both[:c] / count - x_hat * (both[c:] / count))
        return dx.astype(x.dtype), dweight.astype(weight.dtype), dbias.astype(bias.dtype)
    return Tensor.from_op(y.astype(x.dtype), (x, weight, bias), backward)


def _device(ops, x, weight, bias, running_mean, running_var, comm, count, momentum, eps, relu):
    c = weight.shape[0]
    s, _ = ops.channel_sums(x.data)
    mean = _all_reduce_host(comm, ops.to_host(s).astype(np.float64)) / count
    mean_d, ones = ops.to_device(mean.astype(np.float32)), ops.fill(ops.empty((c,)), 1.0)
    _, q = ops.channel_sums(x.data, x.data, None, mean_d, ones)  # sum(x (x - mean)): over all ranks, sum((x - mean)^2)
    var = np.maximum(_all_reduce_host(comm, ops.to_host(q).astype(np.float64)) / count, 0.0)
    _update_running(running_mean, running_var, mean, var, count, momentum, True)
    # the global statistics in the eval-mode slots: the kernel normalises with them, and computes inv_std
    y, mean_d, inv_std = ops.batch_norm_forward(x.data, weight.data, bias.data, mean_d,
                                                ops.to_device(var.astype(np.float32)), False, momentum, eps, relu)

    def backward(g):
        db, dw = ops.channel_sums(g, x.data, y if relu else None, mean_d, inv_std)
        both = _all_reduce_host(comm, np.concatenate([ops.to_host(db), ops.to_host(dw)]).astype(np.float64))
        # cuda_ops' batch-norm dx in its training form, given the global sums and count
        dx = ops.bn_dx(g, x.data, y, relu, mean_d, inv_std, weight.data, ops.to_device(both[c:].astype(np.float32)),
                       ops.to_device(both[:c].astype(np.float32)), count, True, ops.empty(x.shape))
        return dx, dw, db
    return Tensor.from_op(y, (x, weight, bias), backward)


class SyncBatchNorm(BatchNorm2d):
    """BatchNorm2d with statistics over every rank's batch in training (comm: the communicator, default the
    process group's); eval, or a single rank, is BatchNorm2d's own path."""

    def __init__(self, c, *, momentum=0.1, eps=1e-5, dtype="float32", comm=None):
        super().__init__(c, momentum=momentum, eps=eps, dtype=dtype)
        self.comm = comm

    def _synced(self, x, relu):
        comm = self.comm if self.comm is not None else get_default()
        if not self.training or comm is None or comm.world_size == 1:
            return None
        x = as_tensor(x)
        self._check_input(x)
        return sync_batch_norm(x, self.weight, self.bias, self.running_mean, self.running_var, comm,
                               momentum=self.momentum, eps=self.eps, relu=relu)

    def forward(self, x):
        y = self._synced(x, False)
        return super().forward(x) if y is None else y

    def forward_relu(self, x):
        y = self._synced(x, True)
        return super().forward_relu(x) if y is None else y


def convert_sync_batchnorm(module, comm=None):
    """Replace every BatchNorm2d inside `module` (in place) by a SyncBatchNorm holding the same parameter
    Tensors and buffers; returns module.  Build the optimiser afterwards or before: the parameters are the same."""
    for k, v in list(vars(module).items()):
        if type(v) is BatchNorm2d:
            setattr(module, k, _synced_copy(v, comm))
        elif isinstance(v, Module):
            convert_sync_batchnorm(v, comm)
        elif isinstance(v, list):
            for i, m in enumerate(v):
                if type(m) is BatchNorm2d:
                    v[i] = _synced_copy(m, comm)
                elif isinstance(m, Module):
                    convert_sync_batchnorm(m, comm)
    return module


def _synced_copy(bn, comm):
    s = SyncBatchNorm.__new__(SyncBatchNorm)
    s.__dict__.update(vars(bn))  # the same weight / bias Tensors and running-statistics arrays
    s.comm = comm
    return s


__all__ = ["SyncBatchNorm", "convert_sync_batchnorm", "sync_batch_norm"]
