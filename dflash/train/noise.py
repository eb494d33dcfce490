"""Feature-noise augmentation: Gaussian noise on the cached target features, with a warm-up ramp and a decay.

Shapes: T = packed tokens, K = taps, D = hidden size.

The recipe (defined here: neither the DFlash paper nor the reference notes in /work/shared/reference have one;
the paper's "noise" is the all-MASK block, method doc 2): during training the drafter's context input is
    h' = h + std(step) * rms(h[t, k, :]) * N(0, I)        per token t and tap k
with std(step) rising linearly from 0 to `noise_start` over the first `warmup_ratio` of the steps, then
decaying (cosine or linear) to `noise_end` at the last step. Off by default (noise_start = 0) until held-out tau
says it helps (bench_quality --noise measures it).

Why relative to each token's and tap's own scale, not absolute: target hidden-state norms differ by orders of
magnitude between taps (deeper layers grow) and between tokens (massive activations at the first token and at
delimiters), and the drafter concatenates the taps before its fc with no per-tap norm, so one absolute std
would drown the small taps and not touch the large ones. It is also the shape of the error the cache itself
makes: fp8 (and 4-bit) storage quantizes each token and tap against its own amax, so relative noise is the
augmentation that makes the drafter robust to storage error. Why ramp up: a random drafter first has to learn
the clean mapping; why decay: the served drafter sees clean features (and the last steps set the final weights).
Tradeoff: one extra randn and an RMS over the hidden axis per micro-batch on the device (about the cost of
one elementwise pass over the features), nothing when off.

How the training driver uses it (per micro-batch, after the loader's H2D copy and fp8 dequantization):
    std = noise_std(step=global_step, total_steps=cfg.steps, cfg=cfg.noise)
    hidden_TKD = add_feature_noise(hidden_TKD, std=std, generator=noise_gen)  # noise_gen seeded from cfg.seed
The generator is the driver's (torch.Generator(device).manual_seed(...), saved with the checkpoint RNG state
for an exact resume); the held-out evaluator never adds noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dflash.errors import ConfigError

if TYPE_CHECKING:  # torch is imported where the noise is drawn: the CLI reads NoiseConfig (via TrainConfig)
    import torch    # for every command, and `dflash --help` or `cache info` need no torch

DECAYS = ("cosine", "linear")


@dataclass(frozen=True, kw_only=True)
class NoiseConfig:
    """Feature-noise schedule (module docstring); TrainConfig embeds it as `noise` or mirrors its fields."""

    noise_start: float = 0.0
    """Peak noise std, relative to each token's and tap's feature RMS, reached at the end of warm-up.
    0 = off (default). 0.05-0.2 are the values worth measuring (fp8 storage error is ~0.03 relative)."""
    noise_end: float = 0.0
    """Noise std at the last step (the decay's floor), relative like noise_start; <= noise_start."""
    warmup_ratio: float = 0.04
    """Fraction of the steps over which the std ramps linearly from 0 to noise_start (the lr's warm-up)."""
    decay: str = "cosine"
    """Shape of the decay from noise_start to noise_end after warm-up: cosine (like the lr) or linear."""

    def __post_init__(self) -> None:
        if self.noise_start < 0:
            raise ConfigError(f"noise_start={self.noise_start}: must be >= 0 (0 turns feature noise off)")
        if not 0 <= self.noise_end <= self.noise_start:
            raise ConfigError(f"noise_end={self.noise_end}: must be in [0, noise_start={self.noise_start}]")
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"warmup_ratio={self.warmup_ratio}: must be in [0, 1)")
        if self.decay not in DECAYS:
            raise ConfigError(f"decay={self.decay!r}: use one of {', '.join(DECAYS)}")

    @property
    def enabled(self) -> bool:
        return self.noise_start > 0

    def to_json(self) -> dict:
        return {"noise_start": self.noise_start, "noise_end": self.noise_end, "warmup_ratio": self.warmup_ratio,
                "decay": self.decay}


def noise_std(*, step: int, total_steps: int, cfg: NoiseConfig) -> float:
    """Relative noise std for optimizer step `step` (0-based) of a run of `total_steps` steps.

    Warm-up: std = noise_start * (step + 1) / warmup_steps for step < warmup_steps (warmup_steps =
    ceil(warmup_ratio * total_steps); the first step already has a little noise, the last warm-up step the peak).
    Then progress p = (step - warmup_steps + 1) / (total_steps - warmup_steps) in (0, 1] and
    std = noise_end + (noise_start - noise_end) * f(p) with f = (1 + cos(pi p)) / 2 (cosine) or 1 - p (linear),
    so the last step has exactly noise_end."""
    if total_steps < 1:
        raise ConfigError(f"total_steps={total_steps}: must be >= 1")
    if not cfg.enabled:
        return 0.0
    step = min(max(step, 0), total_steps - 1)
    warm = math.ceil(cfg.warmup_ratio * total_steps)
    if step < warm:
        return cfg.noise_start * (step + 1) / warm
    if total_steps == warm:
        return cfg.noise_start
    p = (step - warm + 1) / (total_steps - warm)
    f = (1 + math.cos(math.pi * p)) / 2 if cfg.decay == "cosine" else 1 - p
    return cfg.noise_end + (cfg.noise_start - cfg.noise_end) * f


def add_feature_noise(hidden_TKD: torch.Tensor, *, std: float, generator: torch.Generator | None) -> torch.Tensor:
    """hidden + std * rms(hidden[t, k, :]) * N(0, 1), per element; a new tensor of hidden's dtype and device.

    std == 0 returns `hidden_TKD` itself (no copy, no random draw: turning noise off leaves the run's random
    stream, and so its batches and anchors, unchanged). The RMS and the noise are computed in float32; the
    generator must be on hidden's device."""
    if std < 0:
        raise ValueError(f"std={std}: must be >= 0")
    if std == 0 or hidden_TKD.numel() == 0:
        return hidden_TKD
    import torch

    h32 = hidden_TKD.float()
    rms_TK1 = h32.pow(2).mean(dim=-1, keepdim=True).sqrt()
    noise = torch.randn(h32.shape, generator=generator, device=h32.device, dtype=torch.float32)
    return (h32 + noise.mul_(rms_TK1 * std)).to(hidden_TKD.dtype)
