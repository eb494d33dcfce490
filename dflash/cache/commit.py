"""The commit protocol: shard names, commit-log lines, totals and the manifest, as small pure functions plus
the few file operations that make them durable.

A shard exists for readers iff its line is in commits/rank-R.jsonl. Lines are appended with one write and
fsynced; a crash mid-append leaves a tail without a newline, which readers ignore and the rank's next writer
truncates. Shard names carry the rank, so ranks never coordinate; only the manifest rewrite takes a lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
from dataclasses import dataclass

from dflash.cache.format import FORMAT_NAME, FORMAT_VERSION, Fingerprint
from dflash.cache.shardfile import write_json_file
from dflash.durable import fsync_dir
from dflash.errors import CacheFormatError, CacheNotFoundError
from dflash.locks import LOCK_FILE as RUN_LOCK  # the whole-run lock of dflash extract

MANIFEST = "manifest.json"
COMMITS = "commits"
SHARDS = "shards"
STAGING = "_staging"
LOCK = ".lock"
TOKENIZED = "_tokenized"  # dflash extract's stored tokenization; never read by cache readers
PUBLISHED = "_published"
"""In the staging folder of an extraction into a cache URL: one empty file per shard that is committed on the
store and deleted here (its commit line stays, so a resume skips its samples; dflash.store.sync.Publisher)."""
_SHARD_RE = re.compile(r"^r(\d{4,})-(\d{6,})$")
_LOG_RE = re.compile(r"^rank-(\d+)\.jsonl$")
_WRITER_LOCK_RE = re.compile(r"^\.dflash-lock-rank-\d+$")
_MANIFEST_TMP_RE = re.compile(r"^\." + re.escape(MANIFEST) + r"\..+\.tmp$")


def writer_lock_name(rank: int) -> str:
    """The per-rank FolderLock file of a CacheWriter: one writer per rank across processes and hosts."""
    return f".dflash-lock-rank-{rank}"


def startup_leftovers(path: str) -> list[str] | None:
    """The entries of a folder without a manifest when all of them are dflash's own start-up files (locks, the
    stored tokenization, a manifest tmp file, empty cache subfolders: what a run killed before its first
    manifest leaves), else None. Such a folder is resumed as if it were empty."""
    names = sorted(os.listdir(path))
    for name in names:
        full = os.path.join(path, name)
        if name in (LOCK, RUN_LOCK, TOKENIZED) or _WRITER_LOCK_RE.match(name) or _MANIFEST_TMP_RE.match(name):
            continue
        if name in (COMMITS, SHARDS, STAGING) and os.path.isdir(full) and not os.listdir(full):
            continue
        return None
    return names


def published_shards(path: str) -> set[str]:
    """The shards of a staging folder that live on the store only (PUBLISHED)."""
    d = os.path.join(path, PUBLISHED)
    return set(os.listdir(d)) if os.path.isdir(d) else set()


def mark_published(path: str, shard: str) -> None:
    """Record durably that `shard` is on the store, before its local folder is deleted (a crash in between
    leaves a marked shard with its folder: checked as usual, deleted by the next publisher)."""
    d = os.path.join(path, PUBLISHED)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, shard), "wb"):
        pass
    fsync_dir(d)


def unmark_published(path: str, shard: str) -> None:
    """The shard's data is in the folder again (a mirror fetched it): it is no longer the store's only."""
    try:
        os.remove(os.path.join(path, PUBLISHED, shard))
    except FileNotFoundError:
        pass


@dataclass(frozen=True, kw_only=True)
class CommitRecord:
    """One committed shard, as logged."""

    shard: str
    """Shard directory name under shards/."""
    rank: int
    """Writer rank that committed it."""
    seq: int
    """Per-rank sequence number (from the name)."""
    num_samples: int
    num_tokens: int
    num_loss_tokens: int
    nbytes: int
    """Bytes of all files of the shard."""
    sample_ids: tuple[int, ...]
    """Ids of the samples in the shard, in shard order."""

    def to_line(self) -> str:
        return json.dumps({"shard": self.shard, "rank": self.rank, "seq": self.seq,
                           "num_samples": self.num_samples, "num_tokens": self.num_tokens,
                           "num_loss_tokens": self.num_loss_tokens, "nbytes": self.nbytes,
                           "sample_ids": list(self.sample_ids)}, separators=(",", ":")) + "\n"


def shard_name(*, rank: int, seq: int) -> str:
    """Unique per rank, sorts by (rank, seq)."""
    return f"r{rank:04d}-{seq:06d}"


def parse_shard_name(name: str) -> tuple[int, int] | None:
    """(rank, seq) of a shard name, or None for anything else."""
    m = _SHARD_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def log_name(rank: int) -> str:
    return f"rank-{rank}.jsonl"


def parse_commit_log(text: str, *, source: str) -> tuple[list[CommitRecord], int]:
    """Complete lines -> records; returns (records, length of a torn tail without newline, 0 if none)."""
    body, sep, tail = text.rpartition("\n")
    if not sep:
        body, tail = "", text
    records = []
    for n, line in enumerate(body.split("\n") if body else [], 1):
        try:
            d = json.loads(line)
            d["sample_ids"] = tuple(d["sample_ids"])
            records.append(CommitRecord(**d))
        except (ValueError, TypeError, KeyError) as e:
            raise CacheFormatError(f"{source} line {n}: malformed commit line ({e})") from e
    return records, len(tail.encode())


def read_commit_logs(path: str) -> list[CommitRecord]:
    """All committed shards of a cache, sorted by (rank, seq)."""
    d = os.path.join(path, COMMITS)
    records: list[CommitRecord] = []
    for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        if _LOG_RE.match(name):
            with open(os.path.join(d, name), "rb") as f:
                recs, _ = parse_commit_log(f.read().decode(), source=f"commits/{name}")
            records += recs
    return sorted(records, key=lambda r: (r.rank, r.seq))


def totals(records: list[CommitRecord]) -> dict:
    """Manifest totals derived from commit records."""
    return {"samples": sum(r.num_samples for r in records), "tokens": sum(r.num_tokens for r in records),
            "loss_tokens": sum(r.num_loss_tokens for r in records), "bytes": sum(r.nbytes for r in records),
            "shards": len(records)}


def build_manifest(fingerprint: Fingerprint, records: list[CommitRecord]) -> dict:
    return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "fingerprint": fingerprint.to_json(),
            "totals": totals(records)}


def read_manifest(path: str) -> dict:
    """manifest.json, checked for format name and version."""
    p = os.path.join(path, MANIFEST)
    if not os.path.exists(p):
        raise CacheNotFoundError(f"no dflash cache at {path} (missing {MANIFEST})")
    try:
        with open(p, "rb") as f:
            m = json.loads(f.read())
    except ValueError as e:
        raise CacheFormatError(f"{p}: not valid JSON ({e})") from e
    return check_manifest(m, source=p)


def check_manifest(m: dict, *, source: str) -> dict:
    """A parsed manifest, checked for format name and version (local files and object stores alike)."""
    if m.get("format") != FORMAT_NAME:
        raise CacheFormatError(f"{source}: format {m.get('format')!r} is not {FORMAT_NAME!r}")
    if m.get("format_version") != FORMAT_VERSION:
        raise CacheFormatError(f"{source}: format version {m.get('format_version')} is not {FORMAT_VERSION}: "
                               "use the dflash version that wrote it, or re-extract")
    return m


def write_manifest_atomic(path: str, manifest: dict, *, tag: str) -> None:
    """tmp file + fsync + os.replace + fsync dir; `tag` keeps concurrent writers' tmp names apart."""
    tmp = os.path.join(path, f".{MANIFEST}.{tag}.tmp")
    write_json_file(tmp, manifest)
    os.replace(tmp, os.path.join(path, MANIFEST))
    fsync_dir(path)


