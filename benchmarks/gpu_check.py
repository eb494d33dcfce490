"""The GPU machine's check stage: the gpu-marked tests and bench_block_mask in groups, across device calls.

The whole set takes about a call's time (10 minutes) or more, so it runs as groups, one process each, and keeps
what it ran in a state file on the machine: the next call on the warm machine (the same command) runs the groups
still pending. A group cut at the time limit is pending again and starts only in a call with more time than it
was cut at; one cut after a whole call's time (WHOLE_CALL_S) does not fit and is reported as failed. A group
whose input is not on the machine yet (NEEDS: the SmolLM2 GGUF) waits, pending, for a later call. Each group's
output goes to OUT/gpu_check_<group>.log, the table of every group so far to OUT/gpu_check.txt.

    python3 benchmarks/gpu_check.py --budget 560 --out $OUT          (run_h200.sh check)
    python3 benchmarks/gpu_check.py --only train --fresh             (one group again)

Exit 0 once every group passed, 3 while groups are pending (call again), 1 when one failed or cannot fit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import time

PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::Warning", "-m", "gpu"]

GROUPS: dict[str, list[str]] = {
    # the 27B target's compiled layers and kernel choices (~3 min of compiles)
    "target": [*PYTEST, "tests/gpu/test_target_fused_gpu.py", "tests/gpu/test_target_kernels_gpu.py"],
    # the CUDA trainer: methods, fused CE, wgrad fusion, the agreed stop flag, online taps
    "train": [*PYTEST, "tests/gpu/test_methods_gpu.py", "tests/gpu/test_fused_ce_gpu.py",
              "tests/gpu/test_wgrad_gpu.py", "tests/gpu/test_agreed_flag_gpu.py", "tests/gpu/test_online_gpu.py"],
    # compiled decoding of the real SmolLM2 (needs_smollm2)
    "generate": [*PYTEST, "tests/gpu/test_generate_gpu.py"],
    # the unit files whose tests have a CUDA case
    "unit": [*PYTEST, "tests/unit/test_attention_tiles.py", "tests/unit/test_drafter_model.py",
             "tests/unit/test_sliding_attention.py", "tests/unit/test_eval_batched.py", "tests/unit/test_quant4.py",
             "tests/unit/test_quant4_gpu.py"],
    "block_mask": [sys.executable, "benchmarks/bench_block_mask.py"],
}


def needs_smollm2() -> str | None:
    """Why the SmolLM2 GGUF is not here (the GPU machine gets it in parts: $DFLASH_SMOLLM2_GGUF), else None."""
    from dflash.errors import ModelNotFoundError
    from dflash.target.assets import smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except ModelNotFoundError as e:
        return f"no SmolLM2 GGUF ({e}): carry the GGUF parts"
    return None


NEEDS = {"generate": needs_smollm2}
"""Group -> what tells why it cannot run on this machine yet (None: it can): it waits, pending, for a later call."""


CUT = 124  # timeout's exit status, which run_h200.sh's callers know too
MIN_START_S = 30.0
WHOLE_CALL_S = 540.0  # what a group gets in a call of its own (10 minutes, less the start and the carry)


@dataclasses.dataclass
class Outcome:
    rc: int
    seconds: float
    last_line: str = ""

    @property
    def cut(self) -> bool:
        return self.rc == CUT

    @property
    def fits(self) -> bool:
        """False once cut after a whole call's time: running it again would be cut again."""
        return not (self.cut and self.seconds >= WHOLE_CALL_S)


def pending(o: Outcome | None) -> bool:
    """Still to run: never run, or cut and fits a call."""
    return o is None or (o.cut and o.fits)


def next_group(order: list[str], state: dict[str, Outcome], *, left: float,
               waiting: dict[str, str] | None = None) -> tuple[str | None, str]:
    """The group to start with `left` seconds of this call (None: none now) and why not. Pending: never run, or
    cut; a group cut at t seconds waits for a call with more than t left, and one cut after a whole call's time
    never starts again (verdict reports it). Groups in `waiting` (group -> why) are passed over in this call."""
    for name in order:
        o = state.get(name)
        if not pending(o) or name in (waiting or {}):
            continue
        if left < MIN_START_S:
            return None, f"{left:.0f} s left: call again for {name} and the groups after it"
        if o is not None and left <= o.seconds:
            return None, f"{name} was cut at {o.seconds:.0f} s and {left:.0f} s are left: call again"
        return name, ""
    return None, ""


