"""Run resolution: taps, mask token, drafter shape, the target hash mirror, schedule and FLOP math."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from dflash.errors import ConfigError
from dflash.train.build import default_heads, resolve_mask_token_id, select_taps
from dflash.train.config import TrainConfig, check_resume_compatible, load_train_config
from dflash.train.metrics import FlopModel
from dflash.train.step import GradSync, apply_divisor, clip_coefficient, lr_factor


def test_select_taps():
    assert select_taps((1, 5, 9), None) == (1, 5, 9)
    assert select_taps((1, 5, 9), [9, 1]) == (9, 1)
    with pytest.raises(ConfigError, match=r"taps \[4\] are not in the cache; it holds taps \[1, 5, 9\]"):
        select_taps((1, 5, 9), [1, 4])


class _Tok:
    def __init__(self, mask=None, pad=None, eos=None):
        self.mask_token_id, self.pad_token_id, self.eos_token_id = mask, pad, eos
        self.mask_token = self.pad_token = "<x>"


def test_mask_token_resolution():
    assert resolve_mask_token_id(_Tok(mask=7, pad=3), configured=None, vocab_size=10)[0] == 7
    assert resolve_mask_token_id(_Tok(pad=3, eos=2), configured=None, vocab_size=10)[0] == 3
    assert resolve_mask_token_id(_Tok(pad=3, eos=2), configured=9, vocab_size=10)[0] == 9
    with pytest.raises(ConfigError, match="--mask-token-id"):
        resolve_mask_token_id(_Tok(pad=2, eos=2), configured=None, vocab_size=10)
    with pytest.raises(ConfigError, match="outside"):
        resolve_mask_token_id(None, configured=10, vocab_size=10)


@pytest.mark.parametrize("hidden,expect", [(5120, (32, 8, 128)), (576, (9, 3, 64)), (64, (1, 1, 64))])
def test_default_heads(hidden, expect):
    assert default_heads(hidden)[:3] == expect


def test_config_yaml_overrides_and_resume_check(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("lr: 0.001\ntaps: [1, 2]\nbetas: [0.9, 0.95]\n")
    cfg = load_train_config(y, {"cache": "c", "model": "m", "output": "o", "lr": 0.002, "steps": None})
    assert cfg.lr == 0.002 and cfg.taps == (1, 2) and cfg.betas == (0.9, 0.95) and cfg.steps is None
    check_resume_compatible(cfg.to_json(), TrainConfig(**{**cfg.to_json(), "taps": (1, 2), "betas": (0.9, 0.95),
                                                           "log_every": 99}))
    with pytest.raises(ConfigError, match="different 'lr'"):
        check_resume_compatible(cfg.to_json(), TrainConfig(**{**cfg.to_json(), "taps": (1, 2),
                                                               "betas": (0.9, 0.95), "lr": 0.5}))


def test_lr_schedule():
    f = [lr_factor(s, total_steps=100, warmup_steps=4, min_lr_ratio=0.0) for s in range(101)]
    assert f[0] == 0.25 and f[3] == 1.0 and f[4] == 1.0
    assert f[52] == pytest.approx(0.5) and f[100] == pytest.approx(0.0, abs=1e-12)
    assert all(a >= b for a, b in zip(f[4:], f[5:]))


def test_flop_model_counts_the_27b_drafter():
    from dflash.drafter.config import DrafterConfig

    dc = DrafterConfig(hidden_size=5120, intermediate_size=17408, target_layer_ids=(1, 16, 31, 46, 61),
                       num_target_layers=64, mask_token_id=248070, vocab_size=248320)
    fm = FlopModel.from_config(dc)
    # method doc 1.2: 319.8M per layer (matmuls + norms), 5 layers 1.60B, fc 131M
    assert fm.layer_matmul_params / 5 == pytest.approx(319.8e6, rel=1e-3)
    assert fm.fc_params == pytest.approx(131e6, rel=1e-3)
    f = fm.step_flops(block_tokens=8192, context_tokens=3072, supervised_tokens=512 * 15,
                      visible_keys=16 * (512 * (1536 + 16)))
    # method doc 3: ~47.8 TFLOP forward for one max-size sample; fwd+bwd about 3x
    assert 100e12 < f < 160e12, f


def test_grad_sync_views_survive_backward():
    lin = torch.nn.Linear(3, 2)
    sync = GradSync(list(lin.parameters()), block_size=4, device=torch.device("cpu"))
    for _ in range(2):  # accumulation must write into the flat buffer, not replace .grad
        lin(torch.ones(1, 3)).sum().backward()
    assert sync.grads.abs().sum() > 0
    assert lin.weight.grad.data_ptr() == sync.flat.data_ptr()
    sync.counters[1] = 2.0
    summed = sync.grads.clone()
    sync.reduce(1)
    norm, divisor = sync.norm_and_divisor(max_norm=0.0)  # clip off: the divisor is the weight sum
    assert torch.equal(sync.grads, summed) and float(divisor) == 2.0
    assert math.isclose(float(norm), float(summed.norm() / 2), rel_tol=1e-6)


def test_a_constant_denominator_replaces_the_weight_sum():
    """loss_normalization=sample: the step's summed gradient is divided by the run's constant, whatever the
    step's weight sum (the number of its supervised samples under per-sample weights)."""
    lin = torch.nn.Linear(3, 1, bias=False)
    sync = GradSync(list(lin.parameters()), block_size=4, device=torch.device("cpu"))
    lin(torch.ones(1, 3)).sum().backward()
    sync.counters[1] = 3.0
    sync.reduce(1)
    norm, divisor = sync.norm_and_divisor(max_norm=0.0, denominator=2.5)
    assert float(divisor) == 2.5 and math.isclose(float(norm), float(sync.grads.norm() / 2.5), rel_tol=1e-6)


