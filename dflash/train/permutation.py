"""The order an epoch visits its samples: one seeded permutation per (seed, epoch), shared by the loader's plan and
the mixture plan (dflash.train.mixture), so neither imports the other."""

from __future__ import annotations

import numpy as np


def epoch_permutation(num_samples: int, *, seed: int, epoch: int) -> np.ndarray:
    """Deterministic permutation of range(num_samples) for (seed, epoch); int64 [N]."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, 0x5EED])))
    return rng.permutation(num_samples).astype(np.int64)
