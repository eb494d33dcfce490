"""Moving caches between a local folder and an object store, by the protocol of dflash.store.protocol.

- `publish_cache(local=, url=)`: every shard committed locally and not yet on the store is stored object by
  object, then its commit record (conditional create); orphans left by a killed publisher are deleted; the
  manifest (same fingerprint, totals over the store's records) is rewritten last. Idempotent: a rerun after
  kill -9 at any instant stores what is missing and ends with the same objects.
- `fetch_cache(url=, local=, taps=)`: a local mirror holding the committed shards, in the local cache format
  (so CacheReader, verify and the loader read it unchanged at disk speed). Per-tap arrays ([T, K, ...]:
  hidden, scales, group_scales) are fetched with parallel ranged GETs of the selected taps' chunks only, into
  sparse files at the same offsets, plus the shard index; with a tap subset the mirror reads only those taps.
  Each mirrored shard is staged, renamed and logged as a local commit, so a killed fetch resumes.
Tradeoff: reads go store -> local disk -> reader instead of straight into pinned buffers; it costs local
scratch space (only of the taps read) and buys an unchanged, checksummed local read path, reuse across
epochs and sweep runs, and resume of both directions.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from dflash.cache import commit as cm
from dflash.cache.format import Fingerprint
from dflash.cache.shardfile import ArrayFile, index_nbytes, shard_file_relpath, write_json_file
from dflash.errors import CacheFormatError, CacheNotFoundError
from dflash.store import protocol as sp
from dflash.store.objects import Store, open_store

log = logging.getLogger(__name__)
TAP_ARRAYS = ("hidden", "scales", "group_scales")  # the [T, K, ...] arrays of format.StoredLayout
MIRROR = "_mirror.json"  # in a fetched folder: which URL and taps it mirrors
DEFAULT_THREADS = 16     # parallel requests: a single S3 stream gives ~100 MB/s, the NIC many times that


@dataclass(frozen=True, kw_only=True)
class SyncStats:
    """What one publish or fetch moved."""

    shards: int
    """Shards stored (publish) or mirrored (fetch) by this call."""
    skipped: int
    """Shards already there."""
    bytes: int
    """Payload bytes moved."""
    orphans_removed: int = 0
    seconds: float = 0.0
    """Wall time spent moving shards (publish: in publish_new passes; fetch: the whole call)."""


def read_store_manifest(store: Store) -> dict | None:
    raw = store.get(cm.MANIFEST)
    if raw is None:
        return None
    try:
        return cm.check_manifest(json.loads(raw), source=f"{store.url.url}/{cm.MANIFEST}")
    except ValueError as e:
        raise CacheFormatError(f"{store.url.url}/{cm.MANIFEST}: not valid JSON ({e})") from e


def read_records(store: Store, listing: sp.StoreListing, *, pool: ThreadPoolExecutor) -> list[cm.CommitRecord]:
    """The committed shards' records, sorted by (rank, seq); a record must name its own shard."""
    keys = list(listing.records.values())
    out = []
    for key, raw in zip(keys, pool.map(store.get, keys)):
        if raw is None:
            continue  # deleted between LIST and GET: not committed any more
        r = sp.parse_record(raw.decode(), key=key)
        if sp.record_key(rank=r.rank, shard=r.shard) != key:
            raise CacheFormatError(f"{store.url.url}/{key}: record names shard {r.shard} of rank {r.rank}")
        out.append(r)
    return sorted(out, key=lambda r: (r.rank, r.seq))


def _shard_files(local: str, shard: str) -> list[str]:
    d = os.path.join(local, cm.SHARDS, shard)
    return [os.path.relpath(os.path.join(root, f), d).replace(os.sep, "/") for root, _, fs in os.walk(d) for f in fs]


