"""CacheWriter: packs appended samples into shards and commits them atomically from one background thread.

Shapes: T = packed tokens, N = samples, K = taps, D = hidden size.

The caller (extraction) hands over CPU bytes; a bounded queue decouples it from the disk, and a full queue
blocks `append` - that is the disk's back-pressure, counted in stats.seconds_blocked. The thread copies each
batch once, tap-major, into a reused block buffer [K, block_tokens, D] and streams every full block to the
shard file: per block, all token chunks of tap 0, then of tap 1, ... So writer memory is two blocks (not
a shard), writes overlap appends, and a read of one tap of a sample is one contiguous pread (or ranged GET)
per block (block_bytes per tap, 32 MB: format.DEFAULT_BLOCK_BYTES). A second thread (_BlockPipe) checksums
and writes a full block while the writer thread copies the next one into the other buffer, so the copy, the crc32c and the disk overlap
(they ran back to back: benchmarks/results/cache_h200.json, writer 0.66 of a raw write). File order is
unchanged: blocks are written in the order they fill. Commit protocol: commit.py.
"""

from __future__ import annotations

import os
import queue
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from dflash.cache import commit as cm
from dflash.cache.format import (DEFAULT_BLOCK_BYTES, DEFAULT_CHUNK_BYTES, FORMAT_NAME, FORMAT_VERSION,
                                 EncodedHidden, Fingerprint, check_stored_finite, choose_chunk_tokens, encode_stored,
                                 stored_layout)
from dflash.cache.shardfile import ArrayWriter, write_array, write_json_file
from dflash.durable import fsync_dir
from dflash.errors import CacheFormatError, ConfigError, DflashError
from dflash.locks import FolderLock

SMALL_CHUNK_TOKENS = 4096   # input_ids / loss_mask chunk: 20 KB, read whole per sample (hidden is ~MBs)
SCALE_CHUNK_TOKENS = 1024   # scales [T,K] chunk: 20 KB at K=5


@dataclass
class WriteStats:
    samples: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    bytes_written: int = 0
    shards_committed: int = 0
    seconds_blocked: float = 0.0
    """Time `append` waited on a full queue (disk back-pressure)."""
    seconds_committing: float = 0.0
    """Time the writer thread spent writing and committing shards."""
    queued_at_close: int = 0
    """Batches still queued when `close` was called (the work left for the final drain)."""
    seconds_close: float = 0.0
    """Wall time of `close`: those queued batches, the last (partial) shard's commit and the manifest."""
    seconds_last_commit: float = 0.0
    """Of the shard committed last: its commit (remaining blocks, fsync, small arrays, rename, record)."""


_CLOSE = object()


