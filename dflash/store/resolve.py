"""Where the commands meet the store: what a cache argument that is a URL becomes.

- Readers (train, eval, sweep): `reader_path(url)` is the URL itself: CacheReader reads it directly with
  ranged GETs (dflash.store.direct), nothing is copied locally. With `mirror=True` (`--store-mirror`) it is
  `local_cache(url)` instead: the committed shards mirrored into mirror_folder(url) (incremental: a rerun
  fetches only new shards), read back at local disk speed every epoch, at the cost of a full local copy.
- `dflash cache verify URL` fetches every committed shard into a temporary folder and checks it there
  (verify_store_cache: what the store holds, not a local copy); `dflash cache info URL` reads the store's
  manifest and records only.
- `dflash extract --output URL`: dflash.extract.to_store (extraction sits above the store layer).
Local paths pass through unchanged everywhere.
"""

from __future__ import annotations

import logging
import os

from dflash.cache import commit as cm
from dflash.store.url import is_store_url, mirror_folder

log = logging.getLogger(__name__)


def local_cache(path, *, taps: tuple[int, ...] | None = None, root: str | None = None) -> str:
    """`path` itself for a local folder; for a URL the local mirror folder, brought up to date first
    (several processes of one machine may call it at once: the mirror's cache lock serializes them)."""
    if not is_store_url(path):
        return os.fspath(path)
    from dflash.store.sync import fetch_cache
    local = mirror_folder(path, root=root) + ("" if taps is None else "-taps-" + "-".join(map(str, sorted(taps))))
    os.makedirs(local, exist_ok=True)
    lock = cm.CacheLock(local)
    try:
        with lock:
            st = fetch_cache(url=path, local=local, taps=taps)
    finally:
        lock.close()
    log.info("%s: local mirror %s (%d shards fetched, %d already there, %.1f MB)", path, local, st.shards,
             st.skipped, st.bytes / 1e6)
    return local


