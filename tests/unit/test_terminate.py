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
from dflash.train.distributed import AgreedFlag, destroy_distributed, init_distributed
from dflash.train.terminate import TermSignal


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
    with TermSignal() as term:
        assert not term.raised
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not term.raised and time.monotonic() < deadline:
            time.sleep(0.01)
        assert term.raised                         # still alive: the handler took it
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_handler_already_there_is_kept():
    seen = []
    old = signal.signal(signal.SIGTERM, lambda *_: seen.append(1))
    try:
        with TermSignal() as term:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
        assert seen == [1] and not term.raised
    finally:
        signal.signal(signal.SIGTERM, old)


def _term_parent_then_wait(rank, emit, folder):
    with TermSignal() as term:
        open(os.path.join(folder, f"ready-{rank}"), "w").close()
        if rank == 0:   # once every rank has its handler
            while len(os.listdir(folder)) < 2:
                time.sleep(0.01)
            os.kill(os.getppid(), signal.SIGTERM)
        deadline = time.monotonic() + 60
        while not term.raised and time.monotonic() < deadline:
            time.sleep(0.01)
        return term.raised


def test_the_launcher_passes_sigterm_on_to_every_rank(tmp_path):
    assert spawn(_term_parent_then_wait, 2, args=(str(tmp_path),)) == [True, True]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def _term_parent_then_sleep(rank, emit, folder):
    open(os.path.join(folder, f"ready-{rank}"), "w").close()
    if rank == 0:
        while len(os.listdir(folder)) < 2:
            time.sleep(0.01)
        os.kill(os.getppid(), signal.SIGTERM)
    time.sleep(60)   # SIGTERM's default action ends it first


def test_a_rank_that_dies_of_the_passed_on_sigterm_is_one_line(tmp_path):
    t = time.monotonic()
    with pytest.raises(DflashError, match=r"^stopped by SIGTERM: rank \d ended with it$"):
        spawn(_term_parent_then_sleep, 2, args=(str(tmp_path),))
    assert time.monotonic() - t < 40
