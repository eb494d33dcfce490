"""Everything a run needs before its first step: the run folder check, the cache, the frozen target
embedding and head, the target/cache compatibility check, the drafter, the compute dtype and the step count.

Split in two: setup_target (what all drafters on one cache share; a sweep builds it once per device) and
setup_drafter (one run's drafter); setup_training composes them for `dflash train`.
"""

from __future__ import annotations

import logging
import pathlib
from dataclasses import dataclass
from typing import Any

import torch

from dflash.errors import ConfigError
from dflash.train import checkpoint as ckpt
from dflash.train.build import (build_drafter_config, check_target_matches, resolve_mask_token_id,
                                select_taps)
from dflash.train.config import TrainConfig
from dflash.train.distributed import DistInfo
from dflash.train.loader import plan_epoch

log = logging.getLogger(__name__)


@dataclass
class TrainSetup:
    reader: Any                       # dflash.cache.CacheReader
    taps: tuple[int, ...]
    drafter: torch.nn.Module          # DFlashDrafter on the device, fp32 master weights
    drafter_config: Any               # DrafterConfig
    embed_VD: torch.Tensor            # frozen, compute dtype, on the device
    lm_head_VD: torch.Tensor          # frozen, compute dtype, on the device
    compute_dtype: torch.dtype
    total_steps: int
    default_gamma: float
    reasons: list[str]


def prepare_run_dir(run_dir: pathlib.Path, *, resume: bool) -> dict | None:
    """Refuse a non-empty run folder unless resuming; return the newest checkpoint's state when resuming."""
    has_content = run_dir.exists() and any(run_dir.iterdir())
    if not resume:
        if has_content:
            raise ConfigError(f"run folder {str(run_dir)!r} is not empty: pass --resume to continue that run, "
                              "or choose a new --output")
        return None
    latest = ckpt.latest_checkpoint(run_dir)
    if latest is None:
        log.info("--resume: no checkpoint in %s yet, starting from step 0", run_dir)
        return None
    return ckpt.load_checkpoint(latest)


def compute_dtype_of(cfg: TrainConfig, device: torch.device) -> tuple[torch.dtype, str]:
    if cfg.dtype == "bfloat16":
        return torch.bfloat16, "dtype bfloat16 requested"
    if cfg.dtype == "float32":
        return torch.float32, "dtype float32 requested"
    if device.type == "cuda":
        return torch.bfloat16, "compute dtype bfloat16 autocast (CUDA; fp32 master weights and Adam states)"
    return torch.float32, f"compute dtype float32 ({device.type}: bf16 matmuls are slow and inexact on CPU)"


def count_total_steps(cfg: TrainConfig, lengths, world_size: int) -> int:
    """cfg.steps, or the sum of the epochs' step counts (packing can differ by a bin between epochs)."""
    if cfg.steps is not None:
        return cfg.steps
    return sum(plan_epoch(lengths, seed=cfg.data_seed, epoch=e, batch_tokens=cfg.batch_tokens, world_size=world_size,
                          grad_accum=cfg.grad_accum).num_steps for e in range(cfg.epochs))


@dataclass
class TargetSetup:
    """What every drafter trained on one cache shares: the reader, the frozen embedding and head on the device,
    the tokenizer and the target's layer count (a sweep builds this once per device)."""

    reader: Any                       # dflash.cache.CacheReader
    tokenizer: Any
    num_target_layers: int
    vocab_size: int
    embed_VD: torch.Tensor            # frozen, compute dtype, on the device
    lm_head_VD: torch.Tensor          # frozen, compute dtype, on the device
    compute_dtype: torch.dtype
    reasons: list[str]


