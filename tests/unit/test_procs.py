"""dflash.procs.spawn with real processes: results in rank order, the torchrun environment, messages to the
parent, and the first failure propagated (DflashError as itself, a crash with its traceback, a silent death
with its exit code) while the other ranks are stopped."""

import os
import time

import pytest

from dflash.errors import ConfigError
from dflash.procs import RankFailedError, free_port, spawn


def _env(rank, emit, tag):
    emit(f"hello from {rank}")
    return (tag, rank, os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"])


def _user_error(rank, emit, marker):
    if rank == 1:
        raise ConfigError("bad value for --foo")
    time.sleep(60)   # must be stopped by the launcher, not waited for
    open(marker, "w").close()


def _bug(rank, emit):
    if rank == 0:
        return "fine"
    return {}["missing-key"]


def _silent_death(rank, emit):
    if rank == 1:
        os._exit(3)
    time.sleep(60)


def test_results_env_and_messages():
    seen = []
    out = spawn(_env, 2, args=("t",), on_message=lambda r, m: seen.append((r, m)))
    assert [o[:4] for o in out] == [("t", 0, "0", "2"), ("t", 1, "1", "2")]
    assert out[0][4] == out[1][4]   # one rendezvous port
    assert sorted(seen) == [(0, "hello from 0"), (1, "hello from 1")]


def test_a_user_error_stops_the_others_and_keeps_its_class(tmp_path):
    t = time.monotonic()
    with pytest.raises(ConfigError, match=r"^rank 1: bad value for --foo$"):
        spawn(_user_error, 2, args=(str(tmp_path / "rank0-finished"),))
    assert time.monotonic() - t < 40 and not (tmp_path / "rank0-finished").exists()


def test_a_crash_carries_the_child_traceback():
    with pytest.raises(RankFailedError) as e:
        spawn(_bug, 2)
    msg = str(e.value)
    assert msg.startswith("rank 1 failed:") and "KeyError: 'missing-key'" in msg and "in _bug" in msg


def test_a_silent_death_names_the_exit_code():
    with pytest.raises(RankFailedError, match="rank 1 died with exit code 3"):
        spawn(_silent_death, 2)


def _unpicklable_result(rank, emit):
    return lambda: None   # a lambda does not pickle: the child cannot send it


def test_a_result_that_cannot_be_sent_is_a_failure_not_a_hang():
    with pytest.raises(RankFailedError, match="rank 0 exited without sending its result"):
        spawn(_unpicklable_result, 1)


def test_free_port_is_bindable():
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def _world(rank, emit):
    return {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_PORT")}


def test_independent_processes_get_no_process_group(monkeypatch):
    """process_group=False: each process is a world of one, even under a parent that itself runs under torchrun."""
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    out = spawn(_world, 2, process_group=False)
    assert out == [{"RANK": None, "WORLD_SIZE": None, "MASTER_PORT": None}] * 2
