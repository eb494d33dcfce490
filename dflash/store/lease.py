"""One extraction per cache URL: a lease object on the store, taken with a conditional create.

Two `dflash extract --output URL` runs on machines with separate staging folders would both publish into one
cache: each one's publisher deletes the other's in-flight objects as orphans, and both reuse shard names.
The local run lock (dflash.locks) cannot see the other machine, so the store holds the lock itself:
`LEASE_KEY` at the cache prefix, created with If-None-Match (first writer wins), renewed every RENEW_EVERY
seconds with If-Match on its own version (a renewal that finds another version has lost the lease), and
deleted when the run ends. The rules for a lease found in place are one pure function, `judge_lease`:

- no lease: free, take it;
- this job's own (same owner id: a rerun of the same torchrun rendezvous, or this process): mine;
- written on this host by a process that no longer exists: stale at once (a kill -9 on this machine);
- not renewed for its ttl (another host's run that died, or lost its network): stale;
- otherwise held: the second run stops at once with one line naming the holder and when the lease expires.

A stale lease is replaced with If-Match on the version judged, so two runs that judge it stale at the same
time cannot both take it. Clocks: `renewed` is the holder's clock, judged by ours; the ttl (300 s, 10 missed
renewals) absorbs ordinary skew. Under torchrun the owner id is the job's rendezvous (the same on every node);
global rank 0 takes the lease and the other ranks wait until it names their job before they touch the store.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass

from dflash.errors import LockedError
from dflash.store.objects import Store
from dflash.store.protocol import LEASE_KEY

log = logging.getLogger(__name__)
RENEW_EVERY = 30.0   # seconds between renewals by the holder
LEASE_TTL = 300.0    # a lease not renewed for this long is stale (10 renewals missed)
WAIT_FOR_RANK0 = 120.0  # how long ranks > 0 wait for rank 0 to take the lease for their job


@dataclass(frozen=True, kw_only=True)
class Lease:
    """The lease object's content."""

    owner: str
    """The job's id: every rank of one run computes the same one (job_owner_id)."""
    host: str
    pid: int
    purpose: str
    """What holds it, e.g. "dflash extract --output s3://b/cache"."""
    acquired: float
    """time.time() of the holder when it took the lease."""
    renewed: float
    """time.time() of the holder at its last renewal."""
    ttl_s: float
    """Seconds after `renewed` when others may judge it stale."""

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), indent=1).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Lease:
        d = json.loads(raw)
        return cls(owner=str(d["owner"]), host=str(d["host"]), pid=int(d["pid"]), purpose=str(d["purpose"]),
                   acquired=float(d["acquired"]), renewed=float(d["renewed"]), ttl_s=float(d["ttl_s"]))

    def describe(self, *, now: float) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.acquired))
        return (f"PID {self.pid} on host {self.host} ({self.purpose}, since {when}, renewed "
                f"{max(0.0, now - self.renewed):.0f} s ago)")


@dataclass(frozen=True, kw_only=True)
class LeaseVerdict:
    """What judge_lease decided about the lease in place."""

    kind: str
    """"free", "mine", "stale" or "held"."""
    reason: str
    """Why, in words (logged on a takeover, part of the error when held)."""


def judge_lease(lease: Lease | None, *, owner: str, host: str, now: float,
                holder_pid_alive: bool | None) -> LeaseVerdict:
    """The rules of the module docstring. holder_pid_alive: whether lease.pid exists on this host (the caller
    checks it when lease.host == host; None otherwise)."""
    if lease is None:
        return LeaseVerdict(kind="free", reason="no lease")
    if lease.owner == owner:
        return LeaseVerdict(kind="mine", reason="this job's own lease")
    if lease.host == host and holder_pid_alive is False:
        return LeaseVerdict(kind="stale", reason=f"its process (PID {lease.pid} on this host) is gone")
    expires = lease.renewed + lease.ttl_s
    if now > expires:
        return LeaseVerdict(kind="stale", reason=f"not renewed for {now - lease.renewed:.0f} s "
                                                 f"(ttl {lease.ttl_s:.0f} s)")
    return LeaseVerdict(kind="held", reason=f"it expires in {expires - now:.0f} s unless renewed")


