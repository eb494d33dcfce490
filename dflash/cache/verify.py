"""Whole-cache checks and summary: every chunk's crc32c, and manifest vs commit logs vs shards.

`verify_cache` reads every byte once (it is as slow as reading the cache); `cache_info` reads only the
manifest, the logs and directory sizes.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field

import numpy as np

from dflash.cache import commit as cm
from dflash.cache.format import Fingerprint, non_finite_values, storage_description, stored_layout
from dflash.cache.shardfile import ArrayFile
from dflash.errors import CacheFormatError

REPAIR_HINT = "rerun the dflash extract command that wrote this cache with --repair to re-extract their samples"


def array_names(storage: str, hidden_size: int) -> list[str]:
    """The arrays of one shard for a storage dtype (format.StoredLayout.array_names)."""
    return stored_layout(storage, hidden_size).array_names


def shard_bytes_on_disk(shard_dir: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, fs in os.walk(shard_dir) for f in fs)


def check_group_json(shard_dir: str, shard: str) -> str | None:
    """The shard's group zarr.json must parse as a zarr v3 group (zarr-python cannot open it otherwise)."""
    try:
        with open(os.path.join(shard_dir, "zarr.json"), "rb") as f:
            meta = json.loads(f.read())
    except (OSError, ValueError) as e:
        return f"shard {shard}: group zarr.json unreadable ({e})"
    if not isinstance(meta, dict) or meta.get("node_type") != "group" or meta.get("zarr_format") != 3:
        return f"shard {shard}: group zarr.json is not a zarr v3 group"
    return None


@dataclass
class VerifyReport:
    problems: list[str] = field(default_factory=list)
    """Each names the shard (and chunk) that is wrong; empty = the cache is sound."""
    notes: list[str] = field(default_factory=list)
    """Harmless findings: crash leftovers that readers ignore."""
    shards: int = 0
    chunks: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def repair_hint(self) -> str:
        """How to repair the problems ("" when there are none)."""
        return f"to repair: {REPAIR_HINT}" if self.problems else ""


def verify_cache(path) -> VerifyReport:
    path = os.fspath(path)
    rep = VerifyReport()
    manifest = cm.read_manifest(path)
    fp = Fingerprint.from_json(manifest["fingerprint"])
    records: list[cm.CommitRecord] = []
    logs_dir = os.path.join(path, cm.COMMITS)
    for name in sorted(os.listdir(logs_dir)) if os.path.isdir(logs_dir) else []:
        with open(os.path.join(logs_dir, name), "rb") as f:
            data = f.read()
        try:
            recs, torn = cm.parse_commit_log(data.decode(errors="replace"), source=f"commits/{name}")
        except CacheFormatError as e:
            rep.problems.append(str(e))
            continue
        if torn:
            rep.notes.append(f"commits/{name}: {torn}-byte torn last line (crash mid-commit; ignored)")
        records += recs
    seen: dict[int, str] = {}
    for r in sorted(records, key=lambda r: (r.rank, r.seq)):
        rep.shards += 1
        verify_shard(path, r, fp, rep)
        for i in r.sample_ids:
            if i in seen:
                rep.problems.append(f"shard {r.shard}: sample id {i} is also committed in shard {seen[i]}")
            seen[i] = r.shard
    want = cm.totals(records)
    if manifest.get("totals") != want:
        # The commit logs are the truth and the manifest's totals a cache of them: a kill between a commit line
        # and the manifest rewrite leaves them behind, a sound state that the next write or resume rewrites.
        rep.notes.append(f"manifest.json totals {manifest.get('totals')} lag the commit logs {want} (crash after "
                         "a commit; readers use the logs, the next write rewrites them)")
    committed = {r.shard for r in records}
    for sub in (cm.SHARDS, cm.STAGING):
        d = os.path.join(path, sub)
        for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
            if sub == cm.STAGING or name not in committed:
                rep.notes.append(f"{sub}/{name}: not committed (crash leftover; invisible, removed on resume)")
    return rep


