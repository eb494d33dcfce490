"""What the drafter proposes at a block and how much of it the target accepts: the argmax over the frozen LM
head and the leading-match count. Offline tau (tau.py, batched.py) and live decoding (live.py) share these,
so the offline and live drafts are the same computation."""

from __future__ import annotations

import torch


def leading_matches(draft_JW: torch.Tensor, ref_JW: torch.Tensor) -> torch.Tensor:
    """Per row: how many leading entries agree (int64 [J]); ref entries < 0 never match (past the end)."""
    return (draft_JW == ref_JW).long().cumprod(dim=1).sum(dim=1)


def draft_argmax(out_ND: torch.Tensor, lm_head_VD: torch.Tensor, *, rows_per_chunk: int = 1024) -> torch.Tensor:
    """argmax of the frozen LM head over final-normed drafter outputs, chunked over rows ([N] int64).

    The matmul runs in the drafter's dtype and the argmax over its logits as they are: a float32 copy first
    (as before) picks the same index, since the bf16 -> fp32 cast is exact and argmax takes the first maximum
    either way, but costs 3x the memory traffic of the argmax. live.py uses this same function so the offline
    and live drafts are the same computation. Chunking bounds the logits at rows_per_chunk x V."""
    head = lm_head_VD.to(device=out_ND.device, dtype=out_ND.dtype)
    parts = [(out_ND[i:i + rows_per_chunk] @ head.T).argmax(dim=-1)
             for i in range(0, out_ND.shape[0], rows_per_chunk)]
    return torch.cat(parts) if parts else out_ND.new_zeros((0,), dtype=torch.long)
