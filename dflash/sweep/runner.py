"""`dflash sweep`: K drafters per device trained from ONE loader stream, checkpointed per run, exported,
evaluated, and summarised.

A group of runs is one stream of the training driver (train.driver.run_stream): each micro-batch is read from
the cache (the union of the group's taps; or computed by one live target when the group is `online`) and
copied to the device once; every drafter then runs its forward/backward on it with its own taps, anchors,
optimizer, schedule and checkpoints. Resume: each run resumes from its newest checkpoint.
Groups are spread over GPUs by processes of the one launcher, dflash.procs.spawn (one per GPU, groups of a GPU
one after another); on CPU one process runs every group.
Tradeoff: runs of a group step in lock-step, so the group's step time is the sum of its drafters' step times;
the win is one cache read and one H2D copy instead of K, and no idle GPU between runs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from dflash.durable import replace_text
from dflash.errors import ConfigError
from dflash.sweep.spec import RunSpec, SweepSpec, plan_groups
from dflash.train.online import live_taps

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
    from dflash.train.setup import refuse_nonempty

    rec = json.loads(json.dumps(_spec_record(spec, groups)))
    path = out / "sweep.json"
    if not resume:
        refuse_nonempty(out, what="sweep folder")
    elif path.exists():
        old = json.loads(path.read_text())
        if old["runs"] != rec["runs"]:
            raise ConfigError(f"--resume: the spec's runs differ from those of the sweep in {str(out)!r} "
                              f"(see {path}); resume with the original spec or use a new --output")
    out.mkdir(parents=True, exist_ok=True)
    replace_text(path, json.dumps(rec, indent=2) + "\n")


def run_sweep(spec: SweepSpec, *, output: str | pathlib.Path, gpus: int = 1, eval_cache: str | None = None,
              approximate: bool = False, resume: bool = False, device: str | None = None,
              eval_limit: int | None = None) -> SweepResult:
    """Train every run of the spec (module docstring), evaluate when eval_cache is given, write the report.
    This process holds the sweep folder's lock (dflash.locks) throughout: a second sweep on the same --output
    fails at once naming this process's PID and host."""
    from dflash.locks import FolderLock

    out = pathlib.Path(output)
    with FolderLock(out, purpose=f"dflash sweep --output {out}"):
        return _run_sweep(spec, out=out, gpus=gpus, eval_cache=eval_cache, approximate=approximate, resume=resume,
                          device=device, eval_limit=eval_limit)


def _run_sweep(spec: SweepSpec, *, out: pathlib.Path, gpus: int, eval_cache: str | None, approximate: bool,
               resume: bool, device: str | None, eval_limit: int | None) -> SweepResult:
    import torch

    from dflash.sweep.report import write_report

    t0 = time.perf_counter()
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
        run_groups_spawned(spec, jobs, output=out, nprocs=min(gpus, len(groups)), device_type="cuda", opts=opts)
    else:
        dev = "cuda" if use_cuda else "cpu"
        for i, names in jobs:
            run_group(i, [r for r in spec.runs if r.name in names], output=out, device=dev, **opts)
    bytes_read = sum(json.loads((out / "streams" / f"group-{i}.json").read_text())["bytes_read"]
                     for i in range(len(groups)))
    rows, best = write_report(out, spec)
    return SweepResult(output=out, rows=rows, best=best, bytes_read=bytes_read,
                       groups=[[r.name for r in g] for g in groups], seconds=time.perf_counter() - t0)


def run_groups_spawned(spec: SweepSpec, jobs: list[tuple[int, list[str]]], *, output: pathlib.Path, nprocs: int,
                       device_type: str, opts: dict) -> list[int]:
    """Run the groups `jobs` ((group index, run names)) in `nprocs` processes started by the one launcher
    (dflash.procs.spawn): process P runs the groups i with i % nprocs == P, one after another, on cuda:P
    (device_type "cuda") or on the CPU ("cpu", which is how the tests run this path). The first failing
    process stops the others; a DflashError is raised here as itself, so the CLI prints one line. Returns the
    cache bytes each process read."""
    from dflash.procs import spawn

    cfgs = [r.config.to_json() for r in spec.runs]   # configs travel as JSON: TrainConfig is rebuilt per process
    return spawn(_device_worker, nprocs, args=(nprocs, device_type, cfgs, [r.name for r in spec.runs], jobs,
                                               str(output), opts), name="dflash-sweep")


