"""Ctrl-C in a long command (extract, train, sweep, generate, eval): exit 130 with one message that says what
is kept and the exact command that resumes, as the last thing on the terminal.

`exits_on_interrupt(describe)` wraps the command's work. On the first Ctrl-C a handler installed for the block
turns any later one into an immediate exit (130): the message may take a moment (it reads checkpoints or a
store's records), and a user who presses Ctrl-C twice wants out now. Every progress bar is closed before the
message, so no bar is redrawn after it (tqdm redraws an open bar when it is garbage collected at exit).
SIGINT that the process ignores (a background job of a script) stays ignored.

A Ctrl-C can leave a lock held: Python runs the handler between bytecodes, also at the entry of
threading.Condition.__exit__, after the lock was taken and before it is released (CPython bpo-29988). A thread
that needs that lock (a queue's, a future's) then never finishes, and whatever waits for it (a thread pool's
shutdown, the interpreter's exit) waits forever. So the first Ctrl-C also starts a watchdog: if the command has not
exited GRACE_S later, it prints the same message, saying so, and exits 130 itself.

The first Ctrl-C is also noted in dflash.ctrl_c: a block that ends normally after one (its KeyboardInterrupt lost
inside a finalizer) exits as interrupted all the same.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Iterator

import click

from dflash import ctrl_c
from dflash.errors import DflashError, interrupt_in_chain

EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a process ended by Ctrl-C
GRACE_S = 60.0  # after the first Ctrl-C, the most a command's own unwinding may take (module docstring)

_message = threading.Lock()   # the message is printed once: by the unwinding command or by the watchdog
_watch: tuple[Callable[[KeyboardInterrupt], str], float] | None = None   # (describe, grace_s) of the open block


def close_progress_bars() -> None:
    """Close every tqdm bar of this process (each is drawn once more, finished, then the line ends)."""
    tqdm = sys.modules.get("tqdm")  # never imported: no bar exists
    if tqdm is None:
        return
    for bar in list(getattr(tqdm.tqdm, "_instances", ())):
        with contextlib.suppress(Exception):
            bar.close()


def command_line(*extra: str) -> str:
    """The command as it was typed (`dflash` + its arguments), with `extra` arguments it lacks appended."""
    args = list(sys.argv[1:])
    return shlex.join(["dflash", *args, *[a for a in extra if a not in args]])


def _exit_now(_signum, _frame) -> None:
    os._exit(EXIT_INTERRUPTED)


def _first_interrupt(_signum, _frame) -> None:
    ctrl_c.note()   # before the raise: Python loses a KeyboardInterrupt raised inside a finalizer (dflash.ctrl_c)
    signal.signal(signal.SIGINT, _exit_now)
    if _watch is not None:
        timer = threading.Timer(_watch[1], _exit_stuck, args=_watch)
        timer.daemon = True
        timer.start()
    raise KeyboardInterrupt


def _exit_stuck(describe: Callable[[KeyboardInterrupt], str], grace_s: float) -> None:
    """The watchdog (module docstring): the message unless the command printed it (then it is stuck in the
    interpreter's exit, joining a thread), and exit 130."""
    if _message.acquire(blocking=False):
        try:
            text = describe(KeyboardInterrupt())
        except Exception as e:  # noqa: BLE001 - exiting matters more than the details
            text = f"interrupted ({e})"
        sys.stderr.write(f"\nstill stopping {grace_s:.0f} s after Ctrl-C (a thread did not finish): exiting now\n"
                         f"{text}\n")
        sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)


@contextlib.contextmanager
def exits_on_interrupt(describe: Callable[[KeyboardInterrupt], str], *, grace_s: float = GRACE_S) -> Iterator[None]:
    """Run the block; on Ctrl-C print describe(the interrupt) on stderr and exit 130, within grace_s of the
    Ctrl-C (module docstring)."""
    global _watch
    ours = (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    if ours:
        _watch = (describe, grace_s)
        ctrl_c.clear()
        signal.signal(signal.SIGINT, _first_interrupt)
    try:
        yield
        if ours:
            ctrl_c.raise_if_came()   # its KeyboardInterrupt was lost on the way (dflash.ctrl_c)
    except Exception as e:
        # a library's own error raised while the interrupt unwound it counts as the interrupt; dflash's own errors
        # say why they stopped the command themselves (a lost lease wakes the main thread with an interrupt)
        interrupt = None if isinstance(e, DflashError) else interrupt_in_chain(e)
        if interrupt is None:
            raise
        _interrupted(interrupt, describe, ours)
    except KeyboardInterrupt as e:
        _interrupted(e, describe, ours)
    finally:
        if ours and signal.getsignal(signal.SIGINT) is _first_interrupt:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if ours:
            _watch = None
            ctrl_c.clear()


def interrupted_outside_work(e: KeyboardInterrupt) -> None:
    """A Ctrl-C before a command's work began (loading its config, importing torch) or after it ended (its last
    lines): nothing of it is half-written. Exits as an interrupted block does."""
    _interrupted(e, lambda _e: "interrupted while the command was starting or finishing, outside its work: nothing "
                               "is half-written; run it again to see where it stands", ours=True)


def _interrupted(e: KeyboardInterrupt, describe: Callable[[KeyboardInterrupt], str], ours: bool) -> None:
    if ours:  # also when the interrupt came another way (an extraction's publisher)
        signal.signal(signal.SIGINT, _exit_now)
    close_progress_bars()
    sys.stdout.flush()
    _message.acquire()   # the watchdog holds it only while it prints, then exits
    click.echo(describe(e), err=True)
    raise SystemExit(EXIT_INTERRUPTED) from None
