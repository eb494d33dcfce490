"""One training recipe, two trainers: the dflash TrainConfig and the SpecForge train_dflash.py command line of the
same work (drafter shape, block, anchors, gamma, mask id, lr schedule, optimizer steps and tokens per step).

Tradeoff: SpecForge trains on one sequence per micro-batch (--batch-size 1, no packing) and steps the optimizer
every --accumulation-steps sequences; dflash packs sequences into token-budget micro-batches. The two see the same
tokens per optimizer step when dflash's budget is the smallest one whose epoch plan has exactly as many steps as
SpecForge's epoch (`match_batch_tokens`): every sample once per epoch, the same number of steps, so the same mean
tokens per step (per-step counts differ: SpecForge's steps are A consecutive shuffled sequences).
The drafter config is dflash's own resolution (dflash.train.build.build_drafter_config), written as the published
config.json (DrafterConfig.to_hf_config) that SpecForge's --draft-config-path reads: one shape, defined once.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

# What SpecForge@40d8feff does differently from the paper / dflash, read from its source (not patched).
SPECFORGE_DIFFERENCES = {
    "anchors": "min(num_anchors, max valid count in the batch - 1) anchors from positions <= seq_len - block_size "
               "with loss_mask = 1 (core/dflash.py _sample_anchor_positions); dflash: min(512, loss positions)",
    "min_loss_tokens": "samples with fewer than 2 x block_size loss tokens are dropped (train_dflash.py "
                       "build_dataloader); the benchmark drops them from both trainers' data",
    "truncation": "SpecForge truncates at --max-length, dflash skips over-long samples; the benchmark keeps only "
                  "samples that fit, so neither happens",
    "warmup_steps": "int(warmup_ratio * total_steps) (floor; dflash rounds), and its cosine starts one step late "
                    "(peak lr twice); with 0 warmup steps (fewer than 25 steps at 4%) its first lr overshoots the "
                    "peak: 2x at 2 steps, 1.025x at 10 (CosineAnnealingWarmupLR, measured with its own class)",
    "system_prompt": "its 'qwen' template inserts 'You are a helpful assistant.' unless the data has a system turn; "
                     "the benchmark writes that system turn into both trainers' data",
    "batching": "one sequence per micro-batch, no packing; loss averaged per sequence then over accumulation steps "
                "(dflash packs; bench_peer trains it with --loss-normalization sample: each sample's mean, weighed "
                "alike whichever step it lands in, as SpecForge's fixed sequences per step weigh them)",
    "accumulation": "the optimizer steps when the global micro-step count is a multiple of --accumulation-steps, "
                    "while the lr schedule counts ceil(N / A) steps per epoch: with N % A != 0 the schedule never "
                    "ends and leftover gradient carries into the next epoch; the benchmark keeps N a multiple of A",
    "optimizer": "BF16Optimizer: AdamW on fp32 master copies of bf16 params, weight decay 0, clip 1.0 "
                 "(--max-grad-norm default)",
    "target": "online: the HF target (bf16) runs on every micro-batch with output_hidden_states=True "
              "(all layers, final norm and LM head included)",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeerRecipe:
    """The shared recipe of both trainers."""

    num_layers: int = 5
    """drafter layers (paper: 5)"""
    block_size: int = 16
    """block size (paper: 16)"""
    num_anchors: int = 512
    """anchors per sequence (paper: 512)"""
    gamma: float = 7.0
    """loss decay exp(-(k-1)/gamma) (paper: 7 for block 16)"""
    mask_token_id: int = 16
    """SmolLM2's <empty_output>, a special token the chat model never emits (configs/train_smollm2.yaml)"""
    lr: float = 6e-4
    """peak AdamW lr, cosine to 0"""
    warmup_ratio: float = 0.04
    """fraction of optimizer steps in linear warmup"""
    epochs: int = 1
    """passes over the data"""
    seqs_per_step: int = 8
    """sequences per optimizer step: SpecForge --accumulation-steps (with --batch-size 1)"""
    max_length: int = 2048
    """longest sample kept (tokens)"""
    rope_theta: float = 1e5
    """drafter RoPE base: the target's (SmolLM2: 1e5)"""
    intermediate_size: int | None = None
    """drafter MLP width; None = dflash's default (3 x hidden)"""
    seed: int = 0
    """seed of both trainers (init, anchors, data order: not the same stream in the two)"""
    attention_backend: str = "flex_attention"
    """SpecForge --attention-backend; on CPU 'sdpa' (flex attention has no CPU backward)"""

    def __post_init__(self) -> None:
        if self.seqs_per_step < 1:
            raise ValueError(f"seqs_per_step={self.seqs_per_step}: must be >= 1")
        if self.epochs < 1:
            raise ValueError(f"epochs={self.epochs}: must be >= 1")


def specforge_steps(num_samples: int, recipe: PeerRecipe) -> int:
    """SpecForge's total optimizer steps: num_epochs * ceil(len(dataloader) / accumulation_steps) (one rank)."""
    return recipe.epochs * math.ceil(num_samples / recipe.seqs_per_step)


