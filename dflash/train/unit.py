"""One drafter being trained: model, optimizer, scheduler, GradSync, metric window and sink, checkpoints.

The driver (train.driver.run_stream) hands every unit of a stream each micro-batch (the unit slices its taps
out of the stream's tap union and picks its anchors by its AnchorRule) and tells it when a step ends, so K
units share one read of the cache. A unit never touches the loader.

Shapes: T = packed context tokens, K = taps of the stream, K' = taps of this drafter, D = hidden size.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import resource
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from dflash.durable import replace_text
from dflash.errors import TrainingDiverged
from dflash.train import checkpoint as ckpt
from dflash.train.config import TrainConfig
from dflash.train.distributed import DistInfo, barrier
from dflash.train.loader import MicroBatch
from dflash.train.metrics import H200_PEAK_BF16, FlopModel, MetricSink, Stopwatch
from dflash.train.noise import add_feature_noise, noise_std
from dflash.train.objective import resolve_gamma
from dflash.train.prefix import DEFAULT_PREFIX_WEIGHT_BASE
from dflash.train.step import (AnchorRule, GradSync, apply_divisor, autocast, lr_factor, micro_batch_loss,
                              summarize_counters)

if TYPE_CHECKING:
    from dflash.eval.heldout import HeldoutEvaluator
    from dflash.train.setup import DrafterSetup, TargetSetup

log = logging.getLogger(__name__)


def memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def build_optimizer(params: list[torch.nn.Parameter], cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over the fp32 master weights, the fused kernel on CUDA and CPU: on CUDA one launch for all
    parameters instead of a foreach chain of ~10 kernels per step over 1.7B parameters (27B drafter shape); on
    CPU 11 vs 42 ms a step for the SmolLM2 drafter's 20M parameters. Both take the step's normaliser and clip as
    their grad_scale (train.step.apply_divisor)."""
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                             fused=device.type in ("cuda", "cpu"))


DIVERGED_FILE = "diverged.json"
"""RUN_DIR/diverged.json: the step a run diverged at (Unit._check_finite); a resume that trains on removes it."""


def first_non_finite(norms: list[float], *, first_step: int) -> tuple[int, float] | None:
    """(global step, norm) of the first non-finite gradient norm of a window whose first step is `first_step`."""
    for k, n in enumerate(norms):
        if not np.isfinite(n):
            return first_step + k, n
    return None


@dataclass(frozen=True, kw_only=True)
class UnitSpec:
    """Everything one unit of a stream is built from (train.driver.build_unit makes it)."""

    name: str
    """Name in the log ("train", or the sweep run's name)."""
    cfg: TrainConfig
    """The run's config; cfg.output is its run folder."""
    drafter: "DrafterSetup"
    """The drafter on the device, its config and the run's step count."""
    state: dict[str, Any] | None
    """The checkpoint being resumed, or None for a fresh run."""
    tap_index: tuple[int, ...] | None
    """Positions of this drafter's taps in the stream's taps; None = the stream carries exactly its taps."""
    restore_rng: bool = True
    """Restore the checkpoint's global RNG states (a stream of one unit; a sweep's units share the process)."""
    progress: bool = True
    """Show a tqdm progress bar on rank 0."""
    cache: dict[str, Any] | None = None
    """driver.cache_record of the training cache, written into every checkpoint (checked on resume)."""
    heldout: "HeldoutEvaluator | None" = None
    """Exact held-out tau every cfg.eval_every steps and at the end (rank 0 only); None = no eval cache."""


