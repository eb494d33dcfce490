"""Resolve what a training run trains: the taps, the mask token, the DrafterConfig, and the check that the
target given with --model is the one the cache was extracted from.

Every automatic choice is returned with its reason so the trainer can log it (STYLE.md 8).
The target check compares the config and tokenizer hashes of dflash.target.identity, which `dflash extract`
wrote into the cache fingerprint.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from dflash.drafter.config import DrafterConfig
from dflash.errors import ConfigError
# the target check is one rule shared with `dflash eval` (setup.py imports it from here)
from dflash.target.check import check_target_matches  # noqa: F401


def select_taps(cache_taps: Sequence[int], requested: Sequence[int] | None, *,
                online_layers: int | None = None) -> tuple[int, ...]:
    """The drafter's target_layer_ids: `requested` (a subset of the cache's taps, in the given order) or all.
    online_layers (an --online run: the target's layer count): the live target computes the taps and the cache
    gives only the token stream, so `requested` may name any of the target's layers (ascending)."""
    available = tuple(int(t) for t in cache_taps)
    if requested is None:
        return available
    taps = tuple(int(t) for t in requested)
    if online_layers is not None:
        from dflash.target.taps import validate_tap_layer_ids

        return validate_tap_layer_ids(taps, num_layers=online_layers)
    missing = [t for t in taps if t not in available]
    if missing:
        raise ConfigError(f"taps {missing} are not in the cache; it holds taps {list(available)}. "
                          "Pick a subset of those (--taps), or extract a cache with these taps.")
    if len(set(taps)) != len(taps):
        raise ConfigError(f"taps {list(taps)} repeat a layer id; give each tap once")
    return taps


def resolve_mask_token_id(tokenizer: Any, *, configured: int | None, vocab_size: int) -> tuple[int, str]:
    """The mask token id and why it was chosen.

    Order: the configured id; the tokenizer's mask token; its pad token when that is not also eos (reusing eos
    corrupts the stop signal, NeMo Automodel PR #2461); otherwise ConfigError asking for an explicit id.
    """
    if configured is not None:
        mask, reason = int(configured), "set in the config (--mask-token-id)"
    elif tokenizer is not None and getattr(tokenizer, "mask_token_id", None) is not None:
        mask, reason = int(tokenizer.mask_token_id), f"the tokenizer's mask token {tokenizer.mask_token!r}"
    elif (tokenizer is not None and getattr(tokenizer, "pad_token_id", None) is not None
          and tokenizer.pad_token_id != getattr(tokenizer, "eos_token_id", None)):
        mask, reason = int(tokenizer.pad_token_id), f"the tokenizer's pad token {tokenizer.pad_token!r} (no mask token)"
    else:
        raise ConfigError("the target tokenizer has no mask token and no pad token distinct from eos: set "
                          "--mask-token-id (or mask_token_id in the YAML) to an id the target never emits, e.g. "
                          "a reserved/padded embedding row (Qwen3: 151669, Qwen3.5: 248070)")
    if not 0 <= mask < vocab_size:
        raise ConfigError(f"mask_token_id={mask} ({reason}) is outside the target embedding's {vocab_size} rows")
    return mask, reason


def default_heads(hidden_size: int) -> tuple[int, int, int, str]:
    """(heads, kv_heads, head_dim, reason). The paper shape 32/8/128 needs hidden >= 4096; smaller targets get
    head_dim 64, hidden/64 heads and about a third as many KV heads (a divisor of the heads)."""
    if hidden_size >= 4096:
        return 32, 8, 128, "paper drafter shape (32 heads, 8 KV heads, head_dim 128)"
    head_dim = 64 if hidden_size % 64 == 0 else 32 if hidden_size % 32 == 0 else hidden_size
    heads = max(1, hidden_size // head_dim)
    kv = max(d for d in range(1, heads + 1) if heads % d == 0 and d <= max(1, heads // 3))
    return heads, kv, head_dim, f"hidden size {hidden_size} < 4096: head_dim {head_dim}, {heads} heads, {kv} KV heads"


@dataclass(frozen=True, kw_only=True)
class ResolvedDrafter:
    config: DrafterConfig
    reasons: tuple[str, ...]


DFLASH2_FIELDS = ("selector_weight", "selector_rank", "selector_top_k", "conv_group_size")
"""TrainConfig fields that only an --arch dflash2 run uses."""


def build_drafter_config(cfg: Any, *, hidden_size: int, taps: Sequence[int], num_target_layers: int,
                         mask_token_id: int, vocab_size: int) -> ResolvedDrafter:
    """DrafterConfig of a TrainConfig: hidden size from the cache, taps and mask from the resolution above."""
    reasons = []
    heads, kv, head_dim, why = default_heads(hidden_size)
    if cfg.num_attention_heads is None or cfg.num_key_value_heads is None or cfg.head_dim is None:
        reasons.append(f"attention shape: {why} (override with num_attention_heads/num_key_value_heads/head_dim)")
    intermediate = cfg.intermediate_size
    if intermediate is None:
        intermediate = 3 * hidden_size
        reasons.append(f"intermediate_size {intermediate} = 3 x hidden (Qwen3-8B drafter ratio)")
    dc = DrafterConfig(
        hidden_size=hidden_size, intermediate_size=intermediate, target_layer_ids=tuple(taps),
        num_target_layers=num_target_layers, mask_token_id=mask_token_id, vocab_size=vocab_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads if cfg.num_attention_heads is not None else heads,
        num_key_value_heads=cfg.num_key_value_heads if cfg.num_key_value_heads is not None else kv,
        head_dim=cfg.head_dim if cfg.head_dim is not None else head_dim,
        rope_theta=float(cfg.rope_theta), block_size=cfg.block_size, layer_types=cfg.layer_types,
        sliding_window=cfg.sliding_window, causal=cfg.causal)
    if dc.sliding_window is not None or dc.causal is not None:
        reasons.append("layer attention: " + ", ".join(
            f"{t} ({'window ' + str(a.window) + ', ' if a.window else ''}{'causal' if a.causal else 'bidirectional'})"
            for t, a in ((dc.layer_types[i], dc.layer_attention(i)) for i in range(dc.num_hidden_layers))))
    if cfg.arch == "dflash2":
        from dflash.drafter.dflash2 import DFlash2Config

        dc = DFlash2Config.from_base(dc, conv_group_size=cfg.conv_group_size, selector_rank=cfg.selector_rank,
                                     selector_top_k=cfg.selector_top_k)
        reasons.append(f"arch dflash2: two-tap in-block convolution (groups of {cfg.conv_group_size} channels), "
                       f"selector rank {cfg.selector_rank} over the top {cfg.selector_top_k} candidates, "
                       f"selector_weight {cfg.selector_weight}")
    else:
        defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
        ignored = [k for k in DFLASH2_FIELDS if getattr(cfg, k) != defaults[k]]
        if ignored:
            reasons.append(f"{', '.join(ignored)} ignored: they size and train DFlash 2's modules (--arch dflash2)")
    return ResolvedDrafter(config=dc, reasons=tuple(reasons))
