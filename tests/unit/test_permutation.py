"""The epoch's sample order: block_permutation's runs of storage neighbours, storage_order, and the plan a
shuffle_block config makes (config_plan)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash.cache.reader import SampleIndex
from dflash.errors import ConfigError
from dflash.train.config import TrainConfig
from dflash.train.loader import config_plan, pack_micro_batches
from dflash.train.permutation import block_permutation, epoch_permutation, storage_order


def test_storage_order_is_by_shard_then_offset():
    shard = np.array([1, 0, 1, 0, 2])
    offset = np.array([0, 50, 10, 0, 0])
    assert storage_order(shard, offset).tolist() == [3, 1, 0, 2, 4]


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 80), block=st.integers(1, 12), seed=st.integers(0, 3), epoch=st.integers(0, 3))
def test_block_permutation_is_runs_of_storage_neighbours(n, block, seed, epoch):
    """Every position once; cut where the result leaves storage order, it is whole runs of `stored`, each run
    `block` long except the first and last of storage, and all runs cut at one phase (the epoch's shift)."""
    stored = np.random.default_rng(seed).permutation(n).astype(np.int64)  # storage order != sample order
    out = block_permutation(stored, block=block, seed=seed, epoch=epoch)
    assert sorted(out.tolist()) == list(range(n))
    rank = np.empty(n, dtype=np.int64)
    rank[stored] = np.arange(n)
    r = rank[out]  # each visited sample's place in storage
    runs = np.split(r, np.flatnonzero(np.diff(r) != 1) + 1) if n else []
    # a run of the shuffled order may be two storage runs that happened to land in storage order: split at the
    # phase, which every run boundary shares
    starts = sorted(int(x[0]) for x in runs)
    phase = next((s % block for s in starts if s), 0)
    pieces = []
    for x in runs:
        cuts = [i for i in range(1, len(x)) if x[i] % block == phase]
        pieces += np.split(x, cuts)
    for x in pieces:
        assert x[0] == 0 or x[0] % block == phase, (x, phase)
        end = x[-1] + 1
        assert end == n or end % block == phase, (x, phase)
        assert len(x) <= block


def test_block_permutation_is_seeded_and_moves_every_epoch():
    stored = np.arange(1000)
    a = block_permutation(stored, block=8, seed=0, epoch=0)
    assert np.array_equal(a, block_permutation(stored, block=8, seed=0, epoch=0))
    assert not np.array_equal(a, block_permutation(stored, block=8, seed=1, epoch=0))
    b = block_permutation(stored, block=8, seed=0, epoch=1)
    assert not np.array_equal(a, b)
    # the runs' boundaries move: which neighbours travel together changes from epoch to epoch
    pairs = [set(zip(x[:-1].tolist(), x[1:].tolist())) for x in (a, b)]
    assert len(pairs[0] & pairs[1]) < 0.95 * len(pairs[0])


def test_block_one_is_a_plain_shuffle_and_a_bad_block_is_refused():
    out = block_permutation(np.arange(50), block=1, seed=2, epoch=0)
    assert sorted(out.tolist()) == list(range(50)) and not np.array_equal(out, np.arange(50))
    with pytest.raises(ValueError, match="block=0"):
        block_permutation(np.arange(5), block=0, seed=0, epoch=0)


def _index(n, seed=0):
    """A cache's index as extraction leaves it: sample ids in data order, stored in another order (the
    extractor's length-sorted batches) across 3 shards."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(50, 600, size=n).astype(np.int64)
    stored = rng.permutation(n)
    shard = np.empty(n, np.int64)
    offset = np.empty(n, np.int64)
    for s, part in enumerate(np.array_split(stored, 3)):
        shard[part] = s
        offset[part] = np.cumsum(lengths[part]) - lengths[part]
    return SampleIndex(sample_id=np.arange(n), length=lengths, num_loss_tokens=lengths // 2, shard=shard,
                       offset=offset, shard_names=["a", "b", "c"])


def _segments(index, mb):
    """What CacheReader.read_many merges: runs of a micro-batch's samples that follow each other in one shard."""
    sh, off, ln = index.shard[mb], index.offset[mb], index.length[mb]
    return 1 + int(np.count_nonzero((sh[1:] != sh[:-1]) | (off[1:] != off[:-1] + ln[:-1])))


@pytest.mark.parametrize("world_size,grad_accum", [(1, 1), (2, 2)])
def test_a_shuffle_block_plan_reads_few_stretches_and_every_sample_once(world_size, grad_accum):
    index = _index(600)
    segments = {}
    for block in (0, 16):
        cfg = TrainConfig(cache="c", model="m", output="o", batch_tokens=4096, grad_accum=grad_accum,
                          shuffle_block=block)
        for epoch in range(2):
            plan = config_plan(cfg, index, epoch=epoch, world_size=world_size)
            mbs = [mb for s in plan.steps for mb in s if len(mb)]
            assert sorted(np.concatenate(mbs).tolist()) == list(range(600))
            segments.setdefault(block, []).append(sum(_segments(index, mb) for mb in mbs) / len(mbs))
    # shuffled samples: a request per sample; runs of 16 neighbours: a micro-batch's ~13 samples in a few
    assert min(segments[0]) > 10 and max(segments[16]) < 4, segments


def test_the_shuffle_block_config_is_checked():
    with pytest.raises(ConfigError, match="shuffle_block=-1"):
        TrainConfig(cache="c", model="m", output="o", shuffle_block=-1)
    with pytest.raises(ConfigError, match="cache_weights"):
        TrainConfig(cache="c", extra_caches=("d",), model="m", output="o", shuffle_block=8, cache_weights=(1.0, 1.0))
    plain = TrainConfig(cache="c", model="m", output="o")
    index = _index(100)
    plan = config_plan(plain, index, epoch=0, world_size=1)  # 0: the seeded shuffle of every sample
    want = pack_micro_batches(epoch_permutation(100, seed=0, epoch=0), index.length, batch_tokens=plain.batch_tokens)
    assert [mb.tolist() for s in plan.steps for mb in s if len(mb)] == [mb.tolist() for mb in want]
