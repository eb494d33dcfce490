"""Sweep specs: YAML -> the list of runs (grid and/or explicit runs over a base TrainConfig) -> groups of runs
that train side by side from one loader stream. Pure functions; nothing here touches torch or the disk
except load_sweep_spec reading the YAML.

Spec (YAML):
    base: {TrainConfig fields}          # shared by every run (cache/model/output come from the command line)
    grid: {field: [v1, v2, ...], ...}   # cartesian product, in the given key order
    runs: [{name: NAME, field: v}, ...] # explicit runs (base + these fields), after the grid's
    max_runs_per_device: 8              # optional: at most this many drafters share one device (memory)
    separate_streams: false             # optional: allow runs that need different data streams (see below)

With several caches (`dflash sweep --cache A --cache B`), `cache_weights` may vary between the runs of a group:
each weight vector trains as a stream of its own, all of them off one read of each cache (sweep.mixture).

Per-run options: anything that does not change the micro-batch stream (lr and schedule, drafter shape,
taps subset, block_size, num_anchors, gamma, seed of init and anchors, steps/epochs, ...). A run's `seed`
seeds its init and anchors; the shuffle seed of the sweep is `base.shuffle_seed` (else `base.seed`) for every
run, so varying `seed` keeps one stream. Stream options (STREAM_FIELDS) must be equal for runs that share a
stream; varying one is a ConfigError unless `separate_streams: true`, which splits the runs into groups that
each read the cache.
Tradeoff: the groups are formed by count (max_runs_per_device), not by a memory model of each drafter.
"""

from __future__ import annotations

import itertools
import pathlib
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from dflash.errors import ConfigError
from dflash.train.config import TrainConfig, config_from_dict

STREAM_FIELDS = ("batch_tokens", "grad_accum", "step_samples", "data_seed", "shuffle_block", "dtype", "num_readers",
                 "prefetch", "verify_checksums", "save_every", "log_every", "online", "online_compile")
