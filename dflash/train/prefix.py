"""The training objectives' block prefixes: how many real tokens each block reveals before its mask slots.

Shapes: J = blocks, B = block size.

Two objectives share the anchors, the loader, the drafter forward and the loss kernel; they differ only in the
block's visible prefix length l (slots 0..l-1 hold the real tokens x_a..x_{a+l-1}, slots l..B-1 the mask token)
and so in which slots are supervised and how their decay is anchored:

- dflash (the paper's): l = 1 for every block (the anchor alone); slot k >= 1 weighs exp(-(k-1)/gamma).
- variable_prefix (D2SD's VP-Drafter, arXiv 2606.04446, as NeMo Automodel's loss_type="variable_prefix" and
  SpecForge's vp_drafter mode define it): l is drawn per block from a truncated geometric prior
  Pr(l) = base^l / sum_{m=lo}^{B-1} base^m over l in [lo, B-1], lo = min(2, B-1); only slots k >= l are
  supervised, weighted exp(-(k-l)/gamma) (the decay re-anchored at the prefix end). lo skips l = 1 (the dflash
  case) and B-1 keeps one masked slot; base < 1 favours short prefixes (0.9 in both peers).

Why the prefix: at inference a VP drafter re-drafts the suffix of a block behind an accepted prefix, so it
trains on blocks that reveal a variable number of real tokens. Held-out tau is unchanged by the objective: the
evaluator decodes with prefix 1 (the standard DFlash step), which a VP drafter must also handle (l >= 2 in
training, so it is a slight shift for it).

Tradeoff: prefix lengths are drawn on the host with the anchors' per-(seed, epoch, sample) generator, right after
the anchors, so a run's draws do not depend on rank, batch composition or the resume point, the anchors stay the
dflash objective's, and the supervised-row count the fused loss needs is known without a GPU sync.
"""

from __future__ import annotations

import numpy as np
import torch

from dflash.errors import ConfigError
from dflash.train.config import OBJECTIVES
DEFAULT_PREFIX_WEIGHT_BASE = 0.9
"""The prior's base in NeMo Automodel and SpecForge (prefix_weight_base)."""


def prefix_range(block_size: int) -> tuple[int, int]:
    """(lo, hi), the inclusive range of variable_prefix lengths: lo = min(2, B-1), hi = B-1."""
    if block_size < 2:
        raise ConfigError(f"block_size={block_size}: a block needs the anchor plus at least one slot (>= 2)")
    return min(2, block_size - 1), block_size - 1


def prefix_probs(*, block_size: int, base: float) -> np.ndarray:
    """float64 [B]: Pr(l) of the truncated geometric prior for l = 0..B-1 (0 outside prefix_range)."""
    if not base > 0:
        raise ConfigError(f"prefix_weight_base={base!r}: must be > 0 (0.9 favours short prefixes, 1 is uniform)")
    lo, hi = prefix_range(block_size)
    p = np.zeros(block_size, dtype=np.float64)
    ls = np.arange(lo, hi + 1)
    w = np.power(float(base), ls - lo)  # base^l / sum base^m, factored by base^lo so large B cannot underflow
    p[lo:hi + 1] = w / w.sum()
    return p


def sample_prefix_lengths(num_blocks: int, *, block_size: int, base: float,
                          generator: torch.Generator) -> torch.Tensor:
    """int64 [J] on the CPU: a variable_prefix length per block, drawn i.i.d. from prefix_probs with `generator`
    (a CPU generator; the anchors' per-sample one)."""
    probs = torch.from_numpy(prefix_probs(block_size=block_size, base=base))
    if num_blocks == 0:
        return torch.zeros(0, dtype=torch.int64)
    return torch.multinomial(probs, num_blocks, replacement=True, generator=generator)


def prefix_lengths(objective: str, num_blocks: int, *, block_size: int, base: float,
                   generator: torch.Generator) -> torch.Tensor | None:
    """The blocks' prefix lengths under `objective`: None for dflash (every block reveals its anchor only, the
    default everywhere), else sample_prefix_lengths."""
    if objective == "dflash":
        return None
    if objective != "variable_prefix":
        raise ConfigError(f"objective={objective!r}: choose {' or '.join(OBJECTIVES)}")
    return sample_prefix_lengths(num_blocks, block_size=block_size, base=base, generator=generator)


def slot_weights(prefix_J: torch.Tensor, *, block_size: int, gamma: float) -> torch.Tensor:
    """float32 [J, B] decay weight per slot before the sequence-end and loss-mask factors: 0 for the revealed
    slots k < l, exp(-(k-l)/gamma) for k >= l. With l = 1 it is objective.decay_weights of every block."""
    if gamma <= 0:
        raise ConfigError(f"gamma={gamma}: must be > 0 (7 for block 16, 5 for 10, 4 for 8)")
    k_B = torch.arange(block_size, device=prefix_J.device)
    rel_JB = k_B[None] - prefix_J[:, None]
    return torch.where(rel_JB >= 0, torch.exp(-rel_JB.clamp(min=0).float() / gamma), 0.0)


def objective_config_fields(objective: str, prefix_weight_base: float) -> dict:
    """The exported config.json's dflash_config fields that mark how the drafter was trained: none for dflash;
    SpecForge's VP-Drafter marks for variable_prefix (training_mode vp_drafter, prefix_weight_base), which it
    reads back when it trains or serves such a drafter."""
    if objective == "dflash":
        return {}
    return {"training_mode": "vp_drafter", "prefix_weight_base": float(prefix_weight_base)}


__all__ = ["DEFAULT_PREFIX_WEIGHT_BASE", "OBJECTIVES", "objective_config_fields", "prefix_lengths", "prefix_probs",
           "prefix_range", "sample_prefix_lengths", "slot_weights"]
