"""SIGTERM during training (dflash.train.terminate): the handler only records it; every rank learns of a SIGTERM
that reached any one of them at the same step (AgreedFlag, with real gloo processes); and `dflash train --gpus N`'s
parent passes a SIGTERM on to its ranks instead of dying, and a rank that dies of it is one line
(dflash.procs.spawn, real processes)."""

import os
import signal
import time

import pytest

from dflash.errors import DflashError
from dflash.procs import spawn
from train_helpers import tiny_cache, tiny_config, tiny_target
from dflash.train.distributed import AgreedFlag, destroy_distributed, init_distributed
from dflash.train.terminate import sigterm_received, stop_on_sigterm


def _polls(rank, emit, raise_from):
    info = init_distributed(device="cpu")
    try:
        flag = AgreedFlag(info)
        return [flag.poll(rank == 1 and i >= raise_from) for i in range(6)]
    finally:
        destroy_distributed()


def test_a_flag_raised_on_one_rank_is_seen_by_every_rank_one_poll_later():
    assert spawn(_polls, 2, args=(2,)) == [[False, False, False, True, True, True]] * 2


def test_a_world_of_one_answers_with_its_own_flag_at_once():
    info = init_distributed(device="cpu")
    flag = AgreedFlag(info)
    assert [flag.poll(r) for r in (False, True, False)] == [False, True, False]


def test_the_handler_records_sigterm_and_is_removed_after():
    with stop_on_sigterm():
        assert not sigterm_received()
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not sigterm_received() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sigterm_received()                  # still alive: the handler took it
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_handler_already_there_is_kept():
    seen = []
    old = signal.signal(signal.SIGTERM, lambda *_: seen.append(1))
    try:
        with stop_on_sigterm():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
            assert seen == [1] and not sigterm_received()
    finally:
        signal.signal(signal.SIGTERM, old)


def _ready_then_term_parent(rank, folder):
    """Rank 0 sends SIGTERM to the launcher once both ranks are ready (their handlers, if any, in place)."""
    open(os.path.join(folder, f"ready-{rank}"), "w").close()
    if rank == 0:
        while len(os.listdir(folder)) < 2:
            time.sleep(0.01)
        os.kill(os.getppid(), signal.SIGTERM)


def _term_parent_then_wait(rank, emit, folder):
    with stop_on_sigterm():
        _ready_then_term_parent(rank, folder)
        deadline = time.monotonic() + 60
        while not sigterm_received() and time.monotonic() < deadline:
            time.sleep(0.01)
        return sigterm_received()


def test_the_launcher_passes_sigterm_on_to_every_rank(tmp_path):
    assert spawn(_term_parent_then_wait, 2, args=(str(tmp_path),)) == [True, True]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_the_launcher_also_passes_it_to_a_handler_of_its_caller(tmp_path):
    """`dflash train --gpus N`: the command's own handler is open in the parent while the ranks run."""
    with stop_on_sigterm():
        assert spawn(_term_parent_then_wait, 2, args=(str(tmp_path),)) == [True, True]
        assert sigterm_received()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def _term_parent_then_sleep(rank, emit, folder):
    _ready_then_term_parent(rank, folder)
    time.sleep(60)   # SIGTERM's default action ends it first


def test_a_rank_that_dies_of_the_passed_on_sigterm_is_one_line(tmp_path):
    t = time.monotonic()
    with pytest.raises(DflashError, match=r"^stopped by SIGTERM: rank \d ended with it$"):
        spawn(_term_parent_then_sleep, 2, args=(str(tmp_path),))
    assert time.monotonic() - t < 40


def test_a_program_that_calls_train_itself_keeps_the_default_action(tmp_path, monkeypatch):
    """A benchmark under `timeout` must still end at its limit: only the commands stop on SIGTERM."""
    from dflash.train.trainer import train

    monkeypatch.setenv("DFLASH_NO_PROGRESS", "1")
    target = tiny_target(tmp_path / "target")
    cfg = tiny_config(cache=str(tiny_cache(tmp_path / "cache", target)), model=str(target), steps=3,
                      output=str(tmp_path / "run"))
    seen = []
    assert train(cfg, device="cpu", before_step=lambda _s: seen.append(signal.getsignal(signal.SIGTERM))).finished
    assert seen == [signal.SIG_DFL] * 3
