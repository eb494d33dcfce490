"""The one training loop: epochs, the loader, gradient accumulation, the DDP step, data position, stop and
checkpoint cadence, over a stream of DrafterUnits that share one read of the cache.

`dflash train` is a stream of one unit (trainer.py), `dflash sweep` a stream of K units per device
(sweep/runner.py), and benchmarks/bench_train.py drives the same loop with its I/O patched (`open_loader`:
micro-batches resident on the GPU instead of the disk cache).

Every rank plans the same epoch (loader.plan_epoch); each unit runs its forward/backward on each micro-batch
with its own taps and anchors, and ends the step with one all-reduce (step.GradSync). Units may stand at
different steps after a resume (a sweep run that was checkpointed later than another): the stream restarts
at the earliest position and a unit that is ahead waits until the stream reaches it. A unit that reaches its
own step count checkpoints and exports at once; the stream runs to the longest unit.
Tradeoff: the units of a stream step in lock-step, so a step takes the sum of their step times; the win is
one cache read and one H2D copy instead of K.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import torch

from dflash import ctrl_c
from dflash.errors import ConfigError, TrainingDiverged
from dflash.train import checkpoint as ckpt
from dflash.train.config import TrainConfig, check_resume_compatible
from dflash.train.distributed import DistInfo
from dflash.train.loader import EpochPlan, HostFn, LoaderStats, MicroBatch, StreamingLoader, config_plan, plan_costs
from dflash.train.setup import TargetSetup, setup_drafter
from dflash.train.step import stream_anchors
from dflash.train.unit import DrafterUnit, UnitSpec

if TYPE_CHECKING:
    from dflash.cache.reader import CacheReader
    from dflash.train.online import OnlineTaps

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Stream:
    """What the units of one stream share."""

    reader: "CacheReader"
    """The training cache; its index gives the epoch plans."""
    taps: tuple[int, ...]
    """Taps read (or computed online) per micro-batch: the union of the units' taps, in cache order."""
    info: DistInfo
    """This process's rank, world size and device."""
    compute_dtype: torch.dtype
    """Dtype of the micro-batches' features on the device."""
    cfg: TrainConfig
    """The stream settings (data_seed, batch_tokens, grad_accum, num_readers, prefetch, stop_after_steps):
    the first unit's config; a sweep's units agree on them (sweep.spec.STREAM_FIELDS)."""
    online: "OnlineTaps | None" = None
    """The live target that computes the taps of every micro-batch (--online); None = read them from the cache."""
    terminate: "Callable[[], bool] | None" = None
    """Polled once a step on every rank: True = stop at this step and checkpoint (a SIGTERM that every rank agrees
    on: train.terminate); None = never."""
    drop_diverged: bool = False
    """A unit whose step diverged (TrainingDiverged) leaves the stream and the others go on (a sweep, where a
    too-high lr is one of the runs); False = the error ends the stream (`dflash train`)."""


class BatchSource(Protocol):
    """What the loop needs of a loader: this rank's micro-batches of one epoch plan, in order."""

    stats: LoaderStats

    def next(self) -> MicroBatch: ...

    def __enter__(self) -> "BatchSource": ...

    def __exit__(self, *exc: object) -> None: ...


OpenLoader = Callable[[Stream, EpochPlan, int, HostFn], BatchSource]
"""(stream, plan, start step in the epoch, host_fn) -> the loader of that epoch from that step."""


def streaming_loader(stream: Stream, plan: EpochPlan, start_step: int, host_fn: HostFn) -> BatchSource:
    """The real loader: reader threads, pinned buffers, side-stream H2D (loader.StreamingLoader)."""
    cfg = stream.cfg
    return StreamingLoader(stream.reader, plan, rank=stream.info.rank, start_step=start_step, taps=stream.taps,
                           device=stream.info.device, dtype=stream.compute_dtype, num_readers=cfg.num_readers,
                           prefetch=cfg.prefetch, host_fn=host_fn, read_hidden=stream.online is None)


@dataclass(frozen=True, kw_only=True)
class StreamResult:
    pos: ckpt.DataPosition | None
    """Where the stream stopped (None: every unit had finished before it started)."""
    steps: int
    """Optimizer steps this call ran."""
    terminated: bool = False
    """Stopped (and checkpointed) because Stream.terminate said so, before every unit had finished."""


