"""One optimizer step: anchors (host, reader thread), the micro-batch forward and loss, the flat-buffer gradient
all-reduce, and the learning-rate schedule.

Shapes: T = packed context tokens, N = samples, J = blocks, B = block size, Q = J*B block tokens, K = taps,
D = hidden size, V = vocab, P = trainable parameters (flattened).

Loss: the decay-weighted mean over every block token of the global step (all micro-batches of all ranks):
each micro-batch backpropagates its unnormalised sum(CE*w); after the step, one all-reduce sums the flat
gradient buffer together with the weight sum and the metric counters, and the gradient is divided by the
global weight sum and scaled by the clip coefficient in one division (apply_divisor: inside the fused
AdamW's kernel). So W ranks x A micro-batches give the same update as 1 rank x W*A micro-batches, and
empty padding micro-batches simply contribute nothing. With loss_normalization=sequence each sample's weights
sum to 1, so the same sums give the mean over the step's samples of each sample's weighted mean; with sample
the same per-sample weights, but the gradient is divided by a constant (the run's mean samples per step)
instead of the step's own weight sum.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch
import torch.distributed as dist

from dflash.train.fused_ce import fused_ce_loss, train_epilogue
from dflash.train.loader import MicroBatch, anchor_seed
from dflash.train.objective import (build_packed_blocks, chunked_ce_loss, packed_layout_flat, per_sample_mean_weights,
                                   sample_anchors, supervised_slots, visible_keys)
from dflash.train.prefix import DEFAULT_PREFIX_WEIGHT_BASE, prefix_lengths

if TYPE_CHECKING:
    from dflash.cache.reader import PackedSamples
    from dflash.train.objective import CELoss


@dataclass(frozen=True, kw_only=True, order=True)
class AnchorRule:
    """What a drafter's anchor draws depend on: runs with equal rules share one draw per micro-batch."""

    seed: int
    """TrainConfig.seed (the anchor generator is seeded by (seed, epoch, sample id))."""
    num_anchors: int
    """Anchors per sequence (TrainConfig.num_anchors)."""
    block_size: int
    """Block size of the drafter (the supervised-slot and visible-key counts depend on it)."""
    full_blocks: bool = False
    """Anchors only where the whole block fits the sequence (TrainConfig.anchor_positions full_blocks)."""
    objective: str = "dflash"
    """TrainConfig.objective: variable_prefix also draws each block's prefix length (train.prefix)."""
    prefix_weight_base: float = DEFAULT_PREFIX_WEIGHT_BASE
    """TrainConfig.prefix_weight_base (the prior of variable_prefix; unused by dflash)."""


@dataclass(frozen=True)
class HostBlocks:
    """Anchors of one micro-batch, drawn on the host, and the counts the FLOP model needs."""

    anchors_J: torch.Tensor       # int64 [J], all samples' anchors concatenated (pinned when CUDA is used)
    blocks_per_sample: list[int]  # [N]
    supervised_tokens: int        # block slots with a nonzero loss weight
    visible_keys: int             # sum over block tokens of the keys each attends to (one layer)
    prefix_J: torch.Tensor | None = None  # int64 [J]: each block's visible prefix (variable_prefix); None = 1


