"""Anchors, blocks, labels, loss weights and the chunked CE of dflash.train.objective (method doc 2)."""

import math

import pytest
import torch
import torch.nn.functional as F

from dflash.errors import ConfigError
from dflash.train.objective import (IGNORE_INDEX, block_attention_mask, build_blocks, build_packed_blocks,
                                    chunked_ce_loss,
                                    decay_weights, default_gamma, dense_mask, expected_blocks, packed_layout,
                                    packed_layout_flat, per_sample_mean_weights, resolve_gamma, sample_anchors,
                                    supervised_slots, visible_keys)

PAPER_DECAY_GAMMA7 = [1.000, 0.867, 0.751, 0.651, 0.565, 0.490, 0.424, 0.368, 0.319, 0.276, 0.240, 0.208,
                      0.180, 0.156, 0.135]


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def valid_positions(mask):
    return {a for a in range(len(mask) - 1) if mask[a] and mask[a + 1]}


# ---------------------------------------------------------------------------------------------- anchors

def test_anchors_only_valid_sorted_unique_and_capped():
    # prompt 0..19, response 20..299, a hole (e.g. a user turn) at 100..109
    mask = torch.zeros(300, dtype=torch.uint8)
    mask[20:300] = 1
    mask[100:110] = 0
    valid = valid_positions(mask.tolist())
    a = sample_anchors(mask, num_anchors=64, generator=gen())
    assert a.dtype == torch.int64 and a.shape == (64,)
    assert set(a.tolist()) <= valid
    assert len(set(a.tolist())) == 64
    assert torch.equal(a, a.sort().values)
    assert 99 not in a.tolist() and 299 not in a.tolist()   # a+1 unsupervised / a = S-1


def test_anchors_take_every_valid_position_when_response_is_short():
    mask = torch.tensor([0, 0, 0, 1, 1, 1, 1, 0, 1, 1])
    a = sample_anchors(mask, num_anchors=512, generator=gen())
    assert a.tolist() == [3, 4, 5, 8]   # 6 is excluded (7 unsupervised), 9 has no a+1


def test_anchors_reach_the_end_of_the_sequence():
    mask = torch.ones(40, dtype=torch.bool)
    a = sample_anchors(mask, num_anchors=39, generator=gen())
    assert a.tolist() == list(range(39))   # includes S-2 = 38
    hits = set()
    for seed in range(200):
        hits.update(sample_anchors(mask, num_anchors=4, generator=gen(seed)).tolist())
    assert 38 in hits and 37 in hits


def test_full_block_anchors_keep_every_block_inside_the_sequence():
    # response 3..39 of a 40-token sequence, B = 16: a <= S - B = 24, else as without the bound
    mask = torch.zeros(40, dtype=torch.bool)
    mask[3:] = True
    a = sample_anchors(mask, num_anchors=512, generator=gen(), full_block=16)
    assert a.tolist() == list(range(3, 25))
    # a hole excludes its own position and the one before it, as without the bound; the count is capped alike
    mask[10] = False
    a = sample_anchors(mask, num_anchors=512, generator=gen(), full_block=16)
    assert a.tolist() == [3, 4, 5, 6, 7, 8, *range(11, 25)]   # 9: a + 1 unsupervised; 10 itself
    capped = sample_anchors(mask, num_anchors=5, generator=gen(3), full_block=16)
    assert capped.numel() == 5 and set(capped.tolist()) <= set(a.tolist())
    # B = 2 adds nothing to a <= S - 2; a sequence shorter than a block has no anchor
    assert torch.equal(sample_anchors(mask, num_anchors=512, generator=gen(), full_block=2),
                       sample_anchors(mask, num_anchors=512, generator=gen()))
    assert sample_anchors(torch.ones(10, dtype=torch.bool), generator=gen(), full_block=16).numel() == 0
    assert sample_anchors(torch.ones(16, dtype=torch.bool), generator=gen(), full_block=16).tolist() == [0]


