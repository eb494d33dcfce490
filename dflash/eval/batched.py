"""Accept lengths at every anchor of many sequences, in a few large drafter forwards: the one computation behind
`dflash eval` (evaluate.py), held-out tau during training (heldout.py) and tau.accept_lengths.

Shapes: S = sequences of the eval set, n = sequences of one chunk, T = their tokens packed, C = context rows of
a chunk, J = its blocks (anchors), B = block size, W = B-1 drafted slots, K = taps, D = hidden size.

Why every anchor: the drafter's block at anchor a is a function of the cached target features before a and the
token y[a] only (drafter/model.py: the context is projected once, neither re-normed per layer nor updated, and
the block is [y[a], MASK x W]; method doc 6). No state flows from an earlier drafted block, so on a
target-greedy cache L(a), the accepted drafts of the block at a, can be computed for all response positions at
once with the training forward (context < anchor, bidirectional within the block), and the accept chain
(anchor -> L -> next anchor) walked afterwards on the host (tau.walk_accept_chain). That spends about tau
times the block tokens of following the chain (which visits ~1/tau of the positions), but in (response
tokens / chunk_anchors) large forwards instead of (longest chain) small sequential ones: on the H200 the
chain-following evaluator took 19.8 s for 244 SmolLM2 eval sequences against 0.19 s per training step.

Schedule (plan_chunks, host side, pure): sequences in eval-set order, the anchors [start, end-1) of each
(the positions walk_accept_chain reads) cut into chunks of <= chunk_anchors blocks and <= chunk_anchors x B
context rows (at least one anchor each). A chunk's context is, per sequence, its positions 0..last anchor-1.
Everything a chunk computes depends only on the rows of its own sequences, so a caller holding the whole eval
set on the device (held-out) and one that reads each chunk's sequences from disk (`dflash eval`) run the very
same forwards and get bit-identical drafts, in bf16 too.
Memory per forward: chunk_anchors x B query rows through the drafter, and the LM head over
ARGMAX_BYTES of logits at a time. One host sync per evaluation (the L values), none per chunk.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch

from dflash.drafter.attention import BlockLayout
from dflash.drafter.blocks import block_input_ids
from dflash.eval.draft import draft_argmax, leading_matches

DEFAULT_CHUNK_ANCHORS = 4096
"""Blocks per drafter forward: 64K query rows at B = 16 (the 27B drafter's MLP activations ~4.5 GB bf16)."""
ARGMAX_BYTES = 1 << 30
"""Logits of the draft argmax at a time: 21K rows of SmolLM2's 49,152 bf16 logits, 2K rows of Qwen3.5's 248,320."""


@dataclass(frozen=True, kw_only=True)
class AnchorChunk:
    """One drafter forward: the anchors [anchor_lo, anchor_hi) of sequences first_seq .. first_seq + n - 1.

    All arrays int64 [n], in sequence order; positions are inside each sequence."""

    first_seq: int
    lengths: np.ndarray
    """Tokens of each sequence (the chunk's sequences packed in order are its T rows)."""
    anchor_lo: np.ndarray
    anchor_hi: np.ndarray
    ends: np.ndarray
    """One past each sequence's last response token (drafts at or past it never match)."""

    @property
    def num_seqs(self) -> int:
        return len(self.lengths)

    @property
    def seqs(self) -> range:
        return range(self.first_seq, self.first_seq + self.num_seqs)

    @property
    def num_blocks(self) -> int:
        return int((self.anchor_hi - self.anchor_lo).sum())

    @property
    def ctx_len(self) -> np.ndarray:
        """Context rows of each sequence: positions 0..last anchor - 1 (a block sees positions < its anchor)."""
        return np.where(self.anchor_hi > self.anchor_lo, self.anchor_hi - 1, 0)


def plan_chunks(*, lengths: np.ndarray, spans: np.ndarray, chunk_anchors: int, block_size: int
                ) -> list[AnchorChunk]:
    """Cut the anchors of every sequence (spans[i] = response [start, end); anchors start..end-2) into chunks
    of <= chunk_anchors blocks and <= chunk_anchors * block_size context rows, keeping eval-set order. A chunk
    always takes at least one anchor. A chunk covers a consecutive range of sequences (callers slice or read
    them as one range); one without anchors inside that range gets an empty anchor range."""
    if chunk_anchors < 1:
        raise ValueError(f"chunk_anchors={chunk_anchors}: must be >= 1")
    lengths, spans = np.asarray(lengths, dtype=np.int64), np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    max_ctx = chunk_anchors * block_size
    chunks: list[AnchorChunk] = []
    cur: dict[int, tuple[int, int]] = {}  # sequence -> (anchor_lo, anchor_hi), insertion = eval-set order
    blocks = ctx = 0

    def close() -> None:
        nonlocal blocks, ctx
        if cur:
            first, last = min(cur), max(cur)
            lo = np.zeros(last + 1 - first, dtype=np.int64)
            hi = np.zeros_like(lo)
            for i, (a, b) in cur.items():
                lo[i - first], hi[i - first] = a, b
            chunks.append(AnchorChunk(first_seq=first, lengths=lengths[first:last + 1], anchor_lo=lo, anchor_hi=hi,
                                      ends=spans[first:last + 1, 1].copy()))
        cur.clear()
        blocks = ctx = 0

    for i, (start, end) in enumerate(spans.tolist()):
        lo, hi = start, end - 1  # walk_accept_chain reads L at pos < end-1
        while lo < hi:
            # anchors lo..lo+k-1 cost k blocks and lo+k-1 context rows (positions below the last anchor)
            k = min(hi - lo, chunk_anchors - blocks, max_ctx - ctx - lo + 1)
            if k < 1 and cur:
                close()
                continue
            k = max(k, 1)
            cur[i] = (lo, lo + k)
            blocks, ctx = blocks + k, ctx + lo + k - 1
            lo += k
            if lo < hi:  # the rest of this sequence goes into the next chunk
                close()
    close()
    return chunks


@contextlib.contextmanager
def forward_only(drafter) -> Iterator[None]:
    """no_grad, eval mode, the attention backend for these forwards and eager element-wise ops, all restored
    after. Backend: compiled flex attention on CUDA (one fused kernel per layer that skips masked tiles),
    chunked dense SDPA elsewhere, whatever the drafter trains with. Element-wise ops eager: a training drafter's
    compile_elementwise kernels round differently from the exported (uncompiled) drafter that `dflash eval`
    loads, and recompiled for each new chunk shape (11.8 s per evaluation on the H200 vs 1.65 s uncompiled)."""
    from dflash.drafter.model import DFlashDrafter

    was_training = drafter.training
    is_dflash = isinstance(drafter, DFlashDrafter)
    backend = drafter.attn_backend if is_dflash else None
    drafter.eval()
    try:
        with torch.no_grad(), (drafter.eager_elementwise() if is_dflash else contextlib.nullcontext()):
            if is_dflash:
                drafter.attn_backend = "auto"
            yield
    finally:
        if is_dflash:
            drafter.attn_backend = backend
        drafter.train(was_training)


def chunk_index(chunk: AnchorChunk, *, device: torch.device) -> dict[str, torch.Tensor]:
    """The chunk's index tensors on `device` (one host-to-device copy): ctx_rows/ctx_seq/ctx_pos [C] (rows of
    the chunk's packed T rows, local sequence id, position), anchor/block_seq/anchor_row/end [J]."""
    n = chunk.num_seqs
    off = np.concatenate([[0], np.cumsum(chunk.lengths)[:-1]]).astype(np.int64)
    ctx_n, blocks_n = chunk.ctx_len, chunk.anchor_hi - chunk.anchor_lo
    ctx_seq = np.repeat(np.arange(n, dtype=np.int64), ctx_n)
    ctx_pos = np.arange(ctx_seq.shape[0], dtype=np.int64) - np.repeat(np.cumsum(ctx_n) - ctx_n, ctx_n)
    block_seq = np.repeat(np.arange(n, dtype=np.int64), blocks_n)
    anchor = np.arange(block_seq.shape[0], dtype=np.int64) - np.repeat(np.cumsum(blocks_n) - blocks_n, blocks_n) \
        + np.repeat(chunk.anchor_lo, blocks_n)
    parts = {"ctx_rows": off[ctx_seq] + ctx_pos, "ctx_seq": ctx_seq, "ctx_pos": ctx_pos, "anchor": anchor,
             "block_seq": block_seq, "anchor_row": off[block_seq] + anchor, "end": chunk.ends[block_seq]}
    flat = torch.from_numpy(np.concatenate(list(parts.values()))).to(device, non_blocking=True)
    return dict(zip(parts, torch.split(flat, [len(v) for v in parts.values()])))


def block_drafts(drafter, out_JBD: torch.Tensor, *, anchor_ids_J: torch.Tensor, lm_head_VD: torch.Tensor,
                 rows_per_chunk: int) -> torch.Tensor:
    """The tokens a drafter proposes for each block's slots 1..B-1 (int64 [J, B-1]) from its final-normed
    outputs: the drafter's own rule when it has one (DFlash 2: the selector's path from the anchor,
    DFlash2Drafter.draft_tokens), else the per-slot argmax of the LM head (DFlash)."""
    own = getattr(drafter, "draft_tokens", None)
    if own is not None:
        return own(out_JBD, anchor_ids_J=anchor_ids_J, lm_head_VD=lm_head_VD, rows_per_chunk=rows_per_chunk)
    J, B, D = out_JBD.shape
    return draft_argmax(out_JBD[:, 1:].reshape(J * (B - 1), D), lm_head_VD, rows_per_chunk=rows_per_chunk
                        ).view(J, B - 1)


def chunk_accept_lengths(drafter, chunk: AnchorChunk, *, hidden_TKD: torch.Tensor, input_ids_T: torch.Tensor,
                         embed_VD: torch.Tensor, lm_head_VD: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """L per block of `chunk` (int64 [J] on the device, no host sync). hidden_TKD / input_ids_T: the chunk's
    sequences packed in order (its T rows) on the drafter's device; embed_VD already in `dtype`."""
    B, mask_id = drafter.cfg.block_size, drafter.cfg.mask_token_id
    ix = chunk_index(chunk, device=input_ids_T.device)
    layout = BlockLayout(ctx_seq_C=ix["ctx_seq"], ctx_pos_C=ix["ctx_pos"], block_seq_J=ix["block_seq"],
                         anchor_J=ix["anchor"], block_size=B)
    ctx_TD = drafter.context(hidden_TKD[ix["ctx_rows"]].to(dtype))
    block_ids_JB = block_input_ids(input_ids_T[ix["anchor_row"]], block_size=B, mask_token_id=mask_id)
    out_QD = drafter(embed_VD[block_ids_JB.reshape(-1)], ctx_TD, q_pos=layout.q_pos_Q, kv_pos=layout.kv_pos_K,
                     mask=layout)
    J = chunk.num_blocks
    rows = max(1, ARGMAX_BYTES // (lm_head_VD.shape[0] * out_QD.element_size()))
    draft_JW = block_drafts(drafter, out_QD.view(J, B, -1), anchor_ids_J=input_ids_T[ix["anchor_row"]],
                            lm_head_VD=lm_head_VD, rows_per_chunk=rows)
    k_W = torch.arange(1, B, device=input_ids_T.device)
    inside_JW = ix["anchor"][:, None] + k_W < ix["end"][:, None]
    ref_JW = torch.where(inside_JW, input_ids_T[(ix["anchor_row"][:, None] + k_W).clamp(max=input_ids_T.shape[0] - 1)],
                         -1)
    return leading_matches(draft_JW, ref_JW)


def accept_lengths_chunks(drafter, chunks: list[AnchorChunk], *,
                          fetch: Callable[[AnchorChunk], tuple[torch.Tensor, torch.Tensor]],
                          embed_VD: torch.Tensor, lm_head_VD: torch.Tensor, dtype: torch.dtype,
                          lengths: np.ndarray) -> np.ndarray:
    """L(a) of every planned anchor, packed over all S sequences (int64 [sum(lengths)], 0 where no anchor).

    fetch(chunk) -> (hidden_TKD, input_ids_T int64) of the chunk's sequences packed, on the drafter's device
    (a view of a resident eval set, or a cache read). Call inside forward_only(drafter)."""
    device = next(drafter.parameters()).device
    embed = embed_VD.to(device=device, dtype=dtype)
    head = lm_head_VD.to(device=device, dtype=dtype)  # once, not per argmax call (draft_argmax casts to this)
    parts = []
    for chunk in chunks:
        hidden_TKD, ids_T = fetch(chunk)
        parts.append(chunk_accept_lengths(drafter, chunk, hidden_TKD=hidden_TKD, input_ids_T=ids_T, embed_VD=embed,
                                          lm_head_VD=head, dtype=dtype))
    L = torch.cat(parts).cpu().numpy() if parts else np.zeros(0, np.int64)  # the one host sync
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    out = np.zeros(int(np.sum(lengths)), dtype=np.int64)
    rows = [np.arange(lo, hi) + offsets[c.first_seq + i]
            for c in chunks for i, (lo, hi) in enumerate(zip(c.anchor_lo.tolist(), c.anchor_hi.tolist()))]
    if rows:
        out[np.concatenate(rows)] = L
    return out