def host_anchors(packed: "PackedSamples", epoch: int, *, seed: int, num_anchors: int, block_size: int,
                 pin: bool, full_blocks: bool = False, objective: str = "dflash",
                 prefix_weight_base: float = DEFAULT_PREFIX_WEIGHT_BASE) -> HostBlocks:
    """Draw each sample's anchors with a generator seeded by (seed, epoch, sample id): independent of rank,
    batch composition and resume point; with objective variable_prefix the same generator then draws the blocks'
    prefix lengths (train.prefix), so the anchors are the dflash objective's. Runs in a loader thread on CPU
    tensors."""
    loss_mask_T = np.asarray(packed.loss_mask)
    offset, anchors, counts, supervised, visible, prefixes = 0, [], [], 0, 0, []
    for sid, n in zip(np.asarray(packed.sample_ids).tolist(), np.asarray(packed.lengths).tolist()):
        mask_S = loss_mask_T[offset:offset + n]
        g = torch.Generator().manual_seed(anchor_seed(seed=seed, epoch=epoch, sample_id=int(sid)))
        a_J = sample_anchors(torch.from_numpy(mask_S.astype(np.bool_)), num_anchors=num_anchors, generator=g,
                             full_block=block_size if full_blocks else None)
        p_J = prefix_lengths(objective, a_J.numel(), block_size=block_size, base=prefix_weight_base, generator=g)
        anchors.append(a_J)
        prefixes.append(p_J)
        counts.append(int(a_J.numel()))
        supervised += supervised_slots(mask_S, a_J.numpy(), block_size=block_size,
                                       prefix_J=None if p_J is None else p_J.numpy())
        visible += visible_keys(a_J.numpy(), block_size=block_size)
        offset += n
    anchors_J = torch.cat(anchors) if anchors else torch.zeros(0, dtype=torch.int64)
    prefix_J = None
    if objective != "dflash":
        prefix_J = torch.cat(prefixes) if prefixes else torch.zeros(0, dtype=torch.int64)
    if pin:
        anchors_J = anchors_J.pin_memory()
        prefix_J = None if prefix_J is None else prefix_J.pin_memory()
    return HostBlocks(anchors_J=anchors_J, blocks_per_sample=counts, supervised_tokens=supervised,
                      visible_keys=visible, prefix_J=prefix_J)


def stream_anchors(packed: "PackedSamples", epoch: int, *, rules: Sequence[AnchorRule],
                   pin: bool) -> dict[AnchorRule, HostBlocks]:
    """The loader's host_fn: one anchor draw per distinct rule of the stream's drafters (cheap, and the same
    draws as a drafter trained alone)."""
    return {r: host_anchors(packed, epoch, seed=r.seed, num_anchors=r.num_anchors, block_size=r.block_size, pin=pin,
                            full_blocks=r.full_blocks, objective=r.objective,
                            prefix_weight_base=r.prefix_weight_base)
            for r in rules}


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Mixed-precision context of the compute dtype (none for float32)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def micro_batch_loss(drafter: torch.nn.Module, mb: MicroBatch, hb: HostBlocks, *, embed_VD: torch.Tensor,
                     lm_head_VD: torch.Tensor, mask_token_id: int, gamma: float, loss_chunk_blocks: int,
                     loss_impl: str = "fused", loss_normalization: str = "token",
                     selector_weight: float = 0.0) -> "CELoss":
    """Forward of one non-empty micro-batch with this drafter's anchors `hb` -> objective.CELoss (tensors only,
    no host sync).

    loss_impl: "fused" (train.fused_ce: head matmul once per supervised row; the row count comes from the
    host-side HostBlocks.supervised_tokens, so no sync; its elementwise epilogue torch.compile'd when the
    drafter's is, TrainConfig.compile_elementwise), "fused_eager" (the same, never compiled) or "checkpoint"
    (objective.chunked_ce_loss). loss_normalization: TrainConfig.loss_normalization (sequence: the weights of
    objective.per_sample_mean_weights, so the step's global weight sum counts samples). A drafter with a
    candidate selector (DFlash 2) adds selector_weight x its selector CE sum (train.selector) to the loss sums."""
    cfg = drafter.cfg
    B = cfg.block_size
    device = mb.input_ids_T.device
    anchors_J = hb.anchors_J.to(device, non_blocking=True)
    lengths = mb.lengths.tolist()
    blk = build_packed_blocks(mb.input_ids_T, mb.loss_mask_T, anchors_J, lengths=lengths,
                              blocks_per_sample=hb.blocks_per_sample, block_size=B, mask_token_id=mask_token_id,
                              gamma=gamma, prefix_J=hb.prefix_J)
    layout = packed_layout_flat(lengths=lengths, anchors_J=anchors_J, blocks_per_sample=hb.blocks_per_sample,
                                block_size=B)  # host lengths and counts: no GPU sync
    block_ids_Q = blk.block_ids_JB.reshape(-1)
    ctx_TD = drafter.context(mb.hidden_TKD)
    block_embeds_QD = embed_VD[block_ids_Q]  # frozen; embed_VD is already in the compute dtype
    hidden_QD = drafter(block_embeds_QD, ctx_TD, q_pos=layout.q_pos_Q, kv_pos=layout.kv_pos_K, mask=layout)
    weights_JB = blk.weights_JB
    if loss_normalization in ("sequence", "sample"):
        weights_JB = per_sample_mean_weights(weights_JB, hb.blocks_per_sample)
    labels_Q, weights_Q = blk.labels_JB.reshape(-1), weights_JB.reshape(-1)
    if loss_impl in ("fused", "fused_eager"):
        terms = fused_ce_loss(hidden_QD, lm_head_VD, labels_Q, weights_Q, chunk=loss_chunk_blocks * B, block_size=B,
                              num_supervised=hb.supervised_tokens,
                              epilogue=train_epilogue(loss_impl, compiled=drafter.elementwise_compiled,
                                                      device=hidden_QD.device))
    else:
        assert loss_impl == "checkpoint", loss_impl
        terms = chunked_ce_loss(hidden_QD, lm_head_VD, labels_Q, weights_Q, chunk=loss_chunk_blocks * B, block_size=B)
    selector = getattr(drafter, "candidate_selector", None)
    if selector is not None and selector_weight > 0:
        from dflash.train.selector import selector_ce_sum

        sel_sum, _ = selector_ce_sum(selector, hidden_QD, lm_head_VD=lm_head_VD, labels_JB=blk.labels_JB,
                                     weights_Q=weights_Q, num_supervised=hb.supervised_tokens,
                                     chunk=loss_chunk_blocks * B)
        ce_sum = terms.weighted_ce_sum + selector_weight * sel_sum
        terms = dataclasses.replace(terms, weighted_ce_sum=ce_sum,
                                    loss=ce_sum / terms.weight_sum.clamp(min=torch.finfo(torch.float32).tiny))
    return terms


