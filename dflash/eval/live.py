"""A real greedy speculative-decoding loop (target + DFlash drafter) for attention-only (Llama-style) targets.

Shapes: P = prompt tokens, K = taps, D = hidden size, B = block size, V = vocabulary.

One step (z-lab dflash/model.py, method doc section 6), with `pos` the position of the newest verified token
y[pos] (the bonus of the previous target forward, not yet in the target's KV cache):
  1. the drafter proposes d_1..d_{B-1} from block [y[pos], MASK x (B-1)] at positions pos..pos+B-1, seeing
     the context features of every verified position < pos (no mask: one block);
  2. the target verifies [y[pos], d_1..d_{B-1}] in one forward on its KV cache (DynamicCache) and takes the
     greedy posterior p_0..p_{B-1};
  3. L = leading matches of d with p_0..p_{B-2}; d_1..d_L are accepted and p_L is the new bonus token;
  4. the target's taps at positions pos..pos+L become new context features; the KV cache is cropped to
     pos+L+1 (the rejected drafts' K/V are dropped).
The output therefore is the target's own greedy output, and the step lengths L+1 give the live tau that the
offline evaluator (tau.py) must reproduce. A step that runs past a stop token or max_new_tokens counts
min(L, tokens kept after y[pos]) + 1, the same clamp as walk_accept_chain.
Tradeoff: the drafter recomputes the context K/V of all positions every step (no drafter KV cache). That is
O(steps x length) drafter work, fine for tests and evaluation of short prompts, not a serving engine.
Hybrid targets (Gated-DeltaNet) need recurrent-state rollback on rejection; they are refused.
Exactness: in fp32 (CPU) the output equals model.generate(do_sample=False) and the steps equal the offline
chain (tests/unit/test_eval_live.py). In bf16 the target's verify forward over B tokens and a one-token decode
step round differently, so after a near-tie the output can leave plain greedy decoding: measured on CPU with
SmolLM2 bf16, 3 of 6 prompts diverged from model.generate at tokens 6, 8 and 26 (bf16 generate itself also
left the fp32 greedy path there); the live steps still equalled the offline chain over the live output's own
one-prefill bf16 features on all 6. So in bf16 compare tau, not tokens, and expect per-prompt tau noise.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Sequence

import torch

from dflash.drafter.blocks import block_input_ids
from dflash.errors import ConfigError
from dflash.eval.batched import block_drafts
from dflash.eval.draft import leading_matches


@dataclass(frozen=True, kw_only=True)
class LiveResult:
    """One prompt decoded by greedy speculative decoding."""

    tokens: list[int]
    """Generated ids (the stop token included when one was generated): the target's greedy output."""
    steps: list[int]
    """Tokens emitted per target verify forward (L+1, clamped at the end); tau = mean(steps)."""
    stop_reason: str
    """'eos' or 'length'."""

    @property
    def tau(self) -> float:
        return sum(self.steps) / len(self.steps) if self.steps else float("nan")


def check_attention_only(target) -> None:
    """Refuse targets whose layers keep a recurrent state (cropping the KV cache cannot roll those back)."""
    from dflash.target.registry import live_decoding_supported

    supported, kinds = live_decoding_supported(target.config)   # the target registry's layer kinds
    if not supported:
        raise ConfigError(f"live speculative decoding supports attention-only targets (Llama, Qwen3); "
                          f"this target has layer types {kinds}: use the offline evaluator (dflash eval)")


def _crop_to(cache, length: int) -> None:
    """Keep the first `length` positions of a DynamicCache (transformers 5 crops by a negative count)."""
    extra = cache.get_seq_length() - length
    if extra <= 0:
        return
    if "tokens_to_remove" in inspect.signature(cache.crop).parameters:
        cache.crop(-extra)
    else:  # transformers 4.x: crop(max_length)
        cache.crop(length)


def tap_features(hidden_states, tap_layer_ids: Sequence[int]) -> torch.Tensor:
    """[S, K, D] of batch row 0 from HF hidden_states (index 0 = embeddings, k+1 = output of layer k): the taps
    extraction stores, from a full forward."""
    return torch.stack([hidden_states[k + 1][0] for k in tap_layer_ids], dim=1)


@torch.no_grad()
def speculative_generate(target, drafter, *, embed_VD: torch.Tensor, lm_head_VD: torch.Tensor,
                         prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int]) -> LiveResult:
    """Greedy speculative decoding of one prompt (batch 1). Target and drafter on one device."""
    from transformers import DynamicCache

    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens}: must be >= 1")
    check_attention_only(target)
    cfg = drafter.cfg
    B, taps, stops = cfg.block_size, cfg.target_layer_ids, set(int(s) for s in stop_ids)
    device = next(target.parameters()).device
    dtype = next(drafter.parameters()).dtype
    embed = embed_VD.to(device=device, dtype=dtype)

    cache = DynamicCache(config=target.config)
    # transformers 5.2x renamed forward(past_key_values=) to cache= (the old name warns)
    cache_kw = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    prompt = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    out = target(input_ids=prompt, use_cache=True, output_hidden_states=True, **{cache_kw: cache})
    ctx_TD = drafter.context(tap_features(out.hidden_states, taps).to(dtype))   # features of positions < pos
    bonus = int(out.logits[0, -1].float().argmax())
    pos = prompt.shape[1]                                                 # position of the bonus token
    tokens, steps = [bonus], []
    offs_B = torch.arange(B, device=device)
    while bonus not in stops and len(tokens) < max_new_tokens:
        # 1. draft
        q_pos = pos + offs_B
        kv_pos = torch.cat([torch.arange(pos, device=device), q_pos])
        block = block_input_ids(torch.tensor(bonus, device=device), block_size=B, mask_token_id=cfg.mask_token_id)
        hidden_BD = drafter(embed[block], ctx_TD, q_pos=q_pos, kv_pos=kv_pos, mask=None)
        draft_W = block_drafts(drafter, hidden_BD[None], anchor_ids_J=block[:1], lm_head_VD=lm_head_VD,
                               rows_per_chunk=1024)[0]                   # [B-1], as offline tau drafts
        # 2. verify [bonus, d_1..d_{B-1}] at positions pos..pos+B-1
        verify = torch.cat([block[:1], draft_W])[None]
        out = target(input_ids=verify, use_cache=True, output_hidden_states=True, **{cache_kw: cache})
        post_B = out.logits[0].float().argmax(dim=-1)
        # 3. accept
        L = int(leading_matches(draft_W[None], post_B[None, :-1])[0])
        new = draft_W[:L].tolist() + [int(post_B[L])]
        kept: list[int] = []
        for t in new[: max_new_tokens - len(tokens)]:
            kept.append(t)
            if t in stops:
                break
        steps.append(min(L, len(kept)) + 1)
        tokens.extend(kept)
        if len(kept) < len(new) or kept[-1] in stops:
            break
        # 4. new context = taps at the verified positions pos..pos+L; drop the rejected drafts' K/V
        ctx_TD = torch.cat([ctx_TD, drafter.context(tap_features(out.hidden_states, taps)[: L + 1].to(dtype))])
        _crop_to(cache, pos + L + 1)
        pos += L + 1
        bonus = new[-1]
    reason = "eos" if tokens[-1] in stops else "length"
    return LiveResult(tokens=tokens, steps=steps, stop_reason=reason)
