"""Data: scikit-learn's handwritten digits (8x8, 1797 images), a prefetching batch loader, and the sampler that
gives each rank of a data-parallel job its own shard."""
from __future__ import annotations

import queue
import threading

import numpy as np

from kernelgen.distributed.process_group import get_default


def load_digits_arrays(path=None):
    """(images uint8 (N, 8, 8, 1) in 0..16, labels int64): scikit-learn's copy, or an .npz written by
    save_digits (for a machine without scikit-learn, such as the GPU machine)."""
    if path is not None:
        with np.load(path) as d:
            if set(d.files) != {"images", "labels"}:
                raise ValueError(f"data must be an .npz with arrays 'images' and 'labels', got {sorted(d.files)}")
            return d["images"].astype(np.uint8), d["labels"].astype(np.int64)
    from sklearn.datasets import load_digits
    d = load_digits()
    return d.images.astype(np.uint8)[..., None], d.target.astype(np.int64)


def save_digits(path):
    images, labels = load_digits_arrays()
    np.savez_compressed(path, images=images, labels=labels)


def load_digits_split(test_fraction=0.2, seed=0, path=None):
    """(x_train, y_train, x_test, y_test): images as uint8 (N, 8, 8, 1) in 0..16, labels int64."""
    images, labels = load_digits_arrays(path)
    order = np.random.default_rng(seed).permutation(len(images))
    n_test = int(len(images) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return images[train], labels[train], images[test], labels[test]


def _count(name, v, lo):
    if not isinstance(v, (int, np.integer)) or isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    return int(v)


class DistributedSampler:
    """The indices of rank `rank`'s shard of a dataset of `size` items, PyTorch's DistributedSampler: every
    epoch one permutation, the same on every rank (seeded by seed + epoch: call set_epoch(e) before each
    epoch, or every epoch sees the same order), dealt out round-robin, so the shards are disjoint and
    together cover the data.  Unless drop_last, the permutation is padded with its own first items up to a
    multiple of num_replicas, so every rank gets as many (a few items twice); drop_last cuts the tail instead.
    num_replicas and rank default to the process group's (kernelgen.distributed.init_process_group)."""

    def __init__(self, size, num_replicas=None, rank=None, shuffle=True, seed=0, drop_last=False):
        comm = get_default()
        num_replicas = (comm.world_size if comm else 1) if num_replicas is None else num_replicas
        rank = (comm.rank if comm else 0) if rank is None else rank
        self.size = _count("size", size, 0)
        self.num_replicas = _count("num_replicas", num_replicas, 1)
        self.rank = _count("rank", rank, 0)
        if self.rank >= self.num_replicas:
            raise ValueError(f"rank must be < num_replicas ({self.num_replicas}), got {self.rank}")
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, int(seed), drop_last, 0
        if drop_last:
            self.per_rank = self.size // self.num_replicas
        else:
            self.per_rank = -(-self.size // self.num_replicas)

    def set_epoch(self, epoch):
        self.epoch = _count("epoch", epoch, 0)

    def __len__(self):
        return self.per_rank

    def indices(self):
        if self.shuffle:
            order = np.random.default_rng(self.seed + self.epoch).permutation(self.size)
        else:
            order = np.arange(self.size)
        total = self.per_rank * self.num_replicas
        if total > len(order) and len(order):
            order = np.resize(order, total)  # np.resize repeats the array: the padding is its first items
        return order[:total][self.rank::self.num_replicas]

    def __iter__(self):
        return iter(self.indices().tolist())


class Loader:
    """Batches of (float32 images scaled to [0, 1], labels); a background thread prepares the next
    batches while the current one trains.  Images stay uint8 until they are used.  sampler: where the
    order comes from instead (a DistributedSampler: this rank's shard), shuffle and seed then unused."""

    def __init__(self, images, labels, batch_size=64, shuffle=True, seed=0, prefetch=2, dtype="float32",
                 drop_last=False, sampler=None):
        # drop_last: every batch has the same shape, so kernelgen compiles each layer's kernels once
        self.images, self.labels, self.batch_size, self.shuffle = images, labels, batch_size, shuffle
        self.drop_last, self.sampler = drop_last, sampler
        self.rng, self.prefetch, self.dtype = np.random.default_rng(seed), prefetch, dtype

    def __len__(self):
        n = len(self.sampler) if self.sampler is not None else len(self.images)
        if self.drop_last:
            return n // self.batch_size
        return -(-n // self.batch_size)

    def _batches(self):
        if self.sampler is not None:
            order = np.fromiter(self.sampler, np.int64)
        elif self.shuffle:
            order = self.rng.permutation(len(self.images))
        else:
            order = np.arange(len(self.images))
        end = len(order) - len(order) % self.batch_size if self.drop_last else len(order)
        for i in range(0, end, self.batch_size):
            idx = order[i:i + self.batch_size]
            yield (self.images[idx].astype(self.dtype) / 16.0), self.labels[idx]

    def __iter__(self):
        q = queue.Queue(self.prefetch)
        done = object()

        def work():
            for b in self._batches():
                q.put(b)
            q.put(done)

        threading.Thread(target=work, daemon=True).start()
        while (item := q.get()) is not done:
            yield item
