"""What a Ctrl-C leaves of a training run or a sweep: the newest checkpoint, the steps lost since it, and the
command that resumes (the CLI prints it; cli/interrupt.py does the exit).

The step the run had reached is known to the loop only: `StepInterrupted` carries it out (it is still a
KeyboardInterrupt, so every handler on the way treats it as one). Without it (a run in spawned workers) the
last step in metrics.jsonl stands in: at most log_every steps behind.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import signal
import threading
from collections.abc import Iterator

from dflash.train import checkpoint as ckpt


class StepInterrupted(KeyboardInterrupt):
    """Ctrl-C during training, re-raised with the step the run had reached."""

    def __init__(self, *, global_step: int) -> None:
        super().__init__()
        self.global_step = global_step
        """Steps completed when the interrupt came (the next step's work is lost with it)."""


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Ctrl-C inside the block takes effect when the block ends, for code that a KeyboardInterrupt cut in the
    middle leaves broken: TensorBoard's writer queue, cut between its put and the wake-up of its writer thread,
    leaves that thread asleep with the record until its 120 s poll, or, cut at the entry of Condition.__exit__,
    holds the queue's lock for good; the run's close then waits minutes, or forever, for that thread. Only in the
    main thread, and only over a handler of Python's own (not SIG_IGN)."""
    handler = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(handler):
        yield
        return
    came = []
    signal.signal(signal.SIGINT, lambda signum, frame: came.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
        if came:
            handler(signal.SIGINT, came[0])   # raises KeyboardInterrupt (the CLI's handler also arms the exit-now)


def last_logged_step(run_dir: pathlib.Path) -> int | None:
    """The step of the last whole record in RUN_DIR/metrics.jsonl (None: none yet)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    step = None
    for line in path.read_text().splitlines():
        try:
            step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line
    return step


def run_state(run_dir: pathlib.Path, *, reached: int | None = None) -> str:
    """One run's part of the message: its newest checkpoint and what is lost since it. reached: the step the
    run had completed (StepInterrupted), else the last logged one."""
    if (run_dir / "drafter" / "config.json").exists():
        return "finished (drafter exported)"
    if reached is None:
        reached = last_logged_step(run_dir)
    newest = ckpt.latest_checkpoint(run_dir)
    saved = ckpt.checkpoint_step(newest) if newest is not None else 0
    where = f"newest checkpoint: step {saved} ({newest})" if newest is not None else "no checkpoint yet"
    if newest is None:
        lost = "a resume starts at step 0"
    elif reached is None or reached <= saved:
        lost = "nothing since it is lost"
    else:
        lost = f"steps {saved + 1}-{reached} since it are lost (redone by the resume)"
    at = "" if reached is None else f"at step {reached}: "
    return f"{at}{where}; {lost}"


def train_interrupted_text(run_dir: str | pathlib.Path, *, reached: int | None, command: str) -> str:
    """The message of `dflash train` after Ctrl-C."""
    state = run_state(pathlib.Path(run_dir), reached=reached)
    return f"interrupted{' ' if state.startswith('at step') else ': '}{state}; resume with: {command}"


def can_resume(run_dir: str | pathlib.Path) -> bool:
    """Whether `--resume` applies: the run wrote its config.json (before its first step); an earlier interrupt
    (while loading) leaves nothing to resume, and the plain command starts over."""
    return (pathlib.Path(run_dir) / "config.json").exists()


def sweep_interrupted_text(output: str | pathlib.Path, *, command: str, why: str = "interrupted") -> str:
    """The message of `dflash sweep` after Ctrl-C (or SIGTERM: why="stopped by SIGTERM"): each run of
    OUTPUT/runs/ on its own line."""
    runs = sorted(p for p in (pathlib.Path(output) / "runs").glob("*") if p.is_dir())
    lines = [f"  {p.name}: {run_state(p)}" for p in runs]
    return "\n".join([f"{why}; the runs of the sweep:", *lines, f"resume with: {command}"])