def job_owner_id(env: dict[str, str] | None = None) -> str:
    """The same id on every rank of one run: torchrun's rendezvous (endpoint and id) when under torchrun,
    else a fresh id for this process (spawned ranks never touch the lease: the parent holds it)."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" in env and "MASTER_ADDR" in env:
        return f"torchrun:{env['MASTER_ADDR']}:{env.get('MASTER_PORT', '')}:{env['TORCHELASTIC_RUN_ID']}"
    return f"process:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


def read_lease(store: Store) -> tuple[Lease, str] | None:
    got = store.get_tagged(LEASE_KEY)
    if got is None:
        return None
    raw, tag = got
    try:
        return Lease.from_bytes(raw), tag
    except (ValueError, KeyError, TypeError):
        # not ours to judge (a torn or foreign object): treat as held forever would block every run; as
        # stale with a warning lets the next run replace it (by version, so only one does)
        log.warning("%s/%s is not a dflash lease; replacing it", store.url.url, LEASE_KEY)
        return Lease(owner="?", host="?", pid=0, purpose="unreadable", acquired=0.0, renewed=0.0, ttl_s=0.0), tag


def lease_verdict(store: Store, owner: str) -> tuple[LeaseVerdict, tuple[Lease, str] | None]:
    """judge_lease on the store's lease as found now (with its version), checking the holder's PID when it
    is on this host."""
    from dflash.locks import pid_alive
    found = read_lease(store)
    host = socket.gethostname()
    lease = None if found is None else found[0]
    alive = pid_alive(lease.pid) if lease is not None and lease.host == host and lease.pid > 0 else None
    return judge_lease(lease, owner=owner, host=host, now=time.time(), holder_pid_alive=alive), found


def lost_error(store: Store, holder: Lease | None, *, when: str) -> LockedError:
    """The one line of a run that lost its lease: who holds it now, and that what it committed is kept."""
    who = "nobody (it was deleted)" if holder is None else holder.describe(now=time.time())
    return LockedError(f"{store.url.url}: this run lost the extraction lease {when}; it is now held by {who}. "
                       "Stopped extracting (two runs would write one cache). The shards committed on the store "
                       "so far are complete and kept: rerun this command once that run is over to resume")


def check_job_lease(store: Store, *, owner: str) -> None:
    """LockedError (lost_error) unless the store's lease names this job: the publisher calls it before
    storing commit records, so a run whose lease was taken over commits nothing more."""
    verdict, found = lease_verdict(store, owner)
    if verdict.kind != "mine":
        raise lost_error(store, None if found is None else found[0], when="before committing its next shards")


def held_error(store: Store, lease: Lease, verdict: LeaseVerdict) -> LockedError:
    return LockedError(f"{store.url.url} is being extracted by {lease.describe(now=time.time())}; "
                       f"{verdict.reason}: wait for that run to finish (a second extraction into one URL would "
                       f"corrupt it), or delete {store.url.url}/{LEASE_KEY} if you know that run is dead")


class ExtractLease:
    """The lease of one extraction run (rank 0 holds it; see the module docstring)."""

    def __init__(self, store: Store, *, owner: str, purpose: str, ttl_s: float = LEASE_TTL) -> None:
        self.store, self.owner, self.purpose, self.ttl_s = store, owner, purpose, ttl_s
        self.e_tag: str | None = None
        self.acquired = 0.0
        self.last_renewal = 0.0
        self.error: Exception | None = None

    def _lease(self, now: float) -> Lease:
        return Lease(owner=self.owner, host=socket.gethostname(), pid=os.getpid(), purpose=self.purpose,
                     acquired=self.acquired or now, renewed=now, ttl_s=self.ttl_s)

    def acquire(self) -> ExtractLease:
        """Take the lease, or LockedError (one line) while another live run holds it."""
        for _ in range(5):  # each lost race re-reads: another run just took or renewed it
            verdict, found = lease_verdict(self.store, self.owner)
            if verdict.kind == "held":
                raise held_error(self.store, found[0], verdict)
            now = time.time()
            if verdict.kind == "stale":
                log.warning("%s: taking over the extraction lease of %s: %s", self.store.url.url,
                            found[0].describe(now=now), verdict.reason)
            self.acquired = found[0].acquired if verdict.kind == "mine" else now
            tag = self.store.put_if(LEASE_KEY, self._lease(now).to_bytes(),
                                    e_tag=None if found is None else found[1])
            if tag is not None:
                self.e_tag, self.last_renewal = tag, now
                return self
        raise LockedError(f"{self.store.url.url}: could not take the extraction lease {LEASE_KEY} (five "
                          "conflicting writers in a row); retry")

    def renew_if_due(self, *, now: float | None = None) -> None:
        """Renew every RENEW_EVERY seconds; LockedError when another run has replaced the lease meanwhile."""
        now = time.time() if now is None else now
        if self.e_tag is None or now - self.last_renewal < RENEW_EVERY:
            return
        tag = self.store.put_if(LEASE_KEY, self._lease(now).to_bytes(), e_tag=self.e_tag)
        if tag is None:
            found = read_lease(self.store)
            raise lost_error(self.store, None if found is None else found[0],
                             when=f"after {now - self.last_renewal:.0f} s without a renewal")
        self.e_tag, self.last_renewal = tag, now

    def check(self) -> None:
        """Raise what the renewer thread hit (a lost lease, a store error): the publisher calls this before
        each pass, so a run that lost the lease stops storing shards."""
        if self.error is not None:
            raise self.error

    def __enter__(self) -> ExtractLease:
        """acquire(), then renew from a daemon thread (extraction's own threads may block for minutes: a
        resume's fetch, a slow commit) until __exit__, which releases the lease."""
        self.acquire()
        self._stop = threading.Event()

        def renew() -> None:
            while not self._stop.wait(1.0):
                try:
                    self.renew_if_due()
                except Exception as e:  # kept for check(); the run decides
                    self.error = e
                    return
        self._thread = threading.Thread(target=renew, name="dflash-lease", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self.error is None:
            self.release()

    def release(self) -> None:
        """Delete the lease if it is still this run's version (a run that lost it leaves the new one)."""
        if self.e_tag is None:
            return
        found = self.store.get_tagged(LEASE_KEY)
        if found is not None and found[1] == self.e_tag:
            self.store.delete([LEASE_KEY])
        self.e_tag = None


def wait_for_job_lease(store: Store, *, owner: str, timeout: float = WAIT_FOR_RANK0) -> None:
    """Ranks > 0 under torchrun: return once the lease names this job (rank 0 took it); LockedError at once
    when another live run holds it, or after `timeout` without rank 0 taking it."""
    deadline = time.monotonic() + timeout
    while True:
        verdict, found = lease_verdict(store, owner)
        if verdict.kind == "mine":
            return
        if verdict.kind == "held":
            raise held_error(store, found[0], verdict)
        if time.monotonic() > deadline:
            raise LockedError(f"{store.url.url}: rank 0 did not take the extraction lease {LEASE_KEY} within "
                              f"{timeout:.0f} s ({verdict.reason})")
        time.sleep(0.5)
