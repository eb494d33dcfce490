"""`dflash sweep`: K drafters per device trained from ONE loader stream, checkpointed per run, exported,
evaluated, and summarised.

Each micro-batch is read from the cache (the union of the group's taps) and copied to the device once; every
drafter of the group then runs its forward/backward on it with its own taps (sliced on the device), anchors
(drawn on the host per (seed, num_anchors, block_size), step.host_anchors), optimizer, schedule and
checkpoints (train.unit.DrafterUnit). The stream runs to the longest run; a shorter run stops, checkpoints and
exports at its own end. Resume: each run resumes from its newest checkpoint (which records the shared data
position); the stream restarts at the earliest position and a run that is ahead waits until it catches up.
Groups are spread over GPUs by spawned processes (one per GPU, groups of a GPU one after another); on CPU one
process runs every group.
Tradeoff: runs of a group step in lock-step, so the group's step time is the sum of its drafters' step times;
the win is one cache read and one H2D copy instead of K, and no idle GPU between runs.
"""

from __future__ import annotations

import json
import logging
import pathlib
import time
from dataclasses import dataclass
from typing import Sequence

from dflash.durable import replace_text
from dflash.errors import ConfigError
from dflash.sweep.spec import RunSpec, SweepSpec, plan_groups

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SweepResult:
    output: pathlib.Path
    rows: list[dict]
    """One per run (report.collect_rows): name, varied values, steps, final loss, acc, tau."""
    best: str | None
    bytes_read: int
    """Cache bytes (hidden + scales) read by this invocation, all groups together."""
    groups: list[list[str]]
    seconds: float


def _spec_record(spec: SweepSpec, groups: list[list[RunSpec]]) -> dict:
    return {"runs": [{"name": r.name, "overrides": dict(r.overrides), "train": r.config.to_json()} for r in spec.runs],
            "varied": list(spec.varied), "groups": [[r.name for r in g] for g in groups]}


def prepare_output(out: pathlib.Path, spec: SweepSpec, groups: list[list[RunSpec]], *, resume: bool) -> None:
    """Refuse a non-empty DIR unless resuming; a resume must have the same runs and configs."""
    rec = json.loads(json.dumps(_spec_record(spec, groups)))
    path = out / "sweep.json"
    if out.exists() and any(out.iterdir()):
        if not resume:
            raise ConfigError(f"sweep folder {str(out)!r} is not empty: pass --resume to continue that sweep, "
                              "or choose a new --output")
        if path.exists():
            old = json.loads(path.read_text())
            if old["runs"] != rec["runs"]:
                raise ConfigError(f"--resume: the spec's runs differ from those of the sweep in {str(out)!r} "
                                  f"(see {path}); resume with the original spec or use a new --output")
    out.mkdir(parents=True, exist_ok=True)
    replace_text(path, json.dumps(rec, indent=2) + "\n")


def run_sweep(spec: SweepSpec, *, output: str | pathlib.Path, gpus: int = 1, eval_cache: str | None = None,
              approximate: bool = False, resume: bool = False, device: str | None = None,
              eval_limit: int | None = None) -> SweepResult:
    """Train every run of the spec (module docstring), evaluate when eval_cache is given, write the report."""
    import torch

    from dflash.sweep.report import write_report

    t0 = time.perf_counter()
    out = pathlib.Path(output)
    use_cuda = torch.cuda.is_available() if device is None else device == "cuda"
    if use_cuda and torch.cuda.device_count() < gpus:
        raise ConfigError(f"--gpus {gpus}: only {torch.cuda.device_count()} CUDA devices are visible")
    groups = plan_groups(spec.runs, gpus=gpus if use_cuda else 1, max_runs_per_device=spec.max_runs_per_device,
                         separate_streams=spec.separate_streams)
    if not use_cuda and gpus > 1:
        log.info("--gpus %d ignored without CUDA: one process runs all %d groups", gpus, len(groups))
    prepare_output(out, spec, groups, resume=resume)
    for i, g in enumerate(groups):
        log.info("group %d: %s", i, ", ".join(r.name for r in g))
    jobs = [(i, [r.name for r in g]) for i, g in enumerate(groups)]
    opts = dict(eval_cache=eval_cache, approximate=approximate, resume=resume, eval_limit=eval_limit)
    if use_cuda and gpus > 1 and len(groups) > 1:
        import torch.multiprocessing as mp

        mp.start_processes(_device_worker, args=(gpus, [r.config.to_json() for r in spec.runs],
                                                 [r.name for r in spec.runs], jobs, str(out), opts),
                           nprocs=min(gpus, len(groups)), join=True, start_method="spawn")
    else:
        dev = "cuda" if use_cuda else "cpu"
        for i, names in jobs:
            run_group(i, [r for r in spec.runs if r.name in names], output=out, device=dev, **opts)
    bytes_read = sum(json.loads((out / "streams" / f"group-{i}.json").read_text())["bytes_read"]
                     for i in range(len(groups)))
    rows, best = write_report(out, spec)
    return SweepResult(output=out, rows=rows, best=best, bytes_read=bytes_read,
                       groups=[[r.name for r in g] for g in groups], seconds=time.perf_counter() - t0)


