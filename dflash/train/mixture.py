"""The mixture plan: which cache each sample slot of an epoch comes from, and which of its samples.

Several caches feed one run by weight (`dflash train --cache A --cache B --cache-weights 3,1`). The caches are
one virtual sample axis (cache.mixed.MixedReader: cache c's local sample j is global index offsets[c] + j);
the plan gives each epoch an order of global indices that the usual packing (loader.plan_epoch) cuts into
micro-batches and steps, so everything downstream (DDP partition, step_samples, resume) is unchanged.

Semantics (pure, deterministic for (seed, weights, counts, epoch); no state carried between epochs, so a
resume re-plans any epoch exactly):
- An epoch has as many slots as the caches hold samples together (sum N_c), whatever the weights.
- Slot quotas: over the whole run, the first k slots hold floor(k C_c / W) - floor(k C_{c-1} / W) samples of
  cache c (C_c the cumulative weights, W their sum), so any prefix of epochs is within one sample per cache
  of the weights, and epoch e's quota is that count at (e+1) N minus the count at e N.
- Inside an epoch the quotas are interleaved evenly: cache c's m-th slot sits at key (m + 1/2) / n_c, the slots
  in key order (ties by cache), so every window of the epoch, and so every step, holds the caches near their
  weights rather than a random draw's +- sqrt(n) (a 200-step window then meets |share - weight| <= 0.02).
- Cache c is read as an endless stream of its own shuffled passes (pass p = a permutation seeded by
  (seed, c, p)); the epoch takes the next n_c of that stream. A cache weighted above its size share is
  repeated (a sample may recur within an epoch), one below it is subsampled, and the next epoch continues
  where this one stopped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflash.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class MixturePlan:
    """One epoch's slots. All int64 [S], S = sum of the caches' sample counts."""

    cache: np.ndarray
    """Cache of each slot."""
    local: np.ndarray
    """Sample index inside that cache."""
    order: np.ndarray
    """Global index of each slot: offsets[cache] + local (the order loader.plan_epoch packs)."""


def check_weights(weights, num_caches: int) -> tuple[float, ...]:
    """The weights as floats; ConfigError unless there is one positive, finite weight per cache."""
    ws = tuple(float(w) for w in weights)
    if len(ws) != num_caches:
        raise ConfigError(f"cache_weights has {len(ws)} weights for {num_caches} caches: give one per --cache")
    if any(not np.isfinite(w) or w <= 0 for w in ws):
        raise ConfigError(f"cache_weights={list(ws)}: every weight must be a positive number")
    return ws


def slots_before(k: int, weights: tuple[float, ...]) -> np.ndarray:
    """int64 [C]: how many of the run's first k slots belong to each cache (the cumulative-rounding rule of the
    module docstring); sums to k."""
    cum = np.cumsum(np.asarray(weights, dtype=np.float64))
    # floor(k * C_c / W) in exact rational-free form: the last cumulative weight maps to exactly k
    bounds = np.floor(k * cum / cum[-1] + 1e-9).astype(np.int64)
    bounds[-1] = k
    return np.diff(np.concatenate([[0], bounds]))


def interleave(counts: np.ndarray) -> np.ndarray:
    """int64 [sum counts]: cache ids with cache c appearing counts[c] times, spread evenly (key (m + 1/2) / n_c,
    ties by cache id)."""
    keys, ids = [], []
    for c, n in enumerate(np.asarray(counts, dtype=np.int64).tolist()):
        if n > 0:
            keys.append((np.arange(n, dtype=np.float64) + 0.5) / n)
            ids.append(np.full(n, c, dtype=np.int64))
    if not keys:
        return np.zeros(0, dtype=np.int64)
    key, cid = np.concatenate(keys), np.concatenate(ids)
    return cid[np.lexsort((cid, key))]


def stream_positions(start: int, count: int, *, num_samples: int, seed: int, cache: int) -> np.ndarray:
    """Local sample indices at positions start .. start+count-1 of cache `cache`'s endless stream of shuffled
    passes (pass p: a permutation seeded by (seed, cache, p))."""
    from dflash.train.permutation import epoch_permutation

    if count == 0:
        return np.zeros(0, dtype=np.int64)
    pos = np.arange(start, start + count, dtype=np.int64)
    out = np.empty(count, dtype=np.int64)
    passes = pos // num_samples
    for p in np.unique(passes).tolist():
        perm = epoch_permutation(num_samples, seed=int(np.random.SeedSequence([seed, cache, 0x313]).generate_state(
            1, np.uint32)[0]), epoch=int(p))
        sel = passes == p
        out[sel] = perm[pos[sel] % num_samples]
    return out


def mixture_epoch(*, counts, weights, seed: int, epoch: int) -> MixturePlan:
    """Epoch `epoch` of a mixture of caches with `counts` samples each, weighted by `weights` (module
    docstring)."""
    counts = np.asarray(counts, dtype=np.int64)
    ws = check_weights(weights, len(counts))
    if (counts <= 0).any():
        raise ConfigError(f"a mixture cache has no samples (counts {counts.tolist()})")
    S = int(counts.sum())
    before = slots_before(epoch * S, ws)
    quota = slots_before((epoch + 1) * S, ws) - before
    cache = interleave(quota)
    local = np.empty(S, dtype=np.int64)
    for c in range(len(counts)):
        sel = cache == c
        local[sel] = stream_positions(int(before[c]), int(quota[c]), num_samples=int(counts[c]), seed=seed, cache=c)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    return MixturePlan(cache=cache, local=local, order=offsets[cache] + local)


def per_cache_counts(indices: np.ndarray, *, offsets: np.ndarray, lengths: np.ndarray,
                     num_caches: int) -> tuple[np.ndarray, np.ndarray]:
    """(samples, tokens) int64 [C] of global sample `indices` per cache (offsets: each cache's first global
    index; lengths: tokens per global index)."""
    idx = np.asarray(indices, dtype=np.int64)
    which = np.searchsorted(offsets, idx, side="right") - 1
    samples = np.bincount(which, minlength=num_caches).astype(np.int64)
    tokens = np.bincount(which, weights=lengths[idx].astype(np.float64), minlength=num_caches).astype(np.int64)
    return samples, tokens


__all__ = ["MixturePlan", "check_weights", "slots_before", "interleave", "stream_positions", "mixture_epoch",
           "per_cache_counts"]
