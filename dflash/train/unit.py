"""One drafter being trained: model, optimizer, scheduler, GradSync, metric window and sink, checkpoints.

`dflash train` drives one DrafterUnit; `dflash sweep` drives K of them over one micro-batch stream. A unit
never touches the loader: the driver hands it each micro-batch (with this unit's anchors and its taps sliced
out of the stream's tap union) and tells it when a step ends, so K units can share one read of the cache.

Shapes: T = packed context tokens, K = taps of the stream, K' = taps of this drafter, D = hidden size.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import resource
from typing import Any, Callable

import numpy as np
import torch

from dflash.durable import replace_text
from dflash.train import checkpoint as ckpt
from dflash.train.config import TrainConfig
from dflash.train.distributed import DistInfo, barrier
from dflash.train.loader import MicroBatch
from dflash.train.metrics import H200_PEAK_BF16, FlopModel, MetricSink, Stopwatch
from dflash.train.step import GradSync, lr_factor, micro_batch_loss, summarize_counters

log = logging.getLogger(__name__)


def memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def build_optimizer(params: list[torch.nn.Parameter], cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over the fp32 master weights. On CUDA the fused kernel: one launch for all parameters instead of
    a foreach chain of ~10 kernels per step over 1.7B parameters (27B drafter shape); the CPU keeps the default
    implementation (checkpoints written there resume bit-exactly)."""
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                             fused=True if device.type == "cuda" else None)


