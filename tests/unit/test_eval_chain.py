"""The accept-chain walk (pure), the response span, and per-anchor accept lengths of the masked chunked forward."""

import numpy as np
import pytest
import torch
from torch import nn

from dflash.drafter.config import DrafterConfig
from dflash.drafter.model import DFlashDrafter
from dflash.eval.evaluate import chain_stats
from dflash.eval.tau import (accept_lengths, draft_argmax, leading_matches, response_span, sequence_steps,
                             walk_accept_chain)


# ------------------------------------------------------------------------------------------ the pure walk

def test_walk_pinned_example():
    # L by position (start 5, end 20): the chain visits 5, 8, 9, 13, 15 and stops at 19 = end-1.
    L = np.zeros(20, dtype=np.int64)
    L[[5, 8, 9, 13, 15]] = [2, 0, 3, 1, 3]
    L[[6, 7, 10, 11, 12, 14, 16, 17, 18]] = 7  # never visited: must not matter
    assert walk_accept_chain(L, 5, 20) == [3, 1, 4, 2, 4]


def test_walk_clamps_at_end_and_counts_every_response_token():
    # every anchor accepts 15: the last step is clamped to the tokens left, so sum(steps) = end-1-start + 1
    L = np.full(40, 15)
    steps = walk_accept_chain(L, 10, 40)
    assert steps == [16, 14]
    assert walk_accept_chain(np.zeros(40, dtype=int), 10, 40) == [1] * 29
    assert walk_accept_chain(L, 10, 11) == []       # a 1-token response: the prefill bonus only
    with pytest.raises(ValueError):
        walk_accept_chain(L, 5, 5)


def test_chain_stats_keys_each_sequence_tau_by_its_sample_id():
    # three packed sequences, sample ids 7, 3, 9; the middle one's response is 1 token (no step, no id)
    lengths = np.array([20, 12, 40])
    spans = np.array([[5, 20], [10, 11], [10, 40]])
    L = np.concatenate([np.zeros(20, dtype=np.int64), np.zeros(12, dtype=np.int64), np.full(40, 15)])
    L[[5, 8, 9, 13, 15]] = [2, 0, 3, 1, 3]
    overall, per_source = chain_stats(L, lengths=lengths, spans=spans, names=["a", "b", "a"], block_size=16,
                                      sample_ids=np.array([7, 3, 9]))
    assert overall.sequence_ids == [7, 9]
    assert overall.per_sequence_tau == [float(np.mean([3, 1, 4, 2, 4])), 15.0]
    assert [(s.name, s.sequence_ids) for s in per_source] == [("a", [7, 9]), ("b", [])]
    default, _ = chain_stats(L, lengths=lengths, spans=spans, names=["a", "b", "a"], block_size=16)
    assert default.sequence_ids == [0, 2]


@pytest.mark.parametrize("seed", range(5))
def test_walk_covers_the_response_exactly(seed):
    rng = np.random.default_rng(seed)
    start, end = int(rng.integers(0, 30)), int(rng.integers(31, 200))
    L = rng.integers(0, 16, size=end)
    steps = walk_accept_chain(L, start, end)
    # the bonus of every step but the last lands inside the response, the chain ends at end-1 or just past it
    assert end - 1 <= start + sum(steps) <= end
    assert all(1 <= s <= 16 for s in steps)


def test_response_span():
    assert response_span([0, 0, 1, 1, 1, 0, 1]) == (2, 5)
    assert response_span([0, 1, 1]) == (1, 3)
    assert response_span([0, 0]) == (0, 0)


def test_leading_matches_stops_at_first_mismatch_and_at_padding():
    d = torch.tensor([[1, 2, 3, 4], [1, 9, 3, 4], [1, 2, 3, 4]])
    r = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, -1, -1]])
    assert leading_matches(d, r).tolist() == [4, 1, 2]


# ----------------------------------------------------- a hand-built predictor with a known mistake pattern

class CopyWithMistakes(nn.Module):
    """Predicts the true token y[p] at every block position p except positions in `mistakes` (predicts
    a wrong id there). With lm_head = identity (V = D) the output row is the one-hot of the prediction."""

    def __init__(self, y: torch.Tensor, mistakes: set[int], *, block_size: int, vocab: int) -> None:
        super().__init__()
        self.cfg = DrafterConfig(hidden_size=vocab, intermediate_size=8, target_layer_ids=(0,), num_target_layers=2,
                                 mask_token_id=vocab - 1, vocab_size=vocab, num_hidden_layers=1,
                                 num_attention_heads=1, num_key_value_heads=1, head_dim=8, block_size=block_size)
        self.y, self.mistakes, self.vocab = y, mistakes, vocab
        self.dummy = nn.Parameter(torch.zeros(1))

    def context(self, hidden_TKD):
        return hidden_TKD[:, 0]

    def forward(self, block_embeds_QD, ctx_TD, *, q_pos, kv_pos, mask=None):
        pred = torch.where(q_pos < len(self.y), self.y[q_pos.clamp(max=len(self.y) - 1)], 0)
        wrong = torch.tensor([int(p) in self.mistakes for p in q_pos.tolist()])
        pred = torch.where(wrong, (pred + 1) % (self.vocab - 1), pred)
        return nn.functional.one_hot(pred, self.vocab).float()