def verdict(order: list[str], state: dict[str, Outcome], *, waiting: dict[str, str] | None = None) -> tuple[int, str]:
    """Exit status and a line: 1 if a group failed or does not fit a call, 3 while one is pending (with why a
    waiting one waits), else 0."""
    failed = [n for n in order if n in state and not state[n].cut and state[n].rc != 0]
    unfit = [n for n in order if n in state and not state[n].fits]
    todo = [n for n in order if pending(state.get(n))]
    bad = ([f"failed: {', '.join(failed)}"] if failed else []) + \
        ([f"cut after a whole call ({WHOLE_CALL_S:.0f} s): {', '.join(unfit)}; split it"] if unfit else [])
    if bad:
        return 1, "; ".join(bad)
    if todo:
        why = "; ".join(f"{n} waits: {(waiting or {})[n]}" for n in todo if n in (waiting or {}))
        return 3, "pending: " + ", ".join(todo) + " (run the same command again" + (f"; {why})" if why else ")")
    return 0, "every group passed"


def table(order: list[str], state: dict[str, Outcome]) -> str:
    rows = []
    for name in order:
        o = state.get(name)
        what = "not run" if o is None else ("cut" if o.cut else "passed" if o.rc == 0 else f"failed (exit {o.rc})")
        rows.append(f"{name:12s} {what:18s} {'' if o is None else f'{o.seconds:6.0f} s'}  "
                    f"{'' if o is None else o.last_line}")
    return "\n".join(rows)


def run_group(argv: list[str], *, limit: float, log: pathlib.Path) -> Outcome:
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = CUT
    lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
    return Outcome(rc=rc, seconds=time.monotonic() - t0, last_line=lines[-1][:160] if lines else "")


def load(path: pathlib.Path) -> dict[str, Outcome]:
    return {k: Outcome(**v) for k, v in json.loads(path.read_text()).items()} if path.exists() else {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=560, help="seconds this call may take (under the call's limit)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp", help="where the logs and the table go")
    ap.add_argument("--state", default="/tmp/gpu_check_state.json", help="what earlier calls ran (on this machine)")
    ap.add_argument("--only", help="comma-separated groups (default all: " + ", ".join(GROUPS) + ")")
    ap.add_argument("--fresh", action="store_true", help="forget what earlier calls ran for these groups")
    args = ap.parse_args(argv)
    order = args.only.split(",") if args.only else list(GROUPS)
    unknown = [n for n in order if n not in GROUPS]
    if unknown:
        ap.error(f"unknown group(s) {', '.join(unknown)}: the groups are {', '.join(GROUPS)}")
    state_path, out = pathlib.Path(args.state), pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    state = load(state_path)
    if args.fresh:
        state = {k: v for k, v in state.items() if k not in order}
    waiting = {n: why for n in order if n in NEEDS and (why := NEEDS[n]())}
    t0 = time.monotonic()
    while True:
        left = args.budget - (time.monotonic() - t0)
        name, why = next_group(order, state, left=left, waiting=waiting)
        if name is None:
            if why:
                print(f"gpu_check: {why}", flush=True)
            break
        print(f"gpu_check: {name} ({left:.0f} s left)", flush=True)
        state[name] = run_group(GROUPS[name], limit=left, log=out / f"gpu_check_{name}.log")
        print(f"gpu_check: {name}: {table([name], state)}", flush=True)
        state_path.write_text(json.dumps({k: dataclasses.asdict(v) for k, v in state.items()}))
    rc, line = verdict(order, state, waiting=waiting)
    text = table(order, state) + f"\n{line}\n"
    (out / "gpu_check.txt").write_text(text)
    print(text, end="")
    return rc


if __name__ == "__main__":
    sys.exit(main())
