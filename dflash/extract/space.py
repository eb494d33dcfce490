"""Bytes a cache will take on disk, and the free-space check done before any model work.

The estimate counts the arrays of DESIGN.md "The cache" exactly (hidden, fp8 scales, input_ids, loss_mask,
samples) plus a small allowance for zarr metadata, crc32c trailers and the commit logs. The check asks for
that much plus a 2% margin, so a run never starts that would hit ENOSPC hours in (the writer still maps a
late ENOSPC to OutOfSpaceError, e.g. when another job fills the disk).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from dflash.cache.format import SAMPLE_ROW_BYTES, SCALE_ITEMSIZE, TOKEN_BYTES, stored_layout
from dflash.errors import OutOfSpaceError

# Per shard: zarr.json files, a crc32c per chunk, a commit-log line; generous so the margin stays honest.
SHARD_OVERHEAD_BYTES = 64 * 1024
SPACE_MARGIN = 1.02


@dataclass(frozen=True, kw_only=True)
class CacheBytes:
    """Estimated bytes per array kind (what `dflash extract` prints before it starts)."""

    hidden: int
    scales: int
    tokens: int
    """input_ids (int32) + loss_mask (uint8)."""
    index: int
    """`samples` rows (4 x int64 each) + per-shard metadata."""

    @property
    def total(self) -> int:
        return self.hidden + self.scales + self.tokens + self.index


def estimate_cache_bytes(*, num_tokens: int, num_samples: int, num_taps: int, hidden_size: int,
                         storage: str, shard_tokens: int, chunk_tokens: int = 1) -> CacheBytes:
    """tokens x the storage layout's hidden bytes per token (bits, + float32 scales per token and tap for fp8
    and 4-bit e4m3, + 4-bit group scales) + ids/mask.

    chunk_tokens: tokens per hidden chunk; zarr stores a shard's last chunk whole, so each shard is
    rounded up to it (negligible at D=5120: 32-token chunks; large for toy models with tiny shards)."""
    layout = stored_layout(storage, hidden_size)  # ConfigError for an unknown storage
    scale_bytes = num_taps * SCALE_ITEMSIZE if layout.has_scales else 0
    num_shards = -(-num_tokens // max(shard_tokens, 1)) if num_tokens else 0
    per_shard = min(shard_tokens, num_tokens)
    stored_tokens = num_shards * (-(-per_shard // chunk_tokens) * chunk_tokens) if num_tokens else 0
    stored_tokens = max(stored_tokens, num_tokens)
    return CacheBytes(
        hidden=stored_tokens * (layout.hidden_bytes_per_token(num_taps) - scale_bytes),
        scales=stored_tokens * scale_bytes,
        tokens=num_tokens * TOKEN_BYTES,
        index=num_samples * SAMPLE_ROW_BYTES + num_shards * SHARD_OVERHEAD_BYTES,
    )


def _existing_ancestor(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def check_free_space(path: str, *, needed_bytes: int) -> int:
    """Raise OutOfSpaceError when the filesystem holding `path` (or its nearest existing parent) has less
    than `needed_bytes` x 1.02 free. Returns the free bytes."""
    free = shutil.disk_usage(_existing_ancestor(path)).free
    want = int(needed_bytes * SPACE_MARGIN)
    if free < want:
        raise OutOfSpaceError(
            f"not enough space for the cache at {path}: needs about {format_bytes(want)} "
            f"(estimate + 2%), {format_bytes(free)} free. Free space, choose another --output, "
            f"use --storage fp8 (half the bytes) or int4 (0.27x) or fewer --taps.")
    return free


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")
