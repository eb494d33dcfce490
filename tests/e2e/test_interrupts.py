"""Ctrl-C in every long command, with a real SIGINT to a real `dflash` process on a tiny real target: train,
sweep, generate and eval exit 130 with one last line (no progress bar after it, no click "Aborted!") that says
what is kept and the command that resumes, and that command finishes the job; extract with its progress bar
drawn ends on its message too; and `generate --endpoint`'s failure is the last line, not its bar."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli.main import cli
from dflash.cache import commit as cm
from helpers_extract import tiny_target_and_data
from helpers_procs import popen_signalable, stop

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
EXTRACT = ["--taps", "0,2,4", "--max-length", "192", "--batch-tokens", "384", "--shard-tokens", "160"]
TINY = ["--config", "configs/train_tiny.yaml", "--device", "cpu"]
GENERATE = ["--max-new-tokens", "24", "--batch-size", "1", "--chunk-conversations", "1", "--device", "cpu"]
# each step of the tiny drafter takes milliseconds: many steps and a checkpoint every 3 leave time to interrupt
LONG = ["--steps", "60", "--save-every", "3", "--log-every", "1"]
SWEEP = """
base: {mask_token_id: 256, num_layers: 1, num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16,
       intermediate_size: 128, block_size: 4, num_anchors: 8, batch_tokens: 1024, steps: 60, log_every: 1,
       save_every: 3}