def test_anchors_none_valid_and_single_token():
    assert sample_anchors(torch.tensor([1, 0, 1, 0]), generator=gen()).numel() == 0
    assert sample_anchors(torch.tensor([1]), generator=gen()).numel() == 0


def test_anchors_deterministic_per_generator_and_uniform():
    mask = torch.ones(200, dtype=torch.bool)
    a1 = sample_anchors(mask, num_anchors=16, generator=gen(7))
    a2 = sample_anchors(mask, num_anchors=16, generator=gen(7))
    a3 = sample_anchors(mask, num_anchors=16, generator=gen(8))
    assert torch.equal(a1, a2) and not torch.equal(a1, a3)
    counts = torch.zeros(199)
    g = gen(1)
    for _ in range(300):
        counts[sample_anchors(mask, num_anchors=20, generator=g)] += 1
    # expected 300*20/199 ~ 30 per position; uniform draws stay well inside [10, 55]
    assert counts.min() >= 10 and counts.max() <= 55


def test_anchors_reject_bad_count():
    with pytest.raises(ConfigError, match="num_anchors"):
        sample_anchors(torch.ones(5), num_anchors=0, generator=gen())


# ----------------------------------------------------------------------------------------------- blocks

def test_decay_weights_match_the_paper():
    w = decay_weights(block_size=16, gamma=7.0)
    assert w.shape == (16,) and w[0] == 0
    assert [round(x, 3) for x in w[1:].tolist()] == PAPER_DECAY_GAMMA7
    assert default_gamma(16) == 7 and default_gamma(10) == 5 and default_gamma(8) == 4
    with pytest.raises(ConfigError, match="gamma"):
        decay_weights(block_size=16, gamma=0)


def test_build_blocks_inputs_positions_labels_weights():
    S, B, MASK = 12, 4, 99
    ids = torch.arange(100, 100 + S)
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1])
    anchors = torch.tensor([2, 3, 9, 10])
    blk = build_blocks(ids, mask, anchors, block_size=B, mask_token_id=MASK, gamma=7.0)
    assert blk.block_ids_JB.tolist() == [[102, 99, 99, 99], [103, 99, 99, 99], [109, 99, 99, 99],
                                         [110, 99, 99, 99]]
    assert blk.positions_JB.tolist() == [[2, 3, 4, 5], [3, 4, 5, 6], [9, 10, 11, 12], [10, 11, 12, 13]]
    # no shift: slot k is labelled with the token at its own position a+k
    assert blk.labels_JB.tolist() == [[102, 103, 104, 105], [103, 104, 105, 106],
                                      [109, 110, 111, IGNORE_INDEX], [110, 111, IGNORE_INDEX, IGNORE_INDEX]]
    d = [0.0] + [math.exp(-(k - 1) / 7) for k in range(1, B)]
    expected = [[0, d[1], d[2], 0],          # position 5 is not a response token
                [0, d[1], 0, d[3]],          # slot 2 -> position 5 unsupervised, slot 3 -> 6 supervised
                [0, d[1], d[2], 0],          # position 12 is past the end
                [0, d[1], 0, 0]]
    assert torch.allclose(blk.weights_JB, torch.tensor(expected), atol=1e-6)
    assert (blk.weights_JB[:, 0] == 0).all()   # slot 0 (the given anchor) is never supervised


def test_build_blocks_default_gamma_is_the_papers():
    ids, mask = torch.arange(40), torch.ones(40)
    blk = build_blocks(ids, mask, torch.tensor([0]), block_size=16, mask_token_id=1)
    assert [round(x, 3) for x in blk.weights_JB[0, 1:].tolist()] == PAPER_DECAY_GAMMA7


