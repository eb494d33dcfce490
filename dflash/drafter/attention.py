"""Which key a draft-block query may see, and the two attention kernels that apply it.

Shapes: C = packed context tokens, J = blocks, B = block size, Q = J*B block (query) tokens,
K = C + Q keys ([context; blocks]), h = heads, d = head_dim.

One packed batch holds several sequences concatenated. A block query sees (a) context tokens of its own
sequence whose position is strictly below the block's anchor (the feature at the anchor itself is not
available at inference, method doc 2) and (b) all B slots of its own block; nothing else.
`block_attention_mask` is that predicate, written once with broadcasting tensor ops so it serves both the
dense path (evaluated on [q, k] index grids) and flex attention's mask_mod (evaluated on scalar indices).

Per layer (LayerAttention, from DrafterConfig.layer_types / sliding_window / causal) the predicate narrows:
a sliding-window layer of window W lets the query at position p see only keys at positions > p - W (the query's
own slot counts as one of the W, as in Hugging Face and SpecForge: the context bound is a + k - (W-1) for slot
k of the block at anchor a, and inside the block slot k' >= k - (W-1)); a causal layer lets slot k see only
slots k' <= k of its block (context keys, all below the anchor, are unaffected). That is SpecForge's training
mask (dflash_mask.py) and what SGLang / vLLM serve: sliding layers run as decoder (causal) attention with
window_left = W-1, full layers bidirectional, unless dflash_config.causal says otherwise (vLLM).

Tradeoff: the dense path (SDPA + boolean mask, CPU, and any device without flex) processes queries in
chunks of whole blocks and keeps only the context keys of the chunk's own sequences (below their anchors)
plus the chunk's own block keys (nothing else is visible), so compute and memory are O(chunk * (C_seq +
chunk)) per chunk instead of O(Q * (C + Q)); the backward recomputes each chunk's probabilities, so they are
not kept for backward. Flex attention (CUDA) skips the
masked-out tiles entirely and is the fast path; torch 2.13 has no CPU backward for it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from dflash.drafter.config import LayerAttention
from dflash.errors import ConfigError

log = logging.getLogger(__name__)

CONTEXT_BLOCK = -1   # block id of context keys


FULL = LayerAttention()
"""The paper's layer: context below the anchor, the whole own block."""


def block_attention_mask(*, q_seq: torch.Tensor, q_anchor: torch.Tensor, q_block: torch.Tensor,
                         kv_seq: torch.Tensor, kv_pos: torch.Tensor, kv_block: torch.Tensor,
                         q_pos: torch.Tensor | None = None, attn: LayerAttention = FULL) -> torch.Tensor:
    """True where a block query may attend to a key. All arguments broadcast against each other.

    q_seq/q_anchor/q_block: the query's sequence id, its block's anchor position and its block id.
    kv_seq/kv_pos/kv_block: the key's sequence id, position, and block id (CONTEXT_BLOCK for context keys).
    q_pos: the query's position (anchor + slot), needed by a windowed or causal `attn`.
    """
    is_ctx = kv_block == CONTEXT_BLOCK
    sees_ctx = is_ctx & (kv_seq == q_seq) & (kv_pos < q_anchor)
    sees_own_block = (kv_block == q_block) & ~is_ctx
    sees = sees_ctx | sees_own_block
    if attn.is_full:
        return sees
    assert q_pos is not None, "a windowed or causal layer's mask needs the query positions"
    if attn.causal:   # context keys sit below the anchor, so this bites inside the block only
        sees = sees & (kv_pos <= q_pos)
    if attn.window is not None:
        sees = sees & (q_pos - kv_pos < attn.window)
    return sees


def own_block_mask(block_size: int, attn: LayerAttention, *, device: torch.device | str = "cpu"
                   ) -> torch.Tensor | None:
    """bool [B, B]: which slots k' (columns) of its own block slot k (rows) sees under `attn`, the same for every
    block (block_attention_mask at anchor 0); None when it sees all of them."""
    if attn.is_full or (not attn.causal and attn.window is not None and attn.window >= block_size):
        return None
    k_B = torch.arange(block_size, device=device)
    zero = torch.zeros((), dtype=torch.int64, device=device)
    return block_attention_mask(q_seq=zero, q_anchor=zero, q_block=zero, q_pos=k_B[:, None], kv_seq=zero,
                                kv_pos=k_B[None], kv_block=zero, attn=attn)


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


