"""Everything a run needs before its first step: the run folder check, the cache, the frozen target
embedding and head, the target/cache compatibility check, the drafter, the compute dtype and the step count.

Split in two: setup_target (what all drafters on one cache share; a sweep builds it once per device) and
setup_drafter (one run's drafter); the driver (train.driver.build_unit) composes them.
"""

from __future__ import annotations

import functools
import logging
import pathlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from dflash.compiled import compile_wanted
from dflash.errors import ConfigError
from dflash.train import checkpoint as ckpt
from dflash.train.build import (build_drafter_config, check_target_matches, resolve_mask_token_id,
                                select_taps)
from dflash.train.config import TrainConfig
from dflash.train.distributed import DistInfo
from dflash.train.loader import EpochPlan, config_plan
from dflash.train.wgrad import fuse_weight_grads

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from dflash.cache.reader import CacheReader
    from dflash.drafter.config import DrafterConfig
    from dflash.drafter.model import DFlashDrafter

log = logging.getLogger(__name__)


def refuse_nonempty(folder: pathlib.Path, *, what: str) -> None:
    """ConfigError when `folder` holds anything but its lock file: a new run (train or sweep) never writes
    into an old one's folder without --resume."""
    from dflash.durable import refuse_nonempty as refuse
    from dflash.locks import LOCK_FILE

    refuse(folder, what=what, remedy="pass --resume to continue that run, or choose a new --output",
           ignore=lambda name: name == LOCK_FILE)


def prepare_run_dir(run_dir: pathlib.Path, *, resume: bool, require_run: bool = True) -> dict | None:
    """Refuse a non-empty run folder unless resuming; return the newest checkpoint's state when resuming.

    require_run: an explicit --resume of `dflash train` needs a run in the folder (its config.json, written
    before the first step): a mistyped --output must not silently start a fresh run. A sweep resumes runs
    that may not have started yet and passes False."""
    if not resume:
        refuse_nonempty(run_dir, what="run folder")
        return None
    latest = ckpt.latest_checkpoint(run_dir)
    if latest is None:
        if require_run and not (run_dir / "config.json").is_file():
            raise ConfigError(f"--resume: no training run in {str(run_dir)!r} (no config.json, no checkpoint); "
                              "check --output, or drop --resume to start a new run")
        log.info("--resume: no checkpoint in %s yet, starting from step 0", run_dir)
        return None
    return ckpt.load_checkpoint(latest)


def cache_in_progress(cache: str) -> str | None:
    """A warning when a live process holds the cache's extraction or writer locks (dflash.locks): training
    then sees only the samples committed so far. None when nobody writes it."""
    import os
    import socket

    from dflash.locks import LOCK_FILE, pid_alive, read_lock_holder
    from dflash.store.url import is_store_url

    if is_store_url(cache):  # read directly from the store: no local lock files to look at
        return None
    # the run lock of dflash extract (LOCK_FILE) and the per-rank CacheWriter locks (LOCK_FILE-rank-R)
    names = sorted(n for n in os.listdir(cache) if n == LOCK_FILE or n.startswith(LOCK_FILE + "-"))
    for name in names:
        holder = read_lock_holder(cache, name=name)
        if holder is not None and (holder.host != socket.gethostname() or pid_alive(holder.pid)):
            return (f"cache {cache!r} is still being written ({holder.describe()}): this run trains on the samples "
                    "committed so far only; wait for the extraction to finish for the whole data set")
    return None


def compute_dtype_of(cfg: TrainConfig, device: torch.device) -> tuple[torch.dtype, str]:
    if cfg.dtype == "bfloat16":
        return torch.bfloat16, "dtype bfloat16 requested"
    if cfg.dtype == "float32":
        return torch.float32, "dtype float32 requested"
    if device.type == "cuda":
        return torch.bfloat16, "compute dtype bfloat16 autocast (CUDA; fp32 master weights and Adam states)"
    return torch.float32, f"compute dtype float32 ({device.type}: bf16 matmuls are slow and inexact on CPU)"


def count_total_steps(cfg: TrainConfig, plan_of: Callable[[int], EpochPlan]) -> int:
    """cfg.steps, or the sum of the epochs' step counts (packing can differ by a bin between epochs); plan_of(e):
    epoch e's plan. With step_samples, every epoch the run reaches is planned here, so a step whose samples
    overflow its micro-batches is a ConfigError before training rather than at that epoch's start."""
    if cfg.steps is None:
        return sum(plan_of(e).num_steps for e in range(cfg.epochs))
    if cfg.step_samples is not None:
        planned, epoch = 0, 0
        while planned < cfg.steps:
            planned += plan_of(epoch).num_steps
            epoch += 1
    return cfg.steps


def samples_per_step(first_plan: EpochPlan, num_samples: int) -> float:
    """The mean number of samples in an optimizer step (all ranks and micro-batches) of the first epoch's plan:
    loss_normalization=sample's constant denominator (the epochs' plans differ by a bin at most)."""
    return num_samples / max(1, first_plan.num_steps)


