"""Progress aggregated over ranks, and the text of the pre-flight report and the final summary.

Ranks add their counters into one float64 vector with a gloo all_reduce every few batches (asynchronously:
the reduce started at round r is waited for at the next report, so ranks drift by up to one interval
instead of stopping at every report). Only rank 0 draws the tqdm bar. Counters are floats so that seconds
and counts travel in one message.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from tqdm import tqdm

from dflash.extract.space import format_bytes

# Indices into the counter vector.
SAMPLES, TOKENS, BYTES, WAIT_S, PADDED = range(5)
NUM_COUNTERS = 5


@dataclass(kw_only=True)
class RankCounters:
    """What one rank has done so far (cumulative)."""

    samples: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    bytes_written: int = 0
    wait_s: float = 0.0
    """Seconds the loop spent blocked on the writer queue (the disk is the bottleneck)."""

    def as_tensor(self) -> torch.Tensor:
        v = torch.zeros(NUM_COUNTERS, dtype=torch.float64)
        v[SAMPLES], v[TOKENS], v[BYTES] = self.samples, self.tokens, self.bytes_written
        v[WAIT_S], v[PADDED] = self.wait_s, self.padded_tokens
        return v


@dataclass(kw_only=True)
class ProgressReporter:
    """Every rank calls `report(counters)` at the same rounds; rank 0 shows the sum."""

    rank: int
    world_size: int
    total_samples: int
    total_tokens: int
    enabled: bool = True
    _pending: tuple | None = None
    _bar: tqdm | None = None
    _start: float = field(default_factory=time.perf_counter)
    totals: torch.Tensor = field(default_factory=lambda: torch.zeros(NUM_COUNTERS, dtype=torch.float64))

    def __post_init__(self) -> None:
        if self.rank == 0 and self.enabled:
            self._bar = tqdm(total=self.total_samples, unit="sample", dynamic_ncols=True, mininterval=1.0,
                             desc="extract", smoothing=0.1)

    def __enter__(self) -> ProgressReporter:
        return self

    def __exit__(self, exc_type, *_exc: object) -> None:
        """On an error (or Ctrl-C) the bar is closed where it stands: a bar left open is redrawn when it is
        garbage collected, after the error's message. A normal end closes it in close()."""
        if exc_type is not None and self._bar is not None:
            self._bar.close()

    def report(self, counters: RankCounters) -> None:
        """Non-blocking in multi-rank runs: completes the previous reduce and starts this one."""
        if self.world_size == 1:
            self._show(counters.as_tensor())
            return
        self._finish_pending()
        buf = counters.as_tensor()
        self._pending = (buf, dist.all_reduce(buf, async_op=True))

    def close(self, counters: RankCounters) -> torch.Tensor:
        """Final blocking reduce; returns the totals over all ranks (on every rank)."""
        self._finish_pending()
        totals = counters.as_tensor()
        if self.world_size > 1:
            dist.all_reduce(totals)
        self._show(totals)
        if self._bar is not None:
            self._bar.close()
        return totals

    def _finish_pending(self) -> None:
        if self._pending is not None:
            buf, work = self._pending
            work.wait()
            self._pending = None
            self._show(buf)

    def _show(self, totals: torch.Tensor) -> None:
        self.totals = totals
        if self._bar is None:
            return
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        self._bar.n = int(totals[SAMPLES])
        self._bar.set_postfix_str(
            f"{totals[TOKENS] / elapsed:,.0f} tok/s, {totals[BYTES] / elapsed / 1e6:,.1f} MB/s written, "
            f"waiting on disk {totals[WAIT_S] / self.world_size:,.1f}s", refresh=False)
        self._bar.refresh()


def format_plan(*, num_samples: int, num_committed: int, num_todo: int, num_tokens: int,
                padded_tokens: int, cache_bytes, eta, world_size: int, device: str, skips_text: str) -> str:
    """The pre-flight report printed before any model work (and all that --dry-run prints)."""
    pad = 100.0 * (padded_tokens - num_tokens) / padded_tokens if padded_tokens else 0.0
    lines = [
        f"samples: {num_samples:,} tokenized, {num_committed:,} already in the cache, {num_todo:,} to extract",
        f"tokens: {num_tokens:,} to extract ({padded_tokens:,} with padding, {pad:.1f}% padding)",
        f"bytes on disk: ~{format_bytes(cache_bytes.total)} (hidden {format_bytes(cache_bytes.hidden)}, "
        f"fp8 scales {format_bytes(cache_bytes.scales)}, ids+mask {format_bytes(cache_bytes.tokens)}, "
        f"index {format_bytes(cache_bytes.index)})",
        f"ranks: {world_size} on {device}",
    ]
    if eta is not None:
        lines.append(f"ETA: ~{format_seconds(eta.seconds)} ({eta.how})")
    if skips_text:
        lines.append(skips_text)
    return "\n".join(lines)


def format_seconds(s: float) -> str:
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else (f"{m}m{sec:02d}s" if m else f"{sec}s")
