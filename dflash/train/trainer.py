"""`dflash train`: train a DFlash drafter from a hidden-state cache, with exact resume and data parallelism.

One process per device (torchrun, or `spawn_local` for --gpus N). The run is a stream of one unit
(train.driver.run_stream); rank 0 writes checkpoints, metrics and the final export (RUN_DIR/drafter).
Tradeoff: the frozen embedding and LM head are replicated on every rank (2 x V x D in the compute dtype).
"""

from __future__ import annotations

import logging
import os
import pathlib
from collections.abc import Callable
from dataclasses import dataclass

from dflash.train.config import TrainConfig
from dflash.train.distributed import AgreedFlag, DistInfo, barrier, destroy_distributed, init_distributed
from dflash.train.driver import Stream, build_unit, run_stream
from dflash.train.interrupted import StepInterrupted
from dflash.train.online import live_taps
from dflash.train.setup import prepare_run_dir, setup_target
from dflash.train.terminate import sigterm_received

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    run_dir: pathlib.Path
    global_step: int
    total_steps: int
    finished: bool
    drafter_dir: pathlib.Path | None
    last_loss: float | None
    """Loss of the last step this call trained (None when it trained none: a resumed finished run)."""
    final_record: dict | None = None
    """The last metrics record this call wrote: metrics.describe_final_loss words it (None: no step logged)."""
    cache_bytes_read: int = 0
    """Hidden/scale bytes this process read from the cache (0 for an --online run: it reads ids and masks only)."""
    terminated: bool = False
    """Stopped by SIGTERM at global_step, with a checkpoint there (train.terminate)."""


def train(cfg: TrainConfig, *, resume: bool = False, device: str | None = None,
          before_step: Callable[[int], None] | None = None) -> TrainResult:
    """Run (or resume) training; call in every process. device: None = CUDA when available, else "cpu".
    before_step(global_step): run_stream's hook (benchmarks start a profiler there)."""
    info = init_distributed(device=device)
    try:
        return _train(cfg, resume=resume, info=info, before_step=before_step)
    finally:
        destroy_distributed()


def _train(cfg: TrainConfig, *, resume: bool, info: DistInfo, before_step=None) -> TrainResult:
    """Rank 0 holds the run folder's lock (dflash.locks) for the whole run: a second `dflash train` on the
    same --output fails at once naming this process's PID and host, before either writes anything."""
    from dflash.locks import FolderLock

    run_dir = pathlib.Path(cfg.output)
    lock = FolderLock(run_dir, purpose=f"dflash train --output {run_dir}").acquire() if info.is_main else None
    try:
        return _train_locked(cfg, resume=resume, info=info, run_dir=run_dir, before_step=before_step)
    finally:
        if lock is not None:
            lock.release()


def _train_locked(cfg: TrainConfig, *, resume: bool, info: DistInfo, run_dir: pathlib.Path,
                  before_step=None) -> TrainResult:
    state = prepare_run_dir(run_dir, resume=resume)      # every rank checks before anyone writes
    barrier(info)
    target = setup_target(cfg, info=info)
    try:
        if info.is_main:
            for why in target.reasons:
                log.info("%s", why)
        unit = build_unit(cfg, target, info=info, state=state,
                          progress=os.environ.get("DFLASH_NO_PROGRESS") != "1")
        # online: the live target computes the taps of every micro-batch; the cache gives only the tokens
        online = live_taps(cfg, unit.dc.target_layer_ids, reader=target.reader, device=info.device)
        agreed = AgreedFlag(info)
        try:
            stream = Stream(reader=target.reader, taps=tuple(unit.dc.target_layer_ids), info=info,
                            compute_dtype=target.compute_dtype, cfg=cfg, online=online,
                            terminate=lambda: agreed.poll(sigterm_received()))
            res = run_stream([unit], stream, before_step=before_step)
        except KeyboardInterrupt as e:  # Ctrl-C: tell the CLI the step reached (train.interrupted)
            if isinstance(e, StepInterrupted):
                raise
            raise StepInterrupted(global_step=unit.pos.global_step) from None
        finally:
            unit.close()
    finally:
        target.reader.close()
    return TrainResult(run_dir=run_dir, global_step=unit.pos.global_step, total_steps=unit.total_steps,
                       finished=unit.finished, drafter_dir=unit.drafter_dir, last_loss=unit.last_loss,
                       final_record=unit.last_record, cache_bytes_read=target.reader.bytes_read,
                       terminated=res.terminated)