def test_known_predictor_gives_hand_computed_tau():
    V, B, start, end = 50, 4, 5, 20
    y = torch.randint(0, V - 1, (end,), generator=torch.Generator().manual_seed(0))
    dr = CopyWithMistakes(y, {8, 9, 15}, block_size=B, vocab=V)
    eye = torch.eye(V)
    hidden = torch.zeros(end, 1, V)
    L = accept_lengths(dr, embed_VD=eye, lm_head_VD=eye, input_ids_T=y, hidden_TKD=hidden, start=start, end=end,
                       mask_token_id=V - 1, chunk_anchors=3)
    # L(a) = error-free positions among a+1..min(a+B-1, end-1)
    assert L[5:19].tolist() == [2, 1, 0, 0, 3, 3, 3, 2, 1, 0, 3, 3, 2, 1]
    steps = walk_accept_chain(L, start, end)
    assert steps == [3, 1, 4, 2, 4]              # positions 5 -> 8 -> 9 -> 13 -> 15 -> 19
    assert np.mean(steps) == pytest.approx(14 / 5)
    mask = torch.zeros(end + 3, dtype=torch.uint8)
    mask[start:end] = 1                          # trailing non-response tokens must be ignored
    y_long = torch.cat([y, torch.tensor([1, 2, 3])])
    assert sequence_steps(dr, embed_VD=eye, lm_head_VD=eye, input_ids_T=y_long, hidden_TKD=torch.zeros(end + 3, 1, V),
                          loss_mask_T=mask.numpy(), mask_token_id=V - 1, chunk_anchors=256) == steps


# ---------------------------------- masked chunked forward == the method doc's one-anchor-at-a-time reference

def tiny_drafter(seed: int, *, B: int = 4, V: int = 48, D: int = 32) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=D, intermediate_size=48, target_layer_ids=(0, 2), num_target_layers=4,
                        mask_token_id=V - 1, vocab_size=V, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, block_size=B)
    dr = DFlashDrafter(cfg).eval()
    dr.reset_parameters(std=0.3)  # larger weights: predictions depend strongly on context and anchor
    return dr


def block_accept_reference(dr, embed, head, y, feats, a, end):
    """Method doc 6 `block_accept`: one anchor, unmasked attention over exactly ctx[:a] and the block."""
    B = dr.cfg.block_size
    ctx = dr.context(feats[:a])
    block = torch.full((B,), dr.cfg.mask_token_id)
    block[0] = y[a]
    q_pos = a + torch.arange(B)
    out = dr(embed[block], ctx, q_pos=q_pos, kv_pos=torch.cat([torch.arange(a), q_pos]), mask=None)
    d = draft_argmax(out[1:], head)
    ref = y[a + 1: min(a + B, end)]
    m = (d[: len(ref)] == ref).long().cumprod(0)
    return int(m.sum())


@torch.no_grad()
def test_masked_chunks_equal_per_anchor_reference():
    dr = tiny_drafter(0)
    V, B, D, T = 48, 4, 32, 40
    g = torch.Generator().manual_seed(1)
    embed, head = torch.randn(V, D, generator=g), torch.randn(V, D, generator=g)
    feats = torch.randn(T, 2, D, generator=g)
    start, end = 6, T
    # Build y so that drafts are often right: y[a+1] = the drafter's own first draft at a, except every 5th.
    y = torch.randint(0, V - 1, (T,), generator=g)
    for a in range(start, end - 1):
        ctx = dr.context(feats[:a])
        block = torch.full((B,), V - 1)
        block[0] = y[a]
        q_pos = a + torch.arange(B)
        out = dr(embed[block], ctx, q_pos=q_pos, kv_pos=torch.cat([torch.arange(a), q_pos]), mask=None)
        if a % 5:
            y[a + 1] = draft_argmax(out[1:2], head)[0]
    ref = [block_accept_reference(dr, embed, head, y, feats, a, end) for a in range(start, end - 1)]
    assert sum(ref) > 10, "the construction should give nonzero accept lengths"
    for chunk in (1, 3, 256):
        L = accept_lengths(dr, embed_VD=embed, lm_head_VD=head, input_ids_T=y, hidden_TKD=feats, start=start,
                           end=end, mask_token_id=V - 1, chunk_anchors=chunk)
        assert L[start:end - 1].tolist() == ref
        assert not L[:start].any() and L[end - 1] == 0
