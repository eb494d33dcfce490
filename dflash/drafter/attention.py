"""Which key a draft-block query may see, and the two attention kernels that apply it.

Shapes: C = packed context tokens, J = blocks, B = block size, Q = J*B block (query) tokens,
K = C + Q keys ([context; blocks]), h = heads, d = head_dim.

One packed batch holds several sequences concatenated. A block query sees (a) context tokens of its own
sequence whose position is strictly below the block's anchor (the feature at the anchor itself is not
available at inference, method doc 2) and (b) all B slots of its own block; nothing else.
`block_attention_mask` is that predicate, written once with broadcasting tensor ops so it serves both the
dense path (evaluated on [q, k] index grids) and flex attention's mask_mod (evaluated on scalar indices).

Tradeoff: the dense path (SDPA + boolean mask, CPU, and any device without flex) processes queries in
chunks of whole blocks and keeps only the context keys plus the chunk's own block keys (other blocks are
never visible), so memory is O(chunk * (C + chunk)) instead of O(Q * (C + Q)); each chunk is
checkpointed so the attention probabilities are not kept for backward. Flex attention (CUDA) skips the
masked-out tiles entirely and is the fast path; torch 2.13 has no CPU backward for it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflash.errors import ConfigError

log = logging.getLogger(__name__)

CONTEXT_BLOCK = -1   # block id of context keys


def block_attention_mask(*, q_seq: torch.Tensor, q_anchor: torch.Tensor, q_block: torch.Tensor,
                         kv_seq: torch.Tensor, kv_pos: torch.Tensor, kv_block: torch.Tensor) -> torch.Tensor:
    """True where a block query may attend to a key. All arguments broadcast against each other.

    q_seq/q_anchor/q_block: the query's sequence id, its block's anchor position and its block id.
    kv_seq/kv_pos/kv_block: the key's sequence id, position, and block id (CONTEXT_BLOCK for context keys).
    """
    is_ctx = kv_block == CONTEXT_BLOCK
    sees_ctx = is_ctx & (kv_seq == q_seq) & (kv_pos < q_anchor)
    sees_own_block = (kv_block == q_block) & ~is_ctx
    return sees_ctx | sees_own_block


@dataclass(frozen=True)
class BlockLayout:
    """Where every context token and block of one packed batch sits. Integer tensors on one device."""

    ctx_seq_C: torch.Tensor     # sequence id of each context token
    ctx_pos_C: torch.Tensor     # position of each context token inside its sequence
    block_seq_J: torch.Tensor   # sequence id of each block
    anchor_J: torch.Tensor      # anchor position of each block (slot k sits at anchor + k)
    block_size: int

    @property
    def num_ctx(self) -> int:
        return self.ctx_seq_C.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.anchor_J.shape[0]

    @property
    def q_pos_Q(self) -> torch.Tensor:
        offs_B = torch.arange(self.block_size, device=self.anchor_J.device)
        return (self.anchor_J[:, None] + offs_B).reshape(-1)

    @property
    def kv_pos_K(self) -> torch.Tensor:
        return torch.cat([self.ctx_pos_C, self.q_pos_Q])

    def query_meta(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(seq, anchor, block) per query token, [Q] each."""
        B = self.block_size
        block_J = torch.arange(self.num_blocks, device=self.anchor_J.device)
        return (self.block_seq_J.repeat_interleave(B), self.anchor_J.repeat_interleave(B),
                block_J.repeat_interleave(B))

    def key_meta(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(seq, pos, block) per key token, [K] each; context keys first."""
        q_seq, _, q_block = self.query_meta()
        ctx_block = torch.full_like(self.ctx_seq_C, CONTEXT_BLOCK)
        return (torch.cat([self.ctx_seq_C, q_seq]), self.kv_pos_K, torch.cat([ctx_block, q_block]))

    def to(self, device: torch.device | str) -> "BlockLayout":
        return BlockLayout(ctx_seq_C=self.ctx_seq_C.to(device), ctx_pos_C=self.ctx_pos_C.to(device),
                           block_seq_J=self.block_seq_J.to(device), anchor_J=self.anchor_J.to(device),
                           block_size=self.block_size)


def dense_mask(layout: BlockLayout) -> torch.Tensor:
    """The full [Q, K] boolean mask (tests and small batches; the kernels never build it whole)."""
    q_seq, q_anchor, q_block = layout.query_meta()
    kv_seq, kv_pos, kv_block = layout.key_meta()
    return block_attention_mask(q_seq=q_seq[:, None], q_anchor=q_anchor[:, None], q_block=q_block[:, None],
                                kv_seq=kv_seq[None], kv_pos=kv_pos[None], kv_block=kv_block[None])


# ---------------------------------------------------------------------------------------------- dense path

def _sdpa_chunk(q_hqd, k_hkd, v_hkd, q_seq, q_anchor, q_block, kv_seq, kv_pos, kv_block):
    mask_qk = block_attention_mask(q_seq=q_seq[:, None], q_anchor=q_anchor[:, None], q_block=q_block[:, None],
                                   kv_seq=kv_seq[None], kv_pos=kv_pos[None], kv_block=kv_block[None])
    return F.scaled_dot_product_attention(q_hqd[None], k_hkd[None], v_hkd[None], attn_mask=mask_qk,
                                          enable_gqa=True)[0]


def dense_block_attention(q_hQd: torch.Tensor, k_hKd: torch.Tensor, v_hKd: torch.Tensor,
                          layout: BlockLayout, *, chunk_tokens: int = 2048) -> torch.Tensor:
    """SDPA with the block mask, in query chunks of whole blocks. Returns [h, Q, d]."""
    C, B = layout.num_ctx, layout.block_size
    q_seq, q_anchor, q_block = layout.query_meta()
    kv_seq, kv_pos, kv_block = layout.key_meta()
    blocks_per_chunk = max(1, chunk_tokens // B)
    use_ckpt = torch.is_grad_enabled() and (q_hQd.requires_grad or k_hKd.requires_grad)
    outs = []
    for j0 in range(0, layout.num_blocks, blocks_per_chunk):
        j1 = min(j0 + blocks_per_chunk, layout.num_blocks)
        qs = slice(j0 * B, j1 * B)
        # Keys: every context token plus this chunk's block tokens; other blocks' keys are never visible.
        ks = torch.cat([torch.arange(C, device=k_hKd.device),
                        torch.arange(C + j0 * B, C + j1 * B, device=k_hKd.device)])
        args = (q_hQd[:, qs], k_hKd[:, ks], v_hKd[:, ks], q_seq[qs], q_anchor[qs], q_block[qs],
                kv_seq[ks], kv_pos[ks], kv_block[ks])
        outs.append(checkpoint(_sdpa_chunk, *args, use_reentrant=False) if use_ckpt else _sdpa_chunk(*args))
    return torch.cat(outs, dim=1)


# ----------------------------------------------------------------------------------------------- flex path

_compiled: dict[str, object] = {}


def _compiled_fn(name: str):
    """torch.compile'd flex_attention, built once per process. Shapes change every packed batch;
    torch.compile's automatic dynamic shapes recompile once and then stay dynamic."""
    if name not in _compiled:
        import torch.nn.attention.flex_attention as fa
        # Uncompiled flex attention materialises the full score matrix; compiled it is a fused kernel that
        # skips fully masked tiles.
        _compiled[name] = torch.compile(getattr(fa, name))
    return _compiled[name]


TILE = 128  # flex attention's default tile (BLOCK_SIZE), for queries and keys


def _cdiv(a, b):
    return -(-a // b)


def _ranges_to_indices(starts_tR: torch.Tensor, ends_tR: torch.Tensor, width: int):
    """Per row t, the ascending, disjoint ranges [starts_tR[t, r], ends_tR[t, r]) concatenated.
    Returns (counts [t] int32, indices [t, width] int32, zero past each row's count)."""
    lens_tR = (ends_tR - starts_tR).clamp(min=0)
    cum_tR = torch.cumsum(lens_tR, 1)
    i_W = torch.arange(width, device=starts_tR.device)
    r_tW = (i_W[None, :, None] >= cum_tR[:, None, :]).sum(-1).clamp(max=starts_tR.shape[1] - 1)
    first_tR = cum_tR - lens_tR  # index in the row's list where range r begins
    idx_tW = torch.gather(starts_tR, 1, r_tW) + i_W[None] - torch.gather(first_tR, 1, r_tW)
    total_t = cum_tR[:, -1]
    idx_tW = torch.where(i_W[None] < total_t[:, None], idx_tW, 0)
    return total_t.to(torch.int32), idx_tW.to(torch.int32)


def layout_tiles(layout: BlockLayout, *, tile: int = TILE) -> dict[str, torch.Tensor]:
    """Which key tiles every query tile must visit, derived from the layout's structure: O(Q + tiles^2)
    index arithmetic, no sync, instead of evaluating the predicate on all Q x K pairs (create_block_mask
    does that, and with ~10 short sequences' blocks per batch Q x K reaches 10^10 pairs per step).

    Requires what packed_layout and the evaluator build: sequence ids 0..N-1, each sequence's context one
    contiguous run of indices holding consecutive positions. A block sees its sequence's run up to its anchor
    (exclusive) and its own B keys. Per query tile the visited key tiles are (a) the hull of its
    rows' context ranges and (b) the hull of its blocks' own keys: a superset of the true tiles (the mask_mod
    masks the rest). "full" tiles, where every pair is visible and the kernel skips the mask_mod, are
    context tiles lying wholly inside every row's range, in tiles whose rows are all real and of one sequence.

    Returns kv_num_blocks/kv_indices (partial tiles) and full_kv_num_blocks/full_kv_indices, shaped
    [1, 1, nq] and [1, 1, nq, nk] (int32) for BlockMask.from_kv_blocks."""
    C, J, B = layout.num_ctx, layout.num_blocks, layout.block_size
    Q, K = J * B, C + J * B
    dev = layout.anchor_J.device
    nq, nk = _cdiv(Q, tile), _cdiv(K, tile)
    pad = nq * tile - Q
    # context index where each sequence's run starts (ids are dense 0..N-1 and N <= C)
    idx_C = torch.arange(C, device=dev)
    start_S = torch.full((C + 1,), C, dtype=torch.int64, device=dev)
    start_S.scatter_reduce_(0, layout.ctx_seq_C, idx_C, reduce="amin")
    end_S = torch.zeros(C + 1, dtype=torch.int64, device=dev)
    end_S.scatter_reduce_(0, layout.ctx_seq_C, idx_C + 1, reduce="amax")
    first_pos_S = torch.cat([layout.ctx_pos_C, layout.ctx_pos_C.new_zeros(1)])[start_S]
    lo_J = start_S[layout.block_seq_J]
    # exclusive end: keys at positions below the anchor, within the sequence's run (whatever position it starts at)
    seen_J = (layout.anchor_J - first_pos_S[layout.block_seq_J]).clamp(min=0)
    hi_J = torch.minimum(lo_J + seen_J, end_S[layout.block_seq_J])
    has_ctx_J = hi_J > lo_J
    big = torch.iinfo(torch.int64).max // 4

    def rows(x_J, fill):  # per block -> per query row, padded to whole tiles -> [nq, tile]
        x_Q = x_J.repeat_interleave(B, output_size=Q)
        return torch.cat([x_Q, x_Q.new_full((pad,), fill)]).view(nq, tile)

    lo_t = rows(torch.where(has_ctx_J, lo_J, big), big).amin(1)
    hi_t = rows(torch.where(has_ctx_J, hi_J, 0), 0).amax(1)
    any_ctx_t = hi_t > lo_t
    a0 = torch.where(any_ctx_t, lo_t // tile, 0)
    a1 = torch.where(any_ctx_t, _cdiv(hi_t, tile), 0)
    # full context tiles: all rows real, one sequence, each with context; full range [lo, min hi)
    seq_tq = rows(layout.block_seq_J, -1)
    one_seq_t = (seq_tq == seq_tq[:, :1]).all(1) & (seq_tq[:, 0] >= 0)
    all_ctx_t = rows(has_ctx_J, False).all(1)
    min_hi_t = rows(hi_J, -1).amin(1)
    f0 = _cdiv(lo_t, tile)
    f1 = min_hi_t // tile
    has_full_t = one_seq_t & all_ctx_t & (f1 > f0)
    f0 = torch.where(has_full_t, f0, a1)
    f1 = torch.where(has_full_t, f1, a1)
    # own-block keys of the tile's rows: blocks first_j..last_j sit at C + j*B
    t_idx = torch.arange(nq, device=dev)
    first_j = (t_idx * tile) // B
    last_j = (torch.clamp((t_idx + 1) * tile, max=Q) - 1) // B
    b0 = torch.maximum((C + first_j * B) // tile, a1)  # the last context tile may also hold the first blocks
    b1 = _cdiv(C + (last_j + 1) * B, tile)
    partial_n, partial_idx = _ranges_to_indices(torch.stack([a0, f1, b0], 1), torch.stack([f0, a1, b1], 1), nk)
    full_n, full_idx = _ranges_to_indices(f0[:, None], f1[:, None], nk)
    return {"kv_num_blocks": partial_n[None, None], "kv_indices": partial_idx[None, None],
            "full_kv_num_blocks": full_n[None, None], "full_kv_indices": full_idx[None, None]}


def layout_mask_mod(layout: BlockLayout):
    """block_attention_mask as a flex-attention mask_mod on (query, key) indices of `layout`."""
    q_seq, q_anchor, q_block = layout.query_meta()
    kv_seq, kv_pos, kv_block = layout.key_meta()
    Q, K = q_seq.shape[0], kv_seq.shape[0]

    def mask_mod(b, h, q_idx, kv_idx):
        # Tiles straddling the end may be evaluated past Q/K and then discarded: keep the lookups in bounds.
        qi, ki = q_idx.clamp(max=Q - 1), kv_idx.clamp(max=K - 1)
        return block_attention_mask(q_seq=q_seq[qi], q_anchor=q_anchor[qi], q_block=q_block[qi],
                                    kv_seq=kv_seq[ki], kv_pos=kv_pos[ki], kv_block=kv_block[ki])

    return mask_mod


def flex_block_mask(layout: BlockLayout, *, tile: int = TILE):
    """A flex-attention BlockMask for `layout`: tile lists from layout_tiles, layout_mask_mod on partial tiles."""
    from torch.nn.attention.flex_attention import BlockMask

    Q = layout.num_blocks * layout.block_size
    return BlockMask.from_kv_blocks(**layout_tiles(layout, tile=tile), BLOCK_SIZE=tile,
                                    mask_mod=layout_mask_mod(layout), seq_lengths=(Q, layout.num_ctx + Q))


def flex_block_attention(q_hQd: torch.Tensor, k_hKd: torch.Tensor, v_hKd: torch.Tensor,
                         block_mask, *, compiled: bool = True) -> torch.Tensor:
    """Flex attention with a prebuilt BlockMask (build it once per forward, share across layers)."""
    if compiled:
        fn = _compiled_fn("flex_attention")
    else:
        from torch.nn.attention.flex_attention import flex_attention as fn
    return fn(q_hQd[None], k_hKd[None], v_hKd[None], block_mask=block_mask, enable_gqa=True)[0]


_logged: set[str] = set()


def choose_backend(device: torch.device, requested: str = "auto") -> str:
    """'flex' on CUDA, 'dense' elsewhere, unless `requested` names one; logs the choice once with its reason."""
    if requested not in ("auto", "dense", "flex"):
        raise ConfigError(f"attention backend {requested!r}: use 'auto', 'dense' or 'flex'")
    if requested != "auto":
        backend, reason = requested, "requested explicitly"
    elif device.type == "cuda":
        backend, reason = "flex", "CUDA device: compiled flex attention skips masked tiles"
    else:
        backend, reason = "dense", (f"{device.type} device: flex attention has no {device.type} backward "
                                    "(torch 2.13), using chunked SDPA with a boolean mask")
    key = f"{device.type}:{backend}"
    if key not in _logged:
        _logged.add(key)
        log.info("drafter attention backend %s (%s)", backend, reason)
    return backend