def _device_worker(index: int, emit, nprocs: int, device_type: str, cfgs: list[dict], names: list[str],
                   jobs: list, out: str, opts: dict) -> int:
    from dflash.train.config import config_from_dict
    from dflash.train.terminate import stop_on_sigterm

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {device_type}{index} %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    device = f"cuda:{index}" if device_type == "cuda" else device_type
    runs = {n: RunSpec(name=n, config=config_from_dict(c), overrides={}) for n, c in zip(names, cfgs)}
    bytes_read = 0
    with stop_on_sigterm():   # a rank process of `dflash sweep --gpus N` (dflash.train.terminate)
        for i, group_names in jobs:
            if i % nprocs == index:
                bytes_read += run_group(i, [runs[n] for n in group_names], output=pathlib.Path(out),
                                        device=device, **opts)
    return bytes_read


def _union_taps(cache_taps: Sequence[int], run_taps: Sequence[Sequence[int]], *, online: bool) -> tuple[int, ...]:
    """The taps any run of the group needs, each read (or, online, computed) once per micro-batch: in cache
    order, or ascending for an online group (whose taps need not be the cache's)."""
    need = {t for taps in run_taps for t in taps}
    return tuple(sorted(need)) if online else tuple(t for t in cache_taps if t in need)


def run_group(index: int, runs: Sequence[RunSpec], *, output: pathlib.Path, device: str, resume: bool,
              eval_cache: str | None = None, approximate: bool = False, eval_limit: int | None = None) -> int:
    """Train one group of runs as one stream (train.driver.run_stream) on one device; returns the cache bytes
    read."""
    import torch

    from dflash.train.build import select_taps
    from dflash.train.distributed import DistInfo
    from dflash.train.driver import Stream, build_unit, run_stream
    from dflash.train.setup import prepare_run_dir, setup_target
    from dflash.train.terminate import SweepTerminated, sigterm_received

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
    layers = target.num_target_layers if first.online else None
    union = _union_taps(reader.tap_layer_ids, [select_taps(reader.tap_layer_ids, r.config.taps, online_layers=layers)
                                               for r in runs], online=first.online)
    units = []
    mixture = None
    try:
        if len({r.config.cache_weights for r in runs}) > 1:  # streams of their own, one read of each cache
            mixture = _run_mixture_group(index, runs, target=target, union=union, info=info, resume=resume,
                                         units=units)
            runs = []  # trained
        for r in runs:
            state = prepare_run_dir(pathlib.Path(r.config.output), resume=resume, require_run=False)
            units.append(build_unit(r.config, target, info=info, state=state, name=r.name, stream_taps=union,
                                    restore_rng=False, progress=False,
                                    record={"sweep": {"name": r.name, "group": index, "stream_taps": list(union)}}))
        if mixture is None:
            # online is a stream field: one live target computes the group's tap union
            online = live_taps(first, union, reader=reader, device=dev)
            streamed = run_stream(units, Stream(reader=reader, taps=union, info=info,
                                                compute_dtype=target.compute_dtype, cfg=first, online=online,
                                                terminate=sigterm_received, drop_diverged=True))
            if streamed.terminated:
                raise SweepTerminated(f"group {index} stopped by SIGTERM at step {streamed.pos.global_step}")
            runs_done = runs
        else:
            runs_done = mixture.pop("runs")
    finally:
        for u in units:
            u.close()
        reader.close()
    bytes_read = int(reader.bytes_read)
    seconds = time.perf_counter() - t0
    del units
    if eval_cache is not None:
        _evaluate(runs_done, eval_cache=eval_cache, device=device, approximate=approximate, limit=eval_limit)
    streams = output / "streams"
    streams.mkdir(parents=True, exist_ok=True)
    (streams / f"group-{index}.json").write_text(json.dumps(
        {"runs": [r.name for r in runs_done], "taps": list(union), "bytes_read": bytes_read, "train_seconds": seconds,
         "device": device, **({"mixture": mixture} if mixture else {})}, indent=2) + "\n")
    return bytes_read


