"""Reading a cache straight from its object store: the CacheReader's ShardSource for a cache URL.

`CacheReader("s3://bucket/cache")` reads what it reads from a folder, the same byte ranges of the same shard
files, each contiguous run one ranged GET (tap-major chunks: one run per sample and tap, so a tap subset
fetches only its taps), checked by crc32c and copied once into the caller's buffers (the training loader's
pinned ones). Nothing is written locally. Per array and shard two small requests open it (zarr.json and the
shard index, a suffix range) and stay cached in the reader. The per-token arrays that are not per tap
(input_ids, loss_mask, fp8/4-bit row scales: ~25 B/token at 5 taps, 0.1% of the 27B's fp8 hidden bytes) are
fetched whole per shard and kept in a bounded in-memory LRU: on SeaweedFS here a request costs as much as
~1 MB of payload, and per sample they were 3 of 8 requests (bench_store: direct read 0.65-0.7x the plain GET
with them, see its JSON for the figure without). When the LRU cannot hold the working set (a paper-scale
cache in random order), a miss costs the same 3 requests as before plus at most shard_tokens x 25 B of
extra bytes (1.6 MB per 64K-token shard against ~25 MB of hidden per 1K-token sample). Parallelism comes from the reader's threads
(16 by default for a URL: one S3 stream gives ~100 MB/s) and the loader's bounded queue of pinned buffers.
Tradeoff against the mirror of dflash.store.sync (still used by `dflash cache verify` and opt-in elsewhere):
every epoch fetches its bytes again, in exchange for no local scratch at all (a paper-scale cache is tens of
TB; one node's disk is 235 GiB).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext

import numpy as np

from dflash.cache import commit as cm
from dflash.cache.shardfile import ArrayFile, index_nbytes, parse_metadata, shard_file_relpath
from dflash.errors import CacheFormatError, CacheNotFoundError
from dflash.store import protocol as sp
from dflash.store.objects import Store, open_store
from dflash.store.sync import DEFAULT_THREADS, read_records, read_store_manifest


class ObjectRanges:
    """ByteRanges of one object: one ranged GET per range, no copy (the scratch buffer is not needed)."""

    def __init__(self, store: Store, key: str) -> None:
        self.store, self.key = store, key

    def read_at(self, offset: int, length: int, scratch: np.ndarray | None) -> np.ndarray:
        return np.frombuffer(self.store.get_range(self.key, start=offset, end=offset + length), np.uint8)


WHOLE_ARRAYS = ("input_ids", "loss_mask", "scales")  # not per tap: fetched whole per shard, kept in the LRU
WHOLE_CACHE_BYTES = 512 << 20  # the LRU's bound: the whole arrays of ~20K 1K-token samples' shards at 5 taps


class SingleFlight:
    """One call per key at a time: threads asking for a key already being fetched wait for that result. The
    reader's threads all miss together on a micro-batch's shards (bench_store: 57-70 GETs for ~35 objects
    without this)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running: dict[object, Future] = {}

    def run(self, key: object, fn):
        with self.lock:
            fut = self.running.get(key)
            mine = fut is None
            if mine:
                fut = self.running[key] = Future()
        if not mine:
            return fut.result()
        try:
            fut.set_result(fn())
        except BaseException as e:
            fut.set_exception(e)
        finally:
            with self.lock:
                del self.running[key]
        return fut.result()


class WholeObjects:
    """A bounded LRU of whole objects (bytes), shared by the reader's threads."""

    def __init__(self, store: Store, *, max_bytes: int = WHOLE_CACHE_BYTES) -> None:
        self.store, self.max_bytes = store, max_bytes
        self.held: OrderedDict[str, np.ndarray] = OrderedDict()
        self.nbytes = 0
        self.flights = SingleFlight()
        self.lock = threading.Lock()

    def get(self, key: str) -> np.ndarray:
        with self.lock:
            got = self.held.get(key)
            if got is not None:
                self.held.move_to_end(key)
                return got
        return self.flights.run(key, lambda: self._fetch(key))

    def _fetch(self, key: str) -> np.ndarray:
        raw = self.store.get(key)
        if raw is None:
            raise CacheFormatError(f"{self.store.url.url}/{key}: committed shard object is missing")
        data = np.frombuffer(raw, np.uint8)
        with self.lock:
            if key not in self.held:
                self.held[key] = data
                self.nbytes += len(data)
            while self.nbytes > self.max_bytes and len(self.held) > 1:
                self.nbytes -= len(self.held.popitem(last=False)[1])
        return data


class WholeObjectRanges:
    """ByteRanges served from a whole object held by WholeObjects."""

    def __init__(self, whole: WholeObjects, key: str) -> None:
        self.whole, self.key = whole, key

    def read_at(self, offset: int, length: int, scratch: np.ndarray | None) -> np.ndarray:
        return self.whole.get(self.key)[offset:offset + length]


class StoreShards:
    """ShardSource of a cache URL: the committed shards by the store's commit records (dflash.store.protocol)."""

    default_threads = DEFAULT_THREADS
    # one ranged GET per contiguous run of a tap (the writer's blocks bound it: 32 MB). Cut into 8 MB GETs that
    # several threads share, a run read slower on SeaweedFS (bench_store's direct_blocks_pieces): each cut lands
    # inside a server chunk that both GETs then read
    piece_bytes = None

    def __init__(self, url: str) -> None:
        self.store = open_store(url)
        self.whole = WholeObjects(self.store)
        self.opening = SingleFlight()

    def manifest(self) -> dict:
        m = read_store_manifest(self.store)
        if m is None:
            raise CacheNotFoundError(f"no dflash cache at {self.store.url.url} (missing {cm.MANIFEST})")
        return m

    def records(self) -> list[cm.CommitRecord]:
        with ThreadPoolExecutor(DEFAULT_THREADS) as pool:
            return read_records(self.store, sp.classify_keys(self.store.list_keys()), pool=pool)

    def open_array(self, shard: str, name: str, label: str) -> ArrayFile:
        # the reader caches what this returns; concurrent first reads of one array share one open
        return self.opening.run((shard, name), lambda: self._open_array(shard, name, label))

    def _open_array(self, shard: str, name: str, label: str) -> ArrayFile:
        key_dir = sp.shard_prefix(shard) + name
        raw = self.store.get(f"{key_dir}/zarr.json")
        if raw is None:
            raise CacheFormatError(f"{label}: committed shard has no {self.store.url.url}/{key_dir}/zarr.json")
        meta = parse_metadata(raw, label)
        key = f"{key_dir}/{shard_file_relpath(len(meta['shape']))}"
        got = self.store.get_tail(key, index_nbytes(meta, label))
        if got is None:
            raise CacheFormatError(f"{label}: committed shard object {self.store.url.url}/{key} is missing")
        tail, size = got
        return ArrayFile.parse(meta, tail, file_size=size, path=self._path(key), label=label)

    def ranges(self, a: ArrayFile) -> nullcontext[ObjectRanges | WholeObjectRanges]:
        # ArrayFile.path is the object's URL (what error messages name); the key is what follows the prefix
        key = a.path[len(self._path("")):]
        if key.split("/")[2] in WHOLE_ARRAYS:  # shards/S/NAME/c/...
            return nullcontext(WholeObjectRanges(self.whole, key))
        return nullcontext(ObjectRanges(self.store, key))

    def _path(self, key: str) -> str:
        return f"{self.store.url.url}/{key}"
