"""A pool of pinned host buffers, allocated once and recycled, for the device->host copies of extraction.

Why: pinning memory (cudaHostAlloc) is slow, ~1-3 GB/s. A fresh pinned tensor per batch (1.7 GB for a
32K-token bf16 batch of the 27B target) cost 45% of the extraction throughput on the H200 (5.7K vs 10.4K
tokens/s forward-only; benchmarks/results/extract_h200.json before this pool). The writer thread hands a
buffer back (CacheWriter.append(on_consumed=...)) once it has copied the bytes into its shard block, so
`queue_depth + 2` buffers cover the batch being copied, the one waiting to be appended, and the queue.
Pinning all of them (6 x 0.85-1.7 GB at the 27B shape) takes seconds, so it is kept off the critical path: with
`prefill=True` a background thread pins them one after another while the target loads (a 54 GB checkpoint
takes minutes); while the thread runs, acquire() waits for its buffers, and once it is done (or failed) acquire()
pins one itself when none is free and fewer than `count` exist (measured on
the H200: pinning on demand in the loop cost 1.1 s of a 60 s fp8 run of benchmarks/bench_extract.py).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

ALIGN = 64


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class PinnedPool:
    """Up to `count` pinned uint8 buffers of `nbytes` each. acquire() returns a free one, pins a new one while
    fewer than `count` exist, and otherwise blocks until one is released. prefill=True pins them all in a
    background thread (acquire takes them as they come)."""

    def __init__(self, *, count: int, nbytes: int, pin: bool = True, prefill: bool = False) -> None:
        if count < 1:
            raise ValueError(f"count={count}: a pool needs at least one buffer")
        self.nbytes = _aligned(nbytes)
        self.count, self.pin = count, pin
        self.allocated = 0
        self._lock = threading.Lock()
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        self._filler = threading.Thread(target=self._prefill, name="dflash-pin-prefill", daemon=True) if prefill else None
        if self._filler is not None:
            self._filler.start()

    def _reserve(self) -> bool:
        with self._lock:
            if self.allocated >= self.count:
                return False
            self.allocated += 1
            return True

    def _new(self) -> torch.Tensor:
        try:
            return torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self.pin)
        except BaseException:
            with self._lock:
                self.allocated -= 1
            raise

    def _prefill(self) -> None:
        while self._reserve():
            try:
                self._free.put(self._new())
            except Exception:  # noqa: BLE001 - acquire() pins on demand instead, and raises there if it fails
                return

    def acquire(self, *, check: Callable[[], None] | None = None) -> torch.Tensor:
        """A free buffer; while waiting, `check()` runs every 50 ms (it raises if the consumer died)."""
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        if self._filler is None or not self._filler.is_alive():
            if self._reserve():
                return self._new()
        while True:
            try:
                return self._free.get(timeout=0.05)
            except queue.Empty:
                if check is not None:
                    check()
                if (self._filler is not None and not self._filler.is_alive() and self._free.empty()
                        and self._reserve()):
                    return self._new()

    def release(self, buf: torch.Tensor) -> None:
        self._free.put(buf)


def batch_views(buf: torch.Tensor, *, bits_shape: tuple[int, ...], bits_dtype: torch.dtype,
                scales_shape: tuple[int, ...] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Carve the encoded hidden bits and (fp8) scales of one batch out of a pool buffer."""
    bits, scales = _carve(buf, [(bits_shape, bits_dtype), (scales_shape, torch.float32)])
    return bits, scales


def encoded_views(buf: torch.Tensor, like):
    """Host views in a pool buffer for every array of a device batch (format.EncodedHidden): same shapes and
    dtypes, each 64-byte aligned, for the non_blocking copies."""
    from dflash.cache.format import EncodedHidden

    arrays = [like.hidden, like.scales, like.group_scales]
    views = _carve(buf, [(None, None) if a is None else (tuple(a.shape), a.dtype) for a in arrays])
    return EncodedHidden(hidden=views[0], scales=views[1], group_scales=views[2])


def _carve(buf: torch.Tensor, specs: list) -> list:
    """[(shape | None, dtype)] -> consecutive aligned views of buf (None where shape is None)."""
    out, off = [], 0
    for shape, dtype in specs:
        if shape is None:
            out.append(None)
            continue
        n = torch.empty((), dtype=dtype).element_size()
        for d in shape:
            n *= d
        if off + n > buf.numel():
            raise ValueError(f"pool buffer of {buf.numel()} bytes is too small for {off + n}")
        out.append(buf[off:off + n].view(dtype).view(shape))
        off = _aligned(off + n)
    return out


def batch_nbytes(*, tokens: int, num_taps: int, hidden: int, storage: str) -> int:
    """Bytes of one batch's encoded arrays (hidden bits, scales, 4-bit group scales, each 64-byte aligned)
    for `tokens` real tokens."""
    from dflash.cache.format import stored_layout

    return tokens * stored_layout(storage, hidden).hidden_bytes_per_token(num_taps) + 2 * ALIGN
