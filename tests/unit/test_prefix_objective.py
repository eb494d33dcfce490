"""The variable_prefix objective (dflash.train.prefix, D2SD's VP-Drafter): the truncated geometric prior's exact
probabilities, its draws, which block slots are revealed and supervised with which weights, the host-side draws
of the training step, and the config / CLI / resume rules."""

import dataclasses
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from dflash.errors import ConfigError
from dflash.train.objective import IGNORE_INDEX, build_blocks, build_packed_blocks, supervised_slots
from dflash.train.prefix import prefix_lengths, prefix_probs, prefix_range, sample_prefix_lengths, slot_weights

M = 1  # mask token id of these tests


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_prefix_range_keeps_one_masked_slot_and_skips_the_anchor_only_case():
    assert prefix_range(16) == (2, 15)
    assert prefix_range(4) == (2, 3)
    assert prefix_range(3) == (2, 2)
    assert prefix_range(2) == (1, 1)  # the only length that leaves a masked slot
    with pytest.raises(ConfigError, match="block_size=1"):
        prefix_range(1)


def test_truncated_geometric_probabilities_are_exact():
    # B = 6, base 1/2: l in [2, 5], Pr(l) = 2^-l / (2^-2 + ... + 2^-5) = 8/15, 4/15, 2/15, 1/15
    p = prefix_probs(block_size=6, base=0.5)
    want = [0, 0, Fraction(8, 15), Fraction(4, 15), Fraction(2, 15), Fraction(1, 15)]
    assert p.shape == (6,) and p.dtype == np.float64
    assert p.tolist() == pytest.approx([float(x) for x in want], abs=1e-15)
    # base 1 is uniform over [2, B-1]; base 0.9 at the paper's block 16: ratio 0.9 between neighbours
    assert prefix_probs(block_size=6, base=1.0).tolist() == pytest.approx([0, 0, .25, .25, .25, .25], abs=1e-15)
    p16 = prefix_probs(block_size=16, base=0.9)
    assert p16[:2].tolist() == [0.0, 0.0] and math.isclose(p16.sum(), 1.0, abs_tol=1e-12)
    assert np.allclose(p16[3:] / p16[2:-1], 0.9, rtol=1e-12)
    assert math.isclose(p16[2], 0.1 / (1 - 0.9 ** 14), rel_tol=1e-12)
    # degenerate ranges put all the mass on the one length
    assert prefix_probs(block_size=3, base=0.9).tolist() == [0.0, 0.0, 1.0]
    assert prefix_probs(block_size=2, base=0.9).tolist() == [0.0, 1.0]
    # a huge block does not underflow
    assert math.isclose(prefix_probs(block_size=2000, base=0.5)[2], 0.5, rel_tol=1e-12)
    for bad in (0.0, -1.0):
        with pytest.raises(ConfigError, match="prefix_weight_base"):
            prefix_probs(block_size=6, base=bad)


def test_draws_follow_the_prior_and_the_generator():
    draws = sample_prefix_lengths(40_000, block_size=6, base=0.5, generator=gen(3))
    assert draws.dtype == torch.int64 and draws.shape == (40_000,)
    freq = np.bincount(draws.numpy(), minlength=6) / 40_000
    assert freq[:2].tolist() == [0.0, 0.0]
    assert np.abs(freq - prefix_probs(block_size=6, base=0.5)).max() < 0.01  # ~4 sigma at n = 40K
    assert torch.equal(draws, sample_prefix_lengths(40_000, block_size=6, base=0.5, generator=gen(3)))
    assert sample_prefix_lengths(0, block_size=6, base=0.5, generator=gen()).shape == (0,)
    assert prefix_lengths("dflash", 5, block_size=6, base=0.5, generator=gen()) is None
    with pytest.raises(ConfigError, match="objective='vp'"):
        prefix_lengths("vp", 5, block_size=6, base=0.5, generator=gen())


def test_slot_weights_re_anchor_the_decay_at_the_prefix_end():
    w = slot_weights(torch.tensor([1, 2, 3]), block_size=5, gamma=2.0)
    e = math.exp
    want = [[0, 1, e(-.5), e(-1), e(-1.5)],
            [0, 0, 1, e(-.5), e(-1)],
            [0, 0, 0, 1, e(-.5)]]
    assert w.dtype == torch.float32
    assert torch.allclose(w, torch.tensor(want, dtype=torch.float32))