runs:
  - {name: a, lr: 0.001}
  - {name: b, lr: 0.002}
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, data, cache, drafter): a tiny target, 12 conversations, their cache and a 2-step drafter."""
    base = tmp_path_factory.mktemp("interrupts")
    model, data = tiny_target_and_data(base, num=12, seed=3)
    cache, run = base / "cache", base / "run"
    for args in (["extract", "--model", model, "--data", data, "--output", str(cache), *EXTRACT, "--no-progress"],
                 ["train", "--cache", str(cache), "--model", model, "--output", str(run), *TINY, "--steps", "2"]):
        res = CliRunner().invoke(cli, args, prog_name="dflash")
        assert res.exit_code == 0, res.output
    return model, data, str(cache), str(run / "drafter")


def last_line(text: str) -> str:
    """The last non-empty line as a terminal shows it (a bar redraws its line with \\r)."""
    return [s for s in re.split(r"[\r\n]", text) if s.strip()][-1]


def interrupt(tmp_path: Path, make, *, tries: int = 4, send=None) -> tuple[subprocess.Popen, str, int]:
    """Start `make(attempt)` = (dflash args, ready(), done()) as a real process; once ready() holds, stop it,
    and if done() does not hold yet (the run could finish on a fast poll's lag) send SIGINT (or call send(p)),
    then let it go on. Returns (process, stderr, attempt); retries with a fresh attempt when the run had
    finished."""
    for attempt in range(tries):
        args, ready, done = make(attempt)
        err_path = tmp_path / f"err{attempt}"
        with open(err_path, "w") as err:
            p = popen_signalable([sys.executable, "-m", "cli.main", *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                                 stderr=err, env={**os.environ, "PYTHONPATH": str(ROOT)})
            deadline = time.monotonic() + 300  # hang guard: a tiny run takes seconds, more on a loaded machine
            while not ready():
                assert p.poll() is None, f"ended early (rc={p.returncode}): {err_path.read_text()[-3000:]}"
                assert time.monotonic() < deadline, "timed out"
                time.sleep(0.01)
            stop(p)
            mid_run = p.poll() is None and not done()
            if mid_run:
                (send or (lambda q: q.send_signal(signal.SIGINT)))(p)
            p.send_signal(signal.SIGCONT)
            p.wait(timeout=300)
        if mid_run:
            return p, err_path.read_text(), attempt
    pytest.fail("the run finished before every SIGINT attempt")


def _resume(message: str, prog: str) -> list[str]:
    """The arguments of the command after '... with: ' (checked to start with `dflash PROG`)."""
    args = shlex.split(message.split(" with: ", 1)[1])
    assert args[:2] == ["dflash", prog], message
    return args[1:]


def _invoke(args: list[str]) -> str:
    res = CliRunner().invoke(cli, args, prog_name="dflash")
    assert res.exit_code == 0, res.output + repr(res.exception)
    return res.output


def _checkpoints(run: Path) -> list[Path]:
    return sorted((run / "checkpoints").glob("step-*.pt"))


def test_train(tiny, tmp_path):
    model, _, cache, _ = tiny

    def make(attempt):
        run = tmp_path / f"run{attempt}"
        return (["train", "--cache", cache, "--model", model, "--output", str(run), *TINY, *LONG],
                lambda: bool(_checkpoints(run)), lambda: (run / "drafter").exists())
    p, err, attempt = interrupt(tmp_path, make)
    run = tmp_path / f"run{attempt}"
    assert p.returncode == 130, err[-3000:]
    line = last_line(err)
    m = re.match(r"interrupted at step (\d+): newest checkpoint: step (\d+) \((.+?)\); (.+?); resume with: ", line)
    assert m, err[-3000:]
    reached, saved = int(m[1]), int(m[2])
    assert m[3] == str(_checkpoints(run)[-1]) and saved <= reached < 60
    assert m[4] == ("nothing since it is lost" if reached == saved else
                    f"steps {saved + 1}-{reached} since it are lost (redone by the resume)")
    assert "Aborted" not in err and "Traceback" not in err
    args = _resume(line, "train")
    assert args[-1] == "--resume" and args[:-1] == make(attempt)[0]
    assert "trained 60 steps" in _invoke(args)


def _weights(drafter: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(drafter / "model.safetensors"))


def _rank_pid(parent: subprocess.Popen, rank: int) -> int:
    """The pid of `dflash train --gpus N`'s rank `rank`: its spawned children, started in rank order (the
    multiprocessing resource tracker, also a child, runs another command)."""
    kids = Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split()
    ranks = sorted(int(k) for k in kids if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes())
    return ranks[rank]


@pytest.mark.parametrize("gpus", [1, 2])
def test_train_sigterm(tiny, tmp_path, gpus):
    """SIGTERM (a scheduler's time limit) to the one process, or to one rank of two: every rank stops at the same
    step, which is checkpointed (no checkpoint was due: --save-every 1000), and the command exits 143 saying so;
    the resume ends where an uninterrupted run ends, bit for bit."""
    model, _, cache, _ = tiny

    def args(run):
        return ["train", "--cache", cache, "--model", model, "--output", str(run), *TINY, "--steps", "60",
                "--save-every", "1000", "--log-every", "1", "--gpus", str(gpus)]

    def make(attempt):
        run = tmp_path / f"run{attempt}"
        metrics = run / "metrics.jsonl"
        return (args(run), lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2,
                lambda: (run / "drafter").exists())
    send = (lambda p: p.send_signal(signal.SIGTERM)) if gpus == 1 else \
        (lambda p: os.kill(_rank_pid(p, 1), signal.SIGTERM))
    p, err, attempt = interrupt(tmp_path, make, send=send)
    run = tmp_path / f"run{attempt}"
    assert p.returncode == 143, err[-3000:]
    line = last_line(err)
    m = re.match(r"stopped by SIGTERM at step (\d+)/60; checkpoint (.+?); continue with: ", line)
    assert m, err[-3000:]
    assert [c.name for c in _checkpoints(run)] == [f"step-{int(m[1]):08d}.pt"] and m[2] == str(_checkpoints(run)[0])
    assert "Traceback" not in err
    resume = _resume(line, "train")
    assert resume == [*args(run), "--resume"]
    assert "trained 60 steps" in _invoke(resume)
    assert "trained 60 steps" in _invoke(args(tmp_path / "whole"))
    a, b = _weights(run / "drafter"), _weights(tmp_path / "whole" / "drafter")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_sweep(tiny, tmp_path):
    model, _, cache, _ = tiny
    spec = tmp_path / "sweep.yaml"
    spec.write_text(SWEEP)

    def make(attempt):
        out = tmp_path / f"sweep{attempt}"
        return (["sweep", str(spec), "--cache", cache, "--model", model, "--output", str(out), "--device", "cpu"],
                lambda: any(_checkpoints(r) for r in (out / "runs").glob("*")),
                lambda: (out / "results.md").exists())
    p, err, attempt = interrupt(tmp_path, make)
    assert p.returncode == 130, err[-3000:]
    lines = [s for s in re.split(r"[\r\n]", err) if s.strip()]
    assert lines[-4] == "interrupted; the runs of the sweep:", err[-3000:]
    for name, line in zip("ab", lines[-3:-1]):
        assert re.match(rf"  {name}: ((at step \d+: )?(newest checkpoint: step \d+ |no checkpoint yet; a resume starts "
                        r"at step 0)|finished)", line), line
    args = _resume(lines[-1], "sweep")
    assert args[-1] == "--resume" and args[:-1] == make(attempt)[0]
    out = _invoke(args)
    assert "a: 60 steps" in out and "b: 60 steps" in out


@pytest.mark.parametrize("mixture", [False, True], ids=["one-stream", "mixture"])
def test_sweep_sigterm(tiny, tmp_path, mixture):
    """SIGTERM stops the group's runs at one step with a checkpoint each; the sweep exits 143 saying so. A group
    whose runs differ in cache_weights (a thread per weighting) agrees on the step too."""
    model, _, cache, _ = tiny
    spec = tmp_path / "sweep.yaml"
    text = SWEEP.replace("save_every: 3", "save_every: 1000")
    caches = ["--cache", cache]
    if mixture:
        text = text.replace("lr: 0.001}", "cache_weights: [3, 1]}").replace("lr: 0.002}", "cache_weights: [1, 3]}")
        shutil.copytree(cache, tmp_path / "cache2")
        caches += ["--cache", str(tmp_path / "cache2")]
    spec.write_text(text)

    def make(attempt):
        out = tmp_path / f"sweep{attempt}"
        return (["sweep", str(spec), *caches, "--model", model, "--output", str(out), "--device", "cpu"],
                lambda: (out / "runs" / "b" / "metrics.jsonl").exists(), lambda: (out / "results.md").exists())
    p, err, attempt = interrupt(tmp_path, make, send=lambda q: q.send_signal(signal.SIGTERM))
    assert p.returncode == 143, err[-3000:]
    lines = [s for s in re.split(r"[\r\n]", err) if s.strip()]
    assert lines[-4] == "stopped by SIGTERM; the runs of the sweep:", err[-3000:]
    out = tmp_path / f"sweep{attempt}"
    steps = {_checkpoints(out / "runs" / name)[-1].name for name in "ab"}
    assert len(steps) == 1                       # both runs of the one stream stopped at the same step
    for name, line in zip("ab", lines[-3:-1]):
        assert re.match(rf"  {name}: (at step \d+: )?newest checkpoint: step \d+ .*; nothing since it is lost$",
                        line), line
    assert "Traceback" not in err
    res = _invoke(_resume(lines[-1], "sweep"))
    assert "a: 60 steps" in res and "b: 60 steps" in res


def test_generate(tiny, tmp_path):
    model, data, _, _ = tiny

    def make(attempt):
        out = tmp_path / f"gen{attempt}.jsonl.gz"
        log = Path(f"{out}.parts") / "commits.jsonl"
        return (["generate", "--model", model, "--data", data, "--output", str(out), *GENERATE],
                lambda: log.exists() and log.read_text().count("\n") >= 1, out.exists)
    p, err, attempt = interrupt(tmp_path, make)
    assert p.returncode == 130, err[-3000:]
    log = tmp_path / f"gen{attempt}.jsonl.gz.parts" / "commits.jsonl"
    chunks = log.read_text().count("\n")
    line = last_line(err)
    assert line.startswith(f"interrupted: {chunks} records in {chunks} chunks are committed in "), err[-3000:]
    args = _resume(line, "generate")
    assert args == make(attempt)[0]
    assert f"resuming: {chunks} chunks" in _invoke(args)


def test_eval(tiny, tmp_path):
    model, _, cache, drafter = tiny
    args = ["eval", "--drafter", drafter, "--cache", cache, "--model", model, "--approximate", "--device", "cpu",
            "--chunk-anchors", "1"]  # one block per forward: long enough to be interrupted

    def make(attempt):
        err = tmp_path / f"err{attempt}"
        return args, lambda: "eval:" in err.read_text(), lambda: False
    p, err, _ = interrupt(tmp_path, make)
    assert p.returncode == 130, err[-3000:]
    line = last_line(err)
    assert line.startswith("interrupted: eval writes nothing"), err[-3000:]
    assert _resume(line, "eval") == args


def test_extract_with_its_bar_ends_on_the_message(tiny, tmp_path):
    model, data, _, _ = tiny

    def make(attempt):
        out = tmp_path / f"cache{attempt}"
        return (["extract", "--model", model, "--data", data, "--output", str(out), *EXTRACT],
                lambda: len(cm.read_commit_logs(str(out))) >= 1 if (out / cm.COMMITS).is_dir() else False,
                lambda: False)  # SIGINT after the run ended its work: still 130 and the message
    p, err, _ = interrupt(tmp_path, make)
    assert p.returncode == 130, err[-3000:]
    assert "extract:" in err  # the bar was drawn
    assert last_line(err).startswith("interrupted: "), err[-3000:]


def test_endpoint_failure_is_the_last_line(tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                                     {"role": "assistant", "content": "a"}]}) + "\n"
                            for i in range(3)))
    env = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}
    r = subprocess.run([sys.executable, "-m", "cli.main", "generate", "--endpoint", f"http://127.0.0.1:{port}/v1",
                        "--served-model", "m", "--data", str(data), "--output", str(tmp_path / "x.jsonl.gz"),
                        "--retries", "1", "--max-consecutive-errors", "2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 1
    assert "generate:" in r.stderr  # the bar was drawn
    assert last_line(r.stderr).startswith("Error: endpoint ") and "rerun the same command" in last_line(r.stderr)