def build_unit(cfg: TrainConfig, target: TargetSetup, *, info: DistInfo, state: dict[str, Any] | None,
               name: str = "train", stream_taps: Sequence[int] | None = None, restore_rng: bool = True,
               progress: bool = True, record: dict[str, Any] | None = None) -> DrafterUnit:
    """One unit of a stream: check a resumed checkpoint against cfg, build the drafter, write RUN_DIR/config.json
    (rank 0; `record` adds keys to it), and place the drafter's taps in the stream's (`stream_taps` None = the
    drafter's own taps)."""
    if state is not None:
        check_resume_compatible(state["train_config"], cfg)
        if state["world_size"] != info.world_size:
            raise ConfigError(f"--resume with {info.world_size} processes, but the checkpoint was written by "
                              f"{state['world_size']}: the epoch plan depends on the world size; resume with "
                              f"{state['world_size']}")
    cache = cache_record(target.reader)
    if state is not None:
        check_same_cache(state.get("extra", {}).get("cache"), cache)
    d = setup_drafter(cfg, target, info=info, resume_state=state)
    run_dir = pathlib.Path(cfg.output)
    if info.is_main:
        for why in d.reasons:
            log.info("%s: %s", name, why)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(
            {"train": cfg.to_json(), "drafter": d.drafter_config.to_json(), "world_size": info.world_size,
             **(record or {})}, indent=2) + "\n")
    taps = tuple(d.taps) if stream_taps is None else tuple(stream_taps)
    tap_index = None if tuple(d.taps) == taps else tuple(taps.index(t) for t in d.taps)
    heldout = None
    if cfg.eval_cache is not None and info.is_main:  # other ranks wait for rank 0's evaluation at the next step
        from dflash.eval.heldout import HeldoutConfig, HeldoutEvaluator

        heldout = HeldoutEvaluator.from_cache(cfg.eval_cache, taps=tuple(d.drafter_config.target_layer_ids),
                                              device=info.device, model=cfg.model,
                                              cfg=HeldoutConfig(limit=cfg.eval_limit))
    return DrafterUnit(UnitSpec(name=name, cfg=cfg, drafter=d, state=state, tap_index=tap_index,
                                restore_rng=restore_rng, progress=progress, cache=cache, heldout=heldout),
                       target=target, info=info)


def cache_record(reader: "CacheReader") -> dict[str, Any]:
    """What a checkpoint records of the cache it trained on: the fingerprint and the committed totals (a resume
    must see the same samples, or its epoch plan and losses change)."""
    idx = reader.index
    rec = {"fingerprint": reader.fingerprint.to_json(),
           "totals": {"samples": int(len(idx.length)), "tokens": int(idx.length.sum()),
                      "loss_tokens": int(idx.num_loss_tokens.sum())}}
    if hasattr(reader, "readers"):  # a mixture: each cache's own record, in order
        rec["caches"] = [cache_record(r) for r in reader.readers]
    return rec


def check_same_cache(saved: dict[str, Any] | None, current: dict[str, Any]) -> None:
    """Raise CacheMismatchError naming the first field where --cache differs from the cache the checkpoint
    trained on (checkpoints written before this record existed are not checked)."""
    from dflash.cache.format import Fingerprint
    from dflash.errors import CacheMismatchError

    if not saved:
        return
    hint = ("the checkpoint was trained on another cache: resume with the --cache the run started with, or "
            "start a new run in an empty --output")
    who = dict(mine="the checkpoint's cache", theirs="the --cache's")
    try:
        Fingerprint.from_json(current["fingerprint"]).check_matches(Fingerprint.from_json(saved["fingerprint"]))
    except CacheMismatchError as e:  # expected = the checkpoint's value, found = --cache's
        raise CacheMismatchError(e.field, e.expected, e.found, hint, **who) from None
    for key, value in saved["totals"].items():
        if current["totals"][key] != value:
            raise CacheMismatchError(f"totals.{key}", value, current["totals"][key], hint, **who)
    old_caches, new_caches = saved.get("caches", [saved]), current.get("caches", [current])
    if len(old_caches) != len(new_caches):
        raise CacheMismatchError("number of caches", len(old_caches), len(new_caches), hint, **who)
    if "caches" in saved:
        for a, b in zip(old_caches, new_caches):
            check_same_cache(a, b)


def step_mix(reader, micro_batches) -> "tuple[Any, Any] | None":
    """(samples, tokens) per cache of one step's micro-batches (all ranks) when the reader mixes several caches
    (cache.mixed.MixedReader); None for one cache."""
    offsets = getattr(reader, "offsets", None)
    if offsets is None:
        return None
    import numpy as np

    from dflash.train.mixture import per_cache_counts

    idx = np.concatenate([np.asarray(mb, dtype=np.int64) for mb in micro_batches])
    return per_cache_counts(idx, offsets=offsets, lengths=reader.index.length, num_caches=len(offsets))