def dense_mask(layout: BlockLayout, attn: LayerAttention = FULL) -> torch.Tensor:
    """The full [Q, K] boolean mask (tests and small batches; the kernels never build it whole)."""
    q_seq, q_anchor, q_block = layout.query_meta()
    kv_seq, kv_pos, kv_block = layout.key_meta()
    return block_attention_mask(q_seq=q_seq[:, None], q_anchor=q_anchor[:, None], q_block=q_block[:, None],
                                q_pos=layout.q_pos_Q[:, None], kv_seq=kv_seq[None], kv_pos=kv_pos[None],
                                kv_block=kv_block[None], attn=attn)


# ---------------------------------------------------------------------------------------------- dense path

def visible_context_bound(layout: BlockLayout, j0: int, j1: int) -> torch.Tensor:
    """bool [C]: the context keys that any of blocks j0..j1-1 may see: positions of their own sequences below
    that sequence's largest anchor among them. Exactly the union of the rows' visible context (a query of
    sequence s sees positions < its anchor), so a chunk attends to O(C_seq) context keys, not all C."""
    seq_j, anchor_j = layout.block_seq_J[j0:j1], layout.anchor_J[j0:j1]
    num_seq = int(seq_j.max()) + 1
    if layout.num_ctx:   # a chunk of blocks anchored at 0 may come with no context at all (tau.py)
        num_seq = max(num_seq, int(layout.ctx_seq_C.max()) + 1)
    bound_S = torch.zeros(num_seq, dtype=torch.int64, device=seq_j.device)
    bound_S.scatter_reduce_(0, seq_j, anchor_j.to(torch.int64), reduce="amax")
    return layout.ctx_pos_C < bound_S[layout.ctx_seq_C]


def _chunk_scores(q_grqd, kc_gcd, kb_gqd, mask_qc, mask_BB, block_size: int, acc: torch.dtype):
    """Scaled scores against the context keys ([g, rep, q, c], masked to -inf) and against each query's own
    block keys ([g, rep, q, B], masked to -inf where mask_BB, when given, hides a slot), in the accumulation
    dtype."""
    g, rep, nq, d = q_grqd.shape
    J, B = nq // block_size, block_size
    s_ctx = (q_grqd @ kc_gcd[:, None].transpose(-1, -2)).to(acc).masked_fill_(~mask_qc, float("-inf"))
    s_blk = (q_grqd.reshape(g, rep, J, B, d) @ kb_gqd.reshape(g, 1, J, B, d).transpose(-1, -2)).to(acc)
    if mask_BB is not None:
        s_blk = s_blk.masked_fill_(~mask_BB, float("-inf"))
    return s_ctx, s_blk.reshape(g, rep, nq, B)


