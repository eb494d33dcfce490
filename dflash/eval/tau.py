"""Exact greedy acceptance length (tau) of a drafter on one sequence whose response is the target's greedy output.

Shapes: T = tokens of the sequence, K = taps, D = hidden size, V = vocabulary, J = anchors in a chunk,
B = block size.

Method doc section 6: the drafter's block at anchor a sees only the context features of positions < a and
the block itself, so the block it proposes during real greedy speculative decoding is a function of the
(cached) features before a and the token y[a]. We therefore compute L(a), the number of leading draft tokens
that match the greedy continuation y[a+1 : a+B], for every response position a at once, in chunks of anchors
run as one masked forward (the training mask: context < anchor, bidirectional within a block), and then walk
the chain a real decoder follows: pos = start (y[start] is the first generated token, the prefill's bonus),
each target step emits L(pos)+1 tokens, pos += L(pos)+1, until the response ends.
Tradeoff: this computes L at every response position although the chain visits only about 1/tau of them;
that costs about one training forward per sequence and needs no target at all.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from dflash.drafter.attention import BlockLayout
from dflash.drafter.blocks import block_input_ids


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


def leading_matches(draft_JW: torch.Tensor, ref_JW: torch.Tensor) -> torch.Tensor:
    """Per row: how many leading entries agree (int64 [J]); ref entries < 0 never match (past the end)."""
    return (draft_JW == ref_JW).long().cumprod(dim=1).sum(dim=1)


def draft_argmax(out_ND: torch.Tensor, lm_head_VD: torch.Tensor, *, rows_per_chunk: int = 1024) -> torch.Tensor:
    """argmax of the frozen LM head over final-normed drafter outputs, chunked over rows ([N] int64).

    The matmul runs in the drafter's dtype and the argmax in float32; live.py uses this same function so the
    offline and live drafts are the same computation. Chunking bounds the logits at rows_per_chunk x V
    (1024 x 248320 fp32 = 1 GB)."""
    head = lm_head_VD.to(device=out_ND.device, dtype=out_ND.dtype)
    parts = [(out_ND[i:i + rows_per_chunk] @ head.T).float().argmax(dim=-1)
             for i in range(0, out_ND.shape[0], rows_per_chunk)]
    return torch.cat(parts) if parts else out_ND.new_zeros((0,), dtype=torch.long)


@torch.no_grad()
def accept_lengths(drafter, *, embed_VD: torch.Tensor, lm_head_VD: torch.Tensor, input_ids_T: torch.Tensor,
                   hidden_TKD: torch.Tensor, start: int, end: int, mask_token_id: int,
                   chunk_anchors: int = 256) -> np.ndarray:
    """L(a) for every anchor a in [start, end-1) as int64 [end] (0 elsewhere).

    hidden_TKD: the target taps of the sequence in the drafter's target_layer_ids order (float, any device
    the drafter is on). Block a is [y[a], MASK x (B-1)] at positions a..a+B-1; its drafts
    d = argmax(lm_head(out))[1:] are compared with y[a+1 : min(a+B, end)].
    """
    if chunk_anchors < 1:
        raise ValueError(f"chunk_anchors={chunk_anchors}: must be >= 1")
    B = drafter.cfg.block_size
    device = next(drafter.parameters()).device
    dtype = next(drafter.parameters()).dtype
    out = np.zeros(max(end, 0), dtype=np.int64)
    if end - 1 <= start:
        return out
    ids_T = input_ids_T.to(device=device, dtype=torch.long)
    embed = embed_VD.to(device=device, dtype=dtype)
    # ctx for positions < end-1: the last anchor is end-2 and sees positions < end-2.
    ctx_TD = drafter.context(hidden_TKD[: end - 1].to(device=device, dtype=dtype))
    offs_B = torch.arange(B, device=device)
    for a0 in range(start, end - 1, chunk_anchors):
        anchors_J = torch.arange(a0, min(a0 + chunk_anchors, end - 1), device=device)
        J, C = anchors_J.shape[0], int(anchors_J[-1])  # context rows 0..C-1 cover every anchor's view
        layout = BlockLayout(ctx_seq_C=torch.zeros(C, dtype=torch.long, device=device),
                             ctx_pos_C=torch.arange(C, device=device),
                             block_seq_J=torch.zeros(J, dtype=torch.long, device=device),
                             anchor_J=anchors_J, block_size=B)
        block_ids_JB = block_input_ids(ids_T[anchors_J], block_size=B, mask_token_id=mask_token_id)
        hidden_QD = drafter(embed[block_ids_JB.reshape(-1)], ctx_TD[:C], q_pos=layout.q_pos_Q,
                            kv_pos=layout.kv_pos_K, mask=layout)
        draft_JW = draft_argmax(hidden_QD.view(J, B, -1)[:, 1:].reshape(J * (B - 1), -1), lm_head_VD).view(J, B - 1)
        pos_JW = anchors_J[:, None] + offs_B[None, 1:]
        ref_JW = torch.where(pos_JW < end, ids_T[pos_JW.clamp(max=end - 1)], -1)
        out[a0: a0 + J] = leading_matches(draft_JW, ref_JW).cpu().numpy()
    return out


def sequence_steps(drafter, *, embed_VD, lm_head_VD, input_ids_T, hidden_TKD, loss_mask_T, mask_token_id,
                   chunk_anchors: int = 256) -> list[int]:
    """Accept-chain steps of one cached sequence (its first loss-masked span is the response)."""
    start, end = response_span(np.asarray(loss_mask_T))
    if end - start < 1:
        return []
    L = accept_lengths(drafter, embed_VD=embed_VD, lm_head_VD=lm_head_VD, input_ids_T=torch.as_tensor(input_ids_T),
                       hidden_TKD=hidden_TKD, start=start, end=end, mask_token_id=mask_token_id,
                       chunk_anchors=chunk_anchors)
    return walk_accept_chain(L, start, end)
