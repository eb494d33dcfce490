"""Where the commands meet the store: what a cache argument that is a URL becomes.

- Readers (train, eval, sweep): `reader_path(url)` is the URL itself: CacheReader reads it directly with
  ranged GETs (dflash.store.direct), nothing is copied locally. With `mirror=True` (`--store-mirror`) it is
  `local_cache(url)` instead: the committed shards mirrored into mirror_folder(url) (incremental: a rerun
  fetches only new shards), read back at local disk speed every epoch, at the cost of a full local copy.
- `dflash cache verify URL` checks the mirror (every byte has to come over anyway, and the checks are the
  local ones); `dflash cache info URL` reads the store's manifest and records only.
- `dflash extract --output URL`: `extract_to_store` extracts into the URL's local staging folder (the same
  folder), after fetching what the store already holds (so a resume, on any machine, node count or scratch
  folder, skips every sample committed on the store), and publishes each rank's shards when the run ends.
  Under torchrun every rank publishes its own rank's shards (shard names carry the rank: ranks never
  delete each other's in-flight objects); spawned ranks are published by the parent.
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


PUBLISH_EVERY = 0.2  # seconds between publish passes while extraction runs (a local log read; no LIST)
STAGED_SHARDS = 2    # committed shards a rank's staging folder may hold before its writer waits for the store


def extract_to_store(cfg, *, num_procs: int | None, echo=print, root: str | None = None):
    """Run `launch(cfg)` with cfg.output = URL through the URL's local staging folder (module docstring);
    a publisher thread stores each shard soon after its local commit, so a killed run loses no more on the
    store than in the staging folder. The run holds the URL's extraction lease (dflash.store.lease) from
    before its first store request to its end: a second run into the URL stops with one line."""
    import contextlib
    import dataclasses

    from dflash.store.objects import open_store

    url = cfg.output
    torchrun = "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1
    rank = int(os.environ["RANK"]) if torchrun else 0
    from dflash.extract.launch import torchrun_group
    from dflash.store.lease import ExtractLease, job_owner_id, wait_for_job_lease
    from dflash.store.throughput import probe_write_read

    store = open_store(url)
    # under torchrun the ranks stay in one process group to the end: rank 0 releases the lease only after
    # every rank has published its last shards (_extract_to_store's last barrier)
    group = torchrun_group() if torchrun and not cfg.dry_run else contextlib.nullcontext()
    if rank != 0:  # rank 0 holds the job's lease (and renews it); the others start once it names their job
        if not cfg.dry_run:
            wait_for_job_lease(store, owner=job_owner_id())
        with group:
            return _extract_to_store(cfg, num_procs=num_procs, echo=echo, root=root, torchrun=torchrun, rank=rank,
                                     lease=None)
    with contextlib.ExitStack() as held:
        lease = None if cfg.dry_run else held.enter_context(
            ExtractLease(store, owner=job_owner_id(), purpose=f"dflash extract --output {url}"))
        held.enter_context(group)  # left before the lease is released (ExitStack: last in, first out)
        # the plan's throughput line (a dry run probes too: a few seconds, objects deleted after)
        cfg = dataclasses.replace(cfg, store_rate=probe_write_read(store)[0])
        return _extract_to_store(cfg, num_procs=num_procs, echo=echo, root=root, torchrun=torchrun, rank=rank,
                                 lease=lease)


def _extract_to_store(cfg, *, num_procs, echo, root, torchrun: bool, rank: int, lease):
    import _thread
    import dataclasses
    import threading

    from dflash.extract.launch import launch
    from dflash.store.lease import check_job_lease, job_owner_id
    from dflash.store.objects import open_store
    from dflash.store.sync import Publisher, fetch_cache, read_store_manifest

    url = cfg.output
    staging = mirror_folder(url, root=root)
    if read_store_manifest(open_store(url)) is not None and not cfg.dry_run:
        os.makedirs(staging, exist_ok=True)
        lock = cm.CacheLock(staging)
        try:
            with lock:  # the ranks of one node share the staging folder: one fetches, the others find it done
                st = fetch_cache(url=url, local=staging, records_only=True)  # their records, no data
        finally:
            lock.close()
        if rank == 0:
            echo(f"{url}: {st.skipped} shards already on the store (their records in {staging}); their samples "
                 "are skipped")
    if cfg.dry_run:  # plans from the staging folder as it is: a dry run downloads nothing
        from dflash.store import protocol as sp
        num = len(sp.classify_keys(open_store(url).list_keys()).records)
        if num and rank == 0:
            echo(f"{url}: {num} shards committed on the store; the real run fetches them first and skips "
                 f"their samples (this plan counts only what {staging} already holds)")
        return launch(dataclasses.replace(cfg, output=staging), num_procs=num_procs, echo=echo)
    stop = threading.Event()
    state: dict = {}
    owner = lease.owner if lease is not None else job_owner_id()  # ranks > 0: torchrun's job id, as rank 0's
    store = open_store(url)

    def publisher() -> Publisher:  # every rank checks its job's lease before it commits shards on the store
        return Publisher(local=staging, url=url, ranks=[rank] if torchrun else None,
                         before_commit=lambda: check_job_lease(store, owner=owner), drop_published=True)
    # a publish failure (a lost lease, the store gone) stops the extraction at once, not at its end: the
    # publisher thread interrupts the main thread (as Ctrl-C would: the ranks stop, committed shards stay)
    # and the main thread raises the publisher's error; off the main thread the run stops at its end
    interrupt = threading.current_thread() is threading.main_thread()

    def publish_loop() -> None:
        try:
            while not stop.wait(PUBLISH_EVERY):
                if lease is not None:
                    lease.check()  # what the renewer found (a lost lease) stops the run
                if "pub" not in state and os.path.exists(os.path.join(staging, cm.MANIFEST)):
                    state["pub"] = publisher()
                if "pub" in state:
                    state["pub"].publish_new()
        except BaseException as e:  # surfaced by the main thread
            state["error"] = e
            if interrupt and not stop.is_set():
                _thread.interrupt_main()

    thread = threading.Thread(target=publish_loop, name="dflash-publish", daemon=True)
    thread.start()
    # bounded staging: each rank's writer holds at most STAGED_SHARDS committed shards that the store has not
    # committed yet (only when a failed publisher can interrupt the run: a writer waiting on a dead one would hang)
    staged = dataclasses.replace(cfg, output=staging, max_held_shards=STAGED_SHARDS if interrupt else None)
    try:
        try:
            result = launch(staged, num_procs=num_procs, echo=echo)
        finally:
            stop.set()
            thread.join()
    except KeyboardInterrupt:
        if "error" in state:
            raise state["error"] from None
        raise
    if "error" in state:
        raise state["error"]
    if lease is not None:
        lease.check()
    pub = state.get("pub") or publisher()
    st = pub.finish()
    if torchrun:  # every rank's shards are on the store before rank 0 returns and releases the job's lease
        import torch.distributed as dist
        dist.barrier()
    if rank == 0:
        # the store's write rate while busy, to hold against the run's (docs/multinode.md, throughput model)
        rate = f" at {st.bytes / st.seconds / 1e6:.1f} MB/s" if st.seconds > 0 else ""
        echo(f"{url}: published {st.shards} shards ({st.bytes / 1e6:.1f} MB{rate}), {st.skipped} already there"
             + (f", {st.orphans_removed} orphan objects removed" if st.orphans_removed else ""))
    return result
