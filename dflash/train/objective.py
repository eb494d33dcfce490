"""The DFlash training objective as pure functions: anchors, blocks, labels, loss weights, mask, loss.

Shapes: S = tokens of one sequence, J = blocks (anchors), B = block size, N = supervised rows (J*B
flattened block tokens), H = hidden size, V = vocabulary, C = packed context tokens.

Semantics (method doc 2, SpecForge dflash_family_model.py): anchors are positions a in [0, S-2] with
loss_mask[a] and loss_mask[a+1], up to 512 per sequence, uniformly without replacement, sorted. Block j is
[x_a, MASK x (B-1)] at positions a..a+B-1; slot k is labelled with input_ids[a+k] (no shift) and weighted
(k>0) * (a+k<S) * loss_mask[a+k] * exp(-(k-1)/gamma). The loss is the weighted mean sum(CE*w)/sum(w).
The variable_prefix objective (train.prefix) reveals l >= 2 real tokens per block instead of the anchor alone,
supervising slots k >= l with exp(-(k-l)/gamma): build_packed_blocks' prefix_J.
Tradeoff: everything returns tensors (no .item()) so a training step never syncs the GPU; callers
.item() on log steps only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflash.drafter.attention import FULL, BlockLayout, LayerAttention, block_attention_mask, dense_mask
from dflash.drafter.blocks import block_input_ids
from dflash.errors import ConfigError
from dflash.train.prefix import slot_weights

__all__ = ["Blocks", "CELoss", "IGNORE_INDEX", "block_attention_mask", "build_blocks", "build_packed_blocks", "ce_metrics", "chunked_ce_loss",
           "decay_weights", "default_gamma", "expected_blocks", "per_sample_mean_weights", "resolve_gamma", "supervised_slots", "visible_keys", "dense_mask", "packed_layout", "packed_layout_flat", "sample_anchors"]

IGNORE_INDEX = -100
"""Label of block slots past the end of the sequence (their weight is 0 as well)."""

_PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}   # method doc 2 / paper App. A.1


def default_gamma(block_size: int) -> float:
    """The paper's decay gamma for a block size (7 for 16, 5 for 10, 4 for 8); else 7 * block_size / 16."""
    return _PAPER_GAMMA.get(block_size, 7.0 * block_size / 16)


def resolve_gamma(gamma: float | None, *, block_size: int) -> float:
    """The decay gamma a run uses: the configured one, else default_gamma (the one place None is resolved)."""
    return default_gamma(block_size) if gamma is None else float(gamma)


def sample_anchors(loss_mask_S: torch.Tensor, *, num_anchors: int = 512, generator: torch.Generator,
                   full_block: int | None = None) -> torch.Tensor:
    """Sorted anchor positions [J], J = min(num_anchors, #valid), drawn without replacement.

    A position a is valid when a <= S-2 and both loss_mask[a] and loss_mask[a+1] are set (the anchor token
    is a response token and slot 1 has a supervised label). With full_block = B, also a <= S-B: the whole block
    a..a+B-1 lies inside the sequence (TrainConfig.anchor_positions full_blocks, SpecForge's bound), so no block
    is cut by the sequence's end. Randomness comes only from `generator` (drawn on the generator's device); the
    result lives on loss_mask_S's device.
    """
    if num_anchors < 1:
        raise ConfigError(f"num_anchors={num_anchors}: must be >= 1 (the paper uses 512)")
    mask_S = loss_mask_S.bool()
    valid = mask_S[:-1] & mask_S[1:]
    if full_block is not None:
        valid[max(mask_S.numel() - full_block + 1, 0):] = False
    candidates = valid.nonzero().flatten()
    n = min(num_anchors, candidates.numel())
    perm = torch.randperm(candidates.numel(), generator=generator, device=generator.device)[:n]
    return candidates[perm.to(candidates.device)].sort().values