class _BlockPipe:
    """One I/O thread that writes full blocks in FIFO order, and the block buffers that cycle through it.

    Every call that touches the thread's state is made from the writer thread; errors of the I/O thread
    are re-raised there (acquire/drain)."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype, *, buffers: int = 2, name: str) -> None:
        self._free: queue.Queue = queue.Queue()
        for _ in range(buffers):
            self._free.put(np.empty(shape, dtype))
        self._jobs: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._skip = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def acquire(self) -> np.ndarray:
        buf = self._free.get()
        self._check()
        return buf

    def submit(self, array_writer: ArrayWriter, chunks: list, buf: np.ndarray) -> None:
        """Write `chunks` (views into buf) with array_writer, then recycle buf."""
        self._check()
        self._jobs.put((array_writer, chunks, buf))

    def drain(self) -> None:
        """Wait until every submitted block is written."""
        self._jobs.join()
        self._check()

    def stop_quietly(self) -> None:
        """Skip the blocks not yet written and wait for the one in flight (abort, or after an error)."""
        self._skip = True
        self._jobs.join()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                array_writer, chunks, buf = job
                if self._error is None and not self._skip:
                    try:
                        array_writer.write_chunks(chunks)
                    except BaseException as e:  # noqa: BLE001 - handed to the writer thread
                        self._error = e
                self._free.put(buf)  # also after an error: the writer thread may be waiting for it
            finally:
                self._jobs.task_done()


class CacheWriter:
    def __init__(self, path, fingerprint: Fingerprint, *, rank: int = 0, shard_tokens: int = 1 << 16,
                 queue_depth: int = 4, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 block_bytes: int = DEFAULT_BLOCK_BYTES, max_held_shards: int | None = None) -> None:
        """Create the cache at `path` or check an existing one's fingerprint; clean this rank's leftovers.

        chunk_bytes: target size of one (tokens, 1 tap, D) hidden chunk, the read and checksum unit
        (512 KB: see benchmarks/results/cache_*.json). block_bytes: per-tap bytes of one streamed block.
        max_held_shards: after a commit, wait while this rank has more committed shard folders than this (an
        extraction into a URL: its publisher deletes each one the store has committed, so the staging folder
        holds at most this many plus the shard being written; a slow store is then back-pressure, counted in
        stats.seconds_blocked like a slow disk). None: no wait (the caller must keep deleting, or it waits)."""
        if shard_tokens < 1 or queue_depth < 1 or rank < 0:
            raise ConfigError(f"shard_tokens={shard_tokens}, queue_depth={queue_depth}, rank={rank} must be positive")
        self.path, self.fingerprint, self.rank = os.fspath(path), fingerprint, rank
        self.shard_tokens = shard_tokens
        self.max_held_shards = max_held_shards
        self.K, self.D = len(fingerprint.tap_layer_ids), fingerprint.hidden_size
        self.storage = fingerprint.storage
        self.layout = stored_layout(self.storage, self.D)
        self.np_dtype = np.dtype(self.layout.hidden_dtype)
        self.W = self.layout.hidden_width  # stored hidden row: D, or D/2 bytes of 4-bit code pairs
        self.chunk_tokens = choose_chunk_tokens(hidden_size=self.W, itemsize=self.np_dtype.itemsize,
                                                chunk_bytes=chunk_bytes)
        chunk = self.chunk_tokens * self.W * self.np_dtype.itemsize
        self.block_tokens = self.chunk_tokens * max(1, 1 << max(0, (block_bytes // chunk).bit_length() - 1))
        self.block_tokens = min(self.block_tokens, -(-shard_tokens // self.chunk_tokens) * self.chunk_tokens)
        self.stats = WriteStats()
        os.makedirs(self.path, exist_ok=True)
        # Two writers of one rank would interleave shard seqs and commit the same samples twice.
        self._rank_lock = FolderLock(self.path, name=cm.writer_lock_name(rank), purpose=f"cache writer rank {rank}")
        self._rank_lock.acquire()
        try:
            self._open_cache()
            self._seq = self._clean_leftovers()
        except BaseException:
            self._rank_lock.release()
            raise
        self._log_totals = cm.LogTotals(self.path)
        # shard being filled (owned by the thread)
        self._pipe = _BlockPipe((self.K, self.block_tokens, self.W), self.np_dtype, name=f"dflash-cache-io-{rank}")
        self._blk_KBD = self._pipe.acquire()
        self._blk_fill = 0       # tokens in the block buffer
        self._blk_start = 0      # shard token offset of the block buffer
        self._hidden_w = None    # ArrayWriter of the shard being filled
        self._scales_TK = np.empty((0, self.K), np.float32)
        self._gscales_TKG = np.empty((0, self.K, self.layout.group_width), self.layout.group_dtype or np.uint8)
        self._ids_T = np.empty(0, np.int32)
        self._mask_T = np.empty(0, np.uint8)
        self._samples: list[tuple[int, int, int, int]] = []  # (id, offset, length, loss tokens)
        self._tokens = 0
        self._queue: queue.Queue = queue.Queue(maxsize=queue_depth)
        self._error: BaseException | None = None
        self._abort = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"dflash-cache-writer-{rank}", daemon=True)
        self._thread.start()

    # -- setup -------------------------------------------------------------------------------------------
    def _open_cache(self) -> None:
        os.makedirs(self.path, exist_ok=True)
        lock = cm.CacheLock(self.path)
        try:
            with lock:
                if os.path.exists(os.path.join(self.path, cm.MANIFEST)):
                    existing = Fingerprint.from_json(cm.read_manifest(self.path)["fingerprint"])
                    existing.check_matches(self.fingerprint)
                else:
                    leftovers = cm.startup_leftovers(self.path)
                    if leftovers is None:
                        other = sorted(os.listdir(self.path))
                        raise CacheFormatError(f"{self.path} is not empty ({other[:3]}...) and has no {cm.MANIFEST}: "
                                               "refusing to write a cache into it; pick a new directory")
                    for name in leftovers:  # a manifest tmp file of a run killed mid-write
                        if name.startswith(f".{cm.MANIFEST}."):
                            os.remove(os.path.join(self.path, name))
                    for d in (cm.COMMITS, cm.SHARDS, cm.STAGING):
                        os.makedirs(os.path.join(self.path, d), exist_ok=True)
                    cm.write_manifest_atomic(self.path, cm.build_manifest(self.fingerprint, []), tag=self._tag)
        finally:
            lock.close()
        for d in (cm.COMMITS, cm.SHARDS, cm.STAGING):
            os.makedirs(os.path.join(self.path, d), exist_ok=True)

    @property
    def _tag(self) -> str:
        return f"{self.rank}-{os.getpid()}"

    def _clean_leftovers(self) -> int:
        """Remove this rank's staging dirs and uncommitted shards (crash leftovers); return the next seq."""
        records = cm.truncate_torn_tail(self.path, self.rank)
        committed = {r.shard for r in records}
        seqs = [r.seq for r in records]
        for sub in (cm.STAGING, cm.SHARDS):
            for name in os.listdir(os.path.join(self.path, sub)):
                parsed = cm.parse_shard_name(name)
                if parsed and parsed[0] == self.rank:
                    seqs.append(parsed[1])
                    if sub == cm.STAGING or name not in committed:
                        shutil.rmtree(os.path.join(self.path, sub, name))
        return max(seqs, default=-1) + 1

    # -- caller side ---------------------------------------------------------------------------------------
    def append(self, *, sample_ids: np.ndarray, lengths: np.ndarray, input_ids: np.ndarray,
               loss_mask: np.ndarray, hidden: torch.Tensor, scales: torch.Tensor | None = None,
               group_scales: torch.Tensor | None = None, on_consumed: Callable[[], None] | None = None) -> None:
        """Queue a batch of samples (concatenated, no padding). Blocks while the queue is full.

        hidden: float features [T, K, D] (encoded here), or the stored arrays already encoded (on the GPU, by
        format.encode_stored): hidden bits with `scales` (fp8; 4-bit e4m3 row scales) and `group_scales`
        (4-bit). A batch holding NaN/Inf features is refused by the writer thread before any of it is written
        (format.check_stored_finite): its DataError comes from the next append or from close.

        The writer keeps references to the arrays until it has copied them: do not modify them afterwards.
        `on_consumed` is called from the writer thread once it has copied them, so the caller can recycle
        the (pinned) buffers; it is not called when the writer fails or is aborted."""
        self._check_usable()
        sample_ids = np.asarray(sample_ids, np.int64).reshape(-1)
        lengths = np.asarray(lengths, np.int64).reshape(-1)
        T = int(lengths.sum())
        if len(sample_ids) != len(lengths) or (lengths < 1).any():
            raise ConfigError(f"sample_ids ({len(sample_ids)}) and lengths ({len(lengths)}) must match, lengths >= 1")
        input_ids = np.asarray(input_ids).reshape(-1)
        loss_mask = np.asarray(loss_mask).reshape(-1)
        if input_ids.shape != (T,) or loss_mask.shape != (T,):
            raise ConfigError(f"input_ids {input_ids.shape} and loss_mask {loss_mask.shape} must be [{T}] = sum(lengths)")
        if any(t is not None and t.device.type != "cpu" for t in (hidden, scales, group_scales)):
            raise ConfigError("hidden must be a CPU tensor (encode on the GPU with encode_stored, then copy)")
        enc = self._encoded(hidden, scales, group_scales, T)
        scales_np = enc.scales.to(torch.float32).contiguous().numpy() if self.layout.has_scales else None
        gscales_np = enc.group_scales.contiguous().numpy() if self.layout.group_width else None
        item = (sample_ids, lengths, input_ids.astype(np.int32, copy=False),
                loss_mask.astype(np.uint8, copy=False), enc.hidden.numpy(), scales_np, gscales_np, on_consumed)
        t0 = time.perf_counter()
        while True:
            try:
                self._queue.put(item, timeout=0.05)
                break
            except queue.Full:
                self._check_usable()
        self.stats.seconds_blocked += time.perf_counter() - t0

    def _encoded(self, hidden: torch.Tensor, scales: torch.Tensor | None, group_scales: torch.Tensor | None,
                 T: int) -> EncodedHidden:
        """The batch as the arrays this storage stores (encoding float features here), shapes checked."""
        L, K = self.layout, self.K
        if hidden.is_floating_point():
            if tuple(hidden.shape) != (T, K, self.D):
                raise ConfigError(f"hidden has shape {tuple(hidden.shape)}, expected [T={T}, K={K}, D={self.D}]")
            if hidden.dtype == torch.bfloat16 and self.storage == "bf16":
                return EncodedHidden(hidden=hidden.view(torch.uint16))
            if scales is not None or group_scales is not None:
                raise ConfigError("scales / group_scales are only given with already-encoded bits")
            return encode_stored(hidden, self.storage, check_finite=False)
        if hidden.dtype != L.hidden_torch_dtype or tuple(hidden.shape) != (T, K, L.hidden_width):
            raise ConfigError(f"hidden {hidden.dtype} {tuple(hidden.shape)} does not match storage {self.storage!r}: "
                              f"expected {L.hidden_dtype} [T={T}, K={K}, {L.hidden_width}]")
        if L.has_scales and (scales is None or tuple(scales.shape) != (T, K)):
            raise ConfigError(f"{self.storage} bits need float32 scales [T={T}, K={K}]")
        if L.group_width and (group_scales is None or group_scales.dtype != L.group_torch_dtype
                              or tuple(group_scales.shape) != (T, K, L.group_width)):
            raise ConfigError(f"{self.storage} codes need {L.group_dtype} group_scales [T={T}, K={K}, "
                              f"G={L.group_width}]")
        return EncodedHidden(hidden=hidden, scales=scales if L.has_scales else None,
                             group_scales=group_scales if L.group_width else None)

    def close(self) -> WriteStats:
        """Commit the last (partial) shard, join the thread, re-raise its error."""
        if self._closed:
            if not self._thread.is_alive():  # closed after a worker error seen by append
                self._rank_lock.release()
            return self.stats
        self._closed = True
        t0 = time.perf_counter()
        self.stats.queued_at_close = self._queue.qsize()
        try:
            self._stop_thread()
            if self._error is not None:
                self._raise_worker_error()
            self._update_manifest()
        finally:
            self._rank_lock.release()
        self.stats.seconds_close = time.perf_counter() - t0
        return self.stats

    def abort(self) -> None:
        """Stop the thread and commit nothing more (the shard being filled is dropped)."""
        self._closed = True
        self._abort.set()
        try:
            self._stop_thread()
        finally:
            self._rank_lock.release()

    def _stop_thread(self) -> None:
        """Queue the close marker (unless the thread already died) and wait for the thread."""
        while self._thread.is_alive():
            try:
                self._queue.put(_CLOSE, timeout=0.05)
                break
            except queue.Full:
                pass
        self._thread.join()

    def __enter__(self) -> CacheWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def raise_if_failed(self) -> None:
        """Re-raise the writer thread's error, if any (for callers waiting on something else than append)."""
        self._check_usable()

    def _check_usable(self) -> None:
        if self._error is not None:
            self._closed = True
            self._raise_worker_error()
        if self._closed:
            raise ConfigError("CacheWriter is closed")

    def _raise_worker_error(self) -> None:
        err = self._error
        if isinstance(err, DflashError):
            # The same class, so the CLI prints its one line (a RuntimeError printed a traceback). Built without
            # calling __init__: subclasses such as CacheMismatchError take other arguments.
            again = type(err).__new__(type(err))
            again.__dict__.update(err.__dict__)
            again.args = (f"cache writer thread stopped: {err}",)
            raise again from err
        raise RuntimeError(f"cache writer thread failed: {err!r}") from err

    # -- writer thread -------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self.max_held_shards is not None:  # a resumed run's leftovers count too, before its first shard
                self._wait_until_held(self.max_held_shards)
            self._run_items()
        finally:
            self._pipe.stop()

    def _run_items(self) -> None:
        try:
            while True:
                item = self._queue.get()
                if self._abort.is_set():
                    self._pipe.stop_quietly()
                    if self._hidden_w is not None:
                        self._hidden_w.close()
                    shutil.rmtree(os.path.join(self.path, cm.STAGING, cm.shard_name(rank=self.rank, seq=self._seq)),
                                  ignore_errors=True)
                    return
                if item is _CLOSE:
                    if self._tokens:
                        self._commit()
                    return
                *batch, on_consumed = item
                self._add(*batch)
                if on_consumed is not None:
                    on_consumed()
        except BaseException as e:  # noqa: BLE001 - handed to the caller thread
            self._error = e
            self._pipe.stop_quietly()
            if self._hidden_w is not None:
                self._hidden_w.close()
            shutil.rmtree(os.path.join(self.path, cm.STAGING, cm.shard_name(rank=self.rank, seq=self._seq)),
                          ignore_errors=True)

    def _add(self, ids_N, lengths_N, input_ids_T, loss_mask_T, hidden_TKD, scales_TK, gscales_TKG) -> None:
        check_stored_finite(self.layout, hidden_TKD, scales_TK, gscales_TKG)  # before any of the batch is written
        starts = np.concatenate([[0], np.cumsum(lengths_N)])
        s, N = 0, len(ids_N)
        while s < N:
            if self._tokens and self._tokens + lengths_N[s] > self.shard_tokens:
                self._commit()
            e = s + 1  # one sample always fits an empty shard (a long sample makes an oversized shard)
            while e < N and self._tokens + starts[e + 1] - starts[s] <= self.shard_tokens:
                e += 1
            a, b = int(starts[s]), int(starts[e])
            off, n = self._tokens, b - a
            self._reserve(off + n)
            self._add_hidden(hidden_TKD[a:b])
            if scales_TK is not None:
                self._scales_TK[off:off + n] = scales_TK[a:b]
            if gscales_TKG is not None:
                self._gscales_TKG[off:off + n] = gscales_TKG[a:b]
            self._ids_T[off:off + n] = input_ids_T[a:b]
            self._mask_T[off:off + n] = loss_mask_T[a:b]
            for j in range(s, e):
                o = off + int(starts[j]) - a
                self._samples.append((int(ids_N[j]), o, int(lengths_N[j]), int(loss_mask_T[starts[j]:starts[j + 1]].sum())))
            self._tokens += n
            s = e
            if self._tokens >= self.shard_tokens:
                self._commit()

    def _reserve(self, tokens: int) -> None:
        """Grow the per-shard arrays kept in memory until the commit (ids, mask, scales: <= 25 bytes per token;
        4-bit group scales K x G bytes: 800 at the 27B shape with groups of 32, 52 MB per 64K-token shard)."""
        have = len(self._ids_T)
        if have >= tokens:
            return
        need = max(tokens, min(self.shard_tokens, 2 * have), 1024)
        t = self._tokens
        G = self.layout.group_width
        for name, shape, dt in (("_scales_TK", (need, self.K), np.float32), ("_ids_T", (need,), np.int32),
                                ("_mask_T", (need,), np.uint8),
                                ("_gscales_TKG", (need if G else 0, self.K, G), self._gscales_TKG.dtype)):
            new = np.empty(shape, dt)
            new[:t] = getattr(self, name)[:t]
            setattr(self, name, new)

    def _add_hidden(self, hidden_TKD: np.ndarray) -> None:
        """Copy tokens tap-major into the block buffer, streaming each full block to the shard file."""
        if self._hidden_w is None:
            stage = os.path.join(self.path, cm.STAGING, cm.shard_name(rank=self.rank, seq=self._seq))
            shutil.rmtree(stage, ignore_errors=True)
            os.makedirs(stage)
            self._hidden_w = ArrayWriter(os.path.join(stage, "hidden"), ndim=3)
        i, n = 0, len(hidden_TKD)
        B = self.block_tokens
        while i < n:
            m = min(n - i, B - self._blk_fill)
            self._blk_KBD[:, self._blk_fill:self._blk_fill + m] = hidden_TKD[i:i + m].transpose(1, 0, 2)
            self._blk_fill += m
            i += m
            if self._blk_fill == B:
                self._flush_block()

    def _flush_block(self) -> None:
        """Write the block's chunks (tap-major); a partial last block is zero-padded to whole chunks."""
        ct, fill = self.chunk_tokens, self._blk_fill
        n_chunks = -(-fill // ct)
        self._blk_KBD[:, fill:n_chunks * ct] = 0
        c0, buf = self._blk_start // ct, self._blk_KBD
        self._pipe.submit(self._hidden_w, [((c0 + c, k, 0), buf[k, c * ct:(c + 1) * ct])
                                           for k in range(self.K) for c in range(n_chunks)], buf)
        self._blk_start += fill
        self._blk_fill = 0
        self._blk_KBD = self._pipe.acquire()

    def _commit(self) -> None:
        t_start = time.perf_counter()
        name = cm.shard_name(rank=self.rank, seq=self._seq)
        stage = os.path.join(self.path, cm.STAGING, name)
        T, K, W, ct = self._tokens, self.K, self.W, self.chunk_tokens
        if self._blk_fill:
            self._flush_block()
        self._pipe.drain()
        nbytes = self._hidden_w.finish(shape=(T, K, W), dtype=self.np_dtype.name, chunk_shape=(ct, 1, W))
        self._hidden_w, self._blk_start = None, 0
        attrs = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "storage": self.storage,
                 "tap_layer_ids": list(self.fingerprint.tap_layer_ids), "rank": self.rank, "seq": self._seq}
        nbytes += write_json_file(os.path.join(stage, "zarr.json"),
                                  {"attributes": attrs, "zarr_format": 3, "node_type": "group"})
        if self.layout.has_scales:
            nbytes += _write_small(os.path.join(stage, "scales"), self._scales_TK[:T], SCALE_CHUNK_TOKENS)
        if self.layout.group_width:
            nbytes += _write_per_tap(os.path.join(stage, "group_scales"), self._gscales_TKG[:T], ct)
        nbytes += _write_small(os.path.join(stage, "input_ids"), self._ids_T[:T], SMALL_CHUNK_TOKENS)
        nbytes += _write_small(os.path.join(stage, "loss_mask"), self._mask_T[:T], SMALL_CHUNK_TOKENS)
        samples = np.array(self._samples, dtype=np.int64).reshape(-1, 4)
        nbytes += _write_small(os.path.join(stage, "samples"), samples, len(samples))
        fsync_dir(stage)
        os.rename(stage, os.path.join(self.path, cm.SHARDS, name))
        fsync_dir(os.path.join(self.path, cm.SHARDS))
        record = cm.CommitRecord(shard=name, rank=self.rank, seq=self._seq, num_samples=len(samples),
                                 num_tokens=T, num_loss_tokens=int(samples[:, 3].sum()), nbytes=nbytes,
                                 sample_ids=tuple(int(i) for i in samples[:, 0]))
        cm.append_commit_line(self.path, self.rank, record)  # the shard is visible from here on
        self._update_manifest()
        self._seq += 1
        st = self.stats
        st.samples += record.num_samples
        st.tokens += T
        st.loss_tokens += record.num_loss_tokens
        st.bytes_written += nbytes
        st.shards_committed += 1
        st.seconds_last_commit = time.perf_counter() - t_start
        st.seconds_committing += st.seconds_last_commit
        self._samples, self._tokens = [], 0
        if self.max_held_shards is not None:
            self._wait_until_held(self.max_held_shards)

    def _wait_until_held(self, most: int) -> None:
        """Block the writer thread while this rank holds more than `most` committed shard folders (see
        max_held_shards); an abort (close after an error, Ctrl-C) ends the wait."""
        shards = os.path.join(self.path, cm.SHARDS)

        def held() -> int:
            return sum((cm.parse_shard_name(n) or (-1,))[0] == self.rank for n in os.listdir(shards))
        while not self._abort.is_set() and held() > most:
            time.sleep(0.02)  # append() blocks meanwhile once the queue is full: stats.seconds_blocked

    def _update_manifest(self) -> None:
        lock = cm.CacheLock(self.path)
        try:
            with lock:
                manifest = cm.build_manifest(self.fingerprint, [])
                manifest["totals"] = self._log_totals.refresh()
                cm.write_manifest_atomic(self.path, manifest, tag=self._tag)
        finally:
            lock.close()


