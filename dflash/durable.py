"""Durability primitive shared by every layer that commits files atomically (cache shards, tokenization parts,
checkpoints, drafter exports): a rename is only durable once its directory is fsynced."""

from __future__ import annotations

import os


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to a sibling temp file and rename it over `path`: a reader (or a crash) never sees half a
    file. Not fsynced: for run records and reports that can be rewritten, not for committed data."""
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