def expected_blocks(loss_tokens: np.ndarray, *, num_anchors: int) -> np.ndarray:
    """Blocks a sample of `loss_tokens` response tokens gets, float64 [N]: min(num_anchors, valid anchors),
    with a single response span's loss_tokens - 1 valid anchors (sample_anchors' rule, without the mask)."""
    return np.clip(np.asarray(loss_tokens, dtype=np.float64) - 1, 0, num_anchors)


def supervised_slots(loss_mask_S: np.ndarray, anchors_J: np.ndarray, *, block_size: int,
                     prefix_J: np.ndarray | None = None) -> int:
    """Block slots with a nonzero loss weight (build_blocks' weights_JB > 0), counted on the host: slot k of the
    block at anchor a with prefix l (prefix_J; None = 1 for every block) is supervised iff k >= l, a + k < S and
    loss_mask[a + k]."""
    a_J = np.asarray(anchors_J, dtype=np.int64)
    k_B = np.arange(block_size)
    pos_JB = a_J[:, None] + k_B[None]
    lo_J = np.ones(len(a_J), np.int64) if prefix_J is None else np.asarray(prefix_J, dtype=np.int64)
    keep_JB = (k_B[None] >= lo_J[:, None]) & (pos_JB < len(loss_mask_S))
    return int(np.asarray(loss_mask_S)[pos_JB[keep_JB]].astype(bool).sum())


def visible_keys(anchors_J: np.ndarray, *, block_size: int, attn: LayerAttention = FULL) -> int:
    """Keys the block tokens attend to, summed over them (one layer): each of the B slots of the block at
    anchor a sees the a context positions before it (block_attention_mask) and the B slots of its block; a
    windowed or causal layer (`attn`) fewer: slot k sees min(a, W-1-k) context keys (none once k >= W-1) and
    its block's slots k' in [k-(W-1), k] (causal) or [k-(W-1), B) (not)."""
    a = np.asarray(anchors_J, dtype=np.int64)
    if attn.is_full:
        return int(block_size * (a.sum() + block_size * len(a)))
    k_B = np.arange(block_size)
    W = attn.window if attn.window is not None else np.iinfo(np.int64).max // 4
    ctx = np.minimum(a[:, None], np.clip(W - 1 - k_B, 0, None)[None]).sum()
    lo_B = np.clip(k_B - (W - 1), 0, None)
    hi_B = k_B + 1 if attn.causal else np.full(block_size, block_size)
    return int(ctx + len(a) * (hi_B - lo_B).sum())


def decay_weights(*, block_size: int, gamma: float) -> torch.Tensor:
    """[B] float32 loss weight per block slot: 0 for slot 0 (the given anchor), exp(-(k-1)/gamma) for k>=1."""
    if gamma <= 0:
        raise ConfigError(f"gamma={gamma}: must be > 0 (7 for block 16, 5 for 10, 4 for 8)")
    k_B = torch.arange(block_size, dtype=torch.float32)
    w_B = torch.exp(-(k_B - 1) / gamma)
    w_B[0] = 0.0
    return w_B


@dataclass(frozen=True)
class Blocks:
    """The draft blocks of one sequence."""

    block_ids_JB: torch.Tensor   # int64 [J,B]: [x_a, MASK, ..., MASK] (with a prefix l: x_a..x_{a+l-1}, MASK...)
    positions_JB: torch.Tensor   # int64 [J,B]: a + k
    labels_JB: torch.Tensor      # int64 [J,B]: input_ids[a+k], IGNORE_INDEX where a+k >= S
    weights_JB: torch.Tensor     # float32 [J,B]: (k>=l) * (a+k<S) * loss_mask[a+k] * exp(-(k-l)/gamma), l = 1 default