def test_build_packed_blocks_equals_each_sequence_alone():
    """One pass over a packed batch == build_blocks per sequence, concatenated: offsets, per-sequence ends
    (a block running past its own sequence must not read the next one) and sequences without anchors."""
    g = torch.Generator().manual_seed(4)
    lengths = [7, 3, 12, 5, 9]
    T = sum(lengths)
    ids, mask = torch.randint(0, 500, (T,), generator=g), (torch.rand(T, generator=g) > 0.3).float()
    anchors = [torch.tensor([0, 4, 6]), torch.tensor([], dtype=torch.long), torch.tensor([1, 10, 11]),
               torch.tensor([3]), torch.tensor([0, 2, 5, 8])]
    packed = build_packed_blocks(ids, mask, torch.cat(anchors), lengths=lengths,
                                 blocks_per_sample=[a.numel() for a in anchors], block_size=4, mask_token_id=99)
    alone, off = [], 0
    for n, a in zip(lengths, anchors):
        alone.append(build_blocks(ids[off:off + n], mask[off:off + n], a, block_size=4, mask_token_id=99))
        off += n
    for f in ("block_ids_JB", "positions_JB", "labels_JB", "weights_JB"):
        assert torch.equal(getattr(packed, f), torch.cat([getattr(b, f) for b in alone])), f
    # the block at anchor 6 of the 7-token first sequence: slots 1..3 are past its end, not the next sequence
    assert packed.labels_JB[2].tolist() == [int(ids[6]), IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]


def _packed_case(seed=4):
    g = torch.Generator().manual_seed(seed)
    lengths = [7, 3, 12, 5, 9]
    T = sum(lengths)
    ids, mask = torch.randint(0, 40, (T,), generator=g), (torch.rand(T, generator=g) > 0.3).float()
    mask[sum(lengths[:3]):sum(lengths[:4])] = 0   # sample 3 has an anchor but nothing supervised
    anchors = [torch.tensor([0, 4, 6]), torch.tensor([], dtype=torch.long), torch.tensor([1, 2, 10, 11]),
               torch.tensor([3]), torch.tensor([0, 2, 5])]
    counts = [a.numel() for a in anchors]
    blk = build_packed_blocks(ids, mask, torch.cat(anchors), lengths=lengths, blocks_per_sample=counts,
                              block_size=4, mask_token_id=39)
    return blk, counts


def test_per_sample_mean_weights_sum_to_one_per_supervised_sample():
    """Each supervised sample's weights sum to 1 with their ratios kept (the decay and the masks); a sample
    with nothing supervised keeps 0s, and one without anchors has no rows."""
    blk, counts = _packed_case()
    w = per_sample_mean_weights(blk.weights_JB, counts)
    off = 0
    for n in counts:
        raw, new = blk.weights_JB[off:off + n], w[off:off + n]
        if raw.sum() > 0:
            assert torch.isclose(new.sum(), torch.tensor(1.0))
            assert torch.allclose(new, raw / raw.sum())
        else:
            assert n == 0 or torch.equal(new, torch.zeros_like(raw))
        off += n
    assert torch.isclose(w.sum(), torch.tensor(3.0))   # three supervised samples: the step's weight sum counts them
    with pytest.raises(ValueError, match="blocks_per_sample sums to 10"):
        per_sample_mean_weights(blk.weights_JB, [3, 0, 4, 1, 2])


def test_sequence_normalised_loss_is_the_mean_of_each_samples_loss():
    """The CE over the packed batch with per_sample_mean_weights == the mean over supervised samples of each
    sample's own weighted-mean CE (SpecForge: one sequence per micro-batch, loss / accumulation steps): value and
    gradient."""
    blk, counts = _packed_case(seed=7)
    g = gen(1)
    rows = blk.labels_JB.numel()
    hidden = torch.randn(rows, 16, generator=g, dtype=torch.float64, requires_grad=True)
    head = torch.randn(40, 16, generator=g, dtype=torch.float64)
    labels = blk.labels_JB.reshape(-1)
    w = per_sample_mean_weights(blk.weights_JB, counts).reshape(-1)
    out = chunked_ce_loss(hidden, head, labels, w, chunk=5, block_size=4)
    per_sample, off = [], 0
    for n in counts:
        sl = slice(off * 4, (off + n) * 4)
        raw = blk.weights_JB.reshape(-1)[sl].double()
        if raw.sum() > 0:
            ce = F.cross_entropy(hidden[sl] @ head.T, labels[sl].clamp(min=0), reduction="none")
            per_sample.append((ce * raw).sum() / raw.sum())
        off += n
    ref = torch.stack(per_sample).mean()
    assert torch.allclose(out.loss.double(), ref, atol=1e-6)
    g_out, = torch.autograd.grad(out.loss, hidden)
    g_ref, = torch.autograd.grad(ref, hidden)
    assert torch.allclose(g_out, g_ref, atol=1e-7)