def _run_mixture_group(index: int, runs: Sequence[RunSpec], *, target, union, info, resume: bool,
                       units: list) -> dict:
    """Train a group whose runs differ in cache_weights (sweep.mixture): one stream per weight vector, each in a
    thread, in lock-step, all reading through one SharedReads. Appends the units to `units` (closed by the
    caller); returns the group's mixture record (reads against the samples its runs use)."""
    from dflash.cache.mixed import MixedReader
    from dflash.sweep.mixture import SharedReads, plan_uses, run_threads
    from dflash.train.driver import Stream, build_unit, run_stream
    from dflash.train.loader import plan_costs
    from dflash.train.setup import prepare_run_dir
    from dflash.train.terminate import SweepTerminated, sigterm_received

    first = runs[0].config
    if first.online:
        raise ConfigError("a sweep that varies cache_weights reads the caches; it cannot run online")
    mixed = target.reader if hasattr(target.reader, "counts") else MixedReader([target.reader])
    if mixed is not target.reader:
        target = dataclasses.replace(target, reader=mixed)
    by_weights: dict = {}
    for r in runs:
        by_weights.setdefault(r.config.cache_weights, []).append(r)
    subs = list(by_weights.values())
    sub_units = []
    for sub in subs:
        mine = []
        for r in sub:
            state = prepare_run_dir(pathlib.Path(r.config.output), resume=resume, require_run=False)
            mine.append(build_unit(r.config, target, info=info, state=state, name=r.name, stream_taps=union,
                                   restore_rng=False, progress=False,
                                   record={"sweep": {"name": r.name, "group": index, "stream_taps": list(union)}}))
        units.extend(mine)
        sub_units.append(mine)
    lengths = mixed.index.length
    costs = plan_costs(lengths, mixed.index.num_loss_tokens, plan_version=min(u.plan_version for u in units))
    uses, used = plan_uses([sub[0].config for sub in subs], [max(u.total_steps for u in us) for us in sub_units],
                           index=mixed.index, counts=mixed.counts, costs=costs)
    shared = SharedReads(mixed, uses)
    views = [shared.view() for _ in subs]
    log.info("group %d: %d mixtures (%s) side by side off one read of each cache", index, len(subs),
             "; ".join(str(list(sub[0].config.cache_weights or ())) for sub in subs))

    def job(k):
        return lambda before, terminate: run_stream(
            sub_units[k], Stream(reader=views[k], taps=union, info=info, compute_dtype=target.compute_dtype,
                                 cfg=subs[k][0].config, terminate=terminate, drop_diverged=True),
            before_step=before)

    streamed = run_threads([job(k) for k in range(len(subs))], stop=sigterm_received)
    stopped = [r for r in streamed if r.terminated]
    if stopped:
        raise SweepTerminated(f"group {index} stopped by SIGTERM at step {stopped[0].pos.global_step}")
    union_used = np.unique(np.concatenate(used)) if used else np.zeros(0, np.int64)
    per_cache = np.bincount(mixed.cache_of(union_used), minlength=len(mixed.counts))
    return {"runs": [r for sub in subs for r in sub],
            "streams": [{"cache_weights": list(sub[0].config.cache_weights or ()), "runs": [r.name for r in sub],
                         "unique_samples": int(len(u))} for sub, u in zip(subs, used)],
            "caches": list(mixed.paths), "unique_samples_per_cache": per_cache.tolist(),
            "unique_samples": int(len(union_used)), "sample_uses": int(uses.sum()),
            "samples_read_from_disk": int(shared.disk_samples), "peak_held_bytes": int(shared.peak_held_bytes)}


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


__all__ = ["SweepResult", "run_sweep", "run_group", "run_groups_spawned", "prepare_output"]