def build_blocks(input_ids_S: torch.Tensor, loss_mask_S: torch.Tensor, anchors_J: torch.Tensor, *,
                 block_size: int, mask_token_id: int, gamma: float | None = None,
                 prefix_J: torch.Tensor | None = None) -> Blocks:
    """Inputs, positions, labels and loss weights of the blocks anchored at `anchors_J` in one sequence.

    gamma defaults to the paper's value for the block size (default_gamma); prefix_J: build_packed_blocks'.
    """
    return build_packed_blocks(input_ids_S, loss_mask_S, anchors_J, lengths=[input_ids_S.shape[0]],
                               blocks_per_sample=[anchors_J.shape[0]],
                               block_size=block_size, mask_token_id=mask_token_id, gamma=gamma, prefix_J=prefix_J)


def build_packed_blocks(input_ids_T: torch.Tensor, loss_mask_T: torch.Tensor, anchors_J: torch.Tensor, *,
                        lengths: Sequence[int], blocks_per_sample: Sequence[int], block_size: int,
                        mask_token_id: int, gamma: float | None = None,
                        prefix_J: torch.Tensor | None = None) -> Blocks:
    """build_blocks of every sequence of a packed batch in one pass (a fixed number of kernels, whatever the
    number of sequences): sequence i holds tokens [start_i, start_i + lengths[i]) of the packed tensors and
    the next blocks_per_sample[i] anchors of anchors_J, which are positions inside that sequence.
    positions_JB are positions inside each sequence. lengths/blocks_per_sample are host ints (no sync).

    prefix_J (int64 [J], train.prefix): each block's visible prefix length l (the variable_prefix objective):
    slots k < l hold the real tokens (the mask token past the sequence's end) and are unsupervised, slots k >= l
    weigh exp(-(k-l)/gamma). None = the paper's block, l = 1 (block_input_ids, decay_weights)."""
    device = input_ids_T.device
    gamma = resolve_gamma(gamma, block_size=block_size)
    # per block: where its sequence starts and ends in the packed tensors (host arithmetic, one copy each)
    starts = np.cumsum([0, *lengths[:-1]], dtype=np.int64)
    reps = np.asarray(blocks_per_sample, dtype=np.int64)
    start_J = torch.from_numpy(np.repeat(starts, reps)).to(device, non_blocking=True)
    end_J = torch.from_numpy(np.repeat(starts + np.asarray(lengths, dtype=np.int64), reps)).to(device, non_blocking=True)
    anchors_J = anchors_J.to(device=device, dtype=torch.int64)
    k_B = torch.arange(block_size, device=device)
    pos_JB = anchors_J[:, None] + k_B[None]
    at_JB = start_J[:, None] + pos_JB
    inside_JB = at_JB < end_J[:, None]
    safe_JB = torch.minimum(at_JB, end_J[:, None] - 1)
    ids_T = input_ids_T.long()
    labels_JB = torch.where(inside_JB, ids_T[safe_JB], IGNORE_INDEX)
    if prefix_J is None:
        block_ids_JB = block_input_ids(ids_T[at_JB[:, 0]], block_size=block_size, mask_token_id=mask_token_id)
        # non_blocking: a blocking copy from pageable host memory synchronises the stream
        decay_JB = decay_weights(block_size=block_size, gamma=gamma).to(device, non_blocking=True)[None]
    else:
        prefix_J = prefix_J.to(device, non_blocking=True)
        shown_JB = (k_B[None] < prefix_J[:, None]) & inside_JB
        block_ids_JB = torch.where(shown_JB, ids_T[safe_JB], mask_token_id)
        decay_JB = slot_weights(prefix_J, block_size=block_size, gamma=gamma)
    weights_JB = decay_JB * inside_JB * loss_mask_T.to(torch.float32)[safe_JB]
    return Blocks(block_ids_JB=block_ids_JB, positions_JB=pos_JB, labels_JB=labels_JB, weights_JB=weights_JB)