def verify_shard(path: str, r: cm.CommitRecord, fp: Fingerprint, rep: VerifyReport) -> None:
    """Every check of one committed shard; problems are appended to rep."""
    d = os.path.join(path, cm.SHARDS, r.shard)
    if not os.path.isdir(d):
        rep.problems.append(f"shard {r.shard}: committed in commits/{cm.log_name(r.rank)} but missing on disk")
        return
    group_problem = check_group_json(d, r.shard)
    if group_problem:
        rep.problems.append(group_problem)
    names = array_names(fp.storage, fp.hidden_size)
    arrays: dict[str, ArrayFile] = {}
    corrupt: set[str] = set()
    for name in names:
        try:
            a = ArrayFile.open(os.path.join(d, name), f"shard {r.shard} array {name}")
        except CacheFormatError as e:
            rep.problems.append(str(e))
            continue
        arrays[name] = a
        bad = a.verify_all(values=functools.partial(non_finite_values, fp.storage, name))
        rep.chunks += len(a.index)
        rep.problems += bad
        if bad:
            corrupt.add(name)
    if len(arrays) != len(names) or corrupt & {"samples", "loss_mask"}:
        return  # contents below would be garbage
    T, K = r.num_tokens, len(fp.tap_layer_ids)
    layout = stored_layout(fp.storage, fp.hidden_size)
    want = {"hidden": (T, K, layout.hidden_width), "scales": (T, K), "group_scales": (T, K, layout.group_width)}
    for name, shape in want.items():
        if name in arrays and arrays[name].shape != shape:
            rep.problems.append(f"shard {r.shard}: {name} shape {arrays[name].shape} != {shape} from log and "
                                f"manifest ({fp.storage})")
    samples = arrays["samples"].read_all()
    mask = arrays["loss_mask"].read_all()
    if tuple(samples[:, 0].tolist()) != r.sample_ids:
        rep.problems.append(f"shard {r.shard}: samples array ids disagree with the commit line")
    ends = samples[:, 1] + samples[:, 2]
    if len(samples) and (samples[0, 1] != 0 or (samples[1:, 1] != ends[:-1]).any() or ends[-1] != T):
        rep.problems.append(f"shard {r.shard}: sample offsets/lengths do not tile the {T} tokens")
    elif len(samples):
        per = np.add.reduceat(mask.astype(np.int64), samples[:, 1]) if T else np.zeros(0)
        if (per != samples[:, 3]).any() or int(mask.sum()) != r.num_loss_tokens:
            rep.problems.append(f"shard {r.shard}: loss-token counts disagree with loss_mask")
    size = shard_bytes_on_disk(d)
    if size != r.nbytes:
        rep.problems.append(f"shard {r.shard}: {size} bytes on disk, commit line says {r.nbytes}")


def cache_info(path) -> dict:
    """Summary for `dflash cache info`: totals from the commit logs, bytes from the directory."""
    path = os.fspath(path)
    on_disk = sum(os.path.getsize(os.path.join(root, f)) for root, _, fs in os.walk(path) for f in fs)
    from dflash.cache.sources import read_sources

    return cache_summary(path=path, manifest=cm.read_manifest(path), records=cm.read_commit_logs(path),
                         bytes_on_disk=on_disk, being_written_by=_live_writer(path), id_ranges=read_sources(path))


def cache_summary(*, path: str, manifest: dict, records: list[cm.CommitRecord], bytes_on_disk: int,
                  being_written_by: str | None, id_ranges: list[dict] | None = None) -> dict:
    """cache_info's dict from what any location provides (a folder here; a store in dflash.store.resolve).
    id_ranges: CACHE/sources.json's rows (dflash.cache.sources); source_counts gives each source's committed
    samples then (None without it)."""
    from dflash.cache.sources import committed_per_source

    fp = Fingerprint.from_json(manifest["fingerprint"])
    counts = None
    if id_ranges is not None and [r["sha256"] for r in id_ranges] == [s.get("sha256") for s in fp.sources]:
        counts = committed_per_source(id_ranges, (i for r in records for i in r.sample_ids))
    t = cm.totals(records)
    on_disk = bytes_on_disk
    return {"path": path, "samples": t["samples"], "tokens": t["tokens"], "loss_tokens": t["loss_tokens"],
            "tap_layer_ids": list(fp.tap_layer_ids), "num_taps": len(fp.tap_layer_ids),
            "hidden_size": fp.hidden_size, "storage": fp.storage, "storage_format": storage_description(fp.storage),
            "hidden_bytes_per_token": stored_layout(fp.storage, fp.hidden_size).hidden_bytes_per_token(
                len(fp.tap_layer_ids)),
            "shards": t["shards"],
            "bytes_on_disk": on_disk, "shard_bytes": t["bytes"],
            "bytes_per_token": (t["bytes"] / t["tokens"]) if t["tokens"] else None,
            "target": fp.target, "target_greedy": fp.target_greedy, "target_dtype": fp.target_dtype,
            "max_length": fp.max_length, "num_target_layers": fp.num_target_layers,
            "sources": [s.get("path") for s in fp.sources], "being_written_by": being_written_by,
            "source_counts": None if counts is None else [{"path": s.get("path"), "samples": n}
                                                          for s, n in zip(fp.sources, counts)]}


def _live_writer(path: str) -> str | None:
    """Who holds the cache's run lock (an extraction in progress: the totals still grow), else None. A lock
    file of a dead process on this host is stale and ignored; another host's cannot be checked from here."""
    import socket

    from dflash.locks import pid_alive, read_lock_holder

    holder = read_lock_holder(path, name=cm.RUN_LOCK)
    if holder is None or (holder.host == socket.gethostname() and not pid_alive(holder.pid)):
        return None
    return holder.describe()
