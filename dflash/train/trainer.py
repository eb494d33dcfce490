"""`dflash train`: train a DFlash drafter from a hidden-state cache, with exact resume and data parallelism.

One process per device (torchrun, or `spawn_local` for --gpus N). Every rank plans the same epoch
(loader.plan_epoch) and runs its share; one all-reduce per step carries gradients and metric counters
(step.GradSync). Rank 0 writes checkpoints, metrics and the final export (RUN_DIR/drafter).
Tradeoff: the frozen embedding and LM head are replicated on every rank (2 x V x D in the compute dtype).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
from dataclasses import dataclass

import torch

from dflash.errors import ConfigError
from dflash.train import checkpoint as ckpt
from dflash.train.config import TrainConfig, check_resume_compatible
from dflash.train.distributed import DistInfo, barrier, destroy_distributed, init_distributed
from dflash.train.loader import StreamingLoader, plan_costs, plan_epoch
from dflash.train.setup import TrainSetup, prepare_run_dir, setup_training
from dflash.train.step import host_anchors
from dflash.train.unit import DrafterUnit, build_optimizer  # noqa: F401 (build_optimizer: re-exported)

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    run_dir: pathlib.Path
    global_step: int
    total_steps: int
    finished: bool
    drafter_dir: pathlib.Path | None
    last_loss: float | None
    cache_bytes_read: int = 0
    """Hidden/scale bytes this process read from the cache (0 for an --online run: it reads ids and masks only)."""


def train(cfg: TrainConfig, *, resume: bool = False, device: str | None = None) -> TrainResult:
    """Run (or resume) training; call in every process. device: None = CUDA when available, else "cpu"."""
    info = init_distributed(device=device)
    try:
        return _train(cfg, resume=resume, info=info)
    finally:
        destroy_distributed()


def autocast(device: torch.device, dtype: torch.dtype):
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def _train(cfg: TrainConfig, *, resume: bool, info: DistInfo) -> TrainResult:
    run_dir = pathlib.Path(cfg.output)
    state = prepare_run_dir(run_dir, resume=resume)      # every rank checks before anyone writes
    barrier(info)
    s: TrainSetup = setup_training(cfg, info=info, resume_state=state)
    for reason in s.reasons:
        if info.is_main:
            log.info("%s", reason)
    if state is not None:
        check_resume_compatible(state["train_config"], cfg)
        if state["world_size"] != info.world_size:
            raise ConfigError(f"--resume with {info.world_size} processes, but the checkpoint was written by "
                              f"{state['world_size']}: the epoch plan depends on the world size; resume with "
                              f"{state['world_size']}")
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps({"train": cfg.to_json(), "drafter": s.drafter_config.to_json(),
                                                          "world_size": info.world_size}, indent=2) + "\n")

    device = info.device
    unit = DrafterUnit(cfg=cfg, run_dir=run_dir, drafter=s.drafter, drafter_config=s.drafter_config,
                       embed_VD=s.embed_VD, lm_head_VD=s.lm_head_VD, total_steps=s.total_steps,
                       default_gamma=s.default_gamma, info=info, state=state,
                       progress=os.environ.get("DFLASH_NO_PROGRESS") != "1")
    dc, total_steps, pos = s.drafter_config, s.total_steps, unit.pos
    online = None
    if cfg.online:  # the live target computes the taps of every micro-batch; the cache gives only the tokens
        from dflash.train.online import OnlineTaps, online_target_dtype

        online = OnlineTaps.load(cfg.model, s.taps, device=device, batch_tokens=cfg.batch_tokens,
                                 dtype=online_target_dtype(s.reader.fingerprint.target_dtype, device))
    lengths = s.reader.index.length
    costs = plan_costs(lengths, s.reader.index.num_loss_tokens, plan_version=unit.plan_version)
    finished = False

    try:
        while pos.global_step < total_steps:
            plan = plan_epoch(lengths, seed=cfg.data_seed, epoch=pos.epoch, batch_tokens=cfg.batch_tokens,
                              world_size=info.world_size, grad_accum=cfg.grad_accum, costs=costs)
            if pos.step_in_epoch >= plan.num_steps:
                pos = ckpt.DataPosition(epoch=pos.epoch + 1, step_in_epoch=0, global_step=pos.global_step)
                continue
            epoch = pos.epoch

            def host_fn(packed, ep, _cfg=cfg, _pin=device.type == "cuda"):
                return host_anchors(packed, ep, seed=_cfg.seed, num_anchors=_cfg.num_anchors,
                                    block_size=dc.block_size, pin=_pin)

            loader = StreamingLoader(s.reader, plan, rank=info.rank, start_step=pos.step_in_epoch, taps=s.taps,
                                     device=device, dtype=s.compute_dtype, num_readers=cfg.num_readers,
                                     prefetch=cfg.prefetch, host_fn=host_fn, read_hidden=online is None)
            with loader:
                for step_in_epoch in range(pos.step_in_epoch, plan.num_steps):
                    if pos.global_step >= total_steps:
                        break
                    unit.begin_step()
                    for _ in range(cfg.grad_accum):
                        mb = loader.next()
                        if mb.is_empty:
                            continue  # padding of the epoch's last step: contributes nothing
                        if online is not None:
                            mb = online.fill(mb, s.compute_dtype)
                        unit.micro_batch(mb, mb.extra, lambda: autocast(device, s.compute_dtype))
                    pos = ckpt.DataPosition(epoch=epoch, step_in_epoch=step_in_epoch + 1,
                                            global_step=pos.global_step + 1)
                    stop = cfg.stop_after_steps is not None and unit.steps_this_run + 1 >= cfg.stop_after_steps
                    step_tokens = sum(int(lengths[mb_].sum()) for mb_ in plan.steps[step_in_epoch])
                    if unit.end_step(pos, step_tokens=step_tokens, stall_s=lambda: loader.stats.wait_s, stop=stop):
                        loader.stats.reset()
                    if stop:
                        break
            if cfg.stop_after_steps is not None and unit.steps_this_run >= cfg.stop_after_steps:
                break
            if pos.step_in_epoch >= plan.num_steps:
                pos = ckpt.DataPosition(epoch=pos.epoch + 1, step_in_epoch=0, global_step=pos.global_step)
        finished = pos.global_step >= total_steps
        drafter_dir = unit.export() if finished else None
        barrier(info)
    finally:
        unit.close()
        s.reader.close()
    return TrainResult(run_dir=run_dir, global_step=pos.global_step, total_steps=total_steps, finished=finished,
                       drafter_dir=drafter_dir, last_loss=unit.last_loss, cache_bytes_read=s.reader.bytes_read)