class _ChunkAttention(torch.autograd.Function):
    """Softmax attention of a chunk's queries over [visible context keys; own block's B keys], one softmax
    over both. g = kv heads (GQA: query head i uses kv head i // (h / g), as SDPA's enable_gqa). The own-block
    part is block-diagonal, so it is computed per block ([J, B, B]), not over the chunk's q x q pairs.

    Why a hand-written backward: autograd over the eager ops (mask, exp, sums, casts) cost more than the whole
    SDPA backward it replaces; this one keeps only the inputs, the output and the row log-sum-exp and
    recomputes the probabilities (flash-attention's backward, dense), so no activation checkpoint is needed."""

    @staticmethod
    def forward(ctx, q_hqd, kc_gcd, vc_gcd, kb_gqd, vb_gqd, mask_qc, mask_BB, block_size: int):
        h, nq, d = q_hqd.shape
        g = kc_gcd.shape[0]
        rep, J, B = h // g, nq // block_size, block_size
        acc = torch.promote_types(q_hqd.dtype, torch.float32)   # softmax in fp32 at least (bf16 training)
        scale = d ** -0.5
        q_grqd = q_hqd.reshape(g, rep, nq, d) * scale
        s_ctx, s_blk = _chunk_scores(q_grqd, kc_gcd, kb_gqd, mask_qc, mask_BB, B, acc)
        # every row sees its own slot, so the row max is finite and exp(-inf - m) = 0 for masked keys
        m = s_blk.amax(-1, keepdim=True)
        if s_ctx.shape[-1]:   # blocks anchored at 0 see no context (amax over nothing is an error)
            m = torch.maximum(m, s_ctx.amax(-1, keepdim=True))
        p_ctx, p_blk = (s_ctx - m).exp_(), (s_blk - m).exp_()
        denom = p_ctx.sum(-1, keepdim=True) + p_blk.sum(-1, keepdim=True)
        dtype = vc_gcd.dtype
        out = (p_ctx.to(dtype) @ vc_gcd[:, None]).to(acc)
        out += (p_blk.reshape(g, rep, J, B, B).to(dtype) @ vb_gqd.reshape(g, 1, J, B, d)).to(acc).reshape(
            g, rep, nq, d)
        out /= denom
        lse = m + denom.log()
        ctx.save_for_backward(q_hqd, kc_gcd, vc_gcd, kb_gqd, vb_gqd, mask_qc, out, lse)
        ctx.block_size = block_size
        ctx.mask_BB = mask_BB
        return out.to(dtype).reshape(h, nq, d)

    @staticmethod
    def backward(ctx, dout_hqd):
        q_hqd, kc_gcd, vc_gcd, kb_gqd, vb_gqd, mask_qc, out, lse = ctx.saved_tensors
        B = ctx.block_size
        h, nq, d = q_hqd.shape
        g, c = kc_gcd.shape[0], kc_gcd.shape[1]
        rep, J = h // g, nq // B
        acc, scale = out.dtype, d ** -0.5
        q_grqd = q_hqd.reshape(g, rep, nq, d).to(acc) * scale
        kc, vc, kb, vb = (t.to(acc) for t in (kc_gcd, vc_gcd, kb_gqd, vb_gqd))
        s_ctx, s_blk = _chunk_scores(q_grqd, kc, kb, mask_qc, ctx.mask_BB, B, acc)
        p_ctx, p_blk = (s_ctx - lse).exp_(), (s_blk - lse).exp_()
        do = dout_hqd.reshape(g, rep, nq, d).to(acc)
        delta = (do * out).sum(-1, keepdim=True)
        ds_ctx = p_ctx * (do @ vc[:, None].transpose(-1, -2) - delta)                    # [g, rep, q, c]
        vb_g1JBd = vb.reshape(g, 1, J, B, d)
        do_grJBd = do.reshape(g, rep, J, B, d)
        dp_blk = (do_grJBd @ vb_g1JBd.transpose(-1, -2)).reshape(g, rep, nq, B)
        ds_blk = p_blk * (dp_blk - delta)                                                # [g, rep, q, B]
        ds_grJBB = ds_blk.reshape(g, rep, J, B, B)
        dq = ds_ctx @ kc[:, None]
        dq += (ds_grJBB @ kb.reshape(g, 1, J, B, d)).reshape(g, rep, nq, d)
        dq *= scale
        # key-side grads sum over the rep query heads sharing a kv head: fold rep into the row axis
        dkc = ds_ctx.reshape(g, rep * nq, c).transpose(1, 2) @ q_grqd.reshape(g, rep * nq, d)
        dvc = p_ctx.reshape(g, rep * nq, c).transpose(1, 2) @ do.reshape(g, rep * nq, d)
        q_gJrBd = q_grqd.reshape(g, rep, J, B, d).transpose(1, 2).reshape(g, J, rep * B, d)
        do_gJrBd = do_grJBd.transpose(1, 2).reshape(g, J, rep * B, d)
        ds_gJrBB = ds_grJBB.transpose(1, 2).reshape(g, J, rep * B, B)
        p_gJrBB = p_blk.reshape(g, rep, J, B, B).transpose(1, 2).reshape(g, J, rep * B, B)
        dkb = (ds_gJrBB.transpose(-1, -2) @ q_gJrBd).reshape(g, nq, d)
        dvb = (p_gJrBB.transpose(-1, -2) @ do_gJrBd).reshape(g, nq, d)
        return (dq.reshape(h, nq, d).to(q_hqd.dtype), dkc.to(kc_gcd.dtype), dvc.to(vc_gcd.dtype),
                dkb.to(kb_gqd.dtype), dvb.to(vb_gqd.dtype), None, None, None)


def _chunk_attention(q_hqd, kc_gcd, vc_gcd, kb_gqd, vb_gqd, mask_qc, block_size: int,
                     mask_BB: torch.Tensor | None = None) -> torch.Tensor:
    return _ChunkAttention.apply(q_hqd, kc_gcd, vc_gcd, kb_gqd, vb_gqd, mask_qc, mask_BB, block_size)


def _context_mask(q_seq, q_anchor, q_pos, kv_seq, kv_pos, attn: LayerAttention = FULL) -> torch.Tensor:
    """block_attention_mask for context keys only: bool [q, c]."""
    ctx_block = torch.full((), CONTEXT_BLOCK, device=q_seq.device)
    return block_attention_mask(q_seq=q_seq[:, None], q_anchor=q_anchor[:, None], q_block=ctx_block + 1,
                                q_pos=q_pos[:, None], kv_seq=kv_seq[None], kv_pos=kv_pos[None], kv_block=ctx_block,
                                attn=attn)


