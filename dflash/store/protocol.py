"""The commit protocol on an object store, where there is no rename and no append: pure functions over keys.

Same rule as the local cache (dflash.cache.commit): a shard exists for readers iff its commit record exists.
Locally the record is a line appended to commits/rank-R.jsonl after the shard's rename; here it is one object
per shard, commits/rank-R/SHARD.json, holding the same line (CommitRecord.to_line), written with a
conditional create after every object of the shard is stored. Shard names, the record and the totals are
the local protocol's (imported, not restated). Consequences, each pinned by a test:
- objects of a shard without its record are orphans (a publisher killed mid-shard): readers never list
  them, `verify` reports them, the next publish overwrites or deletes them;
- a record whose shard objects are missing is a fault (someone deleted objects): verify reports it;
- the upload order puts every array's data before its zarr.json and the group zarr.json last, so even a
  reader that ignored the records would never see metadata pointing at missing bytes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from dflash.cache import commit as cm

RECORD_SUFFIX = ".json"
LEASE_KEY = "extract-lease.json"  # the running extraction's lease (dflash.store.lease): part of the layout
_RECORD_RE = re.compile(r"^rank-(\d+)/(.+)\.json$")


def record_key(*, rank: int, shard: str) -> str:
    """The commit record of one shard: commits/rank-R/SHARD.json."""
    return f"{cm.COMMITS}/rank-{rank}/{shard}{RECORD_SUFFIX}"


def shard_prefix(shard: str) -> str:
    return f"{cm.SHARDS}/{shard}/"


@dataclass(frozen=True, kw_only=True)
class StoreListing:
    """What a listing of a cache prefix holds, by the protocol."""

    records: dict[str, str]
    """Committed shard name -> its record key (the shards readers see)."""
    shard_objects: dict[str, tuple[str, ...]]
    """Shard name -> its object keys (committed or not)."""
    orphans: tuple[str, ...]
    """Object keys of shards without a record: ignored by readers, reported by verify, cleaned on publish."""
    missing: tuple[str, ...]
    """Committed shards with no objects at all: faults."""
    has_manifest: bool
    has_lease: bool
    """An extraction lease is in place (a run is writing, or died without releasing it)."""
    strays: tuple[str, ...]
    """Keys the protocol does not know (reported as notes; never read, never deleted)."""


def classify_keys(keys: Iterable[str]) -> StoreListing:
    """Sort a cache's keys into committed shards, orphans, faults and strays."""
    records: dict[str, str] = {}
    objects: dict[str, list[str]] = {}
    strays: list[str] = []
    has_manifest = has_lease = False
    for key in keys:
        head, _, rest = key.partition("/")
        if key == cm.MANIFEST:
            has_manifest = True
        elif key == LEASE_KEY:
            has_lease = True
        elif head == cm.COMMITS and (m := _RECORD_RE.match(rest)) and cm.parse_shard_name(m.group(2)):
            rank, seq = cm.parse_shard_name(m.group(2))
            if rank == int(m.group(1)):
                records[m.group(2)] = key
            else:
                strays.append(key)
        elif head == cm.SHARDS and cm.parse_shard_name(rest.partition("/")[0]) and rest.partition("/")[2]:
            objects.setdefault(rest.partition("/")[0], []).append(key)
        else:
            strays.append(key)
    orphans = tuple(k for s in sorted(objects) if s not in records for k in sorted(objects[s]))
    missing = tuple(s for s in sorted(records) if s not in objects)
    return StoreListing(records=dict(sorted(records.items())),
                        shard_objects={s: tuple(sorted(v)) for s, v in sorted(objects.items())},
                        orphans=orphans, missing=missing, has_manifest=has_manifest, has_lease=has_lease,
                        strays=tuple(sorted(strays)))


def upload_order(relpaths: Iterable[str]) -> list[str]:
    """The order in which one shard's files (paths relative to the shard folder) are stored: data objects,
    then each array's zarr.json, the group zarr.json last. The commit record follows all of them."""
    def rank(p: str) -> tuple[int, str]:
        if p == "zarr.json":
            return (2, p)
        return (1 if p.endswith("/zarr.json") else 0, p)
    return sorted(relpaths, key=rank)


def parse_record(text: str, *, key: str) -> cm.CommitRecord:
    """One commit record object -> CommitRecord (the local log's line parser: one rule for both)."""
    records, torn = cm.parse_commit_log(text, source=key)
    if len(records) != 1 or torn:
        from dflash.errors import CacheFormatError
        raise CacheFormatError(f"{key}: a commit record holds exactly one complete line")
    return records[0]