@dataclass(frozen=True, kw_only=True)
class TargetSetup:
    """What every drafter trained on one cache shares: the reader, the frozen embedding and head on the device,
    the tokenizer and the target's layer count (a sweep builds this once per device)."""

    reader: "CacheReader"
    """The training cache, open."""
    tokenizer: "PreTrainedTokenizerBase"
    """The target's tokenizer (the cache check and the mask token)."""
    num_target_layers: int
    """Decoder layers of the target."""
    vocab_size: int
    """Rows of the target's embedding."""
    embed_VD: torch.Tensor
    """Frozen embedding, compute dtype, on the device."""
    lm_head_VD: torch.Tensor
    """Frozen LM head (the embedding itself when tied), compute dtype, on the device."""
    compute_dtype: torch.dtype
    """Autocast dtype of the drafter's forward."""
    reasons: tuple[str, ...]
    """Automatic choices with their reasons, to log."""


def setup_target(cfg: TrainConfig, *, info: DistInfo) -> TargetSetup:
    """Open the cache, read the target's embedding and head, check that the cache was made from this target."""
    from transformers import AutoConfig, AutoTokenizer

    from dflash.cache import CacheReader
    from dflash.target.head import embedding_and_head
    from dflash.target.load import local_model_dir, text_config

    reasons: list[str] = []
    readers = []
    try:
        for path in cfg.cache_paths:
            readers.append(CacheReader(path, verify=cfg.verify_checksums))
            if len(readers[-1]) == 0:
                raise ConfigError(f"cache {path!r} has no committed samples")
            busy = cache_in_progress(path)
            if busy and info.is_main:
                log.warning("%s (%d samples committed)", busy, len(readers[-1]))
        if len(readers) == 1:
            reader = readers[0]
        else:
            from dflash.cache.mixed import MixedReader

            reader = MixedReader(readers)
            reasons.append(f"{len(readers)} caches mixed ({', '.join(f'{len(r)}' for r in readers)} samples), "
                           + ("every sample once per epoch" if cfg.cache_weights is None else
                              f"weights {list(cfg.cache_weights)}"))
    except BaseException:
        for r in readers:
            r.close()
        raise
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
                       reasons=tuple(reasons))


@dataclass(frozen=True, kw_only=True)
class DrafterSetup:
    """One run's drafter, built and placed on the device."""

    taps: tuple[int, ...]
    """The drafter's target_layer_ids (a subset of the cache's taps, or online any of the target's layers)."""
    drafter: "DFlashDrafter"
    """On the device, fp32 master weights, seeded init (or to be loaded from the checkpoint)."""
    drafter_config: "DrafterConfig"
    total_steps: int
    """Optimizer steps of the whole run."""
    grad_denominator: float | None
    """What each step's summed gradient is divided by when it is a constant (loss_normalization=sample: the mean
    samples per step of the first epoch's plan); None = the step's own weight sum."""
    reasons: tuple[str, ...]
    """Automatic choices with their reasons, to log."""


def setup_drafter(cfg: TrainConfig, target: TargetSetup, *, info: DistInfo,
                  resume_state: dict | None) -> DrafterSetup:
    """The drafter of one run: taps, config (from the checkpoint when resuming), init seeded by cfg.seed."""
    from dflash.drafter.registry import build_drafter, config_from_json

    reasons: list[str] = []
    reader = target.reader
    init = None
    if resume_state is None and cfg.init_from is not None:  # a resume continues its own weights instead
        from dflash.train.init_from import check_init_fits, load_init

        init = load_init(cfg.init_from)
        check_init_fits(init.config, hidden_size=reader.hidden_size, num_target_layers=target.num_target_layers,
                        vocab_size=target.vocab_size, cache_taps=reader.tap_layer_ids, requested_taps=cfg.taps,
                        online=cfg.online)
    wanted = cfg.taps if init is None else init.config.target_layer_ids
    if resume_state is not None:  # the drafter's own taps (a run started --init-from took them from its source)
        wanted = tuple(resume_state["drafter_config"]["target_layer_ids"])
    taps = select_taps(reader.tap_layer_ids, wanted, online_layers=target.num_target_layers if cfg.online else None)
    if wanted is None:
        reasons.append(f"taps: all of the cache's taps {list(taps)}")
    if resume_state is not None:
        dc = config_from_json(resume_state["drafter_config"])
        reasons.append("drafter config: from the checkpoint being resumed")
    elif init is not None:
        dc = init.config
        reasons.append(f"drafter config and initial weights: from {init.source} (its shape, taps, block size "
                       "and mask token; the run's own shape settings are not used)")
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
    drafter = build_drafter(dc).to(info.device)
    if init is not None:
        drafter.load_state_dict(init.state, strict=True)
    if compile_wanted(cfg.compile_elementwise, info.device):
        drafter.compile_elementwise()
        reasons.append(f"norms, RoPE, SiLU-gating and the fused CE's elementwise work: torch.compile'd "
                       f"(compile_elementwise={cfg.compile_elementwise})")
    if compile_wanted(cfg.wgrad_fusion, info.device):
        n = fuse_weight_grads(drafter)
        reasons.append(f"{n} linear layers add their weight gradients into .grad in the matmul "
                       f"(wgrad_fusion={cfg.wgrad_fusion})")
    reasons.append(describe_drafter(dc, drafter))
    # each epoch planned once for the step count, the CPU estimate and the sample denominator
    plan_of = functools.cache(lambda e: config_plan(cfg, reader.index, epoch=e, world_size=info.world_size,
                                                    counts=getattr(reader, "counts", None)))
    total = count_total_steps(cfg, plan_of)
    if info.device.type == "cpu" and info.is_main and cfg.num_anchors * dc.block_size >= GPU_SIZED_BLOCK_TOKENS:
        per_epoch = plan_of(0).num_steps
        warning = cpu_time_warning(cfg=cfg, dc=dc, lengths=reader.index.length,
                                   loss_tokens=reader.index.num_loss_tokens, total_steps=total,
                                   steps_per_epoch=per_epoch, flops_per_s=cpu_matmul_flops())
        if warning:
            log.warning("%s", warning)
    reasons.append(f"{total} optimizer steps ({'--steps' if cfg.steps else f'{cfg.epochs} epochs'}), "
                   f"{len(reader)} samples, world size {info.world_size}, grad_accum {cfg.grad_accum}")
    denominator = None
    if cfg.loss_normalization == "sample":
        denominator = samples_per_step(plan_of(0), len(reader.index.length))
        reasons.append(f"loss_normalization sample: each step's sum of per-sample means divided by {denominator:.2f}, "
                       "the mean samples per step of the first epoch")
    return DrafterSetup(taps=taps, drafter=drafter, drafter_config=dc, total_steps=total,
                        grad_denominator=denominator, reasons=tuple(reasons))