def dense_block_attention(q_hQd: torch.Tensor, k_hKd: torch.Tensor, v_hKd: torch.Tensor,
                          layout: BlockLayout, *, chunk_tokens: int = 2048,
                          attn: LayerAttention = FULL) -> torch.Tensor:
    """Attention with the block mask, in query chunks of whole blocks. Returns [h, Q, d].

    Each chunk attends to the context its own sequences can see (visible_context_bound) and each block to its
    own B keys: a packed batch of N sequences costs O(Q x (C / N + B)), not O(Q x (C + chunk)) (with 512
    anchors x 16 a CPU step over several sequences was dominated by scores against other sequences' context
    and other blocks' keys, all masked). The key selection syncs with the host once per chunk: this path is
    the CPU / no-flex fallback."""
    C, B = layout.num_ctx, layout.block_size
    q_seq, q_anchor, _ = layout.query_meta()
    q_pos = layout.q_pos_Q
    mask_BB = own_block_mask(B, attn, device=q_hQd.device)
    blocks_per_chunk = max(1, chunk_tokens // B)
    outs = []
    for j0 in range(0, layout.num_blocks, blocks_per_chunk):
        j1 = min(j0 + blocks_per_chunk, layout.num_blocks)
        qs, bs = slice(j0 * B, j1 * B), slice(C + j0 * B, C + j1 * B)
        # a superset under a window (its lower bound is left to the mask): the window narrows, never widens
        ks = torch.nonzero(visible_context_bound(layout, j0, j1)).squeeze(1)
        mask_qc = _context_mask(q_seq[qs], q_anchor[qs], q_pos[qs], layout.ctx_seq_C[ks], layout.ctx_pos_C[ks],
                                attn)
        outs.append(_chunk_attention(q_hQd[:, qs], k_hKd[:, ks], v_hKd[:, ks], k_hKd[:, bs], v_hKd[:, bs],
                                     mask_qc, B, mask_BB))
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


def layout_tiles(layout: BlockLayout, *, tile: int = TILE, full_tiles: bool = True,
                 window: int | None = None) -> dict[str, torch.Tensor]:
    """Which key tiles every query tile must visit, derived from the layout's structure: O(Q + tiles^2)
    index arithmetic, no sync, instead of evaluating the predicate on all Q x K pairs (create_block_mask
    does that, and with ~10 short sequences' blocks per batch Q x K reaches 10^10 pairs per step).

    Requires what packed_layout and the evaluator build: sequence ids 0..N-1, each sequence's context one
    contiguous run of indices holding consecutive positions. A block sees its sequence's run up to its anchor
    (exclusive) and its own B keys. Per query tile the visited key tiles are (a) the hull of its
    rows' context ranges and (b) the hull of its blocks' own keys: a superset of the true tiles (the mask_mod
    masks the rest). "full" tiles, where every pair is visible and the kernel skips the mask_mod, are
    context tiles lying wholly inside every row's range, in tiles whose rows are all real and of one sequence.

    full_tiles=False lists every visited tile as partial (a sliding-window layer: its window may cut into a
    context tile the full-attention rule finds wholly visible). window W: a block's context range starts at
    position a - (W-1) (what its slot 0 sees; later slots see less), so far context tiles are skipped.

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
    if window is not None:
        lo_J = lo_J + (layout.anchor_J - (window - 1) - first_pos_S[layout.block_seq_J]).clamp(min=0)
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
    has_full_t = one_seq_t & all_ctx_t & (f1 > f0) & full_tiles
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


def layout_mask_mod(layout: BlockLayout, attn: LayerAttention = FULL):
    """block_attention_mask as a flex-attention mask_mod on (query, key) indices of `layout`."""
    q_seq, q_anchor, q_block = layout.query_meta()
    kv_seq, kv_pos, kv_block = layout.key_meta()
    q_pos = layout.q_pos_Q
    Q, K = q_seq.shape[0], kv_seq.shape[0]

    def mask_mod(b, h, q_idx, kv_idx):
        # Tiles straddling the end may be evaluated past Q/K and then discarded: keep the lookups in bounds.
        qi, ki = q_idx.clamp(max=Q - 1), kv_idx.clamp(max=K - 1)
        return block_attention_mask(q_seq=q_seq[qi], q_anchor=q_anchor[qi], q_block=q_block[qi], q_pos=q_pos[qi],
                                    kv_seq=kv_seq[ki], kv_pos=kv_pos[ki], kv_block=kv_block[ki], attn=attn)

    return mask_mod


def flex_block_mask(layout: BlockLayout, *, tile: int = TILE, attn: LayerAttention = FULL):
    """A flex-attention BlockMask for `layout`: tile lists from layout_tiles, layout_mask_mod on partial tiles.
    A causal layer keeps the full context tiles (it narrows only the own-block keys, never in a full tile); a
    windowed one has none."""
    from torch.nn.attention.flex_attention import BlockMask

    Q = layout.num_blocks * layout.block_size
    tiles = layout_tiles(layout, tile=tile, full_tiles=attn.window is None, window=attn.window)
    return BlockMask.from_kv_blocks(**tiles, BLOCK_SIZE=tile, mask_mod=layout_mask_mod(layout, attn),
                                    seq_lengths=(Q, layout.num_ctx + Q))


SMALL_HEAD_FORWARD_TILES = {"BLOCK_M": 64, "BLOCK_N": 64}
"""Flex attention's forward tiles for heads of <= 64 dims on CUDA. Inductor's H100/H200 default for bf16 at
head_dim 64 is 128 x 128 with 4 warps; on the drafter's block layout (a SmolLM2 step: 104K block queries over
119K keys) 64 x 64 ran the forward 2.9x faster (5.48 -> 1.88 ms a layer, forward + backward 11.1 -> 7.5 ms) with
the same output, measured on the H200 (benchmarks/bench_flex_tiles.py, results/flex_tiles_h200.json); in the
SmolLM2 training step flex attention went from 59.4 to 39.7 ms (results/smollm2_step_tiles_h200.json). At
head_dim 256, 64 x 64 needs more shared memory than the H200 has and max-autotune picks the default's speed
(results/flex_tiles_hd256_h200.json). At the 27B drafter's 128-dim heads inductor's default runs at 209 TFLOP/s
forward, 142 forward + backward, max-autotune picks the same speed and the backward tiles tried are 1.7-2x slower
(results/flex_tiles_27b_h200.json). Heads above 64 dims keep inductor's choice."""


