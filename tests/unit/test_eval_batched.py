"""The all-anchor schedule of dflash.eval.batched: plan_chunks covers every anchor once within its budgets, the
chunk index tensors say what the mask rule says, and one chunked forward equals the method doc's per-anchor
reference in both attention backends (dense SDPA, and flex attention, the CUDA path, run eagerly on CPU)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash.drafter.config import DrafterConfig
from dflash.drafter.model import DFlashDrafter
from dflash.eval.batched import AnchorChunk, accept_lengths_chunks, chunk_index, forward_only, plan_chunks
from dflash.eval.tau import draft_argmax


def _anchors_of(chunks):
    """(sequence, anchor) pairs in plan order."""
    return [(c.first_seq + i, a) for c in chunks for i in range(c.num_seqs)
            for a in range(int(c.anchor_lo[i]), int(c.anchor_hi[i]))]


@settings(max_examples=60, deadline=None)
@given(data=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 60)), min_size=1, max_size=12),
       chunk_anchors=st.integers(1, 50), block_size=st.integers(2, 8))
def test_plan_covers_every_anchor_once_within_budgets(data, chunk_anchors, block_size):
    """data: (prompt tokens, response tokens) per sequence; anchors are start..end-2 of each response."""
    lengths = np.array([p + r for p, r in data], dtype=np.int64)
    spans = np.array([[p, p + r] if r else [0, 0] for p, r in data], dtype=np.int64)
    chunks = plan_chunks(lengths=lengths, spans=spans, chunk_anchors=chunk_anchors, block_size=block_size)
    want = [(i, a) for i, (s, e) in enumerate(spans.tolist()) for a in range(s, e - 1)]
    assert _anchors_of(chunks) == want
    for c in chunks:
        assert 1 <= c.num_blocks
        ctx = int(c.ctx_len.sum())
        # budgets hold unless the chunk is a single anchor (always taken)
        assert c.num_blocks == 1 or (c.num_blocks <= chunk_anchors and ctx <= chunk_anchors * block_size)
        rng = slice(c.seqs.start, c.seqs.stop)
        assert (c.lengths == lengths[rng]).all() and (c.ends == spans[rng, 1]).all()
        assert c.anchor_hi[0] > c.anchor_lo[0] and c.anchor_hi[-1] > c.anchor_lo[-1], "no empty sequence at an edge"


def test_plan_pinned_example():
    # two sequences: responses [3, 9) (anchors 3..7) and [2, 4) (anchor 2); 4 blocks per chunk
    chunks = plan_chunks(lengths=np.array([10, 5]), spans=np.array([[3, 9], [2, 4]]), chunk_anchors=4, block_size=4)
    assert [(c.first_seq, c.anchor_lo.tolist(), c.anchor_hi.tolist()) for c in chunks] == [
        (0, [3], [7]), (0, [7, 2], [8, 3])]
    assert chunks[1].ctx_len.tolist() == [7, 2]
    # a sequence without anchors between two others stays in the range with an empty anchor range
    c, = plan_chunks(lengths=np.array([6, 6, 6]), spans=np.array([[2, 6], [3, 4], [1, 3]]), chunk_anchors=64,
                     block_size=4)
    assert (c.first_seq, c.anchor_lo.tolist(), c.anchor_hi.tolist(), c.ctx_len.tolist()) == (
        0, [2, 0, 1], [5, 0, 2], [4, 0, 1])
    with pytest.raises(ValueError, match="chunk_anchors"):
        plan_chunks(lengths=np.array([4]), spans=np.array([[0, 4]]), chunk_anchors=0, block_size=4)


def test_chunk_index_is_the_mask_rule():
    """Context rows: each sequence's positions below its last anchor in the chunk, at its packed offset;
    anchor rows at the sequence's offset; every block's end is its sequence's."""
    c = AnchorChunk(first_seq=5, lengths=np.array([6, 4, 7]), anchor_lo=np.array([3, 0, 2]),
                    anchor_hi=np.array([5, 0, 4]), ends=np.array([6, 4, 7]))
    ix = {k: v.tolist() for k, v in chunk_index(c, device=torch.device("cpu")).items()}
    assert ix["ctx_rows"] == [0, 1, 2, 3, 10, 11, 12]
    assert ix["ctx_seq"] == [0, 0, 0, 0, 2, 2, 2] and ix["ctx_pos"] == [0, 1, 2, 3, 0, 1, 2]
    assert ix["anchor"] == [3, 4, 2, 3] and ix["block_seq"] == [0, 0, 2, 2]
    assert ix["anchor_row"] == [3, 4, 12, 13] and ix["end"] == [6, 6, 7, 7]


