"""DistributedSampler: each rank its shard, disjoint and together covering the data, reshuffled per epoch, the
same on every rank for a given epoch; the Loader batches a rank's shard."""
from __future__ import annotations

import numpy as np
import pytest

from kernelgen.nn.data import DistributedSampler, Loader


@pytest.mark.parametrize("size, world", [(12, 3), (10, 4), (7, 1), (5, 8)])
def test_shards_disjoint_and_covering(size, world):
    shards = [list(DistributedSampler(size, world, r, seed=3)) for r in range(world)]
    assert len({len(s) for s in shards}) == 1 and len(shards[0]) == -(-size // world)
    flat = [i for s in shards for i in s]
    assert set(flat) == set(range(size))  # covering
    if size % world == 0:
        assert len(flat) == len(set(flat))  # disjoint
    else:  # padded with a few items twice, each shard itself without repeats
        assert len(flat) - len(set(flat)) == (-size) % world or size < world


def test_drop_last_is_disjoint():
    shards = [set(DistributedSampler(10, 4, r, drop_last=True)) for r in range(4)]
    assert all(len(s) == 2 for s in shards)
    assert len(set.union(*shards)) == 8


def test_set_epoch_reshuffles_the_same_way_everywhere():
    a, b = DistributedSampler(100, 2, 0), DistributedSampler(100, 2, 1)
    first = list(a)
    a.set_epoch(1), b.set_epoch(1)
    assert list(a) != first
    assert not set(a) & set(b)
    assert list(a) == list(DistributedSampler(100, 2, 0, seed=1))  # the permutation is seeded by seed + epoch
    assert list(DistributedSampler(6, 2, 1, shuffle=False)) == [1, 3, 5]


def test_bad_arguments():
    with pytest.raises(ValueError, match="rank must be < num_replicas"):
        DistributedSampler(10, 2, 2)
    with pytest.raises(TypeError, match="num_replicas"):
        DistributedSampler(10, 2.0, 0)
    with pytest.raises(ValueError, match="epoch"):
        DistributedSampler(10, 2, 0).set_epoch(-1)


def test_loader_batches_the_shard():
    images = np.arange(20, dtype=np.uint8).reshape(20, 1, 1, 1)
    labels = np.arange(20)
    sampler = DistributedSampler(20, 2, 1, seed=5)
    loader = Loader(images, labels, batch_size=4, sampler=sampler, drop_last=True)
    assert len(loader) == 2
    seen = np.concatenate([y for _, y in loader])
    np.testing.assert_array_equal(seen, list(sampler)[:8])
