"""The dense (CPU) block-attention path: equal to SDPA over the whole boolean mask, forward and backward, and each
query chunk attends only to the context its own sequences can see (not to the whole packed batch)."""

import pytest
import torch
import torch.nn.functional as F

from dflash.drafter import attention
from dflash.drafter.attention import dense_block_attention, dense_mask
from dflash.train.objective import packed_layout

B = 4
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def packed_batch(seed=0, lengths=(37, 12, 50, 5, 23, 41)):
    """Several sequences packed together, random anchors (at most 9 per sequence), q/k/v of the right shapes."""
    g = torch.Generator().manual_seed(seed)
    anchors = []
    for n in lengths:
        a = torch.randperm(n - 1, generator=g)[:min(9, n - 1)]
        anchors.append(torch.sort(a)[0])
    lay = packed_layout(lengths=list(lengths), anchors=anchors, block_size=B)
    Q, K = lay.num_blocks * B, lay.num_ctx + lay.num_blocks * B
    q = torch.randn(HEADS, Q, HEAD_DIM, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(KV_HEADS, K, HEAD_DIM, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(KV_HEADS, K, HEAD_DIM, generator=g, dtype=torch.float64, requires_grad=True)
    return lay, q, k, v


def whole_mask_attention(q, k, v, lay):
    """The reference: one SDPA call over every query and key with the full [Q, K] mask."""
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=dense_mask(lay), enable_gqa=True)[0]


@pytest.mark.parametrize("chunk_tokens", [B, 3 * B, 10 * B, 4096])
def test_dense_path_equals_whole_mask_forward_and_backward(chunk_tokens):
    lay, q, k, v = packed_batch()
    ref = whole_mask_attention(q, k, v, lay)
    grads_ref = torch.autograd.grad((ref.sin() * ref).sum(), (q, k, v))
    out = dense_block_attention(q, k, v, lay, chunk_tokens=chunk_tokens)
    grads = torch.autograd.grad((out.sin() * out).sum(), (q, k, v))
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-12)


def test_each_chunk_attends_only_to_the_context_its_sequences_see(monkeypatch):
    """O(Q x C_seq), not O(Q x C_batch): the context keys a chunk's attention gets are exactly the context
    columns its rows can see (own sequences, below their anchors), and each block gets its own B keys only."""
    lay, q, k, v = packed_batch(seed=1)
    chunk_tokens = 3 * B
    seen = []
    real = attention._chunk_attention

    def recording(q_hqd, kc_gcd, vc_gcd, kb_gqd, vb_gqd, mask_qc, block_size, *rest):
        seen.append((q_hqd.shape[1], kc_gcd.shape[1], kb_gqd.shape[1]))
        return real(q_hqd, kc_gcd, vc_gcd, kb_gqd, vb_gqd, mask_qc, block_size, *rest)

    monkeypatch.setattr(attention, "_chunk_attention", recording)
    with torch.no_grad():
        dense_block_attention(q, k, v, lay, chunk_tokens=chunk_tokens)
    mask_QK = dense_mask(lay)
    C = lay.num_ctx
    expected = []
    for j0 in range(0, lay.num_blocks, chunk_tokens // B):
        rows = mask_QK[j0 * B:(j0 + chunk_tokens // B) * B]
        visible_C = rows[:, :C].any(0)
        j1 = min(j0 + chunk_tokens // B, lay.num_blocks)
        assert torch.equal(attention.visible_context_bound(lay, j0, j1), visible_C)
        expected.append((rows.shape[0], int(visible_C.sum()), rows.shape[0]))
    assert seen == expected
    assert max(c for _, c, _ in seen) < C // 2   # the batch's whole context is C keys per chunk


def test_blocks_without_any_context():
    """tau.py's first anchor chunk may start at position 0: a layout with no context keys at all."""
    from dflash.drafter.attention import BlockLayout

    lay = BlockLayout(ctx_seq_C=torch.zeros(0, dtype=torch.long), ctx_pos_C=torch.zeros(0, dtype=torch.long),
                      block_seq_J=torch.zeros(1, dtype=torch.long), anchor_J=torch.zeros(1, dtype=torch.long),
                      block_size=B)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(HEADS, B, HEAD_DIM, generator=g, dtype=torch.float64)
    k = torch.randn(KV_HEADS, B, HEAD_DIM, generator=g, dtype=torch.float64)
    v = torch.randn(KV_HEADS, B, HEAD_DIM, generator=g, dtype=torch.float64)
    torch.testing.assert_close(dense_block_attention(q, k, v, lay), whole_mask_attention(q, k, v, lay),
                               rtol=1e-12, atol=1e-12)
