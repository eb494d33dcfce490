"""Ctrl-C at random moments of real `dflash sweep`, `dflash extract` or `dflash generate` processes on a tiny target:
every run must exit 130 with its message as the last line (or 0 when it had finished), within the hang guard; an
extraction's rerun must complete a cache that `dflash cache verify` passes, and a generation's rerun must write the
records an uninterrupted run writes. A sweep run that takes over 40 s is reported SLOW (an
uninterrupted one takes ~5 s). Random by design, so not in CI: each defect it found is pinned by a deterministic
test in tests/unit/test_interrupt.py.

Usage: python scripts/sigint_stress.py sweep|extract|generate [--runs 100] [--max-delay 3] [--work DIR]
Exit status 1 when any run went wrong; every run's stderr stays in DIR.
"""

from __future__ import annotations

import argparse
import gzip
import os
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "e2e")]

from dflash.cache import commit as cm  # noqa: E402
from helpers_extract import tiny_target_and_data  # noqa: E402
from helpers_procs import popen_signalable, stop  # noqa: E402
from test_interrupts import EXTRACT, GENERATE, SWEEP, last_line  # noqa: E402  (the e2e tests' tiny runs)

CONVERSATIONS = 12
HANG_S = 150.0
SLOW_S = 40.0


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "cli.main", *args]


def one_run(i: int, *, command: str, work: pathlib.Path, model: str, data: str, cache: str, delay: float,
            env: dict) -> str | None:
    """One interrupted run; None when it behaved, else what went wrong."""
    out = work / f"{command}{i}"
    if command == "sweep":
        args = cli("sweep", str(work / "sweep.yaml"), "--cache", cache, "--model", model, "--output", str(out),
                   "--device", "cpu")
        started, finished = (lambda: any((out / "runs").glob("*/checkpoints/step-*.pt"))), (out / "results.md").exists
    elif command == "generate":
        out = work / f"gen{i}.jsonl.gz"
        args = cli("generate", "--model", model, "--data", data, "--output", str(out), *GENERATE)
        started, finished = pathlib.Path(f"{out}.parts/commits.jsonl").exists, out.exists
    else:
        args = cli("extract", "--model", model, "--data", data, "--output", str(out), *EXTRACT)
        started = (out / "commits").is_dir
        finished = lambda: sum(len(r.sample_ids) for r in cm.read_commit_logs(str(out))) == CONVERSATIONS  # noqa: E731
    t0 = time.monotonic()
    with open(work / f"err{i}", "w") as err:
        p = popen_signalable(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, env=env)
        while not started() and p.poll() is None:
            time.sleep(0.005)
        time.sleep(random.uniform(0, delay))
        stop(p)
        done = p.poll() is not None or finished()
        if not done:
            p.send_signal(signal.SIGINT)
        p.send_signal(signal.SIGCONT)
        try:
            p.wait(timeout=HANG_S)
        except subprocess.TimeoutExpired:
            p.kill()
            return f"HANG: still running {HANG_S:.0f} s after SIGINT"
    seconds = time.monotonic() - t0
    text = (work / f"err{i}").read_text()
    text = text if text.strip() else "(nothing on stderr)"
    if done:
        if p.returncode not in (0, -signal.SIGINT):   # -2: SIGINT during the interpreter's exit, the work done
            return f"finished run exited {p.returncode}: {last_line(text)[-300:]}"
    elif p.returncode != 130 or not last_line(text).startswith(("interrupted", "resume with")) \
            or "Traceback" in text:
        return f"exit {p.returncode}, last line {last_line(text)[-300:]!r}"
    if command == "sweep" and seconds > SLOW_S:
        return f"SLOW: {seconds:.0f} s"
    if command == "extract":
        rerun = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
        verify = subprocess.run(cli("cache", "verify", str(out)), cwd=ROOT, env=env, capture_output=True, text=True)
        if rerun.returncode or verify.returncode:
            return f"rerun exit {rerun.returncode}, verify exit {verify.returncode}: {verify.stdout[-300:]}"
    if command == "generate":
        rerun = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
        if rerun.returncode:
            return f"rerun exit {rerun.returncode}: {last_line(rerun.stderr or '(nothing)')[-300:]}"
        if records(out) != records(work / "generated.jsonl.gz"):
            return "the resumed generation's records differ from an uninterrupted run's"
    return None


def records(path: pathlib.Path) -> list[str]:
    with gzip.open(path, "rt") as f:
        return f.read().splitlines()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["sweep", "extract", "generate"], help="the command to interrupt")
    ap.add_argument("--runs", type=int, default=100, help="interrupted runs (default 100; ~7 s each for sweep)")
    ap.add_argument("--max-delay", type=float, default=3.0,
                    help="SIGINT at a uniform random delay up to this many seconds after the run's first "
                         "checkpoint (sweep) or commit (extract, generate) (default 3)")
    ap.add_argument("--work", default=None, help="folder for the tiny target, the runs and their stderr "
                                                 "(default: a new temporary folder)")
    a = ap.parse_args()
    work = pathlib.Path(a.work or tempfile.mkdtemp(prefix="sigint_stress_"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    model, data = tiny_target_and_data(work, num=CONVERSATIONS, seed=3)
    cache = str(work / "cache")
    subprocess.run(cli("extract", "--model", model, "--data", data, "--output", cache, *EXTRACT, "--no-progress"),
                   cwd=ROOT, env=env, check=True, capture_output=True)
    (work / "sweep.yaml").write_text(SWEEP)
    if a.command == "generate":   # what every interrupted and resumed generation must end with
        subprocess.run(cli("generate", "--model", model, "--data", data, "--output", str(work / "generated.jsonl.gz"),
                           *GENERATE), cwd=ROOT, env=env, check=True, capture_output=True)
    bad = 0
    for i in range(a.runs):
        what = one_run(i, command=a.command, work=work, model=model, data=data, cache=cache, delay=a.max_delay,
                       env=env)
        bad += what is not None
        print(f"{i}: {what or 'ok'}", flush=True)
    print(f"{a.runs - bad} of {a.runs} runs behaved; stderr of each in {work}/err<N>")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
