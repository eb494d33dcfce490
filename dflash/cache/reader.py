"""CacheReader: the sample index of a cache and reads of any samples and any subset of its taps.

Shapes: T = packed tokens, N = samples, K' = selected taps, D = hidden size.

The index comes from the commit logs and each shard's small `samples` array; hidden data is not touched
until a read. Reads go straight to the shard files (shardfile.py): per sample and tap one pread of the
contiguous token chunks, a crc32c check per chunk, one copy into the caller's (pinned) buffer. Threads help
on fast disks because pread, crc32c and numpy copies release the GIL. The store stays plain zarr.
A cache URL (s3://...) is read the same way through dflash.store.direct: the same byte ranges, each one
ranged GET, no local copy (parallel requests: num_threads defaults to 16 there, 1 for a local folder).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from dflash.cache import commit as cm
from dflash.cache.format import Fingerprint, decode_bf16, decode_stored, stored_layout
from dflash.cache.shardfile import ArrayFile, ByteRanges, FileRanges, split_rows
from dflash.errors import CacheFormatError, ConfigError

log = logging.getLogger(__name__)
_PIECE_BYTES = 8 << 20  # per-tap rows per read task
_ARRAY_CACHE = 1024  # parsed shard indexes kept (hidden index: 16 B per chunk, ~160 KB per 64k-token shard)


@dataclass
class SampleIndex:
    """All int64 [N], sorted by sample_id; shard indexes shard_names (a MixedReader's: numbered across its
    caches, shard_names empty)."""

    sample_id: np.ndarray
    length: np.ndarray
    num_loss_tokens: np.ndarray
    shard: np.ndarray
    offset: np.ndarray
    shard_names: list[str]


@dataclass
class Sample:
    sample_id: int
    input_ids: np.ndarray        # int32 [T]
    loss_mask: np.ndarray        # uint8 [T]
    hidden: torch.Tensor         # [T,K',D] bf16, or uint8 fp8 bits, or uint8 4-bit codes [T,K',D/2]
    scales: torch.Tensor | None  # float32 [T,K'] for fp8 bits (4-bit e4m3: row scales)
    group_scales: torch.Tensor | None = None  # [T,K',G] for 4-bit codes


@dataclass
class PackedSamples:
    sample_ids: np.ndarray       # int64 [N]
    lengths: np.ndarray          # int64 [N]
    input_ids: np.ndarray        # int32 [T]
    loss_mask: np.ndarray        # uint8 [T]
    hidden: torch.Tensor         # [T,K',D] bf16, or uint8 fp8 bits, or uint8 4-bit codes [T,K',D/2]
    scales: torch.Tensor | None  # float32 [T,K'] for fp8 bits (4-bit e4m3: row scales)
    group_scales: torch.Tensor | None = None  # [T,K',G] for 4-bit codes


@dataclass
class PackedBuffers:
    """Destination buffers (e.g. pinned) for read_many; only the first T rows are used."""

    hidden: torch.Tensor          # uint16 (bf16 storage) or uint8 (fp8) [>=T, K', D]; 4-bit uint8 [>=T, K', D/2]
    scales: torch.Tensor | None   # float32 [>=T, K'] (fp8; 4-bit with e4m3 group scales)
    input_ids: torch.Tensor       # int32 [>=T]
    loss_mask: torch.Tensor       # uint8 [>=T]
    group_scales: torch.Tensor | None = None  # [>=T, K', G] (4-bit)

    @classmethod
    def allocate(cls, *, tokens: int, num_taps: int, hidden_size: int, storage: str,
                 pin_memory: bool = False) -> PackedBuffers:
        def e(shape, dt):
            return torch.empty(shape, dtype=dt, pin_memory=pin_memory)
        L = stored_layout(storage, hidden_size)
        return cls(hidden=e((tokens, num_taps, L.hidden_width), L.hidden_torch_dtype),
                   scales=e((tokens, num_taps), torch.float32) if L.has_scales else None,
                   input_ids=e((tokens,), torch.int32), loss_mask=e((tokens,), torch.uint8),
                   group_scales=e((tokens, num_taps, L.group_width), L.group_torch_dtype) if L.group_width else None)


def stored_samples(out: PackedBuffers, *, sample_ids: np.ndarray, lengths: np.ndarray, storage: str,
                   layout) -> PackedSamples:
    """The first sum(lengths) rows of `out` as read samples, hidden as stored (bf16 bits decoded; fp8 and 4-bit
    with their scales): what a reader over several caches returns once its sub-reads have filled `out`."""
    T = int(lengths.sum())
    hidden = out.hidden[:T]
    if storage == "bf16":
        hidden = decode_bf16(hidden)
    return PackedSamples(sample_ids=sample_ids, lengths=lengths, input_ids=out.input_ids[:T].numpy(),
                         loss_mask=out.loss_mask[:T].numpy(), hidden=hidden,
                         scales=out.scales[:T] if layout.has_scales else None,
                         group_scales=out.group_scales[:T] if layout.group_width else None)


class ShardSource(Protocol):
    """Where a reader's cache lives: its manifest, commit records and shard files (a folder or a store)."""

    default_threads: int
    """read_many's parallel requests when the caller does not say."""
    piece_bytes: int | None
    """Most bytes of one read task per tap: longer contiguous runs are cut (split_rows) into parts read side by
    side (a local file's reads go through a scratch buffer of this size); None: one task per run."""

    def manifest(self) -> dict: ...

    def records(self) -> list[cm.CommitRecord]:
        """Committed shards, sorted by (rank, seq)."""
        ...

    def open_array(self, shard: str, name: str, label: str) -> ArrayFile: ...

    def ranges(self, a: ArrayFile) -> AbstractContextManager[ByteRanges]:
        """The byte ranges of `a`'s shard file, open for the duration of the with block."""
        ...