class GradSync:
    """Parameters' .grad are views into one flat fp32 buffer, followed by the step's metric counters, so one
    all-reduce per step carries both.

    Counter layout (S = 4 + 2B floats): [ce_sum, weight_sum, accept_len_sum, num_blocks, correct_B, count_B].
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], *, block_size: int, device: torch.device) -> None:
        self.params = list(params)
        self.num_params = sum(p.numel() for p in self.params)
        self.block_size = block_size
        self.flat = torch.zeros(self.num_params + 4 + 2 * block_size, dtype=torch.float32, device=device)
        offset = 0
        self._offsets: list[int] = []
        for p in self.params:
            assert p.dtype == torch.float32, "master weights are fp32"
            p.grad = self.flat[offset:offset + p.numel()].view_as(p)
            self._offsets.append(offset)
            offset += p.numel()
        self.grads = self.flat[:self.num_params]
        self.counters = self.flat[self.num_params:]

    def zero(self) -> None:
        self.flat.zero_()

    def add(self, terms) -> None:
        """Accumulate one micro-batch's CELoss counters (detached)."""
        B = self.block_size
        c = self.counters
        c[0] += terms.weighted_ce_sum.detach().float()
        c[1] += terms.weight_sum.detach().float()
        c[2] += terms.accept_len_sum.detach().float()
        c[3] += terms.num_blocks.detach().float()
        c[4:4 + B] += terms.correct_B.detach().float()
        c[4 + B:] += terms.count_B.detach().float()

    def reduce(self, world_size: int) -> None:
        """Sum gradients and counters over ranks (one all-reduce of the flat buffer)."""
        if world_size > 1:
            dist.all_reduce(self.flat, op=dist.ReduceOp.SUM)
        self.check_views()

    def norm_and_divisor(self, *, max_norm: float,
                         denominator: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm, divisor) of the reduced step, both 0-dim device tensors (no host sync): the global L2 norm of the
        normalised gradient (what clip_grad_norm_ reports) and the one number the summed gradient is divided by
        to become the update's gradient: the normaliser (the global weight sum, or `denominator` when given:
        loss_normalization=sample's run constant) over the clip coefficient. apply_divisor applies it."""
        if denominator is not None:
            # a fill on the device: torch.tensor(x, device=cuda) copies from pageable memory, which waits for the GPU
            normaliser = torch.full((), float(denominator), dtype=torch.float32, device=self.flat.device)
        else:
            # clamp: a step whose blocks have no supervised slot has zero gradient anyway
            normaliser = self.counters[1].clamp(min=1e-12)
        norm = torch.linalg.vector_norm(self.grads) / normaliser
        return norm, normaliser / clip_coefficient(norm, max_norm=max_norm)

    def check_views(self) -> None:
        """Assert that every .grad is still the view of the flat buffer at its own offset: autograd replacing a
        view with a fresh tensor (or a view moved elsewhere) would silently drop that parameter from the
        all-reduce and the clip, so catch that bug loudly."""
        base = self.flat.data_ptr()
        width = self.flat.element_size()
        for p, offset in zip(self.params, self._offsets):
            g = p.grad
            assert g is not None, "a parameter lost its .grad view of the flat buffer"
            assert (g.untyped_storage().data_ptr() == self.flat.untyped_storage().data_ptr()
                    and g.data_ptr() == base + offset * width and g.is_contiguous()), \
                f".grad of a {tuple(p.shape)} parameter is not the flat buffer's view at element {offset}"

    def step_counters(self) -> torch.Tensor:
        return self.counters.detach().clone()