class DrafterUnit:
    """The per-drafter state of a run. `pos` is the data position this drafter has trained up to."""

    def __init__(self, spec: UnitSpec, *, target: "TargetSetup", info: DistInfo) -> None:
        cfg, d, state = spec.cfg, spec.drafter, spec.state
        self.cfg, self.name, self.info = cfg, spec.name, info
        self.cache_record = spec.cache
        self.cache_manifest = target.reader.manifest  # the model card's training-data table
        self.heldout = spec.heldout
        self.run_dir = pathlib.Path(cfg.output)
        self.drafter, self.dc = d.drafter, d.drafter_config
        self.embed_VD, self.lm_head_VD = target.embed_VD, target.lm_head_VD
        self.compute_dtype = target.compute_dtype
        self.total_steps = d.total_steps
        self.grad_denominator = d.grad_denominator
        self.anchor_rule = AnchorRule(seed=cfg.seed, num_anchors=cfg.num_anchors, block_size=self.dc.block_size,
                                      full_blocks=cfg.anchor_positions == "full_blocks", objective=cfg.objective,
                                      # dflash draws no prefix: runs differing only in the unused base share a draw
                                      prefix_weight_base=(cfg.prefix_weight_base if cfg.objective != "dflash"
                                                          else DEFAULT_PREFIX_WEIGHT_BASE))
        self.tap_index = None if spec.tap_index is None else torch.tensor(spec.tap_index, dtype=torch.long,
                                                                          device=info.device)
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, cfg, info.device)
        warmup = int(round(cfg.warmup_ratio * self.total_steps))
        total = self.total_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, total_steps=total, warmup_steps=warmup,
                                                   min_lr_ratio=cfg.min_lr_ratio))
        self.pos = ckpt.DataPosition(epoch=0, step_in_epoch=0, global_step=0)
        self.diverged: dict[str, Any] | None = None
        if self.info.is_main:
            (self.run_dir / DIVERGED_FILE).unlink(missing_ok=True)   # this run trains on: an earlier stop is past
        self.plan_version = ckpt.plan_version_of(state)  # written into every checkpoint of this run
        window: dict[str, Any] = {}
        if state is not None:
            self.drafter.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            if spec.restore_rng:
                ckpt.set_rng_state(state["rng"])
            self.pos = ckpt.position_of(state)
            window = state.get("extra", {}).get("metric_window") or {}
            log.info("%s: resuming at step %d (epoch %d, step %d of the epoch)", self.name, self.pos.global_step,
                     self.pos.epoch, self.pos.step_in_epoch)
        if info.is_main:
            # A fresh start (state None) in a folder with records of a run killed before its first checkpoint
            # drops them too; they are redone.
            truncate_metrics(self.run_dir, self.pos.global_step)
        self.sync = GradSync(self.params, block_size=self.dc.block_size, device=info.device)
        self.flops = FlopModel.from_config(self.dc)
        self.peak = cfg.peak_flops if cfg.peak_flops is not None else (
            H200_PEAK_BF16 if info.device.type == "cuda" else None)
        self.sink = MetricSink(self.run_dir, enabled=info.is_main, total_steps=self.total_steps,
                               initial_step=self.pos.global_step, progress=spec.progress, report_to=cfg.report_to,
                               config={"train": cfg.to_json(), "drafter": self.dc.to_json()})
        self.gamma = resolve_gamma(cfg.gamma, block_size=self.dc.block_size)
        self.noise = cfg.noise
        self._micro_in_step = 0
        self.last_loss: float | None = None
        self.last_record: dict[str, Any] | None = None
        """The last metrics record this call wrote (its `loss` is the "final loss" train and sweep print)."""
        self.steps_this_run = 0
        self.drafter_dir: pathlib.Path | None = None
        self.last_heldout = None
        """The last held-out evaluation (eval.heldout.HeldoutResult) of this call, for the model card."""
        # The log window: steps since the last metrics record. A checkpoint inside a window carries the
        # window's counters (metric_window), so a resume logs every step exactly once.
        self._window: list[torch.Tensor] = [c.to(info.device) for c in window.get("counters", [])]
        self._norms: list[torch.Tensor] = [n.to(info.device) for n in window.get("norms", [])]
        self._first = int(window.get("first", self.pos.global_step + 1))
        self._tokens, self._flops, self._timed_steps = 0, 0.0, 0  # of this process only (tokens/s, MFU)
        self._step_flops = 0.0
        self.watch = Stopwatch()
        # samples and tokens seen per cache since step 0 (a mixture of several caches; None for one cache)
        readers = getattr(target.reader, "readers", None)
        self.mix_names: tuple[str, ...] | None = tuple(r.path for r in readers) if readers else None
        seen = (state or {}).get("extra", {}).get("mix_seen")
        self.mix_seen = None if self.mix_names is None else (
            np.asarray(seen, dtype=np.int64) if seen is not None else np.zeros((2, len(self.mix_names)), np.int64))

    @property
    def finished(self) -> bool:
        """Trained to its last step, or stopped for good at a diverged one (nothing more to train or export)."""
        return self.diverged is not None or self.pos.global_step >= self.total_steps

    def begin_step(self) -> None:
        self.sync.zero()
        self._step_flops = 0.0
        self._micro_in_step = 0

    def _noise_generator(self) -> torch.Generator:
        """The feature-noise draws of one micro-batch, seeded by (seed, step, rank, micro-batch of the step):
        a resumed run draws the same noise as an uninterrupted one without saving generator state."""
        seed = int(np.random.SeedSequence([self.cfg.seed, self.pos.global_step, self.info.rank, self._micro_in_step,
                                           0x401]).generate_state(1, np.uint64)[0] >> 1)
        return torch.Generator(device=self.info.device).manual_seed(seed)

    def micro_batch(self, mb: MicroBatch) -> None:
        """Forward + backward of one non-empty micro-batch of the stream, with this drafter's taps and anchors."""
        if self.tap_index is not None:
            mb = dataclasses.replace(mb, hidden_TKD=mb.hidden_TKD.index_select(1, self.tap_index))
        hb = mb.blocks[self.anchor_rule]
        std = noise_std(step=self.pos.global_step, total_steps=self.total_steps, cfg=self.noise)
        if std > 0:
            mb = dataclasses.replace(mb, hidden_TKD=add_feature_noise(mb.hidden_TKD, std=std,
                                                                      generator=self._noise_generator()))
        self._micro_in_step += 1
        with autocast(self.info.device, self.compute_dtype):
            terms = micro_batch_loss(self.drafter, mb, hb, embed_VD=self.embed_VD, lm_head_VD=self.lm_head_VD,
                                     mask_token_id=self.dc.mask_token_id, gamma=self.gamma,
                                     loss_chunk_blocks=self.cfg.loss_chunk_blocks, loss_impl=self.cfg.loss_impl,
                                     loss_normalization=self.cfg.loss_normalization,
                                     selector_weight=self.cfg.selector_weight)
        terms.weighted_ce_sum.backward()
        self.sync.add(terms)
        self._step_flops += self.flops.step_flops(
            block_tokens=sum(hb.blocks_per_sample) * self.dc.block_size, context_tokens=mb.num_tokens,
            supervised_tokens=hb.supervised_tokens, visible_keys=self._visible_keys(hb))

    def _visible_keys(self, hb) -> int:
        """Keys per layer summed over block tokens, for the FLOP model: the host count of the anchor draw for the
        paper's layers; a drafter with windowed or causal layers averages its layers' counts (the FlopModel
        multiplies by the layer count)."""
        attns = [self.dc.layer_attention(i) for i in range(self.dc.num_hidden_layers)]
        if all(a.is_full for a in attns):
            return hb.visible_keys
        from dflash.train.objective import visible_keys

        B = self.dc.block_size
        anchors = hb.anchors_J.numpy()
        return round(sum(visible_keys(anchors, block_size=B, attn=a) for a in attns) / len(attns))

    def end_step(self, pos: ckpt.DataPosition, *, step_tokens: int, stall_s: Callable[[], float],
                 stop: bool = False, mix: tuple[np.ndarray, np.ndarray] | None = None,
                 evaluate_at_stop: bool = True) -> bool:
        """All-reduce, clip, optimizer and scheduler step; log and checkpoint when due. Returns True if it logged.
        stall_s() gives the loader's wait time since its last reset (read only on log steps). mix: the step's
        (samples, tokens) per cache (driver.step_mix) of a mixture run. evaluate_at_stop=False: a stop for
        SIGTERM checkpoints without the held-out evaluation (the grace before SIGKILL is short)."""
        cfg = self.cfg
        if mix is not None and self.mix_seen is not None:
            self.mix_seen += np.stack(mix)
        self.sync.reduce(self.info.world_size)
        norm, divisor = self.sync.norm_and_divisor(max_norm=cfg.grad_clip, denominator=self.grad_denominator)
        apply_divisor(self.optimizer, self.sync.grads, divisor)
        self.optimizer.step()
        self.scheduler.step()
        self.pos = pos
        self.steps_this_run += 1
        self._window.append(self.sync.step_counters())
        self._norms.append(norm.detach().float().reshape(1))
        self._tokens += step_tokens
        self._flops += self._step_flops
        self._timed_steps += 1
        self.sink.advance()
        last = self.finished or stop
        logged = False
        evaluate = self.heldout is not None and (pos.global_step % cfg.eval_every == 0
                                                 or self.finished or (stop and evaluate_at_stop))
        due_log = pos.global_step % cfg.log_every == 0 or last or evaluate
        due_save = pos.global_step % cfg.save_every == 0 or last
        if due_log or due_save:
            norms = torch.cat(self._norms).cpu().tolist()   # the window's, on the host once: checked, then logged
            self._check_finite(norms)
        if due_log:
            self._log(pos, stall_s(), norms, heldout=self._evaluate() if evaluate else None)
            logged = True
        if due_save:
            self.save()
        return logged

    def _check_finite(self, norms: list[float]) -> None:
        """Raise TrainingDiverged when a step of the window (`norms`) had a non-finite gradient norm: its update has
        made the weights non-finite, and a checkpoint of them would rotate the good ones away (keep_checkpoints).
        Checked before every log and save, so no step goes unchecked into a checkpoint or an export; the norm
        is the all-reduced one, so every rank stops at the same step."""
        step = first_non_finite(norms, first_step=self._first)
        if step is not None:
            newest = ckpt.latest_checkpoint(self.run_dir)
            # --lr cannot change on --resume (an exact resume would reach the same step again)
            then = (f"start a new run with a lower --lr and --init-from {newest} (the newest checkpoint's weights)"
                    if newest else "start again with a lower --lr")
            self.diverged = {"step": step[0], "grad_norm": step[1],
                             "newest_checkpoint": str(newest) if newest else None}
            if self.info.is_main:
                replace_text(self.run_dir / DIVERGED_FILE, json.dumps(self.diverged, indent=2) + "\n")
            raise TrainingDiverged(f"{self.name}: training diverged at step {step[0]} (gradient norm {step[1]}); "
                                   f"nothing from that step on is checkpointed or exported: {then}; if the lr is "
                                   "not the cause, check the cache with `dflash cache verify` (bytes and nan/inf)")

    def _evaluate(self) -> dict[str, Any]:
        """Held-out tau of the drafter as it is now (heldout_* metrics), with the time it took; the time is
        no part of the log window's tokens/s (the stopwatch is lapped around it)."""
        assert self.heldout is not None
        self.watch.pause()
        try:
            res = self.heldout.evaluate(self.drafter, embed_VD=self.embed_VD, lm_head_VD=self.lm_head_VD,
                                        compute_dtype=self.compute_dtype)
        finally:
            self.watch.resume()
        self.last_heldout = res
        return res.to_metrics()

    def _log(self, pos: ckpt.DataPosition, stall_s: float, norms: list[float], *,
             heldout: dict[str, Any] | None = None) -> None:
        """One metrics record of the log window; `norms`: its gradient norms, already on the host."""
        B = self.dc.block_size
        dt = self.watch.lap()  # after the .cpu() below the GPU has caught up; measured per window
        summ = summarize_counters(torch.stack(self._window), block_size=B)
        dt = dt + self.watch.lap()
        self.last_loss = summ["losses"][-1]
        steps = max(1, self._timed_steps)
        rec = {"step": pos.global_step, "epoch": pos.epoch,
               "loss": float(np.mean(summ["losses"])), "step_losses": summ["losses"], "first_step": self._first,
               "lr": self.scheduler.get_last_lr()[0], "grad_norm": float(np.mean(norms)),
               "acc": summ["acc"], "accept_len": summ["accept_len"],
               "tokens_per_s": self._tokens / dt, "stall_frac": min(1.0, stall_s / dt),
               "mfu": (self._flops / dt / self.peak) if self.peak else None, "mem_gb": memory_gb(self.info.device),
               "step_time_s": dt / steps}
        rec.update(self.mix_metrics())
        if heldout is not None:
            rec.update(heldout)
            # training-batch acceptance over held-out tau: well above 1 means the drafter memorises its batches
            tau = heldout["heldout_tau"]
            rec["train_over_heldout"] = summ["accept_len"] / tau if tau and tau == tau else None
        self.sink.write(rec)
        self.last_record = rec
        self._window, self._norms, self._tokens, self._flops, self._timed_steps = [], [], 0, 0.0, 0
        self._first = pos.global_step + 1

    def mix_metrics(self) -> dict[str, Any]:
        """cache_samples / cache_tokens: per cache path, what the run has trained on since step 0 (a mixture
        only; {} for one cache)."""
        if self.mix_seen is None or self.mix_names is None:
            return {}
        return {"cache_samples": dict(zip(self.mix_names, self.mix_seen[0].tolist())),
                "cache_tokens": dict(zip(self.mix_names, self.mix_seen[1].tolist()))}

    def _window_state(self) -> dict[str, Any]:
        """The unlogged part of the log window, for the checkpoint (host tensors)."""
        return {"counters": [c.cpu() for c in self._window], "norms": [n.cpu() for n in self._norms],
                "first": self._first}

    def save(self) -> None:
        if self.info.is_main:
            ckpt.save_checkpoint(self.run_dir, model_state=self.drafter.state_dict(),
                                 optimizer_state=self.optimizer.state_dict(),
                                 scheduler_state=self.scheduler.state_dict(), position=self.pos,
                                 world_size=self.info.world_size, train_config=self.cfg.to_json(),
                                 drafter_config=self.dc.to_json(), keep=self.cfg.keep_checkpoints,
                                 extra={"metric_window": self._window_state(), "cache": self.cache_record,
                                        "mix_seen": None if self.mix_seen is None else self.mix_seen.tolist()},
                                 plan_version=self.plan_version)
        barrier(self.info)

    def export(self) -> pathlib.Path:
        """Write RUN_DIR/drafter with its model card (README.md: held-out tau, data, recipe) on rank 0; every
        rank calls it once the unit is finished."""
        out = self.run_dir / "drafter"
        if self.info.is_main:
            from dflash.drafter.card import write_model_card
            from dflash.drafter.export import export_drafter
            from dflash.train.prefix import objective_config_fields

            out = export_drafter(self.drafter, self.dc, out, overwrite=True,
                                 dflash_extra=objective_config_fields(self.cfg.objective, self.cfg.prefix_weight_base))
            heldout = []
            if self.last_heldout is not None:  # the evaluation of the last step (end_step runs before export)
                heldout = [{**self.last_heldout.to_json(), "name": pathlib.Path(str(self.cfg.eval_cache)).name,
                            "step": self.pos.global_step}]
            data = self.cache_manifest
            if self.mix_names is not None:
                from dflash.drafter.card import data_summary

                data = {**data_summary(data), **self.mix_metrics()}
            write_model_card(out, heldout=heldout, data=data, recipe=self.cfg.to_json(), target=self.cfg.model)
            log.info("%s: exported the drafter of step %d to %s", self.name, self.pos.global_step, out)
        barrier(self.info)
        self.drafter_dir = out
        return out

    def close(self) -> None:
        self.sink.close()


def truncate_metrics(run_dir: pathlib.Path, global_step: int) -> None:
    """Drop metric records past the checkpoint being resumed (an interrupted run logged them; they are redone),
    and a torn last line (a kill or a full disk mid-write)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    keep = []
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                log.warning("%s: dropping a torn last line (%d bytes)", path, len(line))
                break
            raise
        if rec["step"] <= global_step:
            keep.append(line)
    replace_text(path, "".join(line + "\n" for line in keep))