class LocalShards:
    """ShardSource of a local cache folder: preads of the shard files."""

    default_threads = 1  # the loader runs its own reader threads; more help only on fast NVMe (bench_cache)
    piece_bytes = _PIECE_BYTES

    def __init__(self, path: str) -> None:
        self.path = path

    def manifest(self) -> dict:
        return cm.read_manifest(self.path)

    def records(self) -> list[cm.CommitRecord]:
        return cm.read_commit_logs(self.path)

    def open_array(self, shard: str, name: str, label: str) -> ArrayFile:
        return ArrayFile.open(os.path.join(self.path, cm.SHARDS, shard, name), label)

    @contextmanager
    def ranges(self, a: ArrayFile):
        fd = os.open(a.path, os.O_RDONLY)
        try:
            yield FileRanges(fd)
        finally:
            os.close(fd)


def open_source(path: str) -> ShardSource:
    """LocalShards for a folder; for a cache URL the store's direct reads (dflash.store.direct)."""
    from dflash.store.url import is_store_url
    if is_store_url(path):
        from dflash.store.direct import StoreShards
        return StoreShards(path)
    return LocalShards(path)


class CacheReader:
    def __init__(self, path, *, verify: bool = True, num_threads: int | None = None) -> None:
        """path: a cache folder or a cache URL (s3://...: read by ranged GETs, nothing copied locally).
        verify: check the crc32c of every chunk read. num_threads: parallel reads in read_many (None: 1 for a
        folder, 16 for a URL, where each read is a request with its latency)."""
        self.path = os.fspath(path)
        self.verify = verify
        self.source = open_source(self.path)
        self.num_threads = self.source.default_threads if num_threads is None else num_threads
        self.manifest = self.source.manifest()
        self.fingerprint = Fingerprint.from_json(self.manifest["fingerprint"])
        self.tap_layer_ids = self.fingerprint.tap_layer_ids
        self.storage = self.fingerprint.storage
        self.hidden_size = self.fingerprint.hidden_size
        self.layout = stored_layout(self.storage, self.hidden_size)
        self.bytes_read = 0
        self._lock = threading.Lock()
        self._arrays: OrderedDict[tuple[int, str], ArrayFile] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._local = threading.local()
        self.index = self._build_index(self.source.records())

    def _map(self, fn, items: list) -> list:
        """fn over items, on the read pool when there is one worth having."""
        if self.num_threads > 1 and len(items) > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="dflash-cache-read")
            return list(self._pool.map(fn, items))
        return [fn(x) for x in items]

    def _build_index(self, records: list[cm.CommitRecord]) -> SampleIndex:
        names = [r.shard for r in records]

        def samples_of(s: int) -> np.ndarray:  # on a store: 3 requests per shard, in parallel
            a = self._array(s, "samples", names)
            with self.source.ranges(a) as src:
                return a.read_all(verify=self.verify, src=src)
        cols: list[np.ndarray] = []
        for s, (r, samples) in enumerate(zip(records, self._map(samples_of, list(range(len(records)))))):
            if samples.shape != (r.num_samples, 4) or tuple(samples[:, 0].tolist()) != r.sample_ids:
                raise CacheFormatError(f"shard {r.shard}: samples array disagrees with its commit line "
                                       f"in commits/{cm.log_name(r.rank)}")
            cols.append(np.column_stack([samples, np.full(len(samples), s, np.int64)]))
        table = np.concatenate(cols) if cols else np.empty((0, 5), np.int64)
        order = np.argsort(table[:, 0], kind="stable")
        table = table[order]
        dup = np.flatnonzero(table[1:, 0] == table[:-1, 0]) + 1
        if len(dup):
            # a sample committed twice (e.g. two ranks raced); both copies are identical data
            log.warning("cache %s: %d sample ids are committed twice; using the first copy", self.path, len(dup))
            table = np.delete(table, dup, axis=0)
        return SampleIndex(sample_id=table[:, 0].copy(), offset=table[:, 1].copy(), length=table[:, 2].copy(),
                           num_loss_tokens=table[:, 3].copy(), shard=table[:, 4].copy(), shard_names=names)

    def _array(self, shard: int, name: str, names: list[str] | None = None) -> ArrayFile:
        key = (shard, name)
        with self._lock:
            a = self._arrays.get(key)
            if a is not None:
                self._arrays.move_to_end(key)
                return a
        sname = (names or self.index.shard_names)[shard]
        a = self.source.open_array(sname, name, f"shard {sname} array {name}")
        with self._lock:
            self._arrays[key] = a
            while len(self._arrays) > _ARRAY_CACHE:
                self._arrays.popitem(last=False)
        return a

    def __len__(self) -> int:
        return len(self.index.sample_id)

    def tap_positions(self, taps: Sequence[int] | None) -> list[int]:
        """Layer ids -> positions on the cache's tap axis; ConfigError naming the available taps."""
        if taps is None:
            return list(range(len(self.tap_layer_ids)))
        pos = {t: i for i, t in enumerate(self.tap_layer_ids)}
        missing = [t for t in taps if t not in pos]
        if missing:
            raise ConfigError(f"taps {missing} are not in the cache; it has tap_layer_ids {list(self.tap_layer_ids)}")
        return [pos[t] for t in taps]

    def read(self, i: int, *, taps: Sequence[int] | None = None, dequantize: bool = False,
             device: torch.device | str | None = None) -> Sample:
        p = self.read_many([i], taps=taps, dequantize=dequantize, device=device)
        return Sample(sample_id=int(p.sample_ids[0]), input_ids=p.input_ids, loss_mask=p.loss_mask,
                      hidden=p.hidden, scales=p.scales, group_scales=p.group_scales)

    def read_many(self, indices: Sequence[int], *, taps: Sequence[int] | None = None,
                  out: PackedBuffers | None = None, dequantize: bool = False,
                  device: torch.device | str | None = None) -> PackedSamples:
        """Samples concatenated along tokens in the given order, into `out` (views of it are returned).
        taps=() reads only input_ids and loss_mask (hidden is [T, 0, W]; bytes_read does not grow).
        dequantize: decode fp8 / 4-bit storage to bf16, on `device` (the stored arrays are copied there first;
        None = the CPU). Eval and held-out eval pass their GPU: a 4-bit decode is a matmul per token."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if len(idx) and (idx.min() < -len(self) or idx.max() >= len(self)):
            raise IndexError(f"sample index out of range for a cache of {len(self)} samples")
        idx = idx % max(len(self), 1)
        pos = self.tap_positions(taps)
        lengths = self.index.length[idx]
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        T, Kp, D = int(starts[-1]), len(pos), self.hidden_size
        if out is None:
            out = PackedBuffers.allocate(tokens=T, num_taps=Kp, hidden_size=D, storage=self.storage)
        self._check_out(out, T, Kp)
        hidden_np = out.hidden[:T].numpy()
        scales_np = out.scales[:T].numpy() if self.layout.has_scales else None
        gscales_np = out.group_scales[:T].numpy() if self.layout.group_width else None
        ids_np, mask_np = out.input_ids[:T].numpy(), out.loss_mask[:T].numpy()

        # merge samples that follow each other in one shard (sequential reads), then cut each tap's rows where
        # the file breaks them (row_runs: one request each; on a store a request costs ~1 MB of payload time,
        # bench_store) and cut runs longer than piece_bytes into near-equal whole-chunk parts (split_rows) so
        # threads share the work and a local file's scratch stays small
        sh, off = self.index.shard[idx], self.index.offset[idx]
        brk = np.flatnonzero((sh[1:] != sh[:-1]) | (off[1:] != off[:-1] + lengths[:-1])) + 1
        seg_first = np.concatenate([[0], brk]).astype(np.int64)
        seg_last = np.concatenate([brk, [len(idx)]]).astype(np.int64)
        row_bytes = self.layout.hidden_width * hidden_np.itemsize
        if pos:  # the hidden indexes of this batch's shards, opened in parallel (a store: 2 requests each)
            self._map(lambda s: self._array(s, "hidden"), sorted(set(sh.tolist())))
        tasks = []
        for a, z in zip(seg_first.tolist(), seg_last.tolist()):
            s, o0, t0, t1 = int(sh[a]), int(off[a]), int(starts[a]), int(starts[z])
            tasks.append((s, o0, t0, t1, None))  # ids, mask, scales of the segment
            hid = self._array(s, "hidden") if pos else None
            cr = hid.chunk_shape[0] if pos else 1
            piece = None if self.source.piece_bytes is None else \
                max(1, self.source.piece_bytes // row_bytes // cr) * cr
            for kk, k in enumerate(pos):
                for run in hid.row_runs(o0, o0 + t1 - t0, (k, 0)):
                    for r0, r1 in split_rows(*run, piece, cr):
                        tasks.append((s, r0, t0 + r0 - o0, t0 + r1 - o0, (kk, k)))

        def task(t) -> int:
            s, o, p0, p1, tap = t
            if tap is None:
                # taps=(): ids and loss mask only (online training); no scale bytes either
                return self._read_small(s, o, p1 - p0, pos,
                                        None if scales_np is None or not pos else scales_np[p0:p1],
                                        ids_np[p0:p1], mask_np[p0:p1])
            kk, k = tap
            n = 0
            for name, dst in (("hidden", hidden_np), ("group_scales", gscales_np)):
                if dst is None:
                    continue
                a = self._array(s, name)
                with self.source.ranges(a) as src:
                    n += a.read_rows(src, o, o + p1 - p0, (k, 0), dst[p0:p1, kk:kk + 1, :],
                                     verify=self.verify, scratch=self._scratch())
            return n

        nbytes = sum(self._map(task, tasks))
        with self._lock:
            self.bytes_read += nbytes
        hidden = out.hidden[:T]
        scales = out.scales[:T] if self.layout.has_scales else None
        gscales = out.group_scales[:T] if self.layout.group_width else None
        if self.storage == "bf16":
            hidden = decode_bf16(hidden)
        elif dequantize:
            on = (lambda t: t) if device is None else (lambda t: None if t is None else t.to(device))
            hidden = decode_stored(on(hidden), on(scales), on(gscales), storage=self.storage)
            scales = gscales = None
        return PackedSamples(sample_ids=self.index.sample_id[idx], lengths=lengths, input_ids=ids_np,
                             loss_mask=mask_np, hidden=hidden, scales=scales, group_scales=gscales)

    def _check_out(self, out: PackedBuffers, T: int, Kp: int) -> None:
        L = self.layout
        want, W = L.hidden_torch_dtype, L.hidden_width
        h = out.hidden
        if h.dtype != want or h.dim() != 3 or h.shape[0] < T or tuple(h.shape[1:]) != (Kp, W) \
                or not h.is_contiguous():
            raise ConfigError(f"out.hidden must be contiguous {want} [>={T}, {Kp}, {W}], "
                              f"got {h.dtype} {tuple(h.shape)}")
        if L.has_scales and (out.scales is None or out.scales.dtype != torch.float32
                             or out.scales.shape[0] < T or out.scales.shape[1] != Kp):
            raise ConfigError(f"out.scales must be float32 [>={T}, {Kp}] for a {self.storage} cache")
        g = out.group_scales
        if L.group_width and (g is None or g.dtype != L.group_torch_dtype or g.shape[0] < T
                              or tuple(g.shape[1:]) != (Kp, L.group_width) or not g.is_contiguous()):
            raise ConfigError(f"out.group_scales must be contiguous {L.group_dtype} [>={T}, {Kp}, {L.group_width}] "
                              f"for a {self.storage} cache")
        if out.input_ids.dtype != torch.int32 or out.loss_mask.dtype != torch.uint8 \
                or out.input_ids.shape[0] < T or out.loss_mask.shape[0] < T:
            raise ConfigError(f"out.input_ids must be int32 [>={T}] and out.loss_mask uint8 [>={T}]")

    def _scratch(self) -> np.ndarray:
        """Per-thread reusable read buffer (see ArrayFile.read_rows on first-touch cost)."""
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = np.empty(_PIECE_BYTES + (4 << 20), np.uint8)
        return buf

    def _read_small(self, s: int, off: int, L: int, pos: list[int], scales_TK: np.ndarray | None,
                    ids_T: np.ndarray, mask_T: np.ndarray) -> int:
        """ids, loss mask and (fp8) scales of L rows; returns scale bytes read."""
        nbytes = 0
        names = [("input_ids", ids_T), ("loss_mask", mask_T)]
        if scales_TK is not None:
            names.append(("scales", None))
        for name, dst in names:
            a = self._array(s, name)
            tmp = np.empty((L, *a.chunk_shape[1:]), a.dtype) if dst is None else dst
            with self.source.ranges(a) as src:
                n = a.read_rows(src, off, off + L, (0,) * (len(a.shape) - 1), tmp, verify=self.verify)
            if dst is None:
                scales_TK[:] = tmp[:, pos]
                nbytes += n
        return nbytes

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def __enter__(self) -> CacheReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def sample_contents(path: str) -> dict:
    """sample id -> (input_ids, loss_mask, hidden bit pattern) as bytes, for every sample of the cache at `path`:
    what two caches must hold alike to be the same cache (a grown cache against the union's, say). Reading
    checks every chunk's crc32c."""
    out = {}
    with CacheReader(str(path)) as r:
        for i in range(len(r)):
            s = r.read(i)
            out[s.sample_id] = (s.input_ids.tobytes(), s.loss_mask.tobytes(),
                                s.hidden.view(torch.uint16).numpy().tobytes())
    return out
