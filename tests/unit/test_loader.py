"""Loader planning: deterministic shuffle, token budgets, and the DDP partition (each sample once per epoch)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash.errors import ConfigError
from dflash.train.loader import (anchor_seed, balance_steps, epoch_permutation, pack_micro_batches, plan_epoch,
                                 sample_costs)


def _lengths(n, seed=0, hi=300):
    return np.random.default_rng(seed).integers(1, hi, size=n).astype(np.int64)


def _costs(lengths, seed=0):
    """Costs of samples whose loss tokens are a random share of their length (ShareGPT-like spread)."""
    share = np.random.default_rng(seed + 100).uniform(0.05, 0.95, size=len(lengths))
    return sample_costs(lengths, np.maximum(1, (share * lengths).astype(np.int64)))


def test_permutation_is_deterministic_and_changes_per_epoch():
    a = epoch_permutation(100, seed=3, epoch=0)
    assert np.array_equal(a, epoch_permutation(100, seed=3, epoch=0))
    assert sorted(a.tolist()) == list(range(100))
    assert not np.array_equal(a, epoch_permutation(100, seed=3, epoch=1))
    assert not np.array_equal(a, epoch_permutation(100, seed=4, epoch=0))


def test_pack_respects_budget_and_keeps_every_sample():
    lengths = _lengths(500, hi=400)
    lengths[7] = 5000  # longer than the budget: a micro-batch of its own
    order = epoch_permutation(len(lengths), seed=0, epoch=0)
    micro = pack_micro_batches(order, lengths, batch_tokens=1024)
    flat = np.concatenate(micro)
    assert sorted(flat.tolist()) == list(range(len(lengths)))
    for mb in micro:
        assert lengths[mb].sum() <= 1024 or len(mb) == 1
    assert [7] in [mb.tolist() for mb in micro]
    fill = lengths[flat].sum() / (1024 * len(micro))
    assert fill > 0.85, fill  # first fit over open bins keeps padding-free micro-batches well filled


@pytest.mark.parametrize("balanced", [False, True])
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_each_sample_once_per_epoch_across_ranks(world_size, grad_accum, balanced):
    lengths = _lengths(301, seed=world_size)
    costs = _costs(lengths) if balanced else None
    for epoch in range(2):
        plan = plan_epoch(lengths, seed=1, epoch=epoch, batch_tokens=700, world_size=world_size,
                          grad_accum=grad_accum, costs=costs)
        seen = []
        for rank in range(world_size):
            for step in range(plan.num_steps):
                mbs = plan.rank_step(rank, step)
                assert len(mbs) == grad_accum  # every rank runs the same number of micro-batches per step
                for mb in mbs:
                    seen.extend(mb.tolist())
        assert sorted(seen) == list(range(len(lengths)))


@pytest.mark.parametrize("balanced", [False, True])
def test_packing_is_independent_of_world_size(balanced):
    """1 rank with grad_accum W*A sees the same global steps as W ranks with grad_accum A."""
    lengths = _lengths(500)
    costs = _costs(lengths) if balanced else None
    one = plan_epoch(lengths, seed=0, epoch=2, batch_tokens=600, world_size=1, grad_accum=4, costs=costs)
    two = plan_epoch(lengths, seed=0, epoch=2, batch_tokens=600, world_size=2, grad_accum=2, costs=costs)
    assert one.num_steps == two.num_steps
    for s in range(one.num_steps):
        a = sorted(np.concatenate(one.rank_step(0, s)).tolist())
        b = sorted(np.concatenate(two.rank_step(0, s) + two.rank_step(1, s)).tolist())
        assert a == b


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 60), world=st.integers(1, 4), accum=st.integers(1, 3), budget=st.integers(1, 500),
       seed=st.integers(0, 5), balanced=st.booleans())
def test_partition_property(n, world, accum, budget, seed, balanced):
    lengths = _lengths(n, seed=seed, hi=200) if n else np.zeros(0, np.int64)
    costs = _costs(lengths, seed) if balanced else None
    plan = plan_epoch(lengths, seed=seed, epoch=0, batch_tokens=budget, world_size=world, grad_accum=accum,
                      costs=costs)
    seen = [i for s in range(plan.num_steps) for r in range(world) for mb in plan.rank_step(r, s) for i in mb]
    assert sorted(seen) == list(range(n))
    # padding never makes a whole step empty
    for s in range(plan.num_steps):
        assert any(len(mb) for mb in plan.steps[s])


def test_anchor_seed_depends_only_on_seed_epoch_sample():
    a = anchor_seed(seed=0, epoch=1, sample_id=42)
    assert a == anchor_seed(seed=0, epoch=1, sample_id=42)
    assert len({a, anchor_seed(seed=0, epoch=2, sample_id=42), anchor_seed(seed=1, epoch=1, sample_id=42),
                anchor_seed(seed=0, epoch=1, sample_id=43)}) == 4
    assert 0 <= a < 2**63


def test_sample_costs_count_capped_anchors_and_cheap_context():
    # 16 x min(512, loss - 1) block tokens + length / 32
    assert sample_costs(np.array([100, 4000, 64]), np.array([50, 3000, 1])).tolist() == [
        16 * 49 + 100 / 32, 16 * 512 + 4000 / 32, 64 / 32]


def test_balance_steps_groups_similar_costs_and_deals_in_snake_order():
    micro = [np.array([i]) for i in range(8)]
    costs = np.array([8.0, 1, 7, 2, 6, 3, 5, 4])  # micro-batch i costs costs[i]
    rng = np.random.Generator(np.random.PCG64(0))
    out = balance_steps(micro, costs, world_size=2, per_step=4, window=2, rng=rng)
    steps = [[int(mb[0]) for mb in out[k:k + 4]] for k in (0, 4)]
    # sorted by cost: 1,3,5,7 (costs 1-4) and 6,4,2,0 (costs 5-8); dealt [a, b, d, c]: rank 0 gets the
    # cheapest and the costliest of its step, rank 1 the middle two
    assert sorted(steps) == [[1, 3, 7, 5], [6, 4, 0, 2]]
    # a partial step (fewer micro-batches than a step needs) only in the last window, and it goes last: here
    # the last window is 4, 5, 6 (costs 6, 3, 5), cut as [5, 6] and the partial [4]
    out = balance_steps(micro[:7], costs[:7], world_size=1, per_step=2, window=2, rng=rng)
    assert sorted(int(mb[0]) for mb in out) == list(range(7)) and int(out[-1][0]) == 4


def _rank_cost_ratio(plan, costs):
    ratios = []
    for s in range(plan.num_steps):
        per_rank = plan.rank_costs(s, costs)
        if min(per_rank) > 0:
            ratios.append(max(per_rank) / np.mean(per_rank))
    return float(np.mean(ratios))


def test_balance_evens_the_ranks_of_a_step():
    """With ShareGPT-like spread of loss tokens, the costliest of 8 ranks runs ~1.4x the mean rank's compute in
    the plain plan; balanced steps bring that near 1 (the step waits for the costliest rank)."""
    lengths = _lengths(6000, hi=2000)
    costs = _costs(lengths)
    plain = plan_epoch(lengths, seed=0, epoch=0, batch_tokens=4096, world_size=8, grad_accum=1)
    bal = plan_epoch(lengths, seed=0, epoch=0, batch_tokens=4096, world_size=8, grad_accum=1, costs=costs)
    before, after = _rank_cost_ratio(plain, costs), _rank_cost_ratio(bal, costs)
    assert before > 1.25 and after < 1.08, (before, after)
    # grad_accum 2: the snake deal keeps each rank's two micro-batches balanced as well
    acc = plan_epoch(lengths, seed=0, epoch=0, batch_tokens=4096, world_size=4, grad_accum=2, costs=costs)
    assert _rank_cost_ratio(acc, costs) < 1.05
    # one micro-batch per step: nothing to balance, the plan is the plain one
    one = plan_epoch(lengths, seed=0, epoch=0, batch_tokens=4096, world_size=1, grad_accum=1, costs=costs)
    ref = plan_epoch(lengths, seed=0, epoch=0, batch_tokens=4096, world_size=1, grad_accum=1)
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(one.steps, ref.steps, strict=True))


def test_balanced_plan_is_deterministic_and_shuffled_per_epoch():
    lengths = _lengths(800, hi=1000)
    costs = _costs(lengths)
    a = plan_epoch(lengths, seed=3, epoch=1, batch_tokens=2048, world_size=4, grad_accum=1, costs=costs)
    b = plan_epoch(lengths, seed=3, epoch=1, batch_tokens=2048, world_size=4, grad_accum=1, costs=costs)
    c = plan_epoch(lengths, seed=3, epoch=2, batch_tokens=2048, world_size=4, grad_accum=1, costs=costs)
    flat = [np.concatenate(s).tolist() for s in a.steps]
    assert flat == [np.concatenate(s).tolist() for s in b.steps]
    assert flat != [np.concatenate(s).tolist() for s in c.steps]
    # steps are not in cost order: the window's steps are shuffled
    step_cost = [costs[np.concatenate(s)].sum() for s in a.steps[:16]]
    assert step_cost != sorted(step_cost) and step_cost != sorted(step_cost, reverse=True)


@pytest.mark.parametrize("world_size,grad_accum", [(1, 3), (2, 2)])
def test_fixed_count_steps_take_consecutive_samples_of_the_permutation(world_size, grad_accum):
    """step_samples: step s holds samples order[s*K:(s+1)*K] (the last the rest), packed within the budget,
    padded with empty micro-batches to world_size x grad_accum; every sample once; costs do not reorder it."""
    rng = np.random.default_rng(3)
    lengths = rng.integers(10, 200, size=53)
    order = epoch_permutation(53, seed=4, epoch=1)
    plan = plan_epoch(lengths, seed=4, epoch=1, batch_tokens=400, world_size=world_size, grad_accum=grad_accum,
                      step_samples=8, costs=rng.random(53))
    assert plan.num_steps == 7
    for s, step in enumerate(plan.steps):
        assert len(step) == world_size * grad_accum
        assert sorted(np.concatenate(step).tolist()) == sorted(order[8 * s:8 * s + 8].tolist())
        assert all(lengths[mb].sum() <= 400 for mb in step)
    assert sum(len(mb) for step in plan.steps for mb in step) == 53


def test_fixed_count_steps_that_need_more_micro_batches_are_a_config_error():
    lengths = np.full(16, 300)
    with pytest.raises(ConfigError, match="step_samples=8: a step's samples need 8 micro-batches of batch_tokens "
                                          "400, more than world_size x grad_accum = 2; raise grad_accum"):
        plan_epoch(lengths, seed=0, epoch=0, batch_tokens=400, world_size=1, grad_accum=2, step_samples=8)
    assert plan_epoch(lengths, seed=0, epoch=0, batch_tokens=2400, world_size=1, grad_accum=1,
                      step_samples=8).num_steps == 2