def _device_worker(index: int, gpus: int, cfgs: list[dict], names: list[str], jobs: list, out: str,
                   opts: dict) -> None:
    from dflash.train.config import config_from_dict

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s gpu{index} %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    runs = {n: RunSpec(name=n, config=config_from_dict(c), overrides={}) for n, c in zip(names, cfgs)}
    for i, group_names in jobs:
        if i % gpus == index:
            run_group(i, [runs[n] for n in group_names], output=pathlib.Path(out), device=f"cuda:{index}", **opts)


def _union_taps(cache_taps: Sequence[int], run_taps: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The taps any run of the group needs, in cache order (each read once per micro-batch)."""
    need = {t for taps in run_taps for t in taps}
    return tuple(t for t in cache_taps if t in need)


def run_group(index: int, runs: Sequence[RunSpec], *, output: pathlib.Path, device: str, resume: bool,
              eval_cache: str | None = None, approximate: bool = False, eval_limit: int | None = None) -> int:
    """Train one group of runs from one stream on one device; returns the cache bytes read."""
    import torch

    from dflash.train import checkpoint as ckpt
    from dflash.train.build import select_taps
    from dflash.train.config import check_resume_compatible
    from dflash.train.distributed import DistInfo
    from dflash.train.loader import StreamingLoader, plan_costs, plan_epoch
    from dflash.train.setup import prepare_run_dir, setup_drafter, setup_target
    from dflash.train.step import host_anchors
    from dflash.train.trainer import autocast
    from dflash.train.unit import DrafterUnit

    t0 = time.perf_counter()
    dev = torch.device(device)
    if dev.type == "cuda":
        if dev.index is None:  # "cuda" alone: the current device (set_device needs an index)
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
    info = DistInfo(rank=0, world_size=1, local_rank=dev.index or 0, device=dev)
    first = runs[0].config
    target = setup_target(first, info=info)
    reader = target.reader
    for why in target.reasons:
        log.info("group %d: %s", index, why)
    taps_of = [select_taps(reader.tap_layer_ids, r.config.taps) for r in runs]
    union = _union_taps(reader.tap_layer_ids, taps_of)
    units: list[DrafterUnit] = []
    anchor_keys: list[tuple] = []
    for r, taps in zip(runs, taps_of):
        run_dir = pathlib.Path(r.config.output)
        state = prepare_run_dir(run_dir, resume=resume)
        if state is not None:
            check_resume_compatible(state["train_config"], r.config)
        d = setup_drafter(r.config, target, info=info, resume_state=state)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(
            {"train": r.config.to_json(), "drafter": d.drafter_config.to_json(), "world_size": 1,
             "sweep": {"name": r.name, "group": index, "stream_taps": list(union)}}, indent=2) + "\n")
        tap_index = None if tuple(d.taps) == union else [union.index(t) for t in d.taps]
        units.append(DrafterUnit(cfg=r.config, run_dir=run_dir, drafter=d.drafter, drafter_config=d.drafter_config,
                                 embed_VD=target.embed_VD, lm_head_VD=target.lm_head_VD, total_steps=d.total_steps,
                                 default_gamma=d.default_gamma, info=info, state=state, restore_rng=False,
                                 progress=False, tap_index=tap_index, name=r.name))
        anchor_keys.append((r.config.seed, r.config.num_anchors, d.drafter_config.block_size))
    lengths = reader.index.length
    # One plan for all runs: the packing order (version 1) while any run started before balanced steps, and
    # every run's checkpoints record the version used, so later resumes keep it.
    plan_version = min(u.plan_version for u in units)
    for u in units:
        u.plan_version = plan_version
    costs = plan_costs(lengths, reader.index.num_loss_tokens, plan_version=plan_version)
    dtype = target.compute_dtype
    end = max(u.total_steps for u in units)
    pending = [u for u in units if not u.finished]
    pos = min((u.pos for u in pending), key=lambda p: p.global_step, default=None)
    try:
        for u in units:
            if u.finished and not (u.run_dir / "drafter" / "config.json").exists():
                u.export()  # killed between the last checkpoint and the export
        while pos is not None and pos.global_step < end and any(not u.finished for u in units):
            plan = plan_epoch(lengths, seed=first.data_seed, epoch=pos.epoch, batch_tokens=first.batch_tokens,
                              world_size=1, grad_accum=first.grad_accum, costs=costs)
            if pos.step_in_epoch >= plan.num_steps:
                pos = ckpt.DataPosition(epoch=pos.epoch + 1, step_in_epoch=0, global_step=pos.global_step)
                continue
            epoch = pos.epoch
            keys = sorted({k for k, u in zip(anchor_keys, units) if not u.finished})

            def host_fn(packed, ep, _keys=keys, _pin=dev.type == "cuda"):
                # anchors per distinct (seed, num_anchors, block_size): cheap, and the same draws as a lone run
                return {k: host_anchors(packed, ep, seed=k[0], num_anchors=k[1], block_size=k[2], pin=_pin)
                        for k in _keys}

            loader = StreamingLoader(reader, plan, rank=0, start_step=pos.step_in_epoch, taps=union, device=dev,
                                     dtype=dtype, num_readers=first.num_readers, prefetch=first.prefetch,
                                     host_fn=host_fn)
            with loader:
                for step_in_epoch in range(pos.step_in_epoch, plan.num_steps):
                    if pos.global_step >= end or all(u.finished for u in units):
                        break
                    active = [(u, k) for u, k in zip(units, anchor_keys)
                              if not u.finished and u.pos.global_step == pos.global_step]
                    for u, _ in active:
                        u.begin_step()
                    for _ in range(first.grad_accum):
                        mb = loader.next()
                        if mb.is_empty or not active:
                            continue
                        for u, k in active:
                            u.micro_batch(mb, mb.extra[k], lambda: autocast(dev, dtype))
                    pos = ckpt.DataPosition(epoch=epoch, step_in_epoch=step_in_epoch + 1,
                                            global_step=pos.global_step + 1)
                    step_tokens = sum(int(lengths[mb_].sum()) for mb_ in plan.steps[step_in_epoch])
                    logged = False
                    for u, _ in active:
                        logged |= u.end_step(pos, step_tokens=step_tokens, stall_s=lambda: loader.stats.wait_s)
                        if u.finished:
                            u.export()
                    if logged:
                        loader.stats.reset()
            if pos.step_in_epoch >= plan.num_steps:
                pos = ckpt.DataPosition(epoch=pos.epoch + 1, step_in_epoch=0, global_step=pos.global_step)
    finally:
        for u in units:
            u.close()
        reader.close()
    bytes_read = int(reader.bytes_read)
    seconds = time.perf_counter() - t0
    del units
    if eval_cache is not None:
        _evaluate(runs, eval_cache=eval_cache, device=device, approximate=approximate, limit=eval_limit)
    streams = output / "streams"
    streams.mkdir(parents=True, exist_ok=True)
    (streams / f"group-{index}.json").write_text(json.dumps(
        {"runs": [r.name for r in runs], "taps": list(union), "bytes_read": bytes_read, "train_seconds": seconds,
         "device": device}, indent=2) + "\n")
    return bytes_read


def _evaluate(runs: Sequence[RunSpec], *, eval_cache: str, device: str, approximate: bool,
              limit: int | None) -> None:
    """Exact greedy tau of every exported drafter of the group (dflash.eval), into RUN_DIR/eval.json."""
    from dflash.eval.evaluate import EvalConfig, evaluate_cache

    for r in runs:
        run_dir = pathlib.Path(r.config.output)
        out = run_dir / "eval.json"
        if out.exists() or not (run_dir / "drafter" / "config.json").exists():
            continue
        res = evaluate_cache(drafter_dir=str(run_dir / "drafter"), cache_dir=eval_cache, model=r.config.model,
                             cfg=EvalConfig(device=device, approximate=approximate, limit=limit), progress=False)
        replace_text(out, json.dumps(res.to_json(), indent=2) + "\n")
        log.info("%s: tau %.3f on %s", r.name, res.overall.tau, eval_cache)


__all__ = ["SweepResult", "run_sweep", "run_group", "prepare_output"]