def test_clip_coefficient_is_clip_grad_norms():
    """The factor clip_grad_norm_ scales by: below max_norm nothing, above it max_norm / (norm + 1e-6), and
    max_norm 0 turns the clip off."""
    for scale in (0.1, 1.0, 37.0):
        g = torch.randn(50, generator=torch.Generator().manual_seed(1)) * scale
        p = torch.nn.Parameter(torch.zeros(50))
        p.grad = g.clone()
        norm = torch.nn.utils.clip_grad_norm_([p], 1.0)
        got = clip_coefficient(norm, max_norm=1.0)
        assert torch.allclose(g * got, p.grad, rtol=1e-6, atol=0), scale
        assert (float(got) == 1.0) == (float(norm) <= 1.0)
    assert float(clip_coefficient(torch.tensor(1e6), max_norm=0.0)) == 1.0


@pytest.mark.parametrize("fused", [False, True])
def test_one_divisor_equals_normalise_then_clip(fused):
    """norm_and_divisor + apply_divisor give the update that dividing by the weight sum, clip_grad_norm_ and
    AdamW gave (the fused kernel takes the divisor as its grad_scale), step after step, with the clip active
    and not; and the norm it reports is clip_grad_norm_'s."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (5,), (3, 7)]
    init = [torch.randn(s, generator=gen) for s in shapes]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    new = [torch.nn.Parameter(t.clone()) for t in init]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.01)
    new_opt = torch.optim.AdamW(new, lr=1e-2, weight_decay=0.01, fused=True if fused else None)
    sync = GradSync(new, block_size=2, device=torch.device("cpu"))
    for step, (scale, weight_sum) in enumerate([(0.01, 3.0), (50.0, 7.0), (0.2, 1.0), (80.0, 2.5)]):
        grads = [torch.randn(s, generator=gen) * scale for s in shapes]
        for p, g in zip(ref, grads):
            p.grad = g / weight_sum
        want_norm = torch.nn.utils.clip_grad_norm_(ref, 1.0)
        ref_opt.step()
        sync.zero()
        for p, g in zip(new, grads):
            p.grad.add_(g)
        sync.counters[1] = weight_sum
        sync.reduce(1)
        norm, divisor = sync.norm_and_divisor(max_norm=1.0)
        apply_divisor(new_opt, sync.grads, divisor)
        new_opt.step()
        assert math.isclose(float(norm), float(want_norm), rel_tol=1e-5), step
        for a, b in zip(ref, new):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7)  # the fused kernel writes it back
            torch.testing.assert_close(b.data, a.data, rtol=1e-5, atol=1e-6)


def test_samples_per_step_is_the_first_epochs_mean():
    """The constant of loss_normalization=sample: samples over the optimizer steps of epoch 0's plan (all ranks
    and micro-batches of a step together)."""
    from dflash.cache.reader import SampleIndex
    from dflash.train.config import TrainConfig
    from dflash.train.loader import config_plan, plan_epoch
    from dflash.train.setup import samples_per_step

    lengths = np.array([100, 700, 50, 300, 900, 20, 400, 60, 500, 80], dtype=np.int64)
    index = SampleIndex(sample_id=np.arange(10), length=lengths, num_loss_tokens=lengths, shard=np.zeros(10, int),
                        offset=np.cumsum(lengths) - lengths, shard_names=["s"])
    cfg = TrainConfig(cache="c", model="m", output="o", batch_tokens=1000, grad_accum=2)

    def per_step(c, world):
        return samples_per_step(config_plan(c, index, epoch=0, world_size=world), len(lengths))

    for world in (1, 2):
        steps = plan_epoch(lengths, seed=cfg.data_seed, epoch=0, batch_tokens=1000, world_size=world,
                           grad_accum=2).num_steps
        assert per_step(cfg, world) == pytest.approx(10 / steps)
    assert per_step(cfg, 2) > per_step(cfg, 1)
    fixed = TrainConfig(cache="c", model="m", output="o", batch_tokens=1000, grad_accum=3, step_samples=4)
    assert per_step(fixed, 1) == pytest.approx(10 / 3)   # steps of 4, 4, 2


def test_fixed_count_steps_train_every_sample_once_per_epoch(tmp_path):
    """step_samples=5 on the 24-sample tiny cache: 5 steps an epoch (the last of 4 samples), whatever the
    token budget, and a budget too small for a step's samples is a one-line ConfigError before training."""
    from dflash.errors import ConfigError
    from dflash.train.metrics import read_metrics
    from dflash.train.trainer import train
    from train_helpers import tiny_cache, tiny_config, tiny_target

    target = tiny_target(tmp_path / "target")
    cache = tiny_cache(tmp_path / "cache", target)
    cfg = tiny_config(cache=str(cache), model=str(target), output=str(tmp_path / "fixed"), epochs=2,
                      step_samples=5, grad_accum=3, save_every=100, log_every=1)
    res = train(cfg, device="cpu")
    assert res.finished and res.global_step == 10
    assert [r["epoch"] for r in read_metrics(cfg.output)] == [0] * 5 + [1] * 5
    small = tiny_config(cache=str(cache), model=str(target), output=str(tmp_path / "small"), step_samples=5,
                        batch_tokens=100)
    with pytest.raises(ConfigError, match="step_samples=5: a step's samples need"):
        train(small, device="cpu")
    assert not (tmp_path / "small" / "checkpoints").exists()
    # with --steps too: every epoch the steps reach is checked up front (here 3 epochs of 5 steps)
    with pytest.raises(ConfigError, match="step_samples=5: a step's samples need"):
        train(dataclasses.replace(small, steps=12), device="cpu")


