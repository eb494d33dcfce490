"""The DFlash block input: the token ids a drafter block is fed, written once for training, tau, live and
held-out evaluation.

Shapes: B = block size; `...` = any leading shape (J blocks, A sequences, or none for one block).
Method doc 2 (SpecForge dflash_family_model.py): the block anchored at position a holds
[x_a, MASK x (B-1)]: slot 0 is the anchor token, which the drafter is given (the target's last accepted or
bonus token), and slots 1..B-1 are the mask token, whose outputs are the B-1 drafted tokens.
Tradeoff: a torch.full plus one indexed write; the callers' kernel count stays what it was.
"""

from __future__ import annotations

import torch

__all__ = ["block_input_ids"]


def block_input_ids(anchor_ids: torch.Tensor, *, block_size: int, mask_token_id: int) -> torch.Tensor:
    """int64 [..., B] on anchor_ids' device: [anchor_ids[...], mask_token_id x (B-1)] per block.

    anchor_ids: integer [...], the anchor (slot 0) token of each block; a 0-d tensor gives one block [B].
    """
    assert block_size >= 1, f"block_size={block_size}: a block holds at least its anchor"
    ids = torch.full((*anchor_ids.shape, block_size), mask_token_id, dtype=torch.int64, device=anchor_ids.device)
    ids[..., 0] = anchor_ids
    return ids