def match_batch_tokens(lengths: np.ndarray, *, steps_per_epoch: int, seed: int, max_tokens: int = 1 << 22) -> int:
    """Smallest dflash batch_tokens whose epoch plan (dflash.train.plan_epoch, one rank) has `steps_per_epoch`
    steps or fewer: binary search, the plan's step count falls as the budget grows. Raises ValueError when even
    one sample per step gives fewer steps (more steps than samples)."""
    from dflash.train.loader import plan_epoch

    lengths = np.asarray(lengths, dtype=np.int64)
    if steps_per_epoch > len(lengths):
        raise ValueError(f"{steps_per_epoch} steps per epoch but only {len(lengths)} samples")

    def steps(budget: int) -> int:
        return plan_epoch(lengths, seed=seed, epoch=0, batch_tokens=budget, world_size=1, grad_accum=1).num_steps

    lo, hi = int(lengths.max()), max_tokens
    while lo < hi:
        mid = (lo + hi) // 2
        if steps(mid) <= steps_per_epoch:
            hi = mid
        else:
            lo = mid + 1
    return lo


def drafter_config(recipe: PeerRecipe, *, target_config: dict, train_cfg):
    """The DrafterConfig both trainers build: dflash's resolution for this target, with the taps `dflash extract`
    stores by default (default_tap_layer_ids: 5 taps, z-lab's build_target_layer_ids(L, 5)), which `dflash train`
    uses all of (TrainConfig.taps None), whatever the number of drafter layers."""
    from dflash.target.taps import default_tap_layer_ids
    from dflash.train.build import build_drafter_config

    n_target = int(target_config["num_hidden_layers"])
    return build_drafter_config(train_cfg, hidden_size=int(target_config["hidden_size"]),
                                taps=default_tap_layer_ids(n_target), num_target_layers=n_target,
                                mask_token_id=recipe.mask_token_id,
                                vocab_size=int(target_config["vocab_size"])).config


def train_config(recipe: PeerRecipe, *, cache: str, model: str, output: str, steps: int, batch_tokens: int,
                 log_every: int = 10, save_every: int = 1000, loss_normalization: str = "token"):
    """dflash's TrainConfig of the recipe (loss_normalization: dflash's choice, not the recipe's: the
    `batching` difference of SPECFORGE_DIFFERENCES)."""
    from dflash.train.config import TrainConfig

    return TrainConfig(cache=cache, model=model, output=output, num_layers=recipe.num_layers,
                       block_size=recipe.block_size, num_anchors=recipe.num_anchors, gamma=recipe.gamma,
                       mask_token_id=recipe.mask_token_id, lr=recipe.lr, warmup_ratio=recipe.warmup_ratio,
                       weight_decay=0.0, grad_clip=1.0, steps=steps, batch_tokens=batch_tokens,
                       rope_theta=recipe.rope_theta, intermediate_size=recipe.intermediate_size, seed=recipe.seed,
                       log_every=log_every, save_every=save_every, loss_normalization=loss_normalization)


def specforge_args(recipe: PeerRecipe, *, target: str, draft_config: str, data: str, output: str, cache: str,
                   log_interval: int = 10, num_workers: int = 2, num_proc: int = 1, save_interval: int = 10**9,
                   resume: bool = False) -> list[str]:
    """train_dflash.py's arguments for the recipe (HF target backend, online); save_interval in micro-steps (a
    multiple of seqs_per_step), resume: continue from output's latest epoch_*_step_* checkpoint."""
    return ["--target-model-backend", "hf", "--target-model-path", target, "--draft-config-path", draft_config,
            "--block-size", str(recipe.block_size), "--mask-token-id", str(recipe.mask_token_id),
            "--num-anchors", str(recipe.num_anchors), "--loss-type", "dflash",
            "--loss-decay-gamma", _num(recipe.gamma), "--attention-backend", recipe.attention_backend,
            "--train-data-path", data, "--chat-template", "qwen", "--max-length", str(recipe.max_length),
            "--batch-size", "1", "--accumulation-steps", str(recipe.seqs_per_step),
            "--num-epochs", str(recipe.epochs), "--learning-rate", _num(recipe.lr),
            "--warmup-ratio", _num(recipe.warmup_ratio), "--max-grad-norm", "1.0", "--seed", str(recipe.seed),
            "--output-dir", output, "--cache-dir", cache, "--report-to", "none",
            "--log-interval", str(log_interval), "--save-interval", str(save_interval),
            "--dataloader-num-workers", str(num_workers), "--build-dataset-num-proc", str(num_proc),
            *(["--resume"] if resume else [])]


def _num(x: float) -> str:
    return repr(float(x)) if not float(x).is_integer() else str(int(x))


def dflash_lr_factors(*, total_steps: int, warmup_ratio: float) -> list[float]:
    """dflash's lr factor before each optimizer step (dflash.train.step.lr_factor, warmup as DrafterUnit rounds)."""
    from dflash.train.step import lr_factor

    warmup = int(round(warmup_ratio * total_steps))
    return [lr_factor(s, total_steps=total_steps, warmup_steps=warmup, min_lr_ratio=0.0) for s in range(total_steps)]