def clip_coefficient(norm: torch.Tensor, *, max_norm: float) -> torch.Tensor:
    """The factor torch.nn.utils.clip_grad_norm_ scales gradients of global norm `norm` by: max_norm / (norm +
    1e-6), at most 1; 1 when max_norm is 0 (the clip off)."""
    if max_norm <= 0:
        return torch.ones_like(norm)
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


def apply_divisor(optimizer: torch.optim.Optimizer, grads: torch.Tensor, divisor: torch.Tensor) -> None:
    """Make the next optimizer.step() use grads / divisor. A fused AdamW takes it as its grad_scale: the kernel
    divides each gradient as it reads it (and writes the quotient back), which saves two full passes over the
    fp32 gradients (1.7B on the 27B drafter: ~14 GB each) against a division by the normaliser followed by
    clip_grad_norm_'s scaling. Other optimizers: one in-place division."""
    if optimizer.defaults.get("fused"):
        optimizer.grad_scale = divisor  # type: ignore[attr-defined]  # read by Adam(W).step, as GradScaler sets it
    else:
        grads.div_(divisor)


def lr_factor(step: int, *, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """Linear warmup from 1/warmup to 1 over `warmup_steps`, then cosine to min_lr_ratio at `total_steps`.
    `step` counts optimizer steps already taken (LambdaLR's last_epoch)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def summarize_counters(counters_SC: torch.Tensor, *, block_size: int) -> dict:
    """Host summary of a stack of per-step counters [steps, 4+2B] (one .cpu() call, on log steps)."""
    c = counters_SC.double().cpu()
    B = block_size
    per_step_loss = (c[:, 0] / c[:, 1].clamp(min=1e-12)).tolist()
    tot = c.sum(0)
    correct, count = tot[4:4 + B], tot[4 + B:]
    acc = (correct[1:] / count[1:].clamp(min=1)).tolist()
    return {"losses": per_step_loss, "acc": acc,
            "accept_len": float(tot[2] / tot[3].clamp(min=1)), "blocks": float(tot[3])}
