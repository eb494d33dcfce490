"""SIGTERM during training: a scheduler's time limit or preemption (SLURM sends SIGTERM, then SIGKILL after its
KillWait), `kill PID`, or the parent of `dflash train --gpus N` / `dflash sweep --gpus N` passing it on. The run
completes the step in flight and one more (the step every rank agrees on: train.distributed.AgreedFlag),
checkpoints there without the held-out evaluation, and returns; `dflash train` then says where it stopped and
exits 143, and `--resume` continues exactly. A sweep group does the same (its runs share one stream in one
process; a group whose runs differ in cache_weights has a stream per weighting, threads that agree on the step:
sweep.mixture.run_threads) and the sweep ends there. What the default action would lose instead: every step since
the last --save-every checkpoint.

Handling SIGTERM is the process's policy, so only the commands (cli/) and the rank processes they spawn enter
`stop_on_sigterm`; a program that calls `train()` itself (a benchmark under `timeout`) keeps SIGTERM's default
action. Only the main thread can install a handler, and only where SIGTERM still has its default action.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from dflash.errors import DflashError

EXIT_TERMINATED = 143  # 128 + SIGTERM: what a shell reports for a process ended by SIGTERM

_received = False   # process-wide, as signals are


class SweepTerminated(DflashError):
    """A sweep group stopped by SIGTERM, its runs checkpointed: the sweep ends there (`dflash sweep` exits 143).
    A DflashError, so a spawned device process's stop reaches the parent as itself."""


def _handle(_signum, _frame) -> None:
    global _received
    _received = True


def sigterm_received() -> bool:
    """Whether a SIGTERM came while `stop_on_sigterm` was open (polled by the training loop once a step)."""
    return _received


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """While open, a SIGTERM sets sigterm_received() instead of ending the process (module docstring)."""
    global _received
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    _received = False
    signal.signal(signal.SIGTERM, _handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _received = False   # what it stopped says so itself (TrainResult.terminated, SweepTerminated)