def test_sequence_normalization_reaches_the_loss_and_nothing_else(tmp_path):
    """Runs that differ only in loss_normalization: step 1 has the same init, anchors and supervised slots
    (equal accuracy and acceptance); the steps differ in how they weigh the tiny cache's samples of different
    lengths, so the later losses differ (at init every CE is ~log V, so step 1's means nearly coincide).
    sample and sequence log the same per-sample mean but scale each step's gradient differently (a constant
    against the step's sample count), so after step 1 (AdamW's first update does not see a gradient's scale)
    their losses part too."""
    from dflash.train.metrics import read_metrics
    from dflash.train.trainer import train
    from train_helpers import tiny_cache, tiny_config, tiny_target

    target = tiny_target(tmp_path / "target")
    cache = tiny_cache(tmp_path / "cache", target)
    recs = {}
    for norm in ("token", "sequence", "sample"):
        cfg = tiny_config(cache=str(cache), model=str(target), output=str(tmp_path / norm), steps=4,
                          loss_normalization=norm, save_every=100, log_every=1)
        train(cfg, device="cpu")
        recs[norm] = read_metrics(cfg.output)
    tok, seq = recs["token"], recs["sequence"]
    assert tok[0]["acc"] == seq[0]["acc"] and tok[0]["accept_len"] == seq[0]["accept_len"]
    # CPU training repeats a run bit for bit (test_fused_ce: fused == fused_eager), so 1e-5 is far above noise
    # (measured: 1e-4 after 4 steps)
    assert abs(tok[-1]["loss"] - seq[-1]["loss"]) > 1e-5 * tok[-1]["loss"], (tok[-1]["loss"], seq[-1]["loss"])
    smp = recs["sample"]
    assert smp[0]["loss"] == seq[0]["loss"] and smp[0]["acc"] == seq[0]["acc"]
    assert abs(smp[-1]["loss"] - seq[-1]["loss"]) > 1e-5 * seq[-1]["loss"], (smp[-1]["loss"], seq[-1]["loss"])