def _write_per_tap(array_dir: str, data_TKX: np.ndarray, chunk_tokens: int) -> int:
    """[T, K, X] in (chunk_tokens, 1, X) chunks, tap-major like `hidden`: the reader reads one tap's rows of a
    sample with the same row ranges (and one pread) as its hidden rows."""
    T, K, X = data_TKX.shape
    n = max(1, -(-T // chunk_tokens))
    padded = np.zeros((n * chunk_tokens, K, X), data_TKX.dtype)
    padded[:T] = data_TKX
    chunks = (((c, k, 0), np.ascontiguousarray(padded[c * chunk_tokens:(c + 1) * chunk_tokens, k:k + 1]))
              for k in range(K) for c in range(n))
    return write_array(array_dir, shape=data_TKX.shape, dtype=data_TKX.dtype.name,
                       chunk_shape=(chunk_tokens, 1, X), chunks=chunks)


def _write_small(array_dir: str, data: np.ndarray, chunk_rows: int) -> int:
    """A small array (ids, mask, scales, samples): pad rows to the chunk and write it chunk by chunk."""
    chunk_rows = max(1, min(chunk_rows, len(data)))
    n = -(-len(data) // chunk_rows)
    padded = np.zeros((n * chunk_rows, *data.shape[1:]), data.dtype)
    padded[:len(data)] = data
    chunk_shape = (chunk_rows, *data.shape[1:])
    return write_array(array_dir, shape=data.shape, dtype=data.dtype.name, chunk_shape=chunk_shape,
                       chunks=(((c,) + (0,) * (data.ndim - 1), padded[c * chunk_rows:(c + 1) * chunk_rows])
                               for c in range(n)))
