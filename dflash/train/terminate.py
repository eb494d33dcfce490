"""SIGTERM during training: a scheduler's time limit or preemption (SLURM sends SIGTERM, then SIGKILL after its
KillWait), `kill PID`, or the parent of `dflash train --gpus N` / `dflash sweep --gpus N` passing it on. The run completes the step in flight and
one more (the step every rank agrees on: train.distributed.AgreedFlag), checkpoints there without the held-out
evaluation, and returns; `dflash train` then says where it stopped and exits 143, and `--resume` continues
exactly. A sweep group does the same (its runs share one stream in one process) and the sweep ends there, except a
group whose runs differ in cache_weights (threads in lock-step over shared reads: it keeps the default action).
What the default action would lose instead: every step since the last --save-every checkpoint.

Only the main thread can install a handler, and only where SIGTERM still has its default action (an embedding
program that handles SIGTERM itself keeps its handler).
"""

from __future__ import annotations

import signal
import threading

from dflash.errors import DflashError

EXIT_TERMINATED = 143  # 128 + SIGTERM: what a shell reports for a process ended by SIGTERM


class SweepTerminated(DflashError):
    """A sweep group stopped by SIGTERM, its runs checkpointed: the sweep ends there (`dflash sweep` exits 143).
    A DflashError, so a spawned device process's stop reaches the parent as itself."""


class TermSignal:
    """Context manager: while open, a SIGTERM sets `raised` instead of ending the process."""

    def __init__(self) -> None:
        self.raised = False
        self._installed = False

    def _handle(self, _signum, _frame) -> None:
        self.raised = True

    def __enter__(self) -> "TermSignal":
        if threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, self._handle)
            self._installed = True
        return self

    def __exit__(self, *_exc) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            self._installed = False