"""What one loader stream depends on (data_seed = shuffle_seed or seed); save_every/log_every are shared so
every run of a group checkpoints and logs at the same data position; online: the group's features come from one
live target instead of the cache (one forward per micro-batch; each run rounds them through its own
online_storage, so storages compare on one stream at the cost of one target), online_compile: how it runs."""
FIXED_FIELDS = ("cache", "extra_caches", "model", "output", "stop_after_steps")
"""Set by the sweep command itself, never by the spec."""
_TOP_KEYS = {"base", "grid", "runs", "max_runs_per_device", "separate_streams"}


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One run of a sweep."""

    name: str
    """Folder name under DIR/runs/ (explicit `name`, else made from the varied values)."""
    config: TrainConfig
    """The resolved config; output = DIR/runs/NAME."""
    overrides: Mapping[str, Any]
    """The fields this run sets on top of the base (grid values and/or the explicit run's fields)."""


@dataclass(frozen=True, kw_only=True)
class SweepSpec:
    runs: tuple[RunSpec, ...]
    varied: tuple[str, ...]
    """TrainConfig fields whose value differs between runs (the columns of the results table)."""
    max_runs_per_device: int | None
    separate_streams: bool


def _value_tag(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return "-".join(_value_tag(x) for x in v)
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def run_name(overrides: Mapping[str, Any]) -> str:
    """'lr0.001_num_layers2' from {'lr': 0.001, 'num_layers': 2}; 'run' when nothing is overridden."""
    if not overrides:
        return "run"
    name = "_".join(f"{k}{_value_tag(v)}" for k, v in overrides.items())
    return re.sub(r"[^A-Za-z0-9._+-]", "-", name)


def _check_keys(where: str, keys: Sequence[str]) -> None:
    fields = set(TrainConfig.__dataclass_fields__)
    for k in keys:
        if k in FIXED_FIELDS:
            raise ConfigError(f"{where}: {k!r} cannot be set in a sweep spec; the sweep command sets it "
                              "(--cache, repeated for a mixture, --model, --output; runs are never stopped early)")
        if k not in fields:
            raise ConfigError(f"{where}: unknown key {k!r}; valid keys: {sorted(fields - set(FIXED_FIELDS))}")


def expand_runs(base: Mapping[str, Any], *, grid: Mapping[str, Sequence[Any]] | None,
                runs: Sequence[Mapping[str, Any]] | None, cache: str, model: str, output: str,
                extra_caches: Sequence[str] = ()) -> list[RunSpec]:
    """The runs of a spec: the grid's cartesian product (base + one value per key), then each explicit run
    (base + its fields). No grid and no runs: one run of the base. Names are unique (ConfigError otherwise)."""
    _check_keys("base", list(base))
    items: list[tuple[str | None, dict[str, Any]]] = []
    if grid:
        _check_keys("grid", list(grid))
        for k, vals in grid.items():
            if not isinstance(vals, (list, tuple)) or len(vals) == 0:
                raise ConfigError(f"grid: {k!r} must be a non-empty list of values, got {vals!r}")
        keys = list(grid)
        for combo in itertools.product(*(grid[k] for k in keys)):
            items.append((None, dict(zip(keys, combo))))
    for i, r in enumerate(runs or []):
        if not isinstance(r, Mapping):
            raise ConfigError(f"runs[{i}] must be a mapping of TrainConfig fields (and an optional name)")
        r = dict(r)
        name = r.pop("name", None)
        _check_keys(f"runs[{i}]", list(r))
        items.append((None if name is None else str(name), r))
    if not items:
        items.append((None, {}))
    fixed = {"cache": cache, "extra_caches": tuple(extra_caches), "model": model}
    base_cfg = config_from_dict({**base, **fixed, "output": output})
    data_seed = base_cfg.data_seed
    out: list[RunSpec] = []
    seen: dict[str, int] = {}
    for i, (name, ov) in enumerate(items):
        name = name or run_name(ov)
        if name in seen:
            raise ConfigError(f"two runs are named {name!r} (runs {seen[name]} and {i}); give explicit `name`s")
        seen[name] = i
        data = {**base, **ov, **fixed, "output": str(pathlib.Path(output) / "runs" / name)}
        data.setdefault("shuffle_seed", data_seed)  # `seed` varies init and anchors, not the stream
        try:
            cfg = config_from_dict(data)
        except ConfigError as e:
            raise ConfigError(f"run {name!r}: {e}") from e
        out.append(RunSpec(name=name, config=cfg, overrides=ov))
    return out


def varied_fields(runs: Sequence[RunSpec]) -> tuple[str, ...]:
    """Fields whose values differ between runs, in TrainConfig order (paths excluded)."""
    if len(runs) < 2:
        return tuple(dict.fromkeys(k for r in runs for k in r.overrides))
    js = [r.config.to_json() for r in runs]
    return tuple(k for k in js[0] if k not in FIXED_FIELDS and any(j[k] != js[0][k] for j in js[1:]))


def stream_key(cfg: TrainConfig) -> tuple:
    return tuple(getattr(cfg, f) for f in STREAM_FIELDS)


def plan_groups(runs: Sequence[RunSpec], *, gpus: int, max_runs_per_device: int | None,
                separate_streams: bool) -> list[list[RunSpec]]:
    """Groups of runs that share one loader stream on one device.

    Runs are grouped by stream key (different keys: ConfigError unless separate_streams), each group is cut
    into chunks of at most max_runs_per_device, and while there are fewer groups than devices the largest
    group is halved (each extra group reads the cache once more, but uses an idle device). Group g runs on
    device g % gpus; groups of one device run one after another.
    """
    if gpus < 1:
        raise ConfigError(f"--gpus {gpus}: must be >= 1")
    if max_runs_per_device is not None and max_runs_per_device < 1:
        raise ConfigError(f"max_runs_per_device={max_runs_per_device}: must be >= 1")
    by_key: dict[tuple, list[RunSpec]] = {}
    for r in runs:
        by_key.setdefault(stream_key(r.config), []).append(r)
    if len(by_key) > 1 and not separate_streams:
        first = runs[0]
        other = next(r for r in runs if stream_key(r.config) != stream_key(first.config))
        field = next(f for f, a, b in zip(STREAM_FIELDS, stream_key(first.config), stream_key(other.config))
                     if a != b)
        raise ConfigError(
            f"runs {first.name!r} and {other.name!r} differ in {field!r} ({getattr(first.config, field)!r} vs "
            f"{getattr(other.config, field)!r}), which changes the data stream: they cannot share one read of the "
            f"cache. Keep {field!r} in `base`, or set `separate_streams: true` to read the cache once per stream.")
    groups: list[list[RunSpec]] = []
    for members in by_key.values():
        step = max_runs_per_device or len(members)
        groups.extend(members[i:i + step] for i in range(0, len(members), step))
    while len(groups) < gpus:
        big = max(range(len(groups)), key=lambda g: len(groups[g]))
        if len(groups[big]) < 2:
            break
        g = groups.pop(big)
        half = (len(g) + 1) // 2
        groups[big:big] = [g[:half], g[half:]]
    return groups


def load_sweep_spec(path: str | pathlib.Path, *, cache: str, model: str, output: str,
                    extra_caches: Sequence[str] = ()) -> SweepSpec:
    """Read and expand a sweep YAML (module docstring)."""
    import yaml

    p = pathlib.Path(path)
    if not p.is_file():
        raise ConfigError(f"sweep spec {str(p)!r} does not exist")
    data = yaml.safe_load(p.read_text()) or {}
    return spec_from_dict(data, cache=cache, model=model, output=output, where=str(p), extra_caches=extra_caches)


def spec_from_dict(data: Mapping[str, Any], *, cache: str, model: str, output: str,
                   where: str = "sweep spec", extra_caches: Sequence[str] = ()) -> SweepSpec:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be a mapping with `base`, `grid` and/or `runs`")
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown}; valid: {sorted(_TOP_KEYS)} "
                          "(TrainConfig fields go under `base`)")
    base = data.get("base") or {}
    grid = data.get("grid")
    runs = data.get("runs")
    if not isinstance(base, Mapping) or (grid is not None and not isinstance(grid, Mapping)) or \
            (runs is not None and not isinstance(runs, list)):
        raise ConfigError(f"{where}: `base` and `grid` must be mappings, `runs` a list")
    expanded = expand_runs(base, grid=grid, runs=runs, cache=cache, model=model, output=output,
                           extra_caches=extra_caches)
    mrpd = data.get("max_runs_per_device")
    if mrpd is not None and (not isinstance(mrpd, int) or mrpd < 1):
        raise ConfigError(f"{where}: max_runs_per_device={mrpd!r} must be a positive integer")
    return SweepSpec(runs=tuple(expanded), varied=varied_fields(expanded), max_runs_per_device=mrpd,
                     separate_streams=bool(data.get("separate_streams", False)))
