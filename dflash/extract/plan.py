"""Work partition and resume plan for `dflash extract`: pure functions over sample lengths.

The batches are a function of the data alone (every sample's length and the token budget), never of the
number of ranks or of what a previous run already committed. Resume and a different rank count only change
*which* batches run and *where*; a batch always has the same members, padding and shape, so a sample's
hidden bytes do not depend on how the run was split or interrupted (no reliance on batch-invariant kernels).
The price: a batch of which some samples are already committed is run whole and only its missing samples
are written (at most the batches in flight when a run died, per rank).

Ranks get batches by longest-processing-time-first greedy on padded tokens (the forward's cost), so they
finish within about one batch of each other.

Shapes: N = samples, B = batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

BatchFn = Callable[..., list[np.ndarray]]


@dataclass(frozen=True, kw_only=True)
class PlannedBatch:
    """One forward pass: the samples it runs and the ones it writes."""

    batch_id: int
    """Index in the global batch list (stable across runs of the same data and budget)."""
    members: np.ndarray
    """int64 [n]: positions in the sample list (not sample ids), sorted by length like the batch builder did."""
    write: np.ndarray
    """bool [n]: True for members not yet committed; only those reach the writer."""
    padded_len: int
    """Longest member: every row is right-padded to it."""

    @property
    def padded_tokens(self) -> int:
        return int(len(self.members) * self.padded_len)


@dataclass(frozen=True, kw_only=True)
class ExtractPlan:
    """What each rank runs, and the counts the pre-flight report prints."""

    world_size: int
    num_samples: int
    """All tokenized samples (committed or not)."""
    num_committed: int
    """Samples already in the cache (skipped)."""
    num_todo: int
    """Samples this run writes."""
    num_tokens_todo: int
    """Real tokens this run writes (sum of their lengths)."""
    num_padded_tokens: int
    """Tokens the forward passes process, padding included (the compute cost)."""
    rank_batches: tuple[tuple[PlannedBatch, ...], ...]
    """[world_size] batches per rank, in processing order."""

    @property
    def num_rounds(self) -> int:
        """Batches of the busiest rank: the number of lock-step progress rounds."""
        return max((len(b) for b in self.rank_batches), default=0)


def assign_batches(*, costs: np.ndarray, world_size: int) -> list[list[int]]:
    """Longest-processing-time-first: the costliest batch goes to the least-loaded rank (ties: lower rank,
    then lower batch index), so the result is deterministic. Each rank's list is in descending cost order,
    which also surfaces an out-of-memory batch in the first seconds of a run."""
    assert world_size >= 1, world_size
    order = sorted(range(len(costs)), key=lambda i: (-int(costs[i]), i))
    loads = [0] * world_size
    out: list[list[int]] = [[] for _ in range(world_size)]
    for i in order:
        r = min(range(world_size), key=lambda k: (loads[k], k))
        out[r].append(i)
        loads[r] += int(costs[i])
    return out


def extraction_batches(lengths: np.ndarray, *, max_tokens: int) -> list[np.ndarray]:
    """The batches `dflash extract` runs: sorted-length token-budget batches of round sizes (why:
    dflash.data.batching)."""
    from dflash.data.batching import token_budget_batches

    return token_budget_batches(lengths, max_tokens=max_tokens, round_sizes=True)


def make_plan(
    *,
    sample_ids: np.ndarray,
    lengths: np.ndarray,
    committed: set[int] | frozenset[int],
    world_size: int,
    max_tokens: int,
    batch_fn: BatchFn,
    groups: np.ndarray | None = None,
) -> ExtractPlan:
    """Build the global batches over all samples with `batch_fn` (dflash.data.token_budget_batches), drop
    batches whose members are all committed, mark the committed members of the others as not-to-write,
    and deal the rest to `world_size` ranks.

    sample_ids: int64 [N] global ids; lengths: int64 [N] tokens per sample; committed: ids already in the cache.
    groups: int [N], e.g. each sample's source: batches never mix groups (batch_fn runs per group, in group
    order), so a group's samples are batched as in an extraction of that group alone and get the same float
    rounding (padding length and batch shape change the kernels' summation order): a cache grown by a new
    source then holds bit for bit what one extraction of all sources holds.
    """
    sample_ids = np.asarray(sample_ids, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    assert sample_ids.shape == lengths.shape, (sample_ids.shape, lengths.shape)
    done_N = np.isin(sample_ids, np.fromiter(committed, dtype=np.int64, count=len(committed)))
    batches: list[PlannedBatch] = []
    if groups is None:
        all_batches = [np.asarray(m, dtype=np.int64) for m in batch_fn(lengths, max_tokens=max_tokens)]
    else:
        groups = np.asarray(groups)
        all_batches = []
        for g in np.unique(groups).tolist():
            where = np.flatnonzero(groups == g)
            all_batches += [where[np.asarray(m, dtype=np.int64)] for m in batch_fn(lengths[where],
                                                                                   max_tokens=max_tokens)]
    seen_N = np.zeros(len(lengths), dtype=np.int64)
    for members in all_batches:
        np.add.at(seen_N, members, 1)
    assert (seen_N == 1).all(), "batch_fn must place every sample in exactly one batch"
    for batch_id, members in enumerate(all_batches):
        write = ~done_N[members]
        if write.any():
            batches.append(PlannedBatch(batch_id=batch_id, members=members, write=write,
                                        padded_len=int(lengths[members].max())))
    costs = np.array([b.padded_tokens for b in batches], dtype=np.int64)
    per_rank = assign_batches(costs=costs, world_size=world_size)
    todo_N = ~done_N
    return ExtractPlan(
        world_size=world_size,
        num_samples=len(sample_ids),
        num_committed=int(done_N.sum()),
        num_todo=int(todo_N.sum()),
        num_tokens_todo=int(lengths[todo_N].sum()),
        num_padded_tokens=int(costs.sum()),
        rank_batches=tuple(tuple(batches[i] for i in idx) for idx in per_rank),
    )