def run_stream(units: Sequence[DrafterUnit], stream: Stream, *, open_loader: OpenLoader = streaming_loader,
               before_step: Callable[[int], None] | None = None) -> StreamResult:
    """Train every unit to its own step count (or until stream.cfg.stop_after_steps steps of this call).

    before_step(global_step) runs before each step (benchmarks start a profiler there). Call on every rank."""
    cfg, info = stream.cfg, stream.info
    reader = stream.reader
    lengths = reader.index.length
    # One plan for all units: the packing order (version 1) while any unit started before balanced steps; every
    # unit's checkpoints record the version used, so later resumes keep it.
    plan_version = min(u.plan_version for u in units)
    for u in units:
        u.plan_version = plan_version
        if u.finished and u.drafter_dir is None:
            # finished before this call: killed between the last checkpoint and the export, or a rerun
            done = u.run_dir / "drafter" / "config.json"
            u.drafter_dir = u.run_dir / "drafter" if done.exists() else u.export()
    costs = plan_costs(lengths, reader.index.num_loss_tokens, plan_version=plan_version)
    pending = [u for u in units if not u.finished]
    pos = min((u.pos for u in pending), key=lambda p: p.global_step, default=None)
    steps, stop, terminated = 0, False, False
    pin = info.device.type == "cuda"
    while pos is not None and not stop and any(not u.finished for u in units):
        plan = config_plan(cfg, reader.index, epoch=pos.epoch, world_size=info.world_size, costs=costs,
                           counts=getattr(reader, "counts", None))
        if pos.step_in_epoch >= plan.num_steps:
            pos = ckpt.DataPosition(epoch=pos.epoch + 1, step_in_epoch=0, global_step=pos.global_step)
            continue
        # the loader reads no step past the last one a unit needs (a mixture sweep counts each sample's reads)
        needed = pos.step_in_epoch + max(u.total_steps for u in units if not u.finished) - pos.global_step
        if needed < plan.num_steps:
            plan = dataclasses.replace(plan, steps=plan.steps[:needed])
        epoch = pos.epoch
        rules = sorted({u.anchor_rule for u in units if not u.finished})

        def host_fn(packed, ep, _rules=rules):
            return stream_anchors(packed, ep, rules=_rules, pin=pin)

        with open_loader(stream, plan, pos.step_in_epoch, host_fn) as loader:
            for step_in_epoch in range(pos.step_in_epoch, plan.num_steps):
                if all(u.finished for u in units):
                    break
                active = [u for u in units if not u.finished and u.pos.global_step == pos.global_step]
                ctrl_c.raise_if_came()   # a Ctrl-C whose KeyboardInterrupt was lost in a finalizer
                if before_step is not None:
                    before_step(pos.global_step)
                for u in active:
                    u.begin_step()
                for _ in range(cfg.grad_accum):
                    mb = loader.next()
                    if mb.is_empty or not active:
                        continue  # padding of the epoch's last step, or units still ahead: nothing to train
                    # online: one target forward, each run's features rounded through its own online_storage
                    filled = None if stream.online is None else stream.online.fill(
                        mb, stream.compute_dtype, storages=[u.cfg.online_storage for u in active])
                    for u in active:
                        u.micro_batch(mb if filled is None else filled[u.cfg.online_storage])
                pos = ckpt.DataPosition(epoch=epoch, step_in_epoch=step_in_epoch + 1, global_step=pos.global_step + 1)
                steps += 1
                terminated = stream.terminate is not None and stream.terminate()
                stop = terminated or (cfg.stop_after_steps is not None and steps >= cfg.stop_after_steps)
                step_tokens = sum(int(lengths[mb_].sum()) for mb_ in plan.steps[step_in_epoch])
                mix = step_mix(reader, plan.steps[step_in_epoch])
                logged = False
                for u in active:
                    try:
                        logged |= u.end_step(pos, step_tokens=step_tokens, stall_s=lambda: loader.stats.wait_s,
                                             stop=stop, mix=mix, evaluate_at_stop=not terminated)
                    except TrainingDiverged as e:
                        if not stream.drop_diverged:
                            raise
                        log.warning("%s; the other runs go on", e)
                        continue
                    if u.finished:
                        u.export()
                if logged:
                    loader.stats.reset()
                if stop:
                    break
        if not stop and pos.step_in_epoch >= plan.num_steps:
            pos = ckpt.DataPosition(epoch=pos.epoch + 1, step_in_epoch=0, global_step=pos.global_step)
    return StreamResult(pos=pos, steps=steps, terminated=terminated and not all(u.finished for u in units))
