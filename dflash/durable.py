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


def current_umask() -> int:
    """The process umask, read without changing it (Linux /proc); elsewhere set-and-restore, which is racy
    only against files another thread creates in that instant."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(folder: str | os.PathLike) -> None:
    """Give `folder` and everything under it the modes a plain open()/mkdir() would have (0666 / 0777 minus
    the umask). Why: safetensors writes its files 0600 and mkdtemp makes 0700 folders, so a drafter or a
    converted model written by dflash was unreadable to a server running as another user while the
    config.json beside it was readable."""
    mask = current_umask()
    os.chmod(folder, 0o777 & ~mask)
    for root, dirs, files in os.walk(folder):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o777 & ~mask)
        for f in files:
            os.chmod(os.path.join(root, f), 0o666 & ~mask)