class Publisher:
    """Publishes a local cache's committed shards to a store, incrementally: `publish_new()` stores the
    shards committed locally since the last call (extract calls it while the run goes on), `finish()` the
    rest plus the manifest. Orphans of the ranks it publishes are deleted when it opens, before it stores
    anything itself, so it never deletes an upload in flight; `ranks` = only these writer ranks' shards
    (one publisher per rank under torchrun), None = every rank (the only writer: extract's run lock)."""

    def __init__(self, *, local: str, url: str, ranks: list[int] | None = None,
                 num_threads: int = DEFAULT_THREADS, before_commit: Callable[[], None] | None = None,
                 drop_published: bool = False) -> None:
        """before_commit: called before each pass stores commit records; it raises to stop the publisher
        (extract passes dflash.store.lease.check_job_lease: a run that lost its lease commits nothing more).
        drop_published: delete each shard's local folder once the store commits it (extract's staging folder:
        it then holds only what is in flight; the commit lines stay and commit.PUBLISHED marks the shard)."""
        self.local, self.ranks, self.before_commit = local, ranks, before_commit
        self.drop_published = drop_published
        self.fp = Fingerprint.from_json(cm.read_manifest(local)["fingerprint"])
        self.store = store = open_store(url)
        theirs = read_store_manifest(store)
        if theirs is not None:
            Fingerprint.from_json(theirs["fingerprint"]).check_matches(self.fp)
        else:
            store.put(cm.MANIFEST, json.dumps(cm.build_manifest(self.fp, []), indent=1).encode())
        self.pool = ThreadPoolExecutor(num_threads)
        listing = sp.classify_keys(store.list_keys())
        # objects of shards without a record: a killed publisher's (never another live rank's in-flight ones)
        orphans = [k for k in listing.orphans if ranks is None or orphan_rank(k) in ranks]
        store.delete(orphans)
        self.remote = set(listing.records)
        self.stats = SyncStats(shards=0, skipped=0, bytes=0, orphans_removed=len(orphans))
        self._skipped = set(self.remote)
        self._drop([r.shard for r in cm.read_commit_logs(local)
                    if r.shard in self.remote and (ranks is None or r.rank in ranks)])  # a crash before the drop

    def publish_new(self) -> int:
        """Store every locally committed shard not yet on the store; returns how many. All pending shards
        move at once, in phases (data objects, array zarr.json, group zarr.json, records) so that the
        requests run in parallel while each shard keeps the protocol's order; a kill between phases
        leaves orphans, never a record before its objects."""
        t0 = time.perf_counter()
        todo = [r for r in cm.read_commit_logs(self.local)
                if (self.ranks is None or r.rank in self.ranks) and r.shard not in self.remote]
        if todo and self.before_commit is not None:
            self.before_commit()  # and again before the records: the lease may go while objects upload
        phases: list[list[tuple[str, str]]] = [[], [], []]
        for r in todo:
            rels = sp.upload_order(_shard_files(self.local, r.shard))
            for rel in rels:
                phases[2 if rel == "zarr.json" else 1 if rel.endswith("zarr.json") else 0].append((r.shard, rel))

        def put(item: tuple[str, str]) -> int:
            shard, rel = item
            with open(os.path.join(self.local, cm.SHARDS, shard, rel), "rb") as f:
                payload = f.read()
            self.store.put(sp.shard_prefix(shard) + rel, payload)
            return len(payload)
        moved = sum(sum(self.pool.map(put, items)) for items in phases)
        if todo and self.before_commit is not None:
            self.before_commit()
        list(self.pool.map(lambda r: self.store.put(sp.record_key(rank=r.rank, shard=r.shard),
                                                    r.to_line().encode(), create=True), todo))  # the commits
        self.remote.update(r.shard for r in todo)
        self._drop([r.shard for r in todo])
        self.stats = dataclasses.replace(self.stats, shards=self.stats.shards + len(todo),
                                         bytes=self.stats.bytes + moved,
                                         seconds=self.stats.seconds + (time.perf_counter() - t0 if todo else 0))
        return len(todo)

    def _drop(self, shards: list[str]) -> None:
        """With drop_published: mark the store's shards as published here, then delete their local folders."""
        if not self.drop_published:
            return
        for shard in shards:
            folder = os.path.join(self.local, cm.SHARDS, shard)
            if os.path.isdir(folder):
                cm.mark_published(self.local, shard)
                shutil.rmtree(folder)

    def finish(self) -> SyncStats:
        """Publish what is left, rewrite the manifest (totals over the store's records), close."""
        try:
            self.publish_new()
            records = read_records(self.store, sp.classify_keys(self.store.list_keys()), pool=self.pool)
            self.store.put(cm.MANIFEST, json.dumps(cm.build_manifest(self.fp, records), indent=1).encode())
        finally:
            self.pool.shutdown()
        mine = {r.shard for r in cm.read_commit_logs(self.local)
                if self.ranks is None or r.rank in self.ranks}
        self.stats = dataclasses.replace(self.stats, skipped=len(mine & self._skipped))
        log.info("published %d shards (%d already there), %d orphan objects removed", self.stats.shards,
                 self.stats.skipped, self.stats.orphans_removed)
        return self.stats