class CacheLock:
    """flock on CACHE/.lock: serializes cache creation and manifest rewrites across writer processes."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(os.path.join(path, LOCK), os.O_RDWR | os.O_CREAT, 0o644)

    def __enter__(self) -> CacheLock:
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        os.close(self.fd)


def append_commit_line(path: str, rank: int, record: CommitRecord) -> None:
    """One write + fsync: the instant the shard becomes visible."""
    from dflash.cache.shardfile import write_all
    p = os.path.join(path, COMMITS, log_name(rank))
    created = not os.path.exists(p)  # only this rank's writer creates its log
    fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        write_all(fd, [record.to_line().encode()])
        os.fsync(fd)
    finally:
        os.close(fd)
    if created:  # the new directory entry: without it a power loss can drop the log, and with it the shard
        fsync_dir(os.path.join(path, COMMITS))


def truncate_torn_tail(path: str, rank: int) -> list[CommitRecord]:
    """Drop a half-written last line of this rank's log (crash mid-append); return its records."""
    p = os.path.join(path, COMMITS, log_name(rank))
    if not os.path.exists(p):
        return []
    with open(p, "rb") as f:
        data = f.read()
    keep = data.rfind(b"\n") + 1
    records, _ = parse_commit_log(data[:keep].decode(), source=f"commits/{log_name(rank)}")
    if keep < len(data):
        os.truncate(p, keep)
        fd = os.open(p, os.O_WRONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return records


def committed_sample_ids(path) -> set[int]:
    """Ids of every committed sample (from the commit logs only); for resume with any rank count."""
    path = os.fspath(path)
    read_manifest(path)
    return {i for r in read_commit_logs(path) for i in r.sample_ids}


def open_cache_fingerprint(path) -> Fingerprint | None:
    """The fingerprint of the cache at `path`, or None if there is no cache there."""
    path = os.fspath(path)
    if not os.path.exists(os.path.join(path, MANIFEST)):
        return None
    return Fingerprint.from_json(read_manifest(path)["fingerprint"])


class LogTotals:
    """Manifest totals over all ranks' logs, reading only the bytes appended since the last refresh
    (re-parsing every log after every commit would be quadratic in the number of shards)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._consumed: dict[str, int] = {}
        self._records: list[CommitRecord] = []

    def refresh(self) -> dict:
        d = os.path.join(self.path, COMMITS)
        for name in sorted(os.listdir(d)):
            if not _LOG_RE.match(name):
                continue
            with open(os.path.join(d, name), "rb") as f:
                f.seek(self._consumed.get(name, 0))
                data = f.read()
            keep = data.rfind(b"\n") + 1
            recs, _ = parse_commit_log(data[:keep].decode(), source=f"commits/{name}")
            self._records += recs
            self._consumed[name] = self._consumed.get(name, 0) + keep
        return totals(self._records)