def test_blocks_reveal_the_prefix_and_supervise_only_the_masked_rest():
    # S = 10, ids 100..109, positions 0-1 are the prompt (no loss)
    ids = torch.arange(100, 110)
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1, 1, 1], dtype=torch.uint8)
    anchors = torch.tensor([2, 5, 7, 8])
    prefix = torch.tensor([2, 3, 3, 3])
    g = 2.0
    blk = build_blocks(ids, mask, anchors, block_size=4, mask_token_id=M, gamma=g, prefix_J=prefix)
    assert blk.block_ids_JB.tolist() == [[102, 103, M, M],
                                         [105, 106, 107, M],
                                         [107, 108, 109, M],
                                         [108, 109, M, M]]  # position 10 is past the end: the mask token
    assert blk.labels_JB.tolist() == [[102, 103, 104, 105],
                                      [105, 106, 107, 108],
                                      [107, 108, 109, IGNORE_INDEX],
                                      [108, 109, IGNORE_INDEX, IGNORE_INDEX]]
    e = math.exp
    assert torch.allclose(blk.weights_JB, torch.tensor([[0, 0, 1, e(-.5)],
                                                        [0, 0, 0, 1],
                                                        [0, 0, 0, 0],     # its only masked slot is past the end
                                                        [0, 0, 0, 0]]))
    assert blk.positions_JB[:, 0].tolist() == anchors.tolist()
    # the host count of supervised slots agrees with the weights
    assert supervised_slots(mask.numpy(), anchors.numpy(), block_size=4, prefix_J=prefix.numpy()) == 3
    # a prompt token under the loss mask is not supervised even past the prefix
    mask2 = mask.clone()
    mask2[4] = 0
    blk2 = build_blocks(ids, mask2, anchors, block_size=4, mask_token_id=M, gamma=g, prefix_J=prefix)
    assert blk2.weights_JB[0].tolist() == [0, 0, 0, pytest.approx(e(-.5))]
    assert supervised_slots(mask2.numpy(), anchors.numpy(), block_size=4, prefix_J=prefix.numpy()) == 2


def test_prefix_one_is_the_paper_objective_bit_for_bit():
    rng = np.random.default_rng(0)
    lengths = [23, 9, 31]
    ids = torch.from_numpy(rng.integers(2, 500, sum(lengths)))
    mask = torch.from_numpy((rng.random(sum(lengths)) < 0.8).astype(np.uint8))
    anchors = torch.cat([torch.tensor([0, 5, 21]), torch.tensor([3, 7]), torch.tensor([1, 2, 29, 30])])
    kw = dict(lengths=lengths, blocks_per_sample=[3, 2, 4], block_size=6, mask_token_id=M, gamma=3.0)
    paper = build_packed_blocks(ids, mask, anchors, **kw)
    ones = build_packed_blocks(ids, mask, anchors, **kw, prefix_J=torch.ones(9, dtype=torch.int64))
    for f in dataclasses.fields(paper):
        assert torch.equal(getattr(paper, f.name), getattr(ones, f.name)), f.name


def test_training_step_draws_prefixes_after_the_same_anchors():
    from dflash.train.step import host_anchors

    class Packed:
        pass

    rng = np.random.default_rng(1)
    p = Packed()
    p.lengths = np.array([30, 7, 50])
    p.sample_ids = np.array([3, 4, 5])
    p.loss_mask = (rng.random(87) < 0.7).astype(np.uint8)
    ids = torch.from_numpy(rng.integers(2, 50, 87))
    base = host_anchors(p, 0, seed=1, num_anchors=8, block_size=6, pin=False)
    vp = host_anchors(p, 0, seed=1, num_anchors=8, block_size=6, pin=False, objective="variable_prefix",
                      prefix_weight_base=0.7)
    assert base.prefix_J is None
    assert torch.equal(vp.anchors_J, base.anchors_J) and vp.blocks_per_sample == base.blocks_per_sample
    assert vp.prefix_J.shape == vp.anchors_J.shape and 2 <= int(vp.prefix_J.min()) and int(vp.prefix_J.max()) <= 5
    again = host_anchors(p, 0, seed=1, num_anchors=8, block_size=6, pin=False, objective="variable_prefix",
                         prefix_weight_base=0.7)
    assert torch.equal(again.prefix_J, vp.prefix_J)
    other_epoch = host_anchors(p, 1, seed=1, num_anchors=8, block_size=6, pin=False, objective="variable_prefix",
                               prefix_weight_base=0.7)
    assert not torch.equal(other_epoch.prefix_J, vp.prefix_J)
    blk = build_packed_blocks(ids, torch.from_numpy(p.loss_mask), vp.anchors_J, lengths=p.lengths.tolist(),
                              blocks_per_sample=vp.blocks_per_sample, block_size=6, mask_token_id=M,
                              prefix_J=vp.prefix_J)
    assert int((blk.weights_JB > 0).sum()) == vp.supervised_tokens > 0
    assert vp.supervised_tokens < base.supervised_tokens  # longer prefixes supervise fewer slots


def test_config_cli_and_resume_rules():
    from cli.main import cli
    from dflash.train.config import TrainConfig, check_resume_compatible

    base = dict(cache="c", model="m", output="o")
    assert TrainConfig(**base).objective == "dflash"  # the paper's objective stays the default
    with pytest.raises(ConfigError, match="objective='vp'"):
        TrainConfig(**base, objective="vp")
    with pytest.raises(ConfigError, match="prefix_weight_base=0"):
        TrainConfig(**base, prefix_weight_base=0)
    cfg = TrainConfig(**base, objective="variable_prefix", prefix_weight_base=0.8)
    for changed in (dict(objective="dflash"), dict(prefix_weight_base=0.9)):
        with pytest.raises(ConfigError, match=f"different '{next(iter(changed))}'"):
            check_resume_compatible(cfg.to_json(), dataclasses.replace(cfg, **changed))
    old = {k: v for k, v in TrainConfig(**base).to_json().items() if k not in ("objective", "prefix_weight_base")}
    check_resume_compatible(old, TrainConfig(**base))  # a checkpoint from before the fields: the defaults
    res = CliRunner().invoke(cli, ["train", "--help"], prog_name="dflash")
    assert res.exit_code == 0 and "--objective [dflash|variable_prefix]" in res.output
    assert "--prefix-weight-base" in res.output
