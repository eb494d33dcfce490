"""Whether a Ctrl-C came during a command's work, as a flag beside its KeyboardInterrupt.

Why: Python loses a KeyboardInterrupt raised while a finalizer runs (an object's __del__, a weakref callback, a
generator closed by the garbage collector): it prints "Exception ignored in ..." and the code goes on. A run
whose Ctrl-C landed there would train on for hours. The CLI's handler sets the flag before it raises; the long
loops (training steps, extraction rounds, generation chunks) check it at each unit of work and the CLI when the
work ends, so a lost interrupt still stops the run at the next unit, or still exits 130.
"""

from __future__ import annotations

import threading

__all__ = ["clear", "note", "raise_if_came"]

_came = threading.Event()


def note() -> None:
    """A Ctrl-C came (called by the CLI's SIGINT handler)."""
    _came.set()


def clear() -> None:
    """Forget earlier Ctrl-Cs (a command's work begins or ends)."""
    _came.clear()


def raise_if_came() -> None:
    """Raise KeyboardInterrupt if a Ctrl-C came since the last clear(): a long loop's check before each unit of
    work, and the CLI's when the work ends."""
    if _came.is_set():
        raise KeyboardInterrupt