def setup_target(cfg: TrainConfig, *, info: DistInfo) -> TargetSetup:
    """Open the cache, read the target's embedding and head, check that the cache was made from this target."""
    from transformers import AutoConfig, AutoTokenizer

    from dflash.cache import CacheReader
    from dflash.target.head import embedding_and_head
    from dflash.target.load import local_model_dir, text_config

    reasons: list[str] = []
    reader = CacheReader(cfg.cache, verify=cfg.verify_checksums)
    if len(reader) == 0:
        raise ConfigError(f"cache {cfg.cache!r} has no committed samples")
    model_dir = local_model_dir(cfg.model)
    embed_VD, head_VD, head_info = embedding_and_head(cfg.model)
    target_config = text_config(AutoConfig.from_pretrained(model_dir))
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as e:  # a target folder without tokenizer files
        raise ConfigError(f"cannot load the tokenizer of {cfg.model!r} ({e}); the cache check and the mask "
                          "token need it") from e
    check_target_matches(reader.fingerprint, model_dir=model_dir, tokenizer=tokenizer,
                         embed_hidden=head_info.hidden_size, num_target_layers=int(target_config.num_hidden_layers))
    dtype, why = compute_dtype_of(cfg, info.device)
    reasons.append(why)
    embed = embed_VD.to(device=info.device, dtype=dtype).requires_grad_(False)
    head = embed if head_info.tied else head_VD.to(device=info.device, dtype=dtype).requires_grad_(False)
    return TargetSetup(reader=reader, tokenizer=tokenizer, num_target_layers=int(target_config.num_hidden_layers),
                       vocab_size=head_info.vocab_size, embed_VD=embed, lm_head_VD=head, compute_dtype=dtype,
                       reasons=reasons)


@dataclass
class DrafterSetup:
    taps: tuple[int, ...]
    drafter: torch.nn.Module          # DFlashDrafter on the device, fp32 master weights
    drafter_config: Any               # DrafterConfig
    total_steps: int
    default_gamma: float
    reasons: list[str]


def setup_drafter(cfg: TrainConfig, target: TargetSetup, *, info: DistInfo,
                  resume_state: dict | None) -> DrafterSetup:
    """The drafter of one run: taps, config (from the checkpoint when resuming), init seeded by cfg.seed."""
    from dflash.drafter.config import DrafterConfig
    from dflash.drafter.model import DFlashDrafter
    from dflash.train.objective import default_gamma

    reasons: list[str] = []
    reader = target.reader
    taps = select_taps(reader.tap_layer_ids, cfg.taps)
    if cfg.taps is None:
        reasons.append(f"taps: all of the cache's taps {list(taps)}")
    if resume_state is not None:
        dc = DrafterConfig(**{**resume_state["drafter_config"],
                              "target_layer_ids": tuple(resume_state["drafter_config"]["target_layer_ids"])})
        reasons.append("drafter config: from the checkpoint being resumed")
    else:
        mask_id, why = resolve_mask_token_id(target.tokenizer, configured=cfg.mask_token_id,
                                             vocab_size=target.vocab_size)
        reasons.append(f"mask_token_id {mask_id}: {why}")
        resolved = build_drafter_config(cfg, hidden_size=reader.hidden_size, taps=taps,
                                        num_target_layers=target.num_target_layers,
                                        mask_token_id=mask_id, vocab_size=target.vocab_size)
        dc = resolved.config
        reasons.extend(resolved.reasons)
    torch.manual_seed(cfg.seed)  # identical init on every rank (built on the CPU, then moved)
    drafter = DFlashDrafter(dc).to(info.device)
    if cfg.compile_elementwise == "on" or (cfg.compile_elementwise == "auto" and info.device.type == "cuda"):
        drafter.compile_elementwise()
        reasons.append(f"norms, RoPE and SiLU-gating: torch.compile'd (compile_elementwise={cfg.compile_elementwise})")
    total = count_total_steps(cfg, reader.index.length, info.world_size)
    reasons.append(f"{total} optimizer steps ({'--steps' if cfg.steps else f'{cfg.epochs} epochs'}), "
                   f"{len(reader)} samples, world size {info.world_size}, grad_accum {cfg.grad_accum}")
    return DrafterSetup(taps=taps, drafter=drafter, drafter_config=dc, total_steps=total,
                        default_gamma=default_gamma(dc.block_size), reasons=reasons)


def setup_training(cfg: TrainConfig, *, info: DistInfo, resume_state: dict | None) -> TrainSetup:
    t = setup_target(cfg, info=info)
    d = setup_drafter(cfg, t, info=info, resume_state=resume_state)
    return TrainSetup(reader=t.reader, taps=d.taps, drafter=d.drafter, drafter_config=d.drafter_config,
                      embed_VD=t.embed_VD, lm_head_VD=t.lm_head_VD, compute_dtype=t.compute_dtype,
                      total_steps=d.total_steps, default_gamma=d.default_gamma, reasons=t.reasons + d.reasons)