def per_sample_mean_weights(weights_JB: torch.Tensor, blocks_per_sample: Sequence[int]) -> torch.Tensor:
    """weights_JB rescaled so that each sample's weights sum to 1 (a sample with no supervised slot keeps 0s).
    With them, sum(CE*w)/sum(w) over a step is the mean over its supervised samples of each sample's
    decay-weighted mean CE: the loss of z-lab's and SpecForge's trainers at one sequence per micro-batch, where
    a short sample weighs as much as a long one. The blocks are the samples' in order, blocks_per_sample[i] each
    (host ints: no sync)."""
    reps = np.asarray(blocks_per_sample, dtype=np.int64)
    if reps.sum() != weights_JB.shape[0]:
        raise ValueError(f"blocks_per_sample sums to {int(reps.sum())}, weights_JB has {weights_JB.shape[0]} blocks")
    device = weights_JB.device
    sample_J = torch.from_numpy(np.repeat(np.arange(len(reps), dtype=np.int64), reps)).to(device, non_blocking=True)
    totals_N = torch.zeros(len(reps), dtype=weights_JB.dtype, device=device).index_add_(0, sample_J,
                                                                                        weights_JB.sum(dim=1))
    inv_N = torch.where(totals_N > 0, 1.0 / totals_N.clamp(min=torch.finfo(weights_JB.dtype).tiny), 0.0)
    return weights_JB * inv_N[sample_J][:, None]


def packed_layout(*, lengths: Sequence[int] | torch.Tensor, anchors: Sequence[torch.Tensor],
                  block_size: int) -> BlockLayout:
    """Layout of a packed batch: sequences of `lengths` concatenated as context, then every sequence's
    blocks in order (anchors[i] holds sequence i's anchors)."""
    assert len(anchors) == len(lengths), "one anchor tensor per sequence"
    device = anchors[0].device if len(anchors) else torch.device("cpu")
    anchors_J = (torch.cat([a.to(device=device, dtype=torch.int64) for a in anchors]) if len(anchors)
                 else torch.zeros(0, dtype=torch.int64))
    return packed_layout_flat(lengths=lengths, anchors_J=anchors_J, blocks_per_sample=[a.shape[0] for a in anchors],
                              block_size=block_size)


def packed_layout_flat(*, lengths: Sequence[int] | torch.Tensor, anchors_J: torch.Tensor,
                       blocks_per_sample: Sequence[int], block_size: int) -> BlockLayout:
    """packed_layout with the anchors concatenated: sequence i owns the next blocks_per_sample[i] of anchors_J."""
    lengths_N = torch.as_tensor(lengths, dtype=torch.int64)
    device = anchors_J.device
    # Host lengths (the trainer's case): the totals are known without a GPU sync, and a non_blocking copy of
    # a small pageable tensor is staged by the driver without waiting for the stream.
    total = int(lengths_N.sum()) if lengths_N.device.type == "cpu" else None
    counts_N = torch.as_tensor(blocks_per_sample, dtype=torch.int64).to(device, non_blocking=True)
    lengths_N = lengths_N.to(device, non_blocking=True)
    seq_N = torch.arange(lengths_N.shape[0], device=device)
    ctx_seq_C = seq_N.repeat_interleave(lengths_N, output_size=total)
    starts_N = torch.cumsum(lengths_N, 0) - lengths_N
    ctx_pos_C = torch.arange(ctx_seq_C.shape[0], device=device) - starts_N[ctx_seq_C]
    block_seq_J = seq_N.repeat_interleave(counts_N, output_size=anchors_J.shape[0])
    return BlockLayout(ctx_seq_C=ctx_seq_C, ctx_pos_C=ctx_pos_C, block_seq_J=block_seq_J,
                       anchor_J=anchors_J.to(torch.int64), block_size=block_size)


@dataclass(frozen=True)
class CELoss:
    """Loss and metrics of one batch; all tensors, nothing synced to the host."""

    loss: torch.Tensor              # scalar: sum(CE*w) / sum(w) (0 when nothing is supervised)
    weighted_ce_sum: torch.Tensor   # scalar: sum(CE*w), for exact averaging across ranks or steps
    weight_sum: torch.Tensor        # scalar: sum(w)
    correct_B: torch.Tensor         # float32 [B]: supervised slots where argmax == label, per slot k
    count_B: torch.Tensor           # float32 [B]: supervised slots (w > 0), per slot k
    accept_len_sum: torch.Tensor    # scalar: sum over blocks of 1 + leading correct slots
    num_blocks: torch.Tensor        # scalar: J

    @property
    def accept_len(self) -> torch.Tensor:
        """Mean accepted length over blocks (SpecForge compute_accept_len + 1): a proxy for tau."""
        return self.accept_len_sum / self.num_blocks.clamp(min=1)


