"""Exact greedy acceptance length (tau) of a drafter on one sequence whose response is the target's greedy output.

Shapes: T = tokens of the sequence, K = taps, D = hidden size, V = vocabulary, J = anchors in a chunk,
B = block size.

Method doc section 6: the drafter's block at anchor a sees only the context features of positions < a and
the block itself, so the block it proposes during real greedy speculative decoding is a function of the
(cached) features before a and the token y[a]. We therefore compute L(a), the number of leading draft tokens
that match the greedy continuation y[a+1 : a+B], for every response position a at once, in chunks of anchors
run as one masked forward (the training mask: context < anchor, bidirectional within a block; schedule and
forward are dflash.eval.batched, shared with `dflash eval` and held-out eval), and then walk
the chain a real decoder follows: pos = start (y[start] is the first generated token, the prefill's bonus),
each target step emits L(pos)+1 tokens, pos += L(pos)+1, until the response ends.
Tradeoff: this computes L at every response position although the chain visits only about 1/tau of them;
that costs about one training forward per sequence and needs no target at all.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from dflash.eval.draft import draft_argmax, leading_matches  # noqa: F401  (re-exported)


def walk_accept_chain(accept_len_by_pos: Sequence[int] | np.ndarray, start: int, end: int) -> list[int]:
    """Tokens emitted by each target step of greedy speculative decoding, following the accept chain.

    accept_len_by_pos[a] = L(a), accepted draft tokens for a block anchored at absolute position a.
    start: position of the first response token (the prefill's bonus, not counted as a step).
    end: one past the last response token. Steps run while pos < end-1; a step emits L(pos) accepted
    tokens plus the target's bonus token, with L clamped to end-1-pos (nothing is accepted past the end of
    the response, as a real decoder stops at eos / max_new_tokens). Returns [L+1, ...]; tau = their mean.
    """
    if not 0 <= start < end:
        raise ValueError(f"need 0 <= start < end, got start={start} end={end}")
    steps: list[int] = []
    pos = start
    while pos < end - 1:
        accepted = min(int(accept_len_by_pos[pos]), end - 1 - pos)
        assert accepted >= 0, f"negative accept length at {pos}"
        steps.append(accepted + 1)
        pos += accepted + 1
    return steps


def response_span(loss_mask_T: np.ndarray | Sequence[int]) -> tuple[int, int]:
    """[start, end) of the first loss-masked (assistant) span; (0, 0) when there is none.

    For `dflash generate` records this is exactly the generated response (stop token included). For other
    data (multi-turn chats, --approximate) only the first assistant turn is evaluated."""
    mask = np.asarray(loss_mask_T).astype(bool)
    on = np.flatnonzero(mask)
    if on.size == 0:
        return 0, 0
    start = int(on[0])
    off = np.flatnonzero(~mask[start:])
    end = start + int(off[0]) if off.size else mask.shape[0]
    return start, end


def response_spans(loss_mask_T: np.ndarray, *, lengths: np.ndarray) -> np.ndarray:
    """response_span of every sequence of a packed set: int64 [S, 2] (positions inside each sequence)."""
    offs = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return np.array([response_span(loss_mask_T[offs[i]: offs[i + 1]]) for i in range(len(lengths))],
                    dtype=np.int64).reshape(len(lengths), 2)


def accept_lengths(drafter, *, embed_VD: torch.Tensor, lm_head_VD: torch.Tensor, input_ids_T: torch.Tensor,
                   hidden_TKD: torch.Tensor, start: int, end: int, mask_token_id: int,
                   chunk_anchors: int | None = None) -> np.ndarray:
    """L(a) for every anchor a in [start, end-1) as int64 [end] (0 elsewhere): the all-anchor schedule of
    dflash.eval.batched on one sequence.

    hidden_TKD: the target taps of the sequence in the drafter's target_layer_ids order (float, any device).
    Block a is [y[a], MASK x (B-1)] at positions a..a+B-1; its drafts d = argmax(lm_head(out))[1:] are
    compared with y[a+1 : min(a+B, end)]. mask_token_id must be the drafter's (cfg.mask_token_id).
    chunk_anchors: blocks per drafter forward (None = batched.DEFAULT_CHUNK_ANCHORS).
    """
    from dflash.eval.batched import DEFAULT_CHUNK_ANCHORS, accept_lengths_chunks, forward_only, plan_chunks

    assert mask_token_id == drafter.cfg.mask_token_id, "the block's mask token is the drafter's"
    out = np.zeros(max(end, 0), dtype=np.int64)
    if end - 1 <= start:
        return out
    param = next(drafter.parameters())
    T = int(input_ids_T.shape[0])
    lengths = np.array([T], dtype=np.int64)
    chunks = plan_chunks(lengths=lengths, spans=np.array([[start, end]]),
                         chunk_anchors=chunk_anchors or DEFAULT_CHUNK_ANCHORS,
                         block_size=drafter.cfg.block_size)
    ids_T = input_ids_T.to(device=param.device, dtype=torch.long)
    hidden = hidden_TKD.to(param.device)
    with forward_only(drafter):
        L_T = accept_lengths_chunks(drafter, chunks, fetch=lambda chunk: (hidden, ids_T), embed_VD=embed_VD,
                                    lm_head_VD=lm_head_VD, dtype=param.dtype, lengths=lengths)
    out[:] = L_T[:end]
    return out


def sequence_steps(drafter, *, embed_VD, lm_head_VD, input_ids_T, hidden_TKD, loss_mask_T, mask_token_id,
                   chunk_anchors: int | None = None) -> list[int]:
    """Accept-chain steps of one cached sequence (its first loss-masked span is the response)."""
    start, end = response_span(np.asarray(loss_mask_T))
    if end - start < 1:
        return []
    L = accept_lengths(drafter, embed_VD=embed_VD, lm_head_VD=lm_head_VD, input_ids_T=torch.as_tensor(input_ids_T),
                       hidden_TKD=hidden_TKD, start=start, end=end, mask_token_id=mask_token_id,
                       chunk_anchors=chunk_anchors)
    return walk_accept_chain(L, start, end)
