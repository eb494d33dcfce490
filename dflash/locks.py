"""One exclusive lock per folder, held for a whole run: a cache being extracted, a training run folder.

Usage (the lock is released on leaving the block, and at interpreter exit if the block never ends):

    from dflash.locks import FolderLock

    with FolderLock(output_dir, purpose="dflash extract"):
        ...  # only this process writes output_dir

    lock = FolderLock(run_dir, purpose="dflash train").acquire()   # or by hand
    try: ...
    finally: lock.release()

A second holder fails at once with dflash.errors.LockedError, one line naming the holder's PID, host, start
time and purpose, and the lock file to delete if that process is known to be gone.

How: the lock file (FOLDER/.dflash-lock by default) is created with O_CREAT|O_EXCL and holds JSON
{pid, host, started, purpose}; the creator also takes fcntl.flock on it where the filesystem supports it, and
writes its holder only once it has the flock (another process checking the file may hold that flock for the
instant it reads it: the creator waits that out), so a written holder's flock is held for as long as it lives.
O_EXCL alone cannot tell a live holder from a killed one (kill -9 leaves the file); flock is dropped by the
kernel when the holder dies, so on one host it is the liveness test. On the same host a lock file is stale
when its PID is dead or its flock can be taken (the PID was reused); a stale file is taken over with a log
line. A lock of another host is never taken over: its PID cannot be checked from here, and flock over
network filesystems is not reliably cluster-wide, so the user deletes it by hand when that run is gone.

Tradeoff: without flock support (some FUSE mounts) two processes that find the same stale file at the same
instant could both take it over; with flock (local disks, NFSv4, Lustre) the takeover is serialized by the
flock of the stale file's inode.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import logging
import os
import socket
import time
from dataclasses import dataclass

from dflash.errors import LockedError

log = logging.getLogger(__name__)

LOCK_FILE = ".dflash-lock"
"""Default lock file name inside the locked folder."""
_YOUNG_S = 10.0
"""An empty lock file younger than this is being written by its creator (create and write are two calls)."""


@dataclass(frozen=True, kw_only=True)
class LockHolder:
    """What a lock file says about the process holding it."""

    pid: int
    host: str
    started: float
    """time.time() when the lock was taken."""
    purpose: str
    """What holds it, e.g. "dflash extract --output /data/cache"."""

    def to_json(self) -> dict:
        return {"pid": self.pid, "host": self.host, "started": self.started, "purpose": self.purpose}

    @classmethod
    def from_json(cls, d: dict) -> LockHolder:
        return cls(pid=int(d["pid"]), host=str(d["host"]), started=float(d["started"]), purpose=str(d["purpose"]))

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"PID {self.pid} on host {self.host} ({self.purpose or 'dflash'}, since {when})"


def pid_alive(pid: int) -> bool:
    """Whether a process with this PID exists on this host (signal 0 checks without sending)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    return True


