"""`dflash extract --output URL`: extraction into an object store through the URL's local staging folder.

`extract_to_store` extracts into the URL's local staging folder (dflash.store.url.staging_folder: never the
read-through mirror's folder, since it deletes each shard once published), after fetching the records of what the
store already holds (so a resume, on any machine, node count or scratch folder, skips every sample committed on
the store), and publishes each rank's shards as they commit. Under torchrun every rank publishes its own rank's
shards (shard names carry the rank: ranks never delete each other's in-flight objects); spawned ranks are
published by the parent. It lives in extract/ because it drives the extraction launcher; the store layer below it
knows nothing of extraction.
"""

from __future__ import annotations

import os
import signal

from dflash.cache import commit as cm
from dflash.store.url import staging_folder

PUBLISH_EVERY = 0.2  # seconds between publish passes while extraction runs (a local log read; no LIST)
LEASE_CHECK_EVERY = 1.0  # seconds between reads of the lease object while extraction runs (one GET): a run
# whose lease was taken stops within about this, not at its next commit or renewal (RENEW_EVERY = 30 s)
STAGED_SHARDS = 2    # committed shards a rank's staging folder may hold before its writer waits for the store


class MainThreadWaker:
    """Raise KeyboardInterrupt in the main thread from another thread, also while the main thread blocks in a
    lock (a full writer queue while the writer waits for a dead publisher) and also when SIGINT is ignored (a
    background job of a script). _thread.interrupt_main does neither: it only sets a flag the interpreter
    checks between bytecodes, and does nothing at all when SIGINT is SIG_IGN. A real signal (WAKE_SIGNAL, sent
    to the main thread only) interrupts the blocking call; its handler, installed for the `with` block, raises."""

    WAKE_SIGNAL = signal.SIGUSR1

    def __init__(self) -> None:
        import threading
        self._lock, self._active = threading.Lock(), False

    def __enter__(self) -> MainThreadWaker:
        self._old = signal.signal(self.WAKE_SIGNAL, self._raise)
        with self._lock:
            self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:  # no signal is sent once the handler may be gone (SIGUSR1's default ends the process)
            self._active = False
        signal.signal(self.WAKE_SIGNAL, self._old)

    @staticmethod
    def _raise(_signum, _frame) -> None:
        raise KeyboardInterrupt

    def interrupt(self) -> None:
        """From any thread; a no-op outside the `with` block."""
        import threading
        with self._lock:
            if self._active:
                signal.pthread_kill(threading.main_thread().ident, self.WAKE_SIGNAL)


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
    import contextlib
    import dataclasses
    import threading
    import time

    from dflash.extract.launch import launch
    from dflash.store.lease import check_job_lease, job_owner_id
    from dflash.store.objects import open_store
    from dflash.store.sync import Publisher, fetch_cache, read_store_manifest

    url = cfg.output
    staging = staging_folder(url, root=root)
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
    wake = MainThreadWaker() if interrupt else None

    def publish_loop() -> None:
        checked = time.monotonic()
        try:
            while not stop.wait(PUBLISH_EVERY):
                if lease is not None:
                    lease.check()  # what the renewer found (a lost lease) stops the run
                if time.monotonic() - checked >= LEASE_CHECK_EVERY:  # a takeover is seen between commits too
                    check_job_lease(store, owner=owner)
                    checked = time.monotonic()
                if "pub" not in state and os.path.exists(os.path.join(staging, cm.MANIFEST)):
                    state["pub"] = publisher()
                if "pub" in state:
                    state["pub"].publish_new()
        except BaseException as e:  # surfaced by the main thread
            state["error"] = e
            if wake is not None and not stop.is_set():
                wake.interrupt()

    thread = threading.Thread(target=publish_loop, name="dflash-publish", daemon=True)
    # bounded staging: each rank's writer holds at most STAGED_SHARDS committed shards that the store has not
    # committed yet (only when a failed publisher can interrupt the run: a writer waiting on a dead one would hang)
    staged = dataclasses.replace(cfg, output=staging, max_held_shards=STAGED_SHARDS if interrupt else None)
    try:
        with wake if wake is not None else contextlib.nullcontext():  # the publisher starts once it can wake us
            thread.start()
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
