"""What a resume may skip, and how a damaged cache is repaired: per-shard checks of committed shards, and the
removal of bad shards (their commit lines first, then their files) so the samples in them are extracted again.

A commit line says "these samples are done"; a resume that trusts it blindly skips samples whose shard was
deleted or corrupted afterwards and reports success. The quick check (`check_committed(deep=False)`)
costs a stat per file and one read of each shard's small `samples` array, so every resume runs it; the deep
check reads every chunk (as `dflash cache verify` does) and is what `dflash extract --repair` runs.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

from dflash.cache import commit as cm
from dflash.cache.format import Fingerprint
from dflash.cache.shardfile import ArrayFile
from dflash.cache.verify import (REPAIR_HINT, VerifyReport, array_names,  # noqa: F401  (REPAIR_HINT: re-exported)
                                 check_group_json, shard_bytes_on_disk, verify_shard)
from dflash.durable import fsync_dir
from dflash.errors import CacheFormatError


@dataclass(frozen=True, kw_only=True)
class ShardFault:
    """A committed shard that cannot be trusted."""

    shard: str
    rank: int
    sample_ids: tuple[int, ...]
    """The ids its commit line claims (they are extracted again on repair)."""
    problem: str
    """The first thing found wrong, naming the shard."""


def quick_problem(path: str, r: cm.CommitRecord, fp: Fingerprint) -> str | None:
    """Cheap per-shard check: files exist, their bytes total the commit line's, the group and array metadata
    parse, and the (crc-checked) samples array holds exactly the line's samples, tokens and loss tokens."""
    d = os.path.join(path, cm.SHARDS, r.shard)
    if not os.path.isdir(d):
        return f"shard {r.shard}: committed in {cm.COMMITS}/{cm.log_name(r.rank)} but missing on disk"
    size = shard_bytes_on_disk(d)
    if size != r.nbytes:
        return f"shard {r.shard}: {size} bytes on disk, commit line says {r.nbytes}"
    problem = check_group_json(d, r.shard)
    if problem:
        return problem
    try:
        for name in array_names(fp.storage, fp.hidden_size):
            a = ArrayFile.open(os.path.join(d, name), f"shard {r.shard} array {name}")
            if name == "samples":
                samples = a.read_all()
    except CacheFormatError as e:
        return str(e)
    if tuple(int(i) for i in samples[:, 0]) != r.sample_ids or len(samples) != r.num_samples:
        return f"shard {r.shard}: its samples array holds other sample ids than its commit line"
    if int(samples[:, 2].sum()) != r.num_tokens or int(samples[:, 3].sum()) != r.num_loss_tokens:
        return f"shard {r.shard}: token counts of its samples array disagree with its commit line"
    return None


def check_committed(path, *, deep: bool = False) -> list[ShardFault]:
    """Every committed shard that fails the quick check (deep: also any verify_cache problem of the shard, e.g.
    a chunk crc), plus any shard committing a sample id an earlier shard already holds."""
    path = os.fspath(path)
    fp = Fingerprint.from_json(cm.read_manifest(path)["fingerprint"])
    faults: list[ShardFault] = []
    seen: dict[int, str] = {}
    # a staging folder's shards that the store holds: marked only after the store committed them, so the store's
    # copy is the one that counts; a folder still here is a leftover (a kill -9 in the middle of its deletion
    # leaves part of it) that the next publisher deletes, never a reason to extract the samples again
    published = cm.published_shards(path)
    for r in cm.read_commit_logs(path):
        remote = r.shard in published
        problem = None if remote else quick_problem(path, r, fp)
        if problem is None and deep and not remote:
            rep = VerifyReport()
            verify_shard(path, r, fp, rep)
            problem = rep.problems[0] if rep.problems else None
        if problem is None:
            dup = next((i for i in r.sample_ids if i in seen), None)
            if dup is not None:
                problem = f"shard {r.shard}: sample id {dup} is also committed in shard {seen[dup]}"
        if problem is None:
            seen.update((i, r.shard) for i in r.sample_ids)
        else:
            faults.append(ShardFault(shard=r.shard, rank=r.rank, sample_ids=r.sample_ids, problem=problem))
    return faults


def drop_shards(path, faults: list[ShardFault]) -> None:
    """Uncommit and delete the faulty shards: each affected rank's log is rewritten without their lines (tmp,
    fsync, rename, fsync commits/), then their folders are removed and the manifest totals rewritten. A crash
    in between leaves only uncommitted folders, which readers ignore and writers remove. The caller holds the
    cache's run lock (no writer is open)."""
    path = os.fspath(path)
    bad = {f.shard for f in faults}
    logs = os.path.join(path, cm.COMMITS)
    for rank in sorted({f.rank for f in faults}):
        p = os.path.join(logs, cm.log_name(rank))
        with open(p, "rb") as f:
            data = f.read()
        complete = data[:data.rfind(b"\n") + 1]  # a torn tail is invisible already: drop it too
        keep = [ln + b"\n" for ln in complete.split(b"\n")[:-1] if json.loads(ln)["shard"] not in bad]
        tmp = f"{p}.repair.tmp"
        with open(tmp, "wb") as f:
            f.write(b"".join(keep))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    fsync_dir(logs)
    for name in sorted(bad):
        shutil.rmtree(os.path.join(path, cm.SHARDS, name), ignore_errors=True)
    fsync_dir(os.path.join(path, cm.SHARDS))
    lock = cm.CacheLock(path)
    try:
        with lock:
            fp = Fingerprint.from_json(cm.read_manifest(path)["fingerprint"])
            cm.write_manifest_atomic(path, cm.build_manifest(fp, cm.read_commit_logs(path)), tag="repair")
    finally:
        lock.close()