def flex_kernel_options(head_dim: int, device_type: str) -> dict | None:
    """kernel_options for flex_attention at this head size on this device type (None: inductor's default)."""
    return dict(SMALL_HEAD_FORWARD_TILES) if device_type == "cuda" and head_dim <= 64 else None


def flex_expands_kv(head_dim: int, device_type: str, *, backward: bool) -> bool:
    """Whether flex_block_attention repeats K and V to the query heads instead of using flex's GQA: on CUDA, at
    heads of more than 64 dims, when a backward will run.

    Why: flex's backward runs one dK/dV program per (key tile, KV head), each looping over its group's query heads,
    and on the block layout the few context tiles carry nearly all that work, so too few programs share the GPU.
    Per query head there are group-size times more. At the 27B drafter's heads (32 / 8 of 128 dims) forward +
    backward took 6.35 against 8.20 ms with the repeat and its backward's sum included, the forward alone 1.77
    against 1.47 ms, on an H100 (results/flex_tiles_expand_kv_h200.json); hence not for forward-only calls. Same
    outputs; the K/V gradients differ by bf16 rounding (the repeat's backward sums the heads in bf16). At 64-dim
    heads (SmolLM2's, with other forward tiles) it measured neutral, so those keep GQA. Cost: the K and V saved for
    the backward are group-size times larger (at the 27B drafter's 4,096-token micro-batches ~1.6 GB more over its
    5 layers)."""
    return backward and device_type == "cuda" and head_dim > 64


def flex_block_attention(q_hQd: torch.Tensor, k_hKd: torch.Tensor, v_hKd: torch.Tensor,
                         block_mask, *, compiled: bool = True) -> torch.Tensor:
    """Flex attention with a prebuilt BlockMask (build it once per forward, share across layers)."""
    if compiled:
        fn = _compiled_fn("flex_attention")
    else:
        from torch.nn.attention.flex_attention import flex_attention as fn
    group = q_hQd.shape[0] // k_hKd.shape[0]
    backward = torch.is_grad_enabled() and any(x.requires_grad for x in (q_hQd, k_hKd, v_hKd))
    expand = group > 1 and flex_expands_kv(q_hQd.shape[-1], q_hQd.device.type, backward=backward)
    if expand:
        k_hKd, v_hKd = k_hKd.repeat_interleave(group, dim=0), v_hKd.repeat_interleave(group, dim=0)
    return fn(q_hQd[None], k_hKd[None], v_hKd[None], block_mask=block_mask, enable_gqa=not expand,
              kernel_options=flex_kernel_options(q_hQd.shape[-1], q_hQd.device.type))[0]


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