def _chunk_terms(hidden_nH, lm_head_VH, labels_n, weights_n):
    logits_nV = (hidden_nH @ lm_head_VH.T).float()
    ce_n = F.cross_entropy(logits_nV, labels_n, ignore_index=IGNORE_INDEX, reduction="none")
    correct_n = logits_nV.argmax(-1) == labels_n
    return (ce_n * weights_n).sum(), correct_n


def chunked_ce_loss(hidden_NH: torch.Tensor, lm_head_VH: torch.Tensor, labels_N: torch.Tensor,
                    weights_N: torch.Tensor, *, chunk: int = 2048, block_size: int) -> CELoss:
    """Weighted CE of the frozen LM head over drafter outputs, `chunk` rows at a time.

    Rows are block tokens in block order (N = J*B). Each chunk's logits are recomputed in backward
    (torch.utils.checkpoint), so [N, V] logits never exist at once: at N=8192, V=248320 they would be
    8.1 GB in fp32.
    """
    N = hidden_NH.shape[0]
    assert N % block_size == 0, "rows must be whole blocks"
    if chunk < 1:
        raise ConfigError(f"chunk={chunk}: must be >= 1 rows")
    weights_N = weights_N.to(torch.float32)
    use_ckpt = torch.is_grad_enabled() and (hidden_NH.requires_grad or lm_head_VH.requires_grad)
    ce_sum = hidden_NH.new_zeros((), dtype=torch.float32)
    correct = []
    for i in range(0, N, chunk):
        args = (hidden_NH[i:i + chunk], lm_head_VH, labels_N[i:i + chunk], weights_N[i:i + chunk])
        part, correct_n = checkpoint(_chunk_terms, *args, use_reentrant=False) if use_ckpt \
            else _chunk_terms(*args)
        ce_sum = ce_sum + part
        correct.append(correct_n)
    weight_sum = weights_N.sum()
    loss = ce_sum / weight_sum.clamp(min=torch.finfo(torch.float32).tiny)
    correct_N = torch.cat(correct) if correct else torch.zeros(N, dtype=torch.bool, device=hidden_NH.device)
    return ce_metrics(loss=loss, ce_sum=ce_sum, weight_sum=weight_sum, correct_N=correct_N, weights_N=weights_N,
                      block_size=block_size)


def ce_metrics(*, loss: torch.Tensor, ce_sum: torch.Tensor, weight_sum: torch.Tensor, correct_N: torch.Tensor,
               weights_N: torch.Tensor, block_size: int) -> CELoss:
    """CELoss from the loss sums and the per-row argmax hits; rows with weight 0 are unsupervised (their
    `correct_N` entry is ignored). Shared by chunked_ce_loss and fused_ce.fused_ce_loss so both count alike."""
    supervised_JB = (weights_N > 0).view(-1, block_size)
    correct_JB = correct_N.view(-1, block_size)
    hit_JB = correct_JB & supervised_JB
    # SpecForge compute_accept_len: unsupervised slots neither break nor extend the chain.
    chain_JB = (correct_JB | ~supervised_JB)[:, 1:].long().cumprod(dim=1) * supervised_JB[:, 1:]
    accept_J = 1.0 + chain_JB.sum(dim=1).float()
    return CELoss(loss=loss, weighted_ce_sum=ce_sum, weight_sum=weight_sum,
                  correct_B=hit_JB.float().sum(0), count_B=supervised_JB.float().sum(0),
                  accept_len_sum=accept_J.sum(),
                  num_blocks=torch.full((), float(supervised_JB.shape[0]), device=weights_N.device))
