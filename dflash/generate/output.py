"""Resumable output of `dflash generate`: records committed in shards, merged into one file at the end.

Layout for `--output OUT.jsonl` (or OUT.jsonl.gz):

    OUT.jsonl.parts/job.json          the job fingerprint (model, data hashes, options), written first
    OUT.jsonl.parts/commits.jsonl     one fsynced line per committed shard: chunk, file, records, bytes, stats
    OUT.jsonl.parts/shards/chunk-NNNNNN.jsonl.gz   one chunk of conversations' records, immutable
    OUT.jsonl.parts/_staging/         a shard being written; never read
    OUT.jsonl.parts/complete.json     written after OUT is in place; the shards are then removed

Commit protocol (as the cache's, dflash.cache.commit): write the shard under _staging, fsync, rename into
shards/, fsync the folder, then append the commit line and fsync it. A shard counts iff its line exists, so
a kill -9 at any instant loses at most the chunk in flight; a rerun redoes it with the same batches (a chunk's
batches are a function of its conversations alone) and so writes the same records. A torn last line (killed
mid-append) is cut off on reopen. Shards are gzip with mtime 0: the same records give the same bytes.

OUT is written once, atomically (tmp + fsync + rename), when every chunk is committed: the shards' gzip
members concatenated (a .gz OUT; gzip readers read multi-member files) or decompressed (.jsonl). dflash.data
reads it like any jsonl(.gz). A rerun of the same job after that says so and does nothing; another job into the
same OUT is refused (naming the differing field) unless overwrite.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import pathlib
import shutil
from typing import Iterable

from dflash.durable import fsync_dir
from dflash.errors import ConfigError
from dflash.locks import FolderLock

PARTS_SUFFIX = ".parts"
JOB_FORMAT = "dflash-generate-job"
JOB_VERSION = 1


def parts_dir(output: str | os.PathLike) -> pathlib.Path:
    out = pathlib.Path(output)
    return out.with_name(out.name + PARTS_SUFFIX)


def read_job(output: str | os.PathLike) -> dict | None:
    """The job.json of a job begun in `output`, None when there is none."""
    p = parts_dir(output) / "job.json"
    return json.loads(p.read_text()) if p.is_file() else None


def _write_durable(path: pathlib.Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def gzip_lines(records: Iterable[dict]) -> bytes:
    """jsonl of `records`, gzip-compressed with a fixed header (same records, same bytes)."""
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=6) as gz:
        for r in records:
            gz.write((json.dumps(r, ensure_ascii=False) + "\n").encode("utf-8"))
    return buf.getvalue()


def first_difference(a: dict, b: dict, prefix: str = "") -> str | None:
    """Dotted name of the first differing key of two JSON objects, or None when equal."""
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            sub = first_difference(va, vb, f"{prefix}{k}.")
            if sub:
                return sub
        elif va != vb:
            return f"{prefix}{k}"
    return None


class ShardedOutput:
    """The parts folder of one output file: job check, commits, resume state, final merge."""

    def __init__(self, output: str | os.PathLike, *, job: dict, overwrite: bool = False) -> None:
        self.output = pathlib.Path(output)
        if not (self.output.name.endswith(".jsonl") or self.output.name.endswith(".jsonl.gz")):
            raise ConfigError(f"--output {self.output}: must end in .jsonl or .jsonl.gz")
        # one writer per output: a second run into it fails at once (LockedError names the holder); a killed
        # holder's flock goes with it, so a rerun after kill -9 takes the lock over
        self._lock = FolderLock(self.output.parent, name=f".{self.output.name}.lock", purpose="dflash generate")
        self._lock.acquire()
        try:
            self._open(job=job, overwrite=overwrite)
        except BaseException:
            self._lock.release()
            raise

    def close(self) -> None:
        """Release the output's lock (the committed shards stay)."""
        self._lock.release()

    def _open(self, *, job: dict, overwrite: bool) -> None:
        self.parts = parts_dir(self.output)
        self.job = {"format": JOB_FORMAT, "version": JOB_VERSION, **job}
        self.complete: dict | None = None
        """complete.json of a finished run of this job (then there is nothing to do)."""
        if overwrite:
            if self.parts.exists():
                shutil.rmtree(self.parts)
            if self.output.exists():
                self.output.unlink()
        existing = self._read_job()
        if existing is None and self.output.exists():
            raise ConfigError(f"--output {self.output} exists and was not written by this job (no {self.parts.name}/"
                              "job.json); pass --overwrite to replace it")
        if existing is not None and existing != self.job:
            field = first_difference(existing, self.job)
            raise ConfigError(f"--output {self.output} holds another job (differs in {field!r}: "
                              f"{_get(existing, field)!r} there, {_get(self.job, field)!r} now); "
                              "pass --overwrite to replace it, or choose another --output")
        (self.parts / "shards").mkdir(parents=True, exist_ok=True)
        if existing is None:
            _write_durable(self.parts / "job.json", json.dumps(self.job, indent=1).encode())
        if (self.parts / "complete.json").is_file() and self.output.is_file():
            self.complete = json.loads((self.parts / "complete.json").read_text())
        staging = self.parts / "_staging"
        if staging.exists():
            shutil.rmtree(staging)  # a shard that was being written when the last run died
        staging.mkdir()
        self.committed: dict[int, dict] = self._read_commits()

    def _read_job(self) -> dict | None:
        return read_job(self.output)

    def _read_commits(self) -> dict[int, dict]:
        log = self.parts / "commits.jsonl"
        if not log.exists():
            return {}
        raw = log.read_bytes()
        good = raw[: raw.rfind(b"\n") + 1]  # a line without its newline was torn by a kill: not committed
        if len(good) != len(raw):
            with open(log, "r+b") as f:
                f.truncate(len(good))
                os.fsync(f.fileno())
        out: dict[int, dict] = {}
        for line in good.decode().splitlines():
            entry = json.loads(line)
            if self.complete is None and not (self.parts / "shards" / entry["file"]).is_file():
                raise ConfigError(f"{self.parts}: committed shard {entry['file']} is missing; the parts folder "
                                  "was changed by hand: pass --overwrite to start again")
            out[int(entry["chunk"])] = entry
        return out

    def commit(self, chunk: int, records: list[dict], stats: dict) -> None:
        """Write one chunk's records as a shard and commit it (durable when this returns)."""
        assert chunk not in self.committed, f"chunk {chunk} committed twice"
        name = f"chunk-{chunk:06d}.jsonl.gz"
        data = gzip_lines(records)
        tmp = self.parts / "_staging" / name
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.parts / "shards" / name)
        fsync_dir(self.parts / "shards")
        entry = {"chunk": chunk, "file": name, "records": len(records), "bytes": len(data), "stats": stats}
        with open(self.parts / "commits.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.committed[chunk] = entry

    def finish(self, *, num_chunks: int, summary: dict, keep_shards: bool = False) -> pathlib.Path:
        """Merge the committed shards in chunk order into the output (atomically), then drop the shards
        (keep_shards: leave them, e.g. to move the output in pieces; `cat` of them in order is the output)."""
        missing = [c for c in range(num_chunks) if c not in self.committed]
        assert not missing, f"chunks {missing[:5]} not committed"
        tmp = self.output.with_name(self.output.name + ".tmp")
        gz_out = self.output.name.endswith(".gz")
        with open(tmp, "wb") as f:
            for c in range(num_chunks):
                shard = self.parts / "shards" / self.committed[c]["file"]
                if gz_out:
                    with open(shard, "rb") as s:
                        shutil.copyfileobj(s, f)
                else:
                    with gzip.open(shard, "rb") as s:
                        shutil.copyfileobj(s, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.output)
        fsync_dir(self.output.parent)
        self.complete = {"output": str(self.output), "chunks": num_chunks, **summary}
        _write_durable(self.parts / "complete.json", json.dumps(self.complete, indent=1).encode())
        if not keep_shards:
            shutil.rmtree(self.parts / "shards")  # the output holds the same records now
        return self.output


def _get(d: dict, dotted: str | None):
    for k in (dotted or "").split("."):
        d = d.get(k) if isinstance(d, dict) else None
    return d


def interrupted_text(output: str | os.PathLike, *, command: str) -> str:
    """What an interrupted (Ctrl-C) `dflash generate` leaves: the committed records (whole lines of
    commits.jsonl; chunks in flight are dropped) and the command that resumes."""
    log = parts_dir(output) / "commits.jsonl"
    entries = []
    if log.exists():
        raw = log.read_bytes()
        entries = [json.loads(line) for line in raw[: raw.rfind(b"\n") + 1].decode().splitlines() if line.strip()]
    records = sum(int(e["records"]) for e in entries)
    return (f"interrupted: {records:,} records in {len(entries):,} chunks are committed in {parts_dir(output)} "
            f"(the chunks in flight were dropped); resume with: {command}")

