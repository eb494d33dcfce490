"""Start a real CLI process for a test that signals it, with the signal dispositions a terminal would give it.

Why: a signal ignored (SIG_IGN) at exec stays ignored in the new program (POSIX), and CPython installs its
KeyboardInterrupt handler only when SIGINT is not ignored at start-up. A non-interactive shell starts a
background job (`bash .ci/run > log &`) with SIGINT and SIGQUIT ignored, pytest and its xdist workers inherit
that, and so would every extraction a test starts: its SIGINT was then a no-op (the SIGINT
test's run exited 0 with all 24 samples committed; /proc/PID/status SigIgn 0x...06 in the workers and their
children). The same holds for a user's `dflash extract ... &` in a script; that is the shell's rule, not ours.
"""

from __future__ import annotations

import signal
import subprocess

# The signals a non-interactive shell ignores in background jobs; SIGTERM/SIGKILL/SIGSTOP are never touched.
RESET_SIGNALS = (signal.SIGINT, signal.SIGQUIT)


def restore_default_signals() -> None:
    """Set RESET_SIGNALS to their default action (runs in the child between fork and exec)."""
    for sig in RESET_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


def popen_signalable(args: list[str], **kwargs) -> subprocess.Popen:
    """subprocess.Popen(args, **kwargs) whose child starts with SIGINT and SIGQUIT at their defaults, whatever
    the test process inherited. preexec_fn runs only signal.signal in the forked child: no lock it could meet."""
    return subprocess.Popen(args, preexec_fn=restore_default_signals, **kwargs)



def stop(p: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGSTOP p and return once it is stopped (or gone). kill() returns before the process has stopped: here 238
    of 300 tries found it still running right after, for up to 15 ms on a quiet machine, more on a loaded one, so a
    check made right after the signal raced a process that could still commit, finish or leave its Ctrl-C handler
    (once: a sweep that exited 0 after its "mid-run" SIGINT)."""
    import time

    p.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while p.poll() is None:
        try:
            with open(f"/proc/{p.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                    return
        except FileNotFoundError:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {p.pid} did not stop within {timeout} s of SIGSTOP")
        time.sleep(0.001)