class DrafterUnit:
    """The per-drafter state of a run. `pos` is the data position this drafter has trained up to."""

    def __init__(self, *, cfg: TrainConfig, run_dir: pathlib.Path, drafter: torch.nn.Module, drafter_config: Any,
                 embed_VD: torch.Tensor, lm_head_VD: torch.Tensor, total_steps: int, default_gamma: float,
                 info: DistInfo, state: dict | None, restore_rng: bool = True, progress: bool = True,
                 tap_index: list[int] | None = None, name: str = "train") -> None:
        self.cfg, self.run_dir, self.drafter, self.dc = cfg, run_dir, drafter, drafter_config
        self.embed_VD, self.lm_head_VD, self.info, self.name = embed_VD, lm_head_VD, info, name
        self.total_steps = total_steps
        # None: the stream carries exactly this drafter's taps in its order; else positions in the stream's taps
        self.tap_index = None if tap_index is None else torch.tensor(tap_index, dtype=torch.long,
                                                                     device=info.device)
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, cfg, info.device)
        warmup = int(round(cfg.warmup_ratio * total_steps))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, total_steps=total_steps, warmup_steps=warmup,
                                                   min_lr_ratio=cfg.min_lr_ratio))
        self.pos = ckpt.DataPosition(epoch=0, step_in_epoch=0, global_step=0)
        self.plan_version = ckpt.plan_version_of(state)  # written into every checkpoint of this run
        if state is not None:
            drafter.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            if restore_rng:
                ckpt.set_rng_state(state["rng"])
            self.pos = ckpt.position_of(state)
            if info.is_main:
                truncate_metrics(run_dir, self.pos.global_step)
                log.info("%s: resuming at step %d (epoch %d, step %d of the epoch)", name, self.pos.global_step,
                         self.pos.epoch, self.pos.step_in_epoch)
        self.sync = GradSync(self.params, block_size=drafter_config.block_size, device=info.device)
        self.flops = FlopModel.from_config(drafter_config)
        device = info.device
        self.peak = cfg.peak_flops if cfg.peak_flops is not None else (
            H200_PEAK_BF16 if device.type == "cuda" else None)
        self.sink = MetricSink(run_dir, enabled=info.is_main, total_steps=total_steps,
                               initial_step=self.pos.global_step, progress=progress)
        self.gamma = cfg.gamma if cfg.gamma is not None else default_gamma
        self.last_loss: float | None = None
        self.steps_this_run = 0
        self._window: list[torch.Tensor] = []
        self._norms: list[torch.Tensor] = []
        self._tokens, self._flops, self._first = 0, 0.0, self.pos.global_step + 1
        self._step_flops = 0.0
        self.watch = Stopwatch()

    @property
    def finished(self) -> bool:
        return self.pos.global_step >= self.total_steps

    def begin_step(self) -> None:
        self.sync.zero()
        self._step_flops = 0.0

    def micro_batch(self, mb: MicroBatch, host_blocks: Any, autocast: Callable[[], Any]) -> None:
        """Forward + backward of one non-empty micro-batch; `host_blocks` = this drafter's anchors (step.HostBlocks)."""
        if self.tap_index is not None:
            mb = dataclasses.replace(mb, hidden_TKD=mb.hidden_TKD.index_select(1, self.tap_index))
        mb = dataclasses.replace(mb, extra=host_blocks)
        with autocast():
            terms = micro_batch_loss(self.drafter, mb, embed_VD=self.embed_VD, lm_head_VD=self.lm_head_VD,
                                     mask_token_id=self.dc.mask_token_id, gamma=self.gamma,
                                     loss_chunk_blocks=self.cfg.loss_chunk_blocks, loss_impl=self.cfg.loss_impl)
        terms.weighted_ce_sum.backward()
        self.sync.add(terms)
        hb = host_blocks
        self._step_flops += self.flops.step_flops(
            block_tokens=sum(hb.blocks_per_sample) * self.dc.block_size, context_tokens=mb.num_tokens,
            supervised_tokens=hb.supervised_tokens, visible_keys=hb.visible_keys)

    def end_step(self, pos: ckpt.DataPosition, *, step_tokens: int, stall_s: Callable[[], float],
                 stop: bool = False) -> bool:
        """All-reduce, clip, optimizer and scheduler step; log and checkpoint when due. Returns True if it logged."""
        cfg = self.cfg
        self.sync.reduce_and_normalise(self.info.world_size)
        norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        self.optimizer.step()
        self.scheduler.step()
        self.pos = pos
        self.steps_this_run += 1
        self._window.append(self.sync.step_counters())
        self._norms.append(norm.detach().float().reshape(1))
        self._tokens += step_tokens
        self._flops += self._step_flops
        self.sink.advance()
        last = self.finished or stop
        logged = False
        if pos.global_step % cfg.log_every == 0 or last:
            self._log(pos, stall_s())
            logged = True
        if pos.global_step % cfg.save_every == 0 or last:
            self.save()
        return logged

    def _log(self, pos: ckpt.DataPosition, stall_s: float) -> None:
        B = self.dc.block_size
        dt = self.watch.lap()  # after the .cpu() below the GPU has caught up; measured per window
        summ = summarize_counters(torch.stack(self._window), block_size=B)
        norms = torch.cat(self._norms).cpu().tolist()
        dt = dt + self.watch.lap()
        self.last_loss = summ["losses"][-1]
        rec = {"step": pos.global_step, "epoch": pos.epoch,
               "loss": float(np.mean(summ["losses"])), "step_losses": summ["losses"], "first_step": self._first,
               "lr": self.scheduler.get_last_lr()[0], "grad_norm": float(np.mean(norms)),
               "acc": summ["acc"], "accept_len": summ["accept_len"],
               "tokens_per_s": self._tokens / dt, "stall_frac": min(1.0, stall_s / dt),
               "mfu": (self._flops / dt / self.peak) if self.peak else None, "mem_gb": memory_gb(self.info.device),
               "step_time_s": dt / len(self._window)}
        self.sink.write(rec)
        self._window, self._norms, self._tokens, self._flops = [], [], 0, 0.0
        self._first = pos.global_step + 1

    def save(self, extra: dict | None = None) -> None:
        if self.info.is_main:
            ckpt.save_checkpoint(self.run_dir, model_state=self.drafter.state_dict(),
                                 optimizer_state=self.optimizer.state_dict(),
                                 scheduler_state=self.scheduler.state_dict(), position=self.pos,
                                 world_size=self.info.world_size, train_config=self.cfg.to_json(),
                                 drafter_config=self.dc.to_json(), keep=self.cfg.keep_checkpoints, extra=extra,
                                 plan_version=self.plan_version)
        barrier(self.info)

    def export(self) -> pathlib.Path | None:
        """Write RUN_DIR/drafter (rank 0); call once the unit is finished."""
        if not self.info.is_main:
            return None
        from dflash.drafter.export import export_drafter

        out = export_drafter(self.drafter, self.dc, self.run_dir / "drafter", overwrite=True)
        log.info("%s: exported the drafter to %s", self.name, out)
        return out

    def close(self) -> None:
        self.sink.close()


def truncate_metrics(run_dir: pathlib.Path, global_step: int) -> None:
    """Drop metric records past the checkpoint being resumed (an interrupted run logged them; they are redone)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] <= global_step]
    replace_text(path, "".join(line + "\n" for line in keep))
