"""File-system rules shared by every layer that writes output folders (cache shards, tokenization parts,
checkpoints, drafter exports): a rename is only durable once its directory is fsynced; finished files get the
modes the umask asks for; a non-empty output folder is refused unless the caller is resuming."""

from __future__ import annotations

import os
import stat
from typing import Callable

from dflash.errors import ConfigError


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


def refuse_nonempty(folder: str | os.PathLike, *, what: str, remedy: str,
                    ignore: Callable[[str], bool] | None = None) -> None:
    """ConfigError when `folder` exists and holds an entry that `ignore(name)` does not accept (STYLE 11: a
    command never writes into a folder that holds something else unless it is resuming). The message names
    the folder, a few of its entries and `remedy`, e.g. "pass --resume to continue that run, or choose a new
    --output". Callers decide what resuming means; this is only the refusal, written once."""
    # One stat, then one listdir: an isdir-then-exists pair raced with another rank creating the folder in
    # between (rank 0 takes the run lock while rank 1 checks) and called the new folder "not a folder".
    try:
        is_dir = stat.S_ISDIR(os.stat(folder).st_mode)
        names = os.listdir(folder) if is_dir else []
    except FileNotFoundError:  # absent (or removed between the two calls): nothing to refuse
        return
    if not is_dir:
        raise ConfigError(f"{what} {os.fspath(folder)!r} exists and is not a folder: {remedy}")
    names = sorted(n for n in names if ignore is None or not ignore(n))
    if names:
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise ConfigError(f"{what} {os.fspath(folder)!r} is not empty ({shown}): {remedy}")