def publish_cache(*, local: str, url: str, ranks: list[int] | None = None,
                  num_threads: int = DEFAULT_THREADS) -> SyncStats:
    """Store the local cache's committed shards on `url` (Publisher, in one go)."""
    return Publisher(local=local, url=url, ranks=ranks, num_threads=num_threads).finish()


def orphan_rank(key: str) -> int:
    """The writer rank of a shard object key (the rank is part of every shard name)."""
    return cm.parse_shard_name(key.split("/")[1])[0]


def _fetch_array(store: Store, key_dir: str, out_dir: str, *, label: str, tap_positions: list[int] | None) -> int:
    """One array into out_dir: zarr.json, then its shard file; with tap_positions only the inner chunks of
    those taps (and the index) are fetched, into a sparse file of the object's size."""
    meta_raw = store.get(f"{key_dir}/zarr.json")
    if meta_raw is None:
        raise CacheFormatError(f"{store.url.url}/{key_dir}: committed shard has no zarr.json")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "zarr.json"), "wb") as f:
        f.write(meta_raw)
    meta = json.loads(meta_raw)
    rel = shard_file_relpath(len(meta["shape"]))
    key, path = f"{key_dir}/{rel}", os.path.join(out_dir, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if tap_positions is None:
        n = store.get_to_file(key, path)
        if n is None:
            raise CacheFormatError(f"{store.url.url}/{key}: committed shard object missing")
        return n
    size = store.size(key)
    tail = index_nbytes(meta, label)
    (index_raw,) = store.get_ranges(key, starts=[size - tail], ends=[size])
    with open(path, "wb") as f:
        f.truncate(size)
        f.seek(size - tail)
        f.write(index_raw)
    a = ArrayFile.open(out_dir, label)  # checks the index crc and bounds
    wanted = set(tap_positions)
    spans: list[list[int]] = []
    for lin in range(len(a.index)):
        off, nb = (int(x) for x in a.index[lin])
        coords = np.unravel_index(lin, a.grid)
        c1 = int(coords[1]) * a.chunk_shape[1]
        if off == int(0xFFFFFFFFFFFFFFFF) or not wanted.intersection(range(c1, c1 + a.chunk_shape[1])):
            continue
        if spans and spans[-1][1] == off:  # coalesce adjacent chunks: one ranged GET per run
            spans[-1][1] = off + nb
        else:
            spans.append([off, off + nb])
    if not spans:
        return len(index_raw)
    parts = store.get_ranges(key, starts=[s for s, _ in spans], ends=[e for _, e in spans])
    fd = os.open(path, os.O_WRONLY)
    try:
        for (start, _), part in zip(spans, parts):
            os.pwrite(fd, part, start)
    finally:
        os.close(fd)
    return len(index_raw) + sum(len(p) for p in parts)


def drop_conflicts(local: str, have_local: dict[str, cm.CommitRecord], records: list[cm.CommitRecord]) -> None:
    """The store is the truth: a local shard whose name the store commits with other content (this folder's
    unpublished shard, while another machine resumed the same URL and reused the name) is uncommitted here
    (its samples are extracted again) and the store's shard is fetched in its place. Without this the two
    would disagree silently: the local samples never reach the store, the store's are skipped here."""
    from dflash.cache.repair import ShardFault, drop_shards
    bad = [ShardFault(shard=r.shard, rank=r.rank, sample_ids=have_local[r.shard].sample_ids,
                      problem=f"shard {r.shard} is committed on the store with other samples")
           for r in records if r.shard in have_local and have_local[r.shard] != r]
    if bad:
        log.warning("%s: %d local shards conflict with the store's (first: %s); using the store's", local,
                    len(bad), bad[0].problem)
        drop_shards(local, bad)
        for f in bad:
            del have_local[f.shard]


def fetch_cache(*, url: str, local: str, taps: tuple[int, ...] | None = None,
                num_threads: int = DEFAULT_THREADS, records_only: bool = False) -> SyncStats:
    """Mirror the committed shards of `url` into the local folder (see the module docstring); `taps` = layer
    ids to fetch (None = all). Returns what this call moved; already mirrored shards are skipped.
    records_only: fetch no shard data; log each record locally and mark it commit.PUBLISHED (an extraction's
    staging folder before a resume: its samples are skipped, and the staging space stays bounded)."""
    t0 = time.perf_counter()
    store = open_store(url)
    manifest = read_store_manifest(store)
    if manifest is None:
        raise CacheNotFoundError(f"no dflash cache at {url} (missing {cm.MANIFEST})")
    fp = Fingerprint.from_json(manifest["fingerprint"])
    positions = None if taps is None else [fp.tap_layer_ids.index(t) for t in fp.tap_layer_ids if t in taps]
    mirror = {"url": store.url.url, "taps": None if taps is None else sorted(taps)}
    os.makedirs(local, exist_ok=True)
    mpath = os.path.join(local, MIRROR)
    if os.path.exists(mpath):
        with open(mpath) as f:
            have = json.load(f)
        if have != mirror:
            raise CacheFormatError(f"{local} mirrors {have['url']} taps {have['taps']}, not {url} taps "
                                   f"{mirror['taps']}: use another folder")
    else:
        write_json_file(mpath, mirror)
    for sub in (cm.COMMITS, cm.SHARDS, cm.STAGING):
        os.makedirs(os.path.join(local, sub), exist_ok=True)
    if os.path.exists(os.path.join(local, cm.MANIFEST)):
        Fingerprint.from_json(cm.read_manifest(local)["fingerprint"]).check_matches(fp)
    else:
        # first, so a fetch killed midway leaves a cache (totals lagging the logs: a note), not a bare folder
        cm.write_manifest_atomic(local, cm.build_manifest(fp, []), tag="fetch")
    have_local = {r.shard: r for r in cm.read_commit_logs(local)}
    with ThreadPoolExecutor(num_threads) as pool:
        listing = sp.classify_keys(store.list_keys())
        records = read_records(store, listing, pool=pool)
        drop_conflicts(local, have_local, records)
        if records_only:
            todo = [r for r in records if r.shard not in have_local]
            for r in todo:  # the marker first: a line without marker or folder would fail the resume check
                cm.mark_published(local, r.shard)
                cm.append_commit_line(local, r.rank, r)
            todo = []
        else:
            # a mirror trusts a local shard only if its folder is there and is not one an extraction's staging
            # folder marked as the store's (deleted, or left half deleted by a kill): a commit line alone (that
            # staging folder read as a mirror, or a shard removed by hand) is fetched again
            published = cm.published_shards(local)
            todo = [r for r in records if r.shard not in have_local or r.shard in published
                    or not os.path.isdir(os.path.join(local, cm.SHARDS, r.shard))]

        def stage(r: cm.CommitRecord) -> str:
            return os.path.join(local, cm.STAGING, f"fetch-{r.shard}")

        tasks = []
        for r in todo:
            shutil.rmtree(stage(r), ignore_errors=True)
            prefix = sp.shard_prefix(r.shard)
            names = sorted({k[len(prefix):].split("/")[0] for k in listing.shard_objects.get(r.shard, ())
                            if k[len(prefix):].count("/")})
            tasks += [(r, name) for name in names]

        def fetch_one(task) -> int:  # every array of every shard is its own task: requests run in parallel
            r, name = task
            return _fetch_array(store, sp.shard_prefix(r.shard) + name, os.path.join(stage(r), name),
                                label=f"shard {r.shard} array {name}",
                                tap_positions=positions if name in TAP_ARRAYS else None)

        def fetch_group(r: cm.CommitRecord) -> None:
            group = store.get(sp.shard_prefix(r.shard) + "zarr.json")
            if group is None:
                raise CacheFormatError(f"{url}/{sp.shard_prefix(r.shard)}zarr.json: committed shard has no "
                                       "group zarr.json")
            os.makedirs(stage(r), exist_ok=True)
            with open(os.path.join(stage(r), "zarr.json"), "wb") as f:
                f.write(group)

        moved = sum(pool.map(fetch_one, tasks))
        list(pool.map(fetch_group, todo))
        for r in todo:  # the local protocol's commit: rename into shards/, then the log line
            dest = os.path.join(local, cm.SHARDS, r.shard)
            shutil.rmtree(dest, ignore_errors=True)
            os.rename(stage(r), dest)
            cm.unmark_published(local, r.shard)
            if r.shard not in have_local:  # a refetched shard keeps its (equal) line: one line per shard
                cm.append_commit_line(local, r.rank, r)
    cm.write_manifest_atomic(local, cm.build_manifest(fp, records), tag="fetch")
    if records_only:
        return SyncStats(shards=0, skipped=len(records), bytes=0, seconds=time.perf_counter() - t0)
    return SyncStats(shards=len(todo), skipped=len(records) - len(todo), bytes=moved,
                     seconds=time.perf_counter() - t0)
