"""CACHE/sources.json: which sample ids each data source of a cache holds, for `dflash cache info`.

Sample ids are a running record index over the sources in order, so each source owns one id range. The file
is written (atomically) by `dflash extract` before its first commit and again when the cache grows by new
sources; it only describes, nothing reads data through it. A cache without it (older, or a store URL) lists
its sources without counts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

SOURCES_FILE = "sources.json"


def write_sources(path: str, sources: list[dict]) -> None:
    """sources: [{"path", "sha256", "first_id", "last_id", "samples"}] in source order (last_id inclusive;
    samples: usable, non-duplicate samples of the source)."""
    from dflash.durable import replace_text

    replace_text(os.path.join(path, SOURCES_FILE), json.dumps({"sources": sources}, indent=1) + "\n")


def read_sources(path: str) -> list[dict] | None:
    p = os.path.join(os.fspath(path), SOURCES_FILE)
    if not os.path.exists(p):
        return None
    with open(p) as f:
        return json.load(f)["sources"]


def committed_per_source(sources: list[dict], committed_ids: Iterable[int]) -> list[int]:
    """How many of `committed_ids` fall in each source's id range."""
    import numpy as np

    ids = np.fromiter(committed_ids, dtype=np.int64)
    return [int(((ids >= s["first_id"]) & (ids <= s["last_id"])).sum()) for s in sources]


__all__ = ["SOURCES_FILE", "write_sources", "read_sources", "committed_per_source"]