def verify_store_cache(url: str, *, root: str | None = None):
    """dflash.cache.verify.verify_cache of what the store holds now: every committed shard fetched into a fresh
    temporary folder under $DFLASH_HOME/store, checked there, then deleted. No local folder is trusted as a
    copy of the store (a mirror may predate a change on the store; an extraction's staging folder has deleted
    its published shards); every byte has to come over for the checksums anyway."""
    import shutil
    import tempfile

    from dflash.cache.verify import verify_cache
    from dflash.store.sync import fetch_cache
    from dflash.home import dflash_home

    base = root or os.path.join(dflash_home(), "store")
    os.makedirs(base, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="verify-", dir=base)
    try:
        fetch_cache(url=url, local=tmp)
        return verify_cache(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def store_interrupted_text(url: str, *, command: str) -> str:
    """What an interrupted `dflash extract --output URL` leaves: the samples committed on the store (its commit
    records; shards still in the staging folder are published by the resume), and the command that resumes."""
    from dflash.store.direct import StoreShards

    records = StoreShards(url).records()
    samples = sum(r.num_samples for r in records)
    return (f"interrupted: {samples:,} samples in {len(records):,} shards are committed on {url} (shards not yet "
            f"published wait in the staging folder; the shard being written was dropped); resume with: {command}")


def reader_path(path, *, mirror: bool = False, root: str | None = None) -> str:
    """What a reader opens for a cache argument: a folder as given; a URL as given (direct reads), or with
    mirror=True its local read-through mirror (local_cache)."""
    if mirror and is_store_url(path):
        return local_cache(path, root=root)
    return os.fspath(path)


def store_cache_info(url: str) -> dict:
    """`dflash cache info URL` from the store itself (manifest, commit records, one LIST for the bytes; no
    shard is fetched); being_written_by names a live extraction lease."""
    import time

    from dflash.cache.verify import cache_summary
    from dflash.store.direct import StoreShards
    from dflash.store.lease import lease_verdict

    src = StoreShards(url)
    manifest, records = src.manifest(), src.records()
    verdict, found = lease_verdict(src.store, owner="")  # "held": a live (or not yet expired) extraction
    return cache_summary(path=url, manifest=manifest, records=records,
                         bytes_on_disk=sum(n for _, n in src.store.list_sizes()),
                         being_written_by=found[0].describe(now=time.time()) if verdict.kind == "held" else None)


def store_notes(path) -> tuple[list[str], list[str]]:
    """(notes, problems) of a cache URL's listing by the protocol (local paths: none): orphans and unknown
    keys are notes (readers never see them; the next extract resume deletes the orphans), committed shards
    without objects are problems."""
    if not is_store_url(path):
        return [], []
    from dflash.store import protocol as sp
    from dflash.store.objects import open_store
    got = sp.classify_keys(open_store(path).list_keys())
    notes = []
    if got.orphans:
        shards = sorted({k.split("/")[1] for k in got.orphans})
        notes.append(f"{len(got.orphans)} objects of {len(shards)} uncommitted shards ({', '.join(shards[:3])}"
                     f"{', ...' if len(shards) > 3 else ''}): a killed publisher's; readers ignore them, the "
                     "next dflash extract --output of this URL deletes them")
    if got.has_lease:
        import time

        from dflash.store.lease import read_lease
        found = read_lease(open_store(path))
        if found is not None:
            notes.append(f"an extraction holds the lease {sp.LEASE_KEY}: {found[0].describe(now=time.time())}; "
                         "the totals may still grow")
    if got.strays:
        notes.append(f"{len(got.strays)} objects outside the cache layout (first {got.strays[0]}); ignored")
    problems = [f"shard {s}: committed (record {got.records[s]}) but no objects on the store" for s in got.missing]
    return notes, problems


def reader_paths(cfg, *, mirror: bool = False):
    """A TrainConfig with its cache and eval_cache through reader_path (URLs unchanged unless mirror)."""
    import dataclasses
    return dataclasses.replace(cfg, cache=reader_path(cfg.cache, mirror=mirror),
                               extra_caches=tuple(reader_path(c, mirror=mirror) for c in cfg.extra_caches),
                               eval_cache=None if cfg.eval_cache is None else reader_path(cfg.eval_cache,
                                                                                          mirror=mirror))


def train_store_line(cfg, *, gpus: int) -> str | None:
    """The throughput line (dflash.store.throughput) of training from a cache URL read directly: bytes per
    token of the read taps against ranged GETs of committed shards' hidden objects. None for a folder, and
    on ranks other than 0 under torchrun (one line per job)."""
    if not is_store_url(cfg.cache) or os.environ.get("RANK", "0") != "0":
        return None
    from dflash.cache.format import TOKEN_BYTES, Fingerprint, stored_layout
    from dflash.cache.shardfile import shard_file_relpath
    from dflash.store import protocol as sp
    from dflash.store.objects import open_store
    from dflash.store.sync import read_store_manifest
    from dflash.store.throughput import PROBE_OBJECTS, probe_read, throughput_line

    store = open_store(cfg.cache)
    manifest = read_store_manifest(store)
    if manifest is None:
        return None  # the reader says so, with its error
    fp = Fingerprint.from_json(manifest["fingerprint"])
    taps = len(cfg.taps) if cfg.taps else len(fp.tap_layer_ids)
    shards = sorted(sp.classify_keys(store.list_keys(f"{cm.COMMITS}/")).records)[:PROBE_OBJECTS]
    rate = probe_read(store, [f"{sp.shard_prefix(s)}hidden/{shard_file_relpath(3)}" for s in shards])
    if rate is None:
        return None
    ranks = int(os.environ.get("WORLD_SIZE", gpus))
    return throughput_line(what="read", ranks=ranks, rate=rate, tokens_per_s=None,
                           bytes_per_token=stored_layout(fp.storage, fp.hidden_size).hidden_bytes_per_token(taps)
                           + TOKEN_BYTES)
