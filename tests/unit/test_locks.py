"""dflash.locks.FolderLock with real processes: a live holder refuses at once, a killed one is taken over."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from dflash.errors import DflashError, LockedError
from dflash.locks import LOCK_FILE, FolderLock, read_lock_holder

HOLD = """
import sys, time
from dflash.locks import FolderLock
lock = FolderLock(sys.argv[1], purpose="holder test").acquire()
print("locked", flush=True)
time.sleep(60)
"""

RACE = """
import sys, time
from dflash.errors import LockedError
from dflash.locks import FolderLock
start = float(sys.argv[2])
time.sleep(max(0.0, start - time.time()))
try:
    FolderLock(sys.argv[1], purpose="race").acquire()
    print("won", flush=True)
    time.sleep(3)
except LockedError:
    print("lost", flush=True)
"""


def _holder(folder) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def test_second_holder_fails_at_once_naming_pid_and_host(tmp_path):
    p = _holder(tmp_path)
    try:
        t = time.perf_counter()
        with pytest.raises(LockedError) as e:
            FolderLock(tmp_path, purpose="second").acquire()
        assert time.perf_counter() - t < 1.0
        msg = str(e.value)
        assert f"PID {p.pid}" in msg and socket.gethostname() in msg and "holder test" in msg
        assert "\n" not in msg and isinstance(e.value, DflashError)
        assert read_lock_holder(tmp_path).pid == p.pid
    finally:
        p.kill()
        p.wait()


def test_killed_holder_is_taken_over_with_a_log_line(tmp_path, caplog):
    p = _holder(tmp_path)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert os.path.exists(tmp_path / LOCK_FILE)  # kill -9 leaves the file
    with caplog.at_level(logging.WARNING, logger="dflash.locks"):
        with FolderLock(tmp_path, purpose="after kill"):
            assert read_lock_holder(tmp_path).pid == os.getpid()
    assert "stale lock" in caplog.text and f"PID {p.pid}" in caplog.text
    assert not os.path.exists(tmp_path / LOCK_FILE)


def test_same_process_twice_is_refused_and_release_frees(tmp_path):
    a = FolderLock(tmp_path).acquire()
    with pytest.raises(LockedError):
        FolderLock(tmp_path).acquire()
    a.release()
    a.release()  # harmless
    with FolderLock(tmp_path) as b:
        assert b.held


def test_reused_pid_on_this_host_is_stale(tmp_path):
    # A file naming a live PID (our parent) whose flock nobody holds: the recorded process died and its PID
    # was reused, so the lock is stale.
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname(),
                                                  "started": time.time() - 100, "purpose": "old"}))
    with FolderLock(tmp_path) as lock:
        assert lock.held and read_lock_holder(tmp_path).pid == os.getpid()


def test_lock_of_another_host_is_never_taken_over(tmp_path):
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": 12345, "host": "node-b", "started": time.time(),
                                                  "purpose": "dflash extract"}))
    with pytest.raises(LockedError, match=r"PID 12345 on host node-b.*delete .*\.dflash-lock"):
        FolderLock(tmp_path).acquire()


def test_empty_file_being_written_is_held_but_an_old_one_is_stale(tmp_path):
    f = tmp_path / LOCK_FILE
    f.write_text("")
    with pytest.raises(LockedError, match="starting up"):
        FolderLock(tmp_path).acquire()
    old = time.time() - 60
    os.utime(f, (old, old))
    with FolderLock(tmp_path) as lock:
        assert lock.held


def test_the_creator_writes_its_holder_only_under_its_flock(tmp_path, monkeypatch):
    """The race behind two winners: another process checking the lock file flocks it in the instant between its
    creation and the creator's own flock. The creator must wait for the flock before it writes its holder;
    otherwise it holds no flock, and a checker that then flocks the file and reads a live holder of this host
    takes it over as stale ("PID reused")."""
    import threading

    from dflash import locks

    real = locks._flock
    checker: list[int] = []

    def checker_first(fd):
        if not checker:  # the creator's first flock: a checker's flock of the new file lands first
            checker.append(os.open(tmp_path / LOCK_FILE, os.O_RDWR))
            assert real(checker[0]) is True
            threading.Timer(0.05, os.close, (checker[0],)).start()  # dropped when the checker closes its fd
        return real(fd)

    monkeypatch.setattr(locks, "_flock", checker_first)
    with FolderLock(tmp_path, purpose="creator") as lock:
        assert lock.held and checker
        time.sleep(0.2)  # the checker has closed its fd by now
        probe = os.open(tmp_path / LOCK_FILE, os.O_RDWR)
        try:
            assert real(probe) is False, "the holder's flock is not held: a checker would take over a live lock"
        finally:
            os.close(probe)
        with pytest.raises(LockedError, match="creator"):
            FolderLock(tmp_path).acquire()


def test_exactly_one_of_many_racing_processes_wins(tmp_path):
    start = time.time() + 1.0
    procs = [subprocess.Popen([sys.executable, "-c", RACE, str(tmp_path), str(start)], stdout=subprocess.PIPE,
                              text=True) for _ in range(6)]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert sorted(outs) == ["lost"] * 5 + ["won"], outs
