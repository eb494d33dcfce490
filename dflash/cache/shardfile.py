"""Write and read one zarr v3 array stored as a single shard file (sharding_indexed codec), bypassing zarr-python.

Layout of every array we write: the array's one outer chunk (= shard) is the whole array, padded up to a
multiple of the inner chunk along axis 0. Inner chunks use codecs [bytes(little), crc32c], so each inner chunk
in the file is its raw bytes followed by a 4-byte little-endian crc32c; the shard index (offset, nbytes uint64
per inner chunk, C order over the inner-chunk grid) plus its own crc32c sits at the end of the file. The file
is a valid zarr v3 shard, so `zarr.open_group` reads it; we write and read it directly because zarr-python's
per-chunk machinery costs more than the disk at GB/s (see benchmarks/bench_cache.py).

The physical order of inner chunks is ours to choose: we write hidden tap-major, so all token chunks of one
tap are adjacent and reading one sample's tokens of one tap is one contiguous pread.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Callable, Protocol

import crc32c
import numpy as np

from dflash.durable import fsync_dir
from dflash.errors import CacheFormatError, OutOfSpaceError

MISSING = np.uint64(0xFFFFFFFFFFFFFFFF)  # zarr: an absent inner chunk (read as fill value)
CRC_BYTES = 4
_IOV_MAX = 512  # stay under IOV_MAX (1024 on Linux) with (data, crc) pairs


def array_metadata(*, shape: Sequence[int], dtype: str, chunk_shape: Sequence[int]) -> dict:
    """zarr.json of an array with one shard covering the whole (padded) array and crc32c on every chunk."""
    ct = chunk_shape[0]
    shard = [max(1, -(-shape[0] // ct)) * ct, *shape[1:]]
    bytes_codec = {"name": "bytes", "configuration": {"endian": "little"}}
    return {
        "shape": list(shape), "data_type": dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": shard}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": 0,
        "codecs": [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": list(chunk_shape),
            "codecs": [bytes_codec, {"name": "crc32c"}],
            "index_codecs": [bytes_codec, {"name": "crc32c"}],
            "index_location": "end"}}],
        "attributes": {}, "zarr_format": 3, "node_type": "array", "storage_transformers": [],
    }


def shard_file_relpath(ndim: int) -> str:
    """Path of the single shard file inside the array directory: c/0/0/... (default key encoding)."""
    return "/".join(["c"] + ["0"] * ndim)


def write_all(fd: int, buffers: list) -> int:
    """writev every buffer; ENOSPC becomes OutOfSpaceError. The only place our data bytes reach the OS."""
    total = 0
    for i in range(0, len(buffers), _IOV_MAX):
        part = [memoryview(b).cast("B") for b in buffers[i:i + _IOV_MAX]]
        want = sum(len(b) for b in part)
        done = 0
        while done < want:
            try:
                n = os.writev(fd, part)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise OutOfSpaceError(f"no space left on device while writing the cache: {e}") from e
                raise
            done += n
            # rare short write: drop the bytes already written and retry the rest
            while n > 0 and part:
                if n >= len(part[0]):
                    n -= len(part[0])
                    part.pop(0)
                else:
                    part[0] = part[0][n:]
                    n = 0
        total += want
    return total


def _load_sync_file_range():
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _load_sync_file_range()  # ctypes calls release the GIL
_SFR_WAIT_BEFORE, _SFR_WRITE, _SFR_WAIT_AFTER = 1, 2, 4
WRITEBACK_LAG_BYTES = 64 << 20


class Writeback:
    """Streams a file's dirty pages to disk as it grows, keeping at most ~WRITEBACK_LAG_BYTES dirty.

    Why: with lots of RAM the kernel starts writeback late, so a writer that fsyncs per shard leaves the
    disk idle while it fills the page cache and then waits for the whole shard at fsync. Starting writeback
    of each block right after it is written (sync_file_range WRITE), waiting for the block LAG bytes back
    and dropping its pages (fadvise DONTNEED) keeps the disk busy, makes the commit's fsync short, and keeps
    written cache bytes from crowding the page cache (and its fresh-page allocation) out. Durability still
    comes from fsync at commit only; these calls are hints and their errors are ignored."""

    def __init__(self, fd: int, *, lag: int = WRITEBACK_LAG_BYTES) -> None:
        self.fd, self.lag = fd, lag
        self.started = 0   # bytes [0, started) have had writeback started
        self.dropped = 0   # bytes [0, dropped) were waited for and dropped from the page cache

    def wrote(self, end: int) -> None:
        """The file now has `end` bytes: start writeback of the new ones, retire the ones lag bytes back."""
        if _SYNC_FILE_RANGE is not None and end > self.started:
            _SYNC_FILE_RANGE(self.fd, self.started, end - self.started, _SFR_WRITE)
        self.started = end
        old = end - self.lag
        if old > self.dropped:
            if _SYNC_FILE_RANGE is not None:
                _SYNC_FILE_RANGE(self.fd, self.dropped, old - self.dropped,
                                 _SFR_WAIT_BEFORE | _SFR_WRITE | _SFR_WAIT_AFTER)
            _fadvise_dontneed(self.fd, self.dropped, old - self.dropped)
            self.dropped = old

    def synced(self) -> None:
        """After fsync: every page is clean, drop them all."""
        _fadvise_dontneed(self.fd, 0, 0)
        self.dropped = self.started


def _fadvise_dontneed(fd: int, offset: int, length: int) -> None:
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


def write_json_file(path: str, obj: dict) -> int:
    data = json.dumps(obj, indent=1).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, [data])
        os.fsync(fd)
    finally:
        os.close(fd)
    return len(data)


class ArrayWriter:
    """Streams the inner chunks of one array into its shard file; `finish` adds the index and zarr.json.

    Chunks may arrive in any order and before the array's final length is known (the writer streams
    hidden blocks as tokens arrive). Files and new directories are fsynced in `finish`."""

    def __init__(self, array_dir: str, *, ndim: int) -> None:
        self.array_dir, self.ndim = array_dir, ndim
        self.rel = shard_file_relpath(ndim)
        os.makedirs(os.path.join(array_dir, os.path.dirname(self.rel)), exist_ok=True)
        self.fd = os.open(os.path.join(array_dir, self.rel), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.offset = 0
        self.entries: list[tuple[tuple[int, ...], int, int]] = []
        self.writeback = Writeback(self.fd)

    def write_chunks(self, chunks: Iterable[tuple[tuple[int, ...], np.ndarray]]) -> None:
        pending = []
        for coords, data in chunks:
            raw = memoryview(np.ascontiguousarray(data)).cast("B")
            crc = crc32c.crc32c(raw).to_bytes(4, "little")
            self.entries.append((tuple(coords), self.offset, len(raw) + CRC_BYTES))
            self.offset += len(raw) + CRC_BYTES
            pending += [raw, crc]
            if len(pending) >= _IOV_MAX:
                write_all(self.fd, pending)
                pending = []
        if pending:
            write_all(self.fd, pending)
        self.writeback.wrote(self.offset)

    def finish(self, *, shape: Sequence[int], dtype: str, chunk_shape: Sequence[int]) -> int:
        """Write the index and zarr.json, fsync; every grid position must have been written. Returns bytes."""
        try:
            grid = [max(1, -(-shape[0] // chunk_shape[0]))] + [s // c for s, c in zip(shape[1:], chunk_shape[1:])]
            index = np.full((int(np.prod(grid)), 2), MISSING, dtype="<u8")
            for coords, off, nb in self.entries:
                index[np.ravel_multi_index(coords, grid)] = (off, nb)
            assert not (index == MISSING).any(), f"ArrayWriter {self.array_dir}: not every chunk was written"
            idx = index.tobytes()
            write_all(self.fd, [idx, crc32c.crc32c(idx).to_bytes(4, "little")])
            os.fsync(self.fd)
            self.writeback.synced()
        finally:
            self.close()
        nbytes = write_json_file(os.path.join(self.array_dir, "zarr.json"),
                                 array_metadata(shape=shape, dtype=dtype, chunk_shape=chunk_shape))
        # fsync the directories we created so their entries survive a crash (c/0/... chain)
        d = os.path.join(self.array_dir, os.path.dirname(self.rel))
        while True:
            fsync_dir(d)
            if os.path.normpath(d) == os.path.normpath(self.array_dir):
                break
            d = os.path.dirname(d)
        return nbytes + self.offset + len(idx) + CRC_BYTES

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def write_array(array_dir: str, *, shape: Sequence[int], dtype: str, chunk_shape: Sequence[int],
                chunks: Iterable[tuple[tuple[int, ...], np.ndarray]]) -> int:
    """Write a whole array at once; `chunks` yields (grid coords, full padded chunk data) in file order."""
    w = ArrayWriter(array_dir, ndim=len(shape))
    try:
        w.write_chunks(chunks)
    except BaseException:
        w.close()
        raise
    return w.finish(shape=shape, dtype=dtype, chunk_shape=chunk_shape)


def parse_metadata(raw: bytes, label: str) -> dict:
    """An array's zarr.json bytes -> dict; CacheFormatError naming the array when it is not JSON."""
    try:
        meta = json.loads(raw)
        meta["shape"]  # noqa: B018  (the one key every caller needs before ArrayFile.parse checks the rest)
    except (ValueError, KeyError, TypeError) as e:
        raise CacheFormatError(f"{label}: cannot read zarr.json: {e}") from e
    return meta


