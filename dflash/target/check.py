"""Whether a target model, a cache and a drafter belong together: the one rule that training, `dflash eval` and
held-out evaluation apply before any work.

A cache records its target (config hash, layer count, hidden size, tokenizer hash); a drafter records the
target shape it was built for (num_target_layers, hidden_size, vocab_size, target_layer_ids). Each check raises
CacheMismatchError naming the two objects and the first differing field ("the drafter's num_target_layers 6 !=
the target's 8"). The target's weights are compared by target_weights_hash when the cache records one (a cache
written before the field existed records '' and cannot tell a re-trained target with the same config and
tokenizer); a drafter records no weights hash, so check_drafter_matches compares shapes only.
"""

from __future__ import annotations

import os
from typing import Any

from dflash.errors import CacheMismatchError

TARGET_HINT = "pass the target the cache was extracted with (--model), or extract a cache for this target"
DRAFTER_HINT = "the drafter was made for another target: train one for this target"


def target_label(model: str | os.PathLike) -> str:
    return f"the target's (--model {os.fspath(model)})"


def check_target_matches(fingerprint: Any, *, model_dir: str | os.PathLike, tokenizer: Any, embed_hidden: int,
                         num_target_layers: int) -> None:
    """Raise CacheMismatchError when the target at model_dir is not the one the cache (fingerprint) was made with:
    hidden size, layer count, tokenizer (when given), config.json hash and weights hash (when the cache records
    one), in that order. The weights hash is cached by file identity, so after the first call it costs a stat
    of each weight file (~1 ms); the first call on a new checkpoint reads every weight byte once."""
    from dflash.target.identity import target_config_hash, target_config_hashes, target_weights_hash, tokenizer_hash

    mine = target_label(model_dir)

    def differ(field: str, found: object, cached: object) -> None:
        if found != cached:
            raise CacheMismatchError(field, found, cached, TARGET_HINT, mine=mine, theirs="the cache's")

    differ("hidden_size", embed_hidden, fingerprint.hidden_size)
    differ("num_target_layers", num_target_layers, fingerprint.num_target_layers)
    if tokenizer is not None:
        differ("tokenizer_hash", tokenizer_hash(tokenizer), fingerprint.tokenizer_hash)
    if fingerprint.target_config_hash not in target_config_hashes(model_dir):
        differ("target_config_hash", target_config_hash(model_dir), fingerprint.target_config_hash)
    cached_weights = fingerprint.target_weights_hash
    if cached_weights:  # '' = a cache from before the field: its weights are unknown, nothing to compare
        differ("target_weights_hash", target_weights_hash(model_dir), cached_weights)


def check_drafter_matches(drafter_cfg: Any, *, num_target_layers: int, hidden_size: int, vocab_size: int) -> None:
    """Raise CacheMismatchError when a drafter (DrafterConfig) was not built for a target of this shape: layer
    count, hidden size (the frozen embedding and head are applied to the drafter's input and output) and the
    embedding's rows (vocab_size)."""
    for field, mine, theirs in (("num_target_layers", drafter_cfg.num_target_layers, num_target_layers),
                                ("hidden_size", drafter_cfg.hidden_size, hidden_size),
                                ("vocab_size", drafter_cfg.vocab_size, vocab_size)):
        if mine != theirs:
            raise CacheMismatchError(field, mine, theirs, DRAFTER_HINT, mine="the drafter's",
                                     theirs="the target's")