def _flock(fd: int) -> bool | None:
    """Try an exclusive non-blocking flock: True = taken, False = held by another, None = unsupported."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return None
        raise


def _flock_created(fd: int) -> bool | None:
    """flock a lock file this process just created. Another process's _take_over_stale may hold the flock for
    the instant it reads the (still empty) file; writing the holder without the flock would let that reader
    find a live holder it could flock and take it over as stale ("PID reused": two winners, seen under load).
    So wait for the flock, up to half of _YOUNG_S (after that the reader may take the empty file over)."""
    deadline = time.monotonic() + _YOUNG_S / 2
    while True:
        got = _flock(fd)
        if got is not False or time.monotonic() > deadline:
            return got
        time.sleep(0.002)


def _read_holder(fd: int) -> LockHolder | None:
    """The holder recorded in an open lock file, None while it is empty or unreadable."""
    try:
        data = os.pread(fd, 1 << 16, 0)
        return LockHolder.from_json(json.loads(data.decode()))
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None


def _write_holder(fd: int, holder: LockHolder) -> None:
    data = json.dumps(holder.to_json()).encode() + b"\n"
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


class FolderLock:
    """An exclusive, process-wide lock on `folder` (created if missing). Not reentrant: a second FolderLock
    on the same folder fails even in the same process. Child processes do not inherit it (O_CLOEXEC)."""

    def __init__(self, folder, *, purpose: str = "", name: str = LOCK_FILE) -> None:
        self.folder = os.fspath(folder)
        self.path = os.path.join(self.folder, name)
        self.purpose = purpose
        self._fd: int | None = None
        self._holder: LockHolder | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> FolderLock:
        """Take the lock or raise LockedError at once (never waits)."""
        if self._fd is not None:
            return self
        os.makedirs(self.folder, exist_ok=True)
        me = LockHolder(pid=os.getpid(), host=socket.gethostname(), started=time.time(), purpose=self.purpose)
        for _ in range(8):  # each retry follows a takeover or a release that raced with us
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            except FileExistsError:
                if self._take_over_stale(me):
                    break
                continue
            # flock before writing: a reader that sees the empty file and can flock it waits for _YOUNG_S, and
            # one that finds a written holder and can flock it takes that holder for dead
            if _flock_created(fd) is False or not _same_file(fd, self.path):
                holder = _read_holder(fd)
                os.close(fd)
                raise self._locked(holder)
            _write_holder(fd, me)
            self._fd = fd
            break
        else:
            raise LockedError(f"{self.folder}: could not take the lock {self.path} (it keeps changing hands)")
        self._holder = me
        atexit.register(self.release)
        return self

    def _take_over_stale(self, me: LockHolder) -> bool:
        """The lock file exists: raise LockedError if its holder lives, take it over if stale (True), or
        return False when it vanished or changed meanwhile (the caller retries)."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            got = _flock(fd)
            if not _same_file(fd, self.path):
                return False  # released (unlinked) between our open and flock
            holder = _read_holder(fd)
            if got is False:
                raise self._locked(holder)
            age = time.time() - os.fstat(fd).st_mtime
            if holder is None:
                if age < _YOUNG_S:
                    raise self._locked(None)
                if got is None:
                    raise LockedError(f"{self.folder}: lock file {self.path} is unreadable and this filesystem has "
                                      "no flock to tell whether its holder lives; delete it if no dflash run uses "
                                      "this folder")
            elif holder.host != me.host or (got is None and pid_alive(holder.pid)):
                raise self._locked(holder)
            log.warning("%s: taking over a stale lock of %s (%s)", self.folder,
                        holder.describe() if holder else "an unknown process",
                        "process gone" if holder is None or not pid_alive(holder.pid) else "PID reused")
            if got is None:  # no flock: replace the file (tradeoff in the module docstring)
                os.unlink(self.path)
                return False
            _write_holder(fd, me)
            self._fd, fd = fd, None
            return True
        finally:
            if fd is not None:
                os.close(fd)

    def _locked(self, holder: LockHolder | None) -> LockedError:
        who = holder.describe() if holder else "another process (starting up)"
        return LockedError(f"{self.folder} is locked by {who}: one run per folder; wait for it to finish or "
                           f"stop it (if that process is gone, delete {self.path})")

    def release(self) -> None:
        """Remove the lock file and drop the flock; harmless when not held."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        atexit.unregister(self.release)
        try:
            if _same_file(fd, self.path):
                os.unlink(self.path)  # unlink before unlocking: nobody can take over a file we still hold
        finally:
            os.close(fd)

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _same_file(fd: int, path: str) -> bool:
    """Whether the open fd is still the file at `path` (a release unlinks it; a takeover keeps the inode)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def read_lock_holder(folder, *, name: str = LOCK_FILE) -> LockHolder | None:
    """The recorded holder of a folder's lock file, None if there is none (for status displays)."""
    try:
        fd = os.open(os.path.join(os.fspath(folder), name), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        return _read_holder(fd)
    finally:
        os.close(fd)