def test_packed_layout_flat_equals_packed_layout():
    anchors = [torch.tensor([1, 3]), torch.tensor([], dtype=torch.long), torch.tensor([2])]
    a = packed_layout(lengths=[5, 2, 4], anchors=anchors, block_size=2)
    b = packed_layout_flat(lengths=[5, 2, 4], anchors_J=torch.cat(anchors), blocks_per_sample=[2, 0, 1], block_size=2)
    for f in ("ctx_seq_C", "ctx_pos_C", "block_seq_J", "anchor_J"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert a.block_seq_J.tolist() == [0, 0, 2]


# ------------------------------------------------------------------------------------------------- mask

def test_block_attention_mask_semantics():
    # seq 0 of length 5, seq 1 of length 4; blocks: seq0@1, seq0@3, seq1@2 (B=2)
    lay = packed_layout(lengths=[5, 4], anchors=[torch.tensor([1, 3]), torch.tensor([2])], block_size=2)
    m = dense_mask(lay)
    C = 9
    assert m.shape == (6, C + 6)
    ctx = m[:, :C].int().tolist()
    assert ctx[0] == ctx[1] == [1, 0, 0, 0, 0, 0, 0, 0, 0]      # positions < 1 of seq 0 only
    assert ctx[2] == ctx[3] == [1, 1, 1, 0, 0, 0, 0, 0, 0]      # strictly before anchor 3
    assert ctx[4] == ctx[5] == [0, 0, 0, 0, 0, 1, 1, 0, 0]      # seq 1 positions 0,1
    blocks = m[:, C:].int().tolist()
    assert blocks == [[1, 1, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0],
                      [0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 1, 1]]     # bidirectional in-block, no cross-block
    # the predicate is elementwise on scalars too (how flex attention's mask_mod calls it)
    t = torch.tensor
    assert block_attention_mask(q_seq=t(0), q_anchor=t(3), q_block=t(1), kv_seq=t(0), kv_pos=t(2),
                                kv_block=t(-1)).item()
    assert not block_attention_mask(q_seq=t(0), q_anchor=t(3), q_block=t(1), kv_seq=t(0), kv_pos=t(3),
                                    kv_block=t(-1)).item()


def test_host_counts_are_the_rules_of_the_blocks_and_the_mask():
    """supervised_slots = build_blocks' weights > 0; visible_keys = the dense mask's True entries of the block
    rows; expected_blocks = sample_anchors' count for one response span."""
    g = gen(3)
    S, B = 40, 5
    ids = torch.randint(0, 50, (S,), generator=g)
    mask = torch.ones(S, dtype=torch.bool)
    mask[:7] = False
    mask[20:23] = False
    anchors = sample_anchors(mask, num_anchors=9, generator=g)
    blk = build_blocks(ids, mask, anchors, block_size=B, mask_token_id=1)
    assert supervised_slots(mask.numpy(), anchors.numpy(), block_size=B) == int((blk.weights_JB > 0).sum()) > 0
    m = dense_mask(packed_layout(lengths=[S], anchors=[anchors], block_size=B))
    assert visible_keys(anchors.numpy(), block_size=B) == int(m.sum())
    one_span = torch.zeros(S, dtype=torch.bool)
    one_span[10:30] = True
    for n in (5, 19, 100):
        a = sample_anchors(one_span, num_anchors=n, generator=gen(0))
        assert expected_blocks(one_span.sum().numpy(), num_anchors=n) == len(a)
    assert resolve_gamma(None, block_size=16) == default_gamma(16) == 7.0 and resolve_gamma(2.5, block_size=16) == 2.5


# --------------------------------------------------------------------------------------------------- CE

def _ce_case(seed=0, J=6, B=4, H=16, V=40):
    g = gen(seed)
    hidden = torch.randn(J * B, H, generator=g, dtype=torch.float64, requires_grad=True)
    head = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (J * B,), generator=g)
    labels[-1] = IGNORE_INDEX
    weights = torch.rand(J * B, generator=g, dtype=torch.float64).float()
    weights[::B] = 0
    weights[-1] = 0
    return hidden, head, labels, weights, B


