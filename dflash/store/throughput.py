"""The throughput model of a run on an object store, as one line: bytes per token of the chosen storage x
tokens/s per rank x ranks = MB/s the store must carry, against what a short probe of the store measured.

Why: storage bandwidth, not only compute, bounds extraction (DESIGN.md: one H200 produces ~450 MB/s of bf16
features) and a store that cannot carry it turns GPU hours into waiting. The probe is short (8 objects of
4 MB: PUT then GET for extraction; ranged GETs of committed shard objects for training, which may hold
read-only credentials) and measures from one node only: several nodes may get more in all.
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from dflash.store.objects import Store

PROBE_OBJECTS = 8
PROBE_BYTES = 4 << 20
PROBE_PREFIX = "_probe"  # deleted after the probe; a killed probe leaves strays that verify notes


@dataclass(frozen=True, kw_only=True)
class StoreRate:
    """What a probe measured."""

    mb_s: float
    """Payload MB/s (1e6 bytes) over the probe's wall time."""
    how: str
    """What was timed, e.g. "8 x 4 MB PUT, 8 in parallel"."""


def throughput_line(*, what: str, bytes_per_token: float, ranks: int, rate: StoreRate,
                    tokens_per_s: float | None) -> str:
    """One line: what each rank needs from the store (at `tokens_per_s` per rank, when known) against `rate`.
    what: "written" or "read"."""
    per_ktok = bytes_per_token * 1000 / 1e6  # MB/s per rank per 1,000 tok/s
    cap = rate.mb_s * 1e6 / (bytes_per_token * max(ranks, 1))  # tok/s per rank the store carries
    head = (f"store throughput: {bytes_per_token:,.0f} B/token {what} x {ranks} rank{'s' if ranks != 1 else ''}; "
            f"the store gave {rate.mb_s:,.0f} MB/s ({rate.how}, from this node): enough for {cap:,.0f} tok/s "
            f"per rank")
    if tokens_per_s is None:
        return head + f" ({per_ktok:,.1f} MB/s per rank per 1,000 tok/s)"
    need = bytes_per_token * tokens_per_s / 1e6
    verdict = (f"{rate.mb_s / (need * ranks):.1f}x headroom" if cap >= tokens_per_s else
               f"the store bounds the run at {cap / tokens_per_s:.0%} of that speed")
    return head + (f"; the expected {tokens_per_s:,.0f} tok/s per rank needs {need:,.1f} MB/s per rank, "
                   f"{need * ranks:,.1f} MB/s in all: {verdict}")


def _timed(fn, items: list, *, threads: int) -> tuple[int, float]:
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        n = sum(pool.map(fn, items))
    return n, max(time.perf_counter() - t, 1e-9)


def probe_write_read(store: Store, *, num: int = PROBE_OBJECTS, nbytes: int = PROBE_BYTES,
                     threads: int = PROBE_OBJECTS) -> tuple[StoreRate, StoreRate]:
    """(write, read) rates of `num` objects of `nbytes` under PROBE_PREFIX/, PUT then GET in parallel, then
    deleted. Random bytes: a store that compresses or deduplicates must not look faster than it is."""
    import numpy as np
    data = np.random.default_rng().integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    keys = [f"{PROBE_PREFIX}/{uuid.uuid4().hex}-{i}" for i in range(num)]
    def put_one(key: str) -> int:
        store.put(key, data)
        return len(data)
    try:
        put, t_put = _timed(put_one, keys, threads=threads)
        got, t_get = _timed(lambda k: len(store.get(k) or b""), keys, threads=threads)
    finally:
        store.delete(keys)
    how = f"{num} x {nbytes >> 20} MB {{}}, {threads} in parallel"
    return (StoreRate(mb_s=put / t_put / 1e6, how=how.format("PUT")),
            StoreRate(mb_s=got / t_get / 1e6, how=how.format("GET")))


def probe_read(store: Store, keys: list[str], *, nbytes: int = PROBE_BYTES,
               threads: int = PROBE_OBJECTS) -> StoreRate | None:
    """The rate of one ranged GET of up to `nbytes` from each of `keys` (committed shard objects), in
    parallel; None without keys."""
    if not keys:
        return None
    got, t = _timed(lambda k: len(store.get_range(k, start=0, end=nbytes)), keys, threads=threads)
    return StoreRate(mb_s=got / t / 1e6, how=f"{len(keys)} ranged GETs of <= {nbytes >> 20} MB, "
                                             f"{threads} in parallel")