def tiny_drafter(seed, *, B=4, V=48, D=32):
    torch.manual_seed(seed)
    # head_dim 16: compiled flex attention (the CUDA path) refuses head dims under 16
    cfg = DrafterConfig(hidden_size=D, intermediate_size=48, target_layer_ids=(0, 2), num_target_layers=4,
                        mask_token_id=V - 1, vocab_size=V, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, block_size=B)
    dr = DFlashDrafter(cfg)
    dr.reset_parameters(std=0.3)
    return dr


@torch.no_grad()
def per_anchor_reference(dr, embed, head, y, feats, a, end):
    """Method doc 6: one block, unmasked attention over exactly ctx[:a] and the block (z-lab's decode step)."""
    B = dr.cfg.block_size
    dev = y.device  # the H200 run of the CUDA case failed here with CPU positions (cuda:0 and cpu)
    block = torch.full((B,), dr.cfg.mask_token_id, device=dev)
    block[0] = y[a]
    q_pos = a + torch.arange(B, device=dev)
    out = dr.eval()(embed[block], dr.context(feats[:a]), q_pos=q_pos,
                    kv_pos=torch.cat([torch.arange(a, device=dev), q_pos]))
    d = draft_argmax(out[1:], head)
    ref = y[a + 1: min(a + B, end)]
    return int((d[: len(ref)] == ref).long().cumprod(0).sum())


def check_packed_chunks(backend, device):
    """Three sequences packed, chunks that split a sequence and join others: L at every anchor equals the
    per-anchor reference (fp32). backend None = forward_only's choice for the device."""
    dr = tiny_drafter(0).to(device)
    V, D = 48, 32
    g = torch.Generator().manual_seed(2)
    embed, head = torch.randn(V, D, generator=g).to(device), torch.randn(V, D, generator=g).to(device)
    lengths = np.array([23, 9, 30])
    spans = np.array([[4, 23], [3, 8], [6, 30]])
    feats = torch.randn(int(lengths.sum()), 2, D, generator=g).to(device)
    y = torch.randint(0, V - 1, (int(lengths.sum()),), generator=g).to(device)
    offs = np.concatenate([[0], np.cumsum(lengths)])
    # make drafts often right: y[a+1] = the drafter's own first draft at a for most anchors
    for i, (s, e) in enumerate(spans.tolist()):
        for a in range(s, e - 1):
            if a % 4:
                ys, fs = y[offs[i]:offs[i + 1]], feats[offs[i]:offs[i + 1]]
                block = torch.full((4,), V - 1, device=device)
                block[0] = ys[a]
                q = a + torch.arange(4, device=device)
                with torch.no_grad():
                    out = dr.eval()(embed[block], dr.context(fs[:a]), q_pos=q,
                                    kv_pos=torch.cat([torch.arange(a, device=device), q]))
                y[offs[i] + a + 1] = draft_argmax(out[1:2], head)[0]
    ref = np.zeros(int(lengths.sum()), dtype=np.int64)
    for i, (s, e) in enumerate(spans.tolist()):
        for a in range(s, e - 1):
            ref[offs[i] + a] = per_anchor_reference(dr, embed, head, y[offs[i]:offs[i + 1]], feats[offs[i]:offs[i + 1]],
                                                    a, e)
    assert ref.sum() > 15, "the construction should give long accepts"
    for chunk_anchors in (5, 4096):
        chunks = plan_chunks(lengths=lengths, spans=spans, chunk_anchors=chunk_anchors, block_size=4)
        assert (len(chunks) > 3) == (chunk_anchors == 5)

        def fetch(c):
            lo, hi = offs[c.first_seq], offs[c.first_seq + c.num_seqs]
            return feats[lo:hi], y[lo:hi]

        dr.train()
        with forward_only(dr):
            if backend is not None:
                dr.attn_backend = backend  # both backends checked on CPU
            L = accept_lengths_chunks(dr, chunks, fetch=fetch, embed_VD=embed, lm_head_VD=head, dtype=torch.float32,
                                      lengths=lengths)
        assert dr.training and dr.attn_backend == "auto", "forward_only restores mode and backend"
        assert L.tolist() == ref.tolist()


@pytest.mark.parametrize("backend", ["dense", "flex"])
def test_packed_chunks_equal_per_anchor_reference(backend):
    """Dense SDPA and flex attention (eager on CPU; forward_only picks compiled flex on CUDA)."""
    check_packed_chunks(backend, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_packed_chunks_equal_per_anchor_reference_on_cuda():
    """The GPU path: forward_only's backend on CUDA (compiled flex attention)."""
    check_packed_chunks(None, torch.device("cuda"))
