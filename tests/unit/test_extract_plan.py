"""Pure planning logic of `dflash extract`: batches independent of ranks and resume state, balanced
partition, exact coverage, byte estimate and the free-space refusal."""

import shutil
from collections import namedtuple

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash.data import token_budget_batches
from dflash.errors import OutOfSpaceError
from dflash.extract.plan import assign_batches, make_plan
from dflash.extract.space import check_free_space, estimate_cache_bytes


def _plan(lengths, *, committed=(), world_size=1, max_tokens=64):
    lengths = np.asarray(lengths, dtype=np.int64)
    ids = np.arange(len(lengths), dtype=np.int64) * 3 + 7  # ids are not positions
    return ids, make_plan(sample_ids=ids, lengths=lengths, committed=set(committed), world_size=world_size,
                          max_tokens=max_tokens, batch_fn=token_budget_batches)


def _written(ids, plan):
    """sample id -> (batch_id, members as ids) for every written sample over all ranks."""
    out = {}
    for batches in plan.rank_batches:
        for b in batches:
            for j, m in enumerate(b.members):
                if b.write[j]:
                    assert int(ids[m]) not in out, "sample written twice"
                    out[int(ids[m])] = (b.batch_id, tuple(int(ids[x]) for x in b.members))
    return out


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 32), min_size=1, max_size=60), world_size=st.integers(1, 5),
       data=st.data())
def test_batches_do_not_depend_on_ranks_or_resume(lengths, world_size, data):
    ids, full = _plan(lengths)
    ref = _written(ids, full)
    assert set(ref) == set(int(i) for i in ids)
    committed = data.draw(st.sets(st.sampled_from([int(i) for i in ids])))
    _, resumed = _plan(lengths, committed=committed, world_size=world_size)
    got = _written(ids, resumed)
    # exactly the uncommitted samples, each in the same batch with the same members as the full run
    assert set(got) == set(ref) - committed
    assert all(got[i] == ref[i] for i in got)
    assert resumed.num_todo == len(ref) - len(committed)
    assert resumed.num_tokens_todo == sum(l for i, l in zip(ids, lengths) if int(i) not in committed)


def test_partially_committed_batch_is_rerun_whole_but_writes_only_missing():
    ids, full = _plan([10] * 6, max_tokens=60)  # one batch of 6
    (batch,) = full.rank_batches[0]
    _, resumed = _plan([10] * 6, committed={int(ids[0]), int(ids[3])}, max_tokens=60)
    (rb,) = resumed.rank_batches[0]
    assert np.array_equal(rb.members, batch.members) and rb.padded_len == batch.padded_len
    assert rb.write.sum() == 4 and not rb.write[list(rb.members).index(0)]
    _, done = _plan([10] * 6, committed=set(int(i) for i in ids), max_tokens=60)
    assert done.num_rounds == 0 and done.num_todo == 0


def test_assign_batches_balances_and_is_deterministic():
    rng = np.random.default_rng(0)
    costs = rng.integers(100, 1000, size=200)
    parts = assign_batches(costs=costs, world_size=8)
    assert sorted(i for p in parts for i in p) == list(range(200))
    loads = [int(costs[p].sum()) for p in parts]
    assert max(loads) - min(loads) <= costs.max()  # LPT: within one batch
    assert parts == assign_batches(costs=costs, world_size=8)
    assert all(list(costs[p]) == sorted(costs[p], reverse=True) for p in parts)  # costliest first


def test_more_ranks_than_batches_leaves_some_idle():
    _, plan = _plan([5, 5], world_size=4, max_tokens=10)
    assert sum(len(b) for b in plan.rank_batches) == 1 and plan.num_rounds == 1


def test_estimate_cache_bytes_counts_every_array():
    b = estimate_cache_bytes(num_tokens=1000, num_samples=10, num_taps=5, hidden_size=64, storage="fp8",
                             shard_tokens=1 << 16)
    assert b.hidden == 1000 * 5 * 64 * 1 and b.scales == 1000 * 5 * 4 and b.tokens == 1000 * 5
    bf = estimate_cache_bytes(num_tokens=1000, num_samples=10, num_taps=5, hidden_size=64, storage="bf16",
                              shard_tokens=1 << 16)
    assert bf.hidden == 2 * b.hidden and bf.scales == 0 and bf.total > bf.hidden
    # chunk rounding: 3 shards of 400 tokens, 256-token chunks -> 512 stored tokens per shard
    c = estimate_cache_bytes(num_tokens=1200, num_samples=3, num_taps=1, hidden_size=8, storage="bf16",
                             shard_tokens=400, chunk_tokens=256)
    assert c.hidden == 3 * 512 * 8 * 2


def test_check_free_space_refuses(monkeypatch, tmp_path):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(OutOfSpaceError, match="not enough space"):
        check_free_space(str(tmp_path / "new" / "cache"), needed_bytes=10_000)
    assert check_free_space(str(tmp_path), needed_bytes=500) == 1000
