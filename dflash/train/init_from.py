"""`dflash train --init-from`: a new run that starts from trained drafter weights.

What can be given: a dflash run folder (its newest checkpoint: the fp32 master weights), one checkpoint file
(checkpoints/step-N.pt), or a drafter folder in z-lab's format (config.json with dflash_config +
model.safetensors: our exports and the published drafters, as SpecForge and speculators users warm-start).
Only the weights and the drafter's shape come over; the optimizer, the schedule, the data position and the
RNG start fresh, so the new run may use another schedule, data or mixture.

The drafter must fit the new run's cache and target: hidden size, target layer count and vocabulary as the
target's, its taps among the cache's (or, with --taps, the same taps). A mismatch is one CacheMismatchError
line naming the field.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from dflash.errors import CacheMismatchError, ModelNotFoundError

if TYPE_CHECKING:
    from dflash.drafter.config import DrafterConfig


@dataclass(frozen=True, kw_only=True)
class InitWeights:
    config: "DrafterConfig"
    """The drafter's shape, taps, mask token and block size, as the source had them."""
    state: dict[str, torch.Tensor]
    """The drafter's state dict (CPU)."""
    source: str
    """What was read, for the log: "checkpoint PATH" or "drafter folder PATH"."""


def load_init(path: str) -> InitWeights:
    """The weights and DrafterConfig of a run folder, checkpoint file or drafter folder (module docstring);
    ModelNotFoundError when `path` is none of them."""
    from dflash.drafter.config import DrafterConfig
    from dflash.drafter.export import CONFIG_NAME, load_drafter
    from dflash.train import checkpoint as ckpt

    p = pathlib.Path(path)
    if p.is_file() or (p.is_dir() and ckpt.latest_checkpoint(p) is not None):
        state = ckpt.load_checkpoint(p)
        dc = state["drafter_config"]
        config = DrafterConfig(**{**dc, "target_layer_ids": tuple(dc["target_layer_ids"])})
        where = p if p.is_file() else ckpt.latest_checkpoint(p)
        return InitWeights(config=config, state=state["model"], source=f"checkpoint {where}")
    if p.is_dir() and (p / CONFIG_NAME).is_file():
        model, config = load_drafter(p, device="cpu", dtype=torch.float32)
        return InitWeights(config=config, state=model.state_dict(), source=f"drafter folder {p}")
    if p.is_dir() and (p / "drafter" / CONFIG_NAME).is_file():  # a finished run whose checkpoints were removed
        return load_init(str(p / "drafter"))
    raise ModelNotFoundError(f"--init-from {path!r}: not a dflash run folder, checkpoint or drafter folder "
                             "(config.json with dflash_config + model.safetensors)")


def check_init_fits(dc: "DrafterConfig", *, hidden_size: int, num_target_layers: int, vocab_size: int,
                    cache_taps: Sequence[int], requested_taps: Sequence[int] | None, online: bool) -> None:
    """CacheMismatchError naming the first field where the init drafter does not fit the run's target and cache."""
    hint = "--init-from a drafter trained for this target and cache, or train from scratch"
    who = dict(mine="the --init-from drafter's", theirs="the run's")
    for name, mine, theirs in (("hidden_size", dc.hidden_size, hidden_size),
                               ("num_target_layers", dc.num_target_layers, num_target_layers),
                               ("vocab_size", dc.vocab_size, vocab_size)):
        if mine != theirs:
            raise CacheMismatchError(name, mine, theirs, hint, **who)
    taps = tuple(dc.target_layer_ids)
    if requested_taps is not None and tuple(requested_taps) != taps:
        raise CacheMismatchError("taps", list(taps), list(requested_taps), hint + " (or drop --taps)", **who)
    missing = [t for t in taps if t not in set(cache_taps)]
    if missing and not online:
        raise CacheMismatchError("target_layer_ids", list(taps), list(cache_taps),
                                 f"the cache lacks taps {missing}; " + hint, mine="the --init-from drafter's",
                                 theirs="the cache's tap_layer_ids")


__all__ = ["InitWeights", "load_init", "check_init_fits"]
