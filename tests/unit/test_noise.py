"""Feature noise (dflash.train.noise): the schedule pinned at its corners, the statistics of the noise relative to
each token's and tap's own scale, off by default, deterministic under a seeded generator."""

import math

import pytest
import torch

from dflash.errors import ConfigError
from dflash.train.noise import NoiseConfig, add_feature_noise, noise_std


def test_off_by_default():
    cfg = NoiseConfig()
    assert not cfg.enabled
    assert all(noise_std(step=s, total_steps=100, cfg=cfg) == 0.0 for s in range(100))
    h = torch.randn(5, 2, 8)
    assert add_feature_noise(h, std=0.0, generator=None) is h


def test_schedule_pinned_cosine_and_linear():
    cos = NoiseConfig(noise_start=0.2, noise_end=0.02, warmup_ratio=0.1)
    s = [noise_std(step=i, total_steps=100, cfg=cos) for i in range(100)]
    assert s[0] == pytest.approx(0.02) and s[4] == pytest.approx(0.1) and s[9] == pytest.approx(0.2)
    assert max(s) == pytest.approx(0.2) and s[-1] == pytest.approx(0.02)
    # halfway through the decay (step 9 + 45) the cosine is at the midpoint
    assert s[54] == pytest.approx(0.02 + 0.18 * (1 + math.cos(math.pi * 0.5)) / 2)
    assert all(a <= b + 1e-12 for a, b in zip(s[:10], s[1:10]))       # ramp up
    assert all(a >= b - 1e-12 for a, b in zip(s[9:], s[10:]))         # then down
    lin = NoiseConfig(noise_start=0.1, warmup_ratio=0.0, decay="linear")
    ls = [noise_std(step=i, total_steps=10, cfg=lin) for i in range(10)]
    assert ls == pytest.approx([0.1 * (1 - (i + 1) / 10) for i in range(10)])
    # steps past the end keep the last value (a resumed run with more steps is clamped, not extrapolated)
    assert noise_std(step=500, total_steps=100, cfg=cos) == pytest.approx(0.02)


def test_config_refuses_bad_values():
    for kw in ({"noise_start": -0.1}, {"noise_start": 0.1, "noise_end": 0.2}, {"warmup_ratio": 1.0},
               {"decay": "step"}):
        with pytest.raises(ConfigError):
            NoiseConfig(**kw)


def test_noise_is_relative_to_each_token_and_tap():
    g = torch.Generator().manual_seed(0)
    T, K, D = 512, 3, 256
    # token and tap scales spanning 4 orders of magnitude (massive activations, deep taps)
    scale_TK = torch.logspace(-2, 2, T * K)[torch.randperm(T * K, generator=g)].view(T, K)
    h = torch.randn(T, K, D, generator=g) * scale_TK[..., None]
    std = 0.1
    out = add_feature_noise(h, std=std, generator=torch.Generator().manual_seed(1))
    assert out.shape == h.shape and out.dtype == h.dtype and out is not h
    rms_TK = h.pow(2).mean(-1).sqrt()
    rel_TKD = (out - h) / rms_TK[..., None]
    assert rel_TKD.mean().abs() < 0.01
    assert rel_TKD.std().item() == pytest.approx(std, rel=0.01)
    # per (token, tap): the relative std is std everywhere, small and large scales alike
    per_TK = rel_TKD.std(dim=-1)
    assert (per_TK / std - 1).abs().max() < 0.3
    small, large = scale_TK < 0.1, scale_TK > 10
    assert per_TK[small].mean().item() == pytest.approx(std, rel=0.03)
    assert per_TK[large].mean().item() == pytest.approx(std, rel=0.03)


def test_seeded_and_dtype_preserving():
    h = torch.randn(64, 2, 32).to(torch.bfloat16)
    a = add_feature_noise(h, std=0.05, generator=torch.Generator().manual_seed(7))
    b = add_feature_noise(h, std=0.05, generator=torch.Generator().manual_seed(7))
    c = add_feature_noise(h, std=0.05, generator=torch.Generator().manual_seed(8))
    assert a.dtype == torch.bfloat16 and torch.equal(a, b) and not torch.equal(a, c)
