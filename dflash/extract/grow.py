"""A cache that grows: `dflash extract --output EXISTING --data NEW...` adds the conversations not yet stored.

The run's sources are the cache's own sources (from its fingerprint, in order), then every given source that
is not one of them (by sha256). Sample ids stay a running record index over that list, so the new samples
get exactly the ids, tokens and features a single extraction of the union would give them, and the usual
resume path skips everything already committed: new shards are committed by the same writer (atomic
commits, kill -9 safe, checksummed, under the cache's lock). The cache's settings (taps, storage, max length,
template kwargs, dtype) must match; the CLI takes them from the cache when not given.

Duplicates: a sample whose tokens and loss mask (its content hash) equal those of a sample of an earlier
source is not stored again, in a grown cache and in a one-run extraction of several sources alike (so the two
agree). Conversation ids of the raw records are not compared: the same content under two ids trains the same,
and the same id with new content is a new sample. Duplicates inside one source are kept (a one-source cache
is what it always was).
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

from dflash.errors import DataError

DUPLICATE = "duplicate"
"""Skip reason of a sample that repeats the content of an earlier source's sample."""


def effective_sources(given: list[str], existing_sources, *, sha_of) -> list[str]:
    """The sources of this run: the cache's own (they must still be readable with the same sha256), then the
    given ones the cache does not hold. existing_sources: the cache fingerprint's [{"path", "sha256"}] (empty
    for a new cache); sha_of(path) -> sha256."""
    if not existing_sources:
        return list(given)
    have = {s["sha256"] for s in existing_sources}
    out = []
    for s in existing_sources:
        p = s["path"]
        if not os.path.exists(p) or sha_of(p) != s["sha256"]:
            raise DataError(f"the cache's source {p} is {'missing' if not os.path.exists(p) else 'changed'}: "
                            "growing or resuming a cache re-reads its sources to number the new conversations "
                            "after theirs; restore it at that path")
        out.append(p)
    seen = set(have)
    for p in given:
        sha = sha_of(p)
        if sha not in seen:
            out.append(os.path.abspath(p))
            seen.add(sha)
    return out


def content_hash(input_ids: np.ndarray, loss_mask: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(input_ids, np.int32).tobytes() + b"|"
                           + np.ascontiguousarray(loss_mask, np.uint8).tobytes(), digest_size=16).digest()


def scan_sources(samples) -> tuple[np.ndarray, dict[int, int]]:
    """(source index of each sample, int32 [N]; {sample id: id of the earlier-source sample it repeats}) over
    TokenizedSamples in id order (module docstring: duplicates across sources only)."""
    first: dict[bytes, tuple[int, int]] = {}
    dups: dict[int, int] = {}
    src = np.zeros(len(samples), dtype=np.int32)
    for i in range(len(samples)):
        s = samples[i]
        src[i] = s.source_index
        h = content_hash(s.input_ids, s.loss_mask)
        seen = first.get(h)
        if seen is None:
            first[h] = (s.sample_id, s.source_index)
        elif seen[1] != s.source_index:
            dups[s.sample_id] = seen[0]
    return src, dups


def source_table(sample_ids: np.ndarray, src: np.ndarray, paths: list[str], shas: list[str],
                 duplicates) -> list[dict]:
    """cache.sources rows: each source's id range and its usable, non-duplicate sample count."""
    ids = np.asarray(sample_ids, dtype=np.int64)
    dup = np.isin(ids, np.fromiter(duplicates, dtype=np.int64, count=len(duplicates)))
    rows = []
    for k, (p, sha) in enumerate(zip(paths, shas)):
        mine = src == k
        rows.append({"path": p, "sha256": sha, "first_id": int(ids[mine].min()) if mine.any() else -1,
                     "last_id": int(ids[mine].max()) if mine.any() else -2, "samples": int((mine & ~dup).sum())})
    return rows


__all__ = ["DUPLICATE", "effective_sources", "content_hash", "scan_sources", "source_table"]


def record_growth(output: str, fingerprint) -> None:
    """Rank 0 of a growing run, holding the cache's run lock, before any writer opens: the manifest's fingerprint
    gains the new sources (totals unchanged; the writers keep them current from the commit logs). A run killed
    after this and before its commits is resumed by the same command, which now finds nothing to add to the
    sources and resumes."""
    from dflash.cache import commit as cm

    manifest = cm.read_manifest(output)
    manifest["fingerprint"] = fingerprint.to_json()
    with cm.CacheLock(output):
        cm.write_manifest_atomic(output, manifest, tag=f"grow-{os.getpid()}")


def cache_settings(output: str) -> dict | None:
    """The extraction settings of the cache at `output` (taps, storage, max_length, template_kwargs, dtype), for
    the options a grow or resume command leaves out; None when `output` holds no cache (or is a URL)."""
    from dflash.cache import open_cache_fingerprint

    if not os.path.isdir(output):
        return None
    fp = open_cache_fingerprint(output)
    if fp is None:
        return None
    return {"taps": tuple(fp.tap_layer_ids), "storage": fp.storage, "max_length": fp.max_length,
            "template_kwargs": dict(fp.template_kwargs), "dtype": fp.target_dtype}