def index_nbytes(meta: dict, label: str = "array") -> int:
    """Bytes of the shard index at the end of an array's shard file: 16 per inner chunk plus its crc32c."""
    try:
        shard = meta["chunk_grid"]["configuration"]["chunk_shape"]
        inner = meta["codecs"][0]["configuration"]["chunk_shape"]
    except (KeyError, IndexError, TypeError) as e:
        raise CacheFormatError(f"{label}: unsupported zarr layout (expected one crc32c shard per array)") from e
    return int(np.prod([s // c for s, c in zip(shard, inner)])) * 16 + CRC_BYTES


def split_rows(start: int, stop: int, piece: int | None, align: int) -> list[tuple[int, int]]:
    """Rows [start, stop) in the fewest near-equal parts of at most max(piece, align) rows (None: one part), every
    inner cut on a multiple of `align` (the chunk rows: no chunk is read by two parts). A run no longer than
    `piece` stays one request; a longer one becomes parts that threads read side by side, each through a scratch
    buffer of `piece` rows at most."""
    if piece is None or stop - start <= piece:
        return [(start, stop)]
    # the run's chunk cells (the first and last may be partial), grouped k to a part: k cells never exceed piece
    edges = [start, *range((start // align + 1) * align, stop, align), stop]
    cells, k = len(edges) - 1, max(1, piece // align)
    parts = -(-cells // k)
    cut = [edges[i * cells // parts] for i in range(parts + 1)]
    return list(zip(cut[:-1], cut[1:]))


class ByteRanges(Protocol):
    """Byte ranges of one shard file, wherever it lives (a local file, an object on a store)."""

    def read_at(self, offset: int, length: int, scratch: np.ndarray | None) -> np.ndarray:
        """uint8 [<= length]: the bytes at [offset, offset + length) (fewer only at the end of the file);
        may be a view of `scratch` (valid until the next call with it)."""
        ...


class FileRanges:
    """ByteRanges of an open local file: one pread per range, into the caller's scratch."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def read_at(self, offset: int, length: int, scratch: np.ndarray | None) -> np.ndarray:
        # reuse the caller's scratch: a fresh multi-MB np.empty is a fresh mmap, and first-touch page
        # faults cost more than the disk read on VMs (0.2 GB/s measured)
        buf = scratch[:length] if scratch is not None and len(scratch) >= length else np.empty(length, np.uint8)
        return buf[:os.preadv(self.fd, [buf], offset)]


@dataclass
class ArrayFile:
    """A parsed shard file of one array: metadata + inner-chunk index. Cheap to keep; holds no fd."""

    path: str               # the shard file
    label: str              # "shard S array hidden", for error messages
    shape: tuple[int, ...]
    dtype: np.dtype
    chunk_shape: tuple[int, ...]
    grid: tuple[int, ...]
    index: np.ndarray       # uint64 [num_chunks, 2] (offset, nbytes incl. crc)

    @classmethod
    def open(cls, array_dir: str, label: str) -> ArrayFile:
        try:
            with open(os.path.join(array_dir, "zarr.json"), "rb") as f:
                meta_raw = f.read()
        except OSError as e:
            raise CacheFormatError(f"{label}: cannot read zarr.json: {e}") from e
        meta = parse_metadata(meta_raw, label)
        path = os.path.join(array_dir, shard_file_relpath(len(meta["shape"])))
        size = index_nbytes(meta, label)
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                end = os.fstat(fd).st_size
                raw = os.pread(fd, size, max(0, end - size))
            finally:
                os.close(fd)
        except OSError as e:
            raise CacheFormatError(f"{label}: cannot read shard file: {e}") from e
        return cls.parse(meta, raw, file_size=end, path=path, label=label)

    @classmethod
    def parse(cls, meta: dict, index_raw: bytes, *, file_size: int, path: str, label: str) -> ArrayFile:
        """From the array's parsed zarr.json (parse_metadata) and the last index_nbytes(meta) bytes of its shard
        file of `file_size` bytes: the one check of layout, index crc and bounds, for files and store objects."""
        try:
            (codec,) = meta["codecs"]
            cfg = codec["configuration"]
            ok = (codec["name"] == "sharding_indexed" and cfg["index_location"] == "end"
                  and [c["name"] for c in cfg["codecs"]] == ["bytes", "crc32c"]
                  and cfg["codecs"][0].get("configuration", {}).get("endian", "little") == "little"
                  and [c["name"] for c in cfg["index_codecs"]] == ["bytes", "crc32c"])
            shape = tuple(meta["shape"])
            chunk_shape = tuple(cfg["chunk_shape"])
            shard_shape = tuple(meta["chunk_grid"]["configuration"]["chunk_shape"])
            ok = ok and shard_shape[0] >= shape[0] and shard_shape[1:] == shape[1:]
        except (KeyError, ValueError, TypeError):
            ok = False
        if not ok:
            raise CacheFormatError(f"{label}: unsupported zarr layout (expected one crc32c shard per array)")
        grid = tuple(s // c for s, c in zip(shard_shape, chunk_shape))
        n = int(np.prod(grid))
        size = n * 16 + CRC_BYTES
        raw = bytes(index_raw)
        if len(raw) != size or crc32c.crc32c(raw[:-4]) != int.from_bytes(raw[-4:], "little"):
            raise CacheFormatError(f"{label}: shard index checksum mismatch (file {path} truncated or corrupted)")
        index = np.frombuffer(raw[:-4], dtype="<u8").reshape(n, 2)
        present = index[:, 0] != MISSING
        if present.any() and int((index[present, 0] + index[present, 1]).max()) > file_size - size:
            raise CacheFormatError(f"{label}: shard index points past the end of {path}")
        return cls(path=path, label=label, shape=shape, dtype=np.dtype(meta["data_type"]).newbyteorder("<"),
                   chunk_shape=chunk_shape, grid=grid, index=index)

    def chunk_name(self, lin: int) -> str:
        return f"{self.label} chunk {tuple(int(c) for c in np.unravel_index(lin, self.grid))}"

    def read_rows(self, src: int | ByteRanges, start: int, stop: int, rest: tuple[int, ...], out: np.ndarray,
                  *, verify: bool, scratch: np.ndarray | None = None) -> int:
        """Copy rows [start, stop) of the chunk column `rest` (grid coords of axes 1..) into out
        [stop-start, *chunk_shape[1:]]. Contiguous chunks are read with one request of `src` (an fd of the
        shard file: one pread; or a ByteRanges, e.g. one ranged GET of an object). Returns bytes read."""
        src = FileRanges(src) if isinstance(src, int) else src
        c0, lins = self._chunks(start, stop, rest)
        chunk_elems = int(np.prod(self.chunk_shape))
        raw_len = chunk_elems * self.dtype.itemsize
        nread = 0
        for i, j in self._runs(lins):
            off = self.index[lins[i], 0]
            if off == MISSING:  # zarr fill value
                self._place(np.zeros(chunk_elems, self.dtype), c0 + i, start, stop, out)
                continue
            run_len = int(self.index[lins[j - 1], 0] + self.index[lins[j - 1], 1] - off)
            buf = src.read_at(int(off), run_len, scratch)
            got = len(buf)
            nread += got
            if got != run_len:
                raise CacheFormatError(f"{self.chunk_name(lins[i])}: short read ({got} of {run_len} bytes)")
            pos = 0
            for k in range(i, j):
                nb = int(self.index[lins[k], 1])
                if nb != raw_len + CRC_BYTES:
                    raise CacheFormatError(f"{self.chunk_name(lins[k])}: size {nb} != {raw_len + CRC_BYTES}")
                data = buf[pos:pos + raw_len]
                if verify and crc32c.crc32c(data) != int.from_bytes(buf[pos + raw_len:pos + nb].tobytes(), "little"):
                    raise CacheFormatError(f"{self.chunk_name(lins[k])}: crc32c checksum mismatch "
                                           f"(file {self.path}); the cache is corrupted")
                self._place(data.view(self.dtype), c0 + k, start, stop, out)
                pos += nb
        return nread

    def row_runs(self, start: int, stop: int, rest: tuple[int, ...]) -> list[tuple[int, int]]:
        """Rows [start, stop) of the chunk column `rest` cut where the file is not contiguous: each part is
        one request of read_rows (one pread, one ranged GET). A reader that splits work along these cuts
        never splits a request in two (writer.py writes blocks of 32 MB per tap, tap-major)."""
        c0, lins = self._chunks(start, stop, rest)
        cr = self.chunk_shape[0]
        return [(max(start, (c0 + i) * cr), min(stop, (c0 + j) * cr)) for i, j in self._runs(lins)]

    def _chunks(self, start: int, stop: int, rest: tuple[int, ...]) -> tuple[int, list[int]]:
        """(first chunk row index, linear chunk ids) covering rows [start, stop) of the column `rest`."""
        cr = self.chunk_shape[0]
        c0, c1 = start // cr, -(-stop // cr)
        return c0, [int(np.ravel_multi_index((c, *rest), self.grid)) for c in range(c0, c1)]

    def _runs(self, lins: list[int]) -> list[tuple[int, int]]:
        """[i, j) spans of `lins` whose chunks follow each other in the file (a missing chunk: a span of one)."""
        spans, i = [], 0
        while i < len(lins):
            j = i + 1
            if self.index[lins[i], 0] != MISSING:
                while j < len(lins) and self.index[lins[j], 0] == self.index[lins[j - 1], 0] + self.index[lins[j - 1], 1]:
                    j += 1
            spans.append((i, j))
            i = j
        return spans

    def _place(self, flat: np.ndarray, c: int, start: int, stop: int, out: np.ndarray) -> None:
        cr = self.chunk_shape[0]
        chunk = flat.reshape(self.chunk_shape)
        a, b = max(start, c * cr), min(stop, (c + 1) * cr)
        out[a - start:b - start] = chunk[a - c * cr:b - c * cr]

    def read_all(self, *, verify: bool = True, src: ByteRanges | None = None) -> np.ndarray:
        """The whole array (small arrays: samples, input_ids), from `src` (default: the local shard file)."""
        out = np.empty(self.shape, self.dtype)
        fd = os.open(self.path, os.O_RDONLY) if src is None else -1
        try:
            for rest in np.ndindex(*self.grid[1:]):
                sl = tuple(slice(r * c, (r + 1) * c) for r, c in zip(rest, self.chunk_shape[1:]))
                self.read_rows(FileRanges(fd) if src is None else src, 0, self.shape[0], tuple(rest),
                               out[(slice(None), *sl)], verify=verify)
        finally:
            if fd >= 0:
                os.close(fd)
        return out

    def verify_all(self, values: Callable[[np.ndarray], int] | None = None) -> list[str]:
        """Check every chunk's crc32c; return one message per bad chunk. values(elements of a sound chunk) -> how
        many of them are bad (format.non_finite_values): one message per chunk that has any."""
        bad = []
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for lin in range(len(self.index)):
                off, nb = (int(x) for x in self.index[lin])
                if off == int(MISSING):
                    continue
                raw = os.pread(fd, nb, off)
                if len(raw) != nb or crc32c.crc32c(raw[:-4]) != int.from_bytes(raw[-4:], "little"):
                    bad.append(f"{self.chunk_name(lin)}: crc32c checksum mismatch")
                elif values is not None:
                    n = values(np.frombuffer(raw, dtype=self.dtype, count=(nb - 4) // self.dtype.itemsize))
                    if n:
                        bad.append(f"{self.chunk_name(lin)}: {n} nan/inf values (the features were stored so)")
        finally:
            os.close(fd)
        return bad