def describe_drafter(dc: "DrafterConfig", drafter: torch.nn.Module) -> str:
    """The drafter shape being trained, for the log (a spec without num_layers silently got 5 layers)."""
    params = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    return (f"drafter: {dc.num_hidden_layers} layers, hidden {dc.hidden_size}, {dc.num_attention_heads} heads / "
            f"{dc.num_key_value_heads} KV heads of {dc.head_dim}, MLP {dc.intermediate_size}, block {dc.block_size}, "
            f"taps {list(dc.target_layer_ids)}, {params / 1e6:.2f}M trainable parameters")


GPU_SIZED_BLOCK_TOKENS = 4096
"""Anchors x block size per sequence from which a CPU run gets a warning (the paper's 512 x 16 = 8192)."""


def cpu_time_warning(*, cfg: TrainConfig, dc: "DrafterConfig", lengths: np.ndarray, loss_tokens: np.ndarray,
                     total_steps: int, steps_per_epoch: int, flops_per_s: float) -> str | None:
    """A warning with a time estimate for a CPU run of a GPU-sized configuration, else None.

    The estimate is metrics.FlopModel over one epoch's block tokens (each sample gets min(num_anchors, loss
    tokens - 1) blocks), scaled to total_steps, at `flops_per_s` (the caller measures a CPU matmul)."""
    from dflash.train.metrics import FlopModel
    from dflash.train.objective import expected_blocks

    if cfg.num_anchors * dc.block_size < GPU_SIZED_BLOCK_TOKENS:
        return None
    B = dc.block_size
    blocks_N = expected_blocks(loss_tokens, num_anchors=cfg.num_anchors)
    block_tokens = float(B * blocks_N.sum())
    context = float(np.asarray(lengths, dtype=np.float64).sum())
    # a block at anchor a sees a context keys + B block keys; anchors are spread over the sequence (mean a ~ S/2)
    visible = float((B * blocks_N * (np.asarray(lengths, dtype=np.float64) / 2 + B)).sum())
    epoch_flops = FlopModel.from_config(dc).step_flops(block_tokens=int(block_tokens), context_tokens=int(context),
                                                       supervised_tokens=int(block_tokens * (B - 1) / B),
                                                       visible_keys=int(visible))
    seconds = epoch_flops * total_steps / max(1, steps_per_epoch) / flops_per_s
    return (f"CPU training of a GPU-sized configuration ({cfg.num_anchors} anchors x block {B} = "
            f"{cfg.num_anchors * B} block tokens per sequence): about {seconds / 60:.0f} min for {total_steps} steps "
            f"at the measured {flops_per_s / 1e9:.0f} GFLOP/s. For a CPU run use fewer anchors and a smaller "
            f"block, e.g. --num-anchors 32 --block-size 8")


def cpu_matmul_flops() -> float:
    """FLOP/s of a float32 512^3 matmul on this CPU (~0.1 s), the rate behind cpu_time_warning."""
    import time

    a = torch.randn(512, 512)
    a @ a  # warm-up
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.1:
        a @ a
        n += 1
    return 2 * 512**3 * n / (time.perf_counter() - t0)
