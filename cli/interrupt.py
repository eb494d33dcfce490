"""Ctrl-C in a long command (extract, train, sweep, generate, eval): exit 130 with one message that says what
is kept and the exact command that resumes, as the last thing on the terminal.

`exits_on_interrupt(describe)` wraps the command's work. On the first Ctrl-C a handler installed for the block
turns any later one into an immediate exit (130): the message may take a moment (it reads checkpoints or a
store's records), and a user who presses Ctrl-C twice wants out now. Every progress bar is closed before the
message, so no bar is redrawn after it (tqdm redraws an open bar when it is garbage collected at exit).
SIGINT that the process ignores (a background job of a script) stays ignored.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
from collections.abc import Callable, Iterator

import click

from dflash.errors import interrupt_in_chain

EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a process ended by Ctrl-C


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
    signal.signal(signal.SIGINT, _exit_now)
    raise KeyboardInterrupt


@contextlib.contextmanager
def exits_on_interrupt(describe: Callable[[KeyboardInterrupt], str]) -> Iterator[None]:
    """Run the block; on Ctrl-C print describe(the interrupt) on stderr and exit 130 (module docstring)."""
    import threading

    ours = (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    if ours:
        signal.signal(signal.SIGINT, _first_interrupt)
    try:
        yield
    except Exception as e:  # a library's own error raised while the interrupt unwound it counts as the interrupt
        interrupt = interrupt_in_chain(e)
        if interrupt is None:
            raise
        _interrupted(interrupt, describe, ours)
    except KeyboardInterrupt as e:
        _interrupted(e, describe, ours)
    finally:
        if ours and signal.getsignal(signal.SIGINT) is _first_interrupt:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _interrupted(e: KeyboardInterrupt, describe: Callable[[KeyboardInterrupt], str], ours: bool) -> None:
    if ours:  # also when the interrupt came another way (an extraction's publisher)
        signal.signal(signal.SIGINT, _exit_now)
    close_progress_bars()
    sys.stdout.flush()
    click.echo(describe(e), err=True)
    raise SystemExit(EXIT_INTERRUPTED) from None
