"""The order an epoch visits its samples: one seeded permutation per (seed, epoch), shared by the loader's plan and
the mixture plan (dflash.train.mixture), so neither imports the other; or, for caches read over the network, runs
of samples that neighbour each other in storage in a seeded order (block_permutation)."""

from __future__ import annotations

import numpy as np


def epoch_permutation(num_samples: int, *, seed: int, epoch: int) -> np.ndarray:
    """Deterministic permutation of range(num_samples) for (seed, epoch); int64 [N]."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, 0x5EED])))
    return rng.permutation(num_samples).astype(np.int64)


def storage_order(shard: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """int64 [N]: sample positions in the order the cache stores them (by shard, then offset in the shard)."""
    return np.lexsort((np.asarray(offset), np.asarray(shard))).astype(np.int64)


def block_permutation(stored: np.ndarray, *, block: int, seed: int, epoch: int) -> np.ndarray:
    """The epoch's order as runs of `block` storage neighbours: `stored` (storage_order) rotated by a seeded
    offset below `block`, so the runs' boundaries move from epoch to epoch, cut into runs of `block` positions
    (the first and last may be shorter), the runs in a seeded random order, each in storage order. Why: micro-
    batches packed from consecutive positions of this order hold a few long stretches of a shard, which the
    reader fetches with few large requests (an object store's cost is per request); the price is a coarser
    shuffle. int64 [N], each position once; block=1 is a plain seeded permutation."""
    if block < 1:
        raise ValueError(f"block={block}: must be >= 1")
    n = len(stored)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, 0xB10C])))
    shift = int(rng.integers(block))
    runs = np.split(np.asarray(stored, dtype=np.int64), np.arange(shift or block, n, block))
    return np.concatenate([runs[i] for i in rng.permutation(len(runs))])
