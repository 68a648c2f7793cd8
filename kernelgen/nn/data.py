"""Data: scikit-learn's handwritten digits (8x8, 1797 images) and a prefetching batch loader."""
from __future__ import annotations

import queue
import threading

import numpy as np


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


class Loader:
    """Batches of (float32 images scaled to [0, 1], labels); a background thread prepares the next
    batches while the current one trains.  Images stay uint8 until they are used."""

    def __init__(self, images, labels, batch_size=64, shuffle=True, seed=0, prefetch=2, dtype="float32",
                 drop_last=False):
        # drop_last: every batch has the same shape, so kernelgen compiles each layer's kernels once
        self.images, self.labels, self.batch_size, self.shuffle = images, labels, batch_size, shuffle
        self.drop_last = drop_last
        self.rng, self.prefetch, self.dtype = np.random.default_rng(seed), prefetch, dtype

    def __len__(self):
        if self.drop_last:
            return len(self.images) // self.batch_size
        return -(-len(self.images) // self.batch_size)

    def _batches(self):
        order = self.rng.permutation(len(self.images)) if self.shuffle else np.arange(len(self.images))
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