def test_chunked_ce_equals_unchunked_value_and_gradient():
    hidden, head, labels, weights, B = _ce_case()
    safe = labels.clamp(min=0)
    ref_ce = F.cross_entropy(hidden @ head.T, safe, reduction="none")
    ref = (ref_ce * weights).sum() / weights.sum()
    ref_grad, = torch.autograd.grad(ref, hidden)
    for chunk in (1, 5, 8, 1000):
        out = chunked_ce_loss(hidden, head, labels, weights, chunk=chunk, block_size=B)
        grad, = torch.autograd.grad(out.loss, hidden)
        assert torch.allclose(out.loss.double(), ref, atol=1e-6), chunk
        assert torch.allclose(grad, ref_grad, atol=1e-7), chunk
        assert torch.allclose(out.weight_sum, weights.sum())


def test_chunked_ce_head_gradient_when_head_is_trainable():
    hidden, head, labels, weights, B = _ce_case(seed=3)
    head.requires_grad_(True)
    ref = (F.cross_entropy(hidden @ head.T, labels.clamp(min=0), reduction="none") * weights).sum() / weights.sum()
    g_ref, = torch.autograd.grad(ref, head)
    g, = torch.autograd.grad(chunked_ce_loss(hidden, head, labels, weights, chunk=7, block_size=B).loss, head)
    assert torch.allclose(g, g_ref, atol=1e-7)


def test_accuracy_and_accept_length():
    B, V = 4, 5
    # one-hot hidden + identity head: argmax = the hot index
    pred = torch.tensor([[0, 1, 2, 3],     # all of slots 1..3 correct -> accept 1+3
                         [0, 1, 0, 3],     # slot 2 wrong -> accept 1+1
                         [0, 0, 2, 3],     # slot 1 wrong -> accept 1
                         [0, 1, 2, 0]])    # slot 3 unsupervised (weight 0): chain neither breaks nor grows
    labels = torch.tensor([[0, 1, 2, 3]] * 4)
    weights = torch.ones(4, B)
    weights[:, 0] = 0
    weights[3, 3] = 0
    hidden = F.one_hot(pred.flatten(), V).float()
    out = chunked_ce_loss(hidden, torch.eye(V), labels.flatten(), weights.flatten(), chunk=3, block_size=B)
    assert out.count_B.tolist() == [0, 4, 4, 3]
    assert out.correct_B.tolist() == [0, 3, 3, 3]
    assert out.accept_len_sum.item() == 4 + 2 + 1 + 3
    assert out.accept_len.item() == pytest.approx(10 / 4)
    assert out.num_blocks.item() == 4


def test_ce_with_nothing_supervised_is_zero_not_nan():
    hidden = torch.randn(8, 4, requires_grad=True)
    out = chunked_ce_loss(hidden, torch.randn(6, 4), torch.zeros(8, dtype=torch.long), torch.zeros(8),
                          chunk=3, block_size=4)
    assert out.loss.item() == 0.0
    out.loss.backward()
    assert torch.isfinite(hidden.grad).all()
