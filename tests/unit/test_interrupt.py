"""Ctrl-C in a long command (cli/interrupt.py), with a real SIGINT to a real process: exit 130, an open progress
bar closed before the message (the message is the last line), and a second Ctrl-C while the message is being
built exits at once. Plus the training runs' message (dflash.train.interrupted) on a run folder."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# a command-like program: a drawn tqdm bar, then work until Ctrl-C; describe() sleeps when asked to
PROGRAM = r"""
import sys, time
from tqdm import tqdm
from cli.interrupt import exits_on_interrupt

def describe(_e):
    print("describing", file=sys.stderr, flush=True)
    time.sleep(float(sys.argv[1]))
    return "interrupted: 3 things kept; resume with: dflash thing --resume"

with exits_on_interrupt(describe):
    bar = tqdm(total=100, desc="work", mininterval=0)
    bar.update(1)
    print("working", file=sys.stderr, flush=True)
    while True:
        time.sleep(0.05)
        bar.update(0)
"""


# a command whose unwinding after Ctrl-C never ends: a lock left held (as a Ctrl-C at the entry of
# Condition.__exit__ leaves a queue's) that a non-daemon thread waits for; "join": the block's finally joins it
# (a thread pool's shutdown), "exit": only the interpreter's exit does
STUCK = r"""
import sys, threading, time
from cli.interrupt import exits_on_interrupt

lock = threading.Lock()
with exits_on_interrupt(lambda _e: "interrupted: 3 things kept; resume with: dflash thing --resume", grace_s=2.0):
    lock.acquire()
    worker = threading.Thread(target=lambda: (lock.acquire(), lock.release()))
    worker.start()
    try:
        print("working", file=sys.stderr, flush=True)
        while True:
            time.sleep(0.05)
    finally:
        if sys.argv[1] == "join":
            worker.join()
"""

# a command whose Ctrl-C lands in a finalizer: Python prints "Exception ignored in ..." and goes on, as if none came
LOST = r"""
import os, signal, sys
from cli.interrupt import exits_on_interrupt

class Finalized:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        total = 0
        for i in range(200_000):   # bytecodes: the handler runs in here
            total += i

with exits_on_interrupt(lambda _e: "interrupted: 3 things kept; resume with: dflash thing --resume"):
    Finalized()
    print("the work went on", file=sys.stderr, flush=True)
"""

# a dflash command interrupted before its work began (where a real one loads its config and imports torch)
STARTING = r"""
import sys, time
from cli.main import cli

@cli.command("starting")
def starting():
    print("working", file=sys.stderr, flush=True)
    time.sleep(60)

cli(["starting"], prog_name="dflash")
"""


def last_line(text: str) -> str:
    """The last non-empty line as a terminal shows it (a bar redraws its line with \\r)."""
    return [s for s in re.split(r"[\r\n]", text) if s.strip()][-1]


def _start(arg, program: str = PROGRAM) -> subprocess.Popen:
    # SIGINT at its default in the child even when this test runs in a background job (tests/e2e/helpers_procs.py)
    return subprocess.Popen([sys.executable, "-c", program, str(arg)], cwd=ROOT, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_for(p: subprocess.Popen, word: str) -> str:
    seen = ""
    deadline = time.monotonic() + 120
    while word not in seen:
        assert time.monotonic() < deadline and p.poll() is None, seen
        seen += p.stderr.read(1)
    return seen


def test_ctrl_c_exits_130_with_the_message_as_the_last_line():
    p = _start(0.0)
    seen = _wait_for(p, "working")
    p.send_signal(signal.SIGINT)
    err = seen + p.communicate(timeout=60)[1]
    assert p.returncode == 130, err
    assert last_line(err) == "interrupted: 3 things kept; resume with: dflash thing --resume", err
    assert "Aborted" not in err and "Traceback" not in err


def test_ctrl_c_while_a_command_starts_exits_130_with_one_line_not_clicks_aborted():
    p = _start(0, STARTING)
    seen = _wait_for(p, "working")
    p.send_signal(signal.SIGINT)
    err = seen + p.communicate(timeout=60)[1]
    assert p.returncode == 130, err
    # communicate() reads the pipe past _wait_for's text buffer, which holds the newline after "working"
    assert last_line(err).removeprefix("working").startswith("interrupted while the command was starting"), err
    assert "Aborted" not in err and "Traceback" not in err


def test_a_ctrl_c_lost_in_a_finalizer_still_exits_130_with_the_message():
    p = _start(0, LOST)
    err = p.communicate(timeout=60)[1]
    assert "Exception ignored in" in err and "KeyboardInterrupt" in err, err   # Python did lose it
    assert "the work went on" in err
    assert p.returncode == 130, err
    assert last_line(err) == "interrupted: 3 things kept; resume with: dflash thing --resume", err


def test_training_stops_at_the_next_step_after_a_lost_ctrl_c(tmp_path, monkeypatch):
    """A Ctrl-C noted (the CLI's handler ran) whose KeyboardInterrupt was lost on the way: the loop raises it at
    the next step, with the step reached."""
    from dflash import ctrl_c
    from dflash.train.interrupted import StepInterrupted
    from dflash.train.trainer import train
    from train_helpers import tiny_cache, tiny_config, tiny_target

    monkeypatch.setenv("DFLASH_NO_PROGRESS", "1")
    target = tiny_target(tmp_path / "target")
    cfg = tiny_config(cache=str(tiny_cache(tmp_path / "cache", target)), model=str(target), steps=6,
                      output=str(tmp_path / "run"))
    seen = []

    def before_step(step):
        seen.append(step)
        if step == 2:
            ctrl_c.note()
    try:
        with pytest.raises(StepInterrupted) as e:
            train(cfg, device="cpu", before_step=before_step)
    finally:
        ctrl_c.clear()
    assert seen == [0, 1, 2] and e.value.global_step == 3


def test_extraction_stops_at_the_next_round_after_a_lost_ctrl_c(tmp_path, monkeypatch):
    """As training: a Ctrl-C noted during a round whose KeyboardInterrupt was lost stops the extraction before the
    next round; a rerun resumes it to the whole cache."""
    from dflash import ctrl_c
    from dflash.data.assets import sharegpt_conversations
    from dflash.extract import driver
    from dflash.extract.driver import ExtractConfig
    from dflash.extract.launch import launch
    from train_helpers import tiny_target

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in sharegpt_conversations(8)))
    cfg = ExtractConfig(model=str(tiny_target(tmp_path / "target")), data=(str(data),), output=str(tmp_path / "c"),
                        taps=(0, 1), dtype="float32", max_length=96, batch_tokens=128, show_progress=False,
                        device="cpu")
    steps = []
    real_step = driver._BatchLoop.step

    def step(self, batch):
        steps.append(batch.batch_id)
        real_step(self, batch)
        ctrl_c.note()
    monkeypatch.setattr(driver._BatchLoop, "step", step)
    try:
        with pytest.raises(KeyboardInterrupt):
            launch(cfg, num_procs=1, echo=lambda *a, **k: None)
    finally:
        ctrl_c.clear()
    assert steps == [0]   # the first round ran, the second never started
    monkeypatch.setattr(driver._BatchLoop, "step", real_step)
    res = launch(cfg, num_procs=1, echo=lambda *a, **k: None)
    assert res.num_committed_before + res.num_samples == 8 - sum(res.skip_counts.values())


def test_generation_stops_after_the_chunk_in_which_a_ctrl_c_was_lost(tmp_path):
    """As training: the chunk being committed stays committed, the processor is closed, no later chunk starts."""
    import time
    from types import SimpleNamespace

    from dflash import ctrl_c
    from dflash.data.skips import SkipCounter
    from dflash.generate.dialog import new_chunk_stats
    from dflash.generate.output import ShardedOutput
    from dflash.generate.run import run_chunks

    convs = [SimpleNamespace(num_generated=lambda mode: 1) for _ in range(6)]
    cfg = SimpleNamespace(chunk_conversations=2, turn_mode="all", output=str(tmp_path / "o.jsonl.gz"))
    started, stopped = [], []

    def chunks(todo, on_batch, may_start):
        try:
            for i, chunk in todo:
                assert may_start(i)
                started.append(i)
                on_batch(len(chunk), 10)
                if i == 0:
                    ctrl_c.note()
                yield i, [{"r": i}], new_chunk_stats() | {"records": 1, "turns": len(chunk)}
        finally:
            stopped.append(True)

    out = ShardedOutput(cfg.output, job={"model": "m"})
    try:
        with pytest.raises(KeyboardInterrupt):
            run_chunks(cfg=cfg, convs=convs, out=out, process_chunks=chunks, read_skips=SkipCounter(),
                       progress=False, t0=time.perf_counter(), stop_after=None)
    finally:
        ctrl_c.clear()
    assert sorted(out.committed) == [0] and started == [0] and stopped == [True]


def test_a_second_ctrl_c_while_the_message_is_built_exits_at_once():
    p = _start(60.0)  # describe() would take a minute
    _wait_for(p, "working")
    p.send_signal(signal.SIGINT)
    _wait_for(p, "describing")
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    p.communicate(timeout=30)
    assert p.returncode == 130 and time.monotonic() - t0 < 10


@pytest.mark.parametrize("stuck_in", ["join", "exit"])
def test_a_command_stuck_after_ctrl_c_exits_130_when_the_grace_ends(stuck_in):
    """The watchdog: stuck in the block's unwinding, it prints the message itself (saying why); stuck in the
    interpreter's exit after the command's own message, it only exits. Either way 130, the message once, last."""
    p = _start(stuck_in, STUCK)
    _wait_for(p, "working")
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    err = p.communicate(timeout=60)[1]   # what came after "working" (the rest of its line may stay unread)
    assert p.returncode == 130 and time.monotonic() - t0 < 30, err
    assert last_line(err) == "interrupted: 3 things kept; resume with: dflash thing --resume", err
    assert err.count("resume with") == 1 and "Traceback" not in err
    assert ("still stopping 2 s after Ctrl-C (a thread did not finish): exiting now" in err) == (stuck_in == "join")


def test_train_message_names_the_newest_checkpoint_and_the_lost_steps(tmp_path):
    from dflash.train import checkpoint as ckpt
    from dflash.train.interrupted import sweep_interrupted_text, train_interrupted_text

    run = tmp_path / "run"
    assert train_interrupted_text(run, reached=None, command="C") == \
        "interrupted: no checkpoint yet; a resume starts at step 0; resume with: C"
    ckpt.checkpoint_dir(run).mkdir(parents=True)
    for step in (5, 10):
        ckpt.checkpoint_path(run, step).write_bytes(b"")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (5, 10, 12)) + '{"ste')
    text = train_interrupted_text(run, reached=13, command="dflash train --resume")
    assert text == (f"interrupted at step 13: newest checkpoint: step 10 ({ckpt.checkpoint_path(run, 10)}); "
                    "steps 11-13 since it are lost (redone by the resume); resume with: dflash train --resume")
    assert "at step 12: " in train_interrupted_text(run, reached=None, command="C")  # the last whole record
    assert "at step 10: " in train_interrupted_text(run, reached=10, command="C")
    assert "nothing since it is lost" in train_interrupted_text(run, reached=10, command="C")
    sweep = tmp_path / "sweep"
    (sweep / "runs" / "b" / "drafter").mkdir(parents=True)
    (sweep / "runs" / "b" / "drafter" / "config.json").write_text("{}")
    os.symlink(run, sweep / "runs" / "a")
    lines = sweep_interrupted_text(sweep, command="dflash sweep S --resume").splitlines()
    assert lines[1].startswith("  a: at step 12: newest checkpoint: step 10") and "steps 11-12" in lines[1]
    assert lines[2] == "  b: finished (drafter exported)" and lines[-1] == "resume with: dflash sweep S --resume"


def _cut_by_ctrl_c_after(writes: int):
    """torch.save whose file's write number `writes` raises KeyboardInterrupt, as a Ctrl-C landing there does."""
    import torch
    real_save = torch.save

    class Cut:
        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, b):
            self.n += 1
            if self.n == writes:
                raise KeyboardInterrupt
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

    return lambda obj, f, **kw: real_save(obj, Cut(f), **kw)


def test_ctrl_c_inside_a_checkpoint_write_raises_the_interrupt_and_leaves_no_file(tmp_path, monkeypatch):
    """torch.save's zip writer, cut mid-write, raises RuntimeError("unexpected pos") from its __exit__; the save
    raises the KeyboardInterrupt behind it (a traceback and exit 1 otherwise), and no partial file is left."""
    import torch

    from dflash.train.checkpoint import atomic_torch_save

    state = {"model": torch.zeros(1000), "step": torch.ones(10)}
    monkeypatch.setattr(torch, "save", _cut_by_ctrl_c_after(3))
    with pytest.raises(BaseException) as raw:
        torch.save(state, open(tmp_path / "raw.pt", "wb"))
    assert type(raw.value) is RuntimeError and isinstance(raw.value.__context__, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        atomic_torch_save(state, tmp_path / "run" / "step-3.pt")
    assert list((tmp_path / "run").iterdir()) == []


def test_an_error_raised_while_an_interrupt_unwinds_exits_130_with_the_message(capsys):
    from cli.interrupt import exits_on_interrupt

    before = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit) as e:
            with exits_on_interrupt(lambda _e: "interrupted: kept; resume with: dflash thing --resume"):
                try:
                    raise KeyboardInterrupt
                except KeyboardInterrupt:
                    raise RuntimeError("unexpected pos 64 vs 0")
        assert e.value.code == 130
        assert last_line(capsys.readouterr().err) == "interrupted: kept; resume with: dflash thing --resume"
        with pytest.raises(RuntimeError, match="no interrupt behind it"):
            with exits_on_interrupt(lambda _e: "unused"):
                raise RuntimeError("no interrupt behind it")
    finally:
        signal.signal(signal.SIGINT, before)


def test_in_chain_walks_causes_and_contexts_once():
    from dflash.errors import in_chain, interrupt_in_chain

    ki = KeyboardInterrupt()
    mid = OSError(28, "No space left on device")
    mid.__context__ = ki
    top = RuntimeError("write failed")
    top.__cause__ = mid
    assert interrupt_in_chain(top) is ki and interrupt_in_chain(ki) is ki
    assert in_chain(top, lambda x: isinstance(x, OSError)) is mid
    ki.__context__ = top                     # a cycle ends the walk
    assert in_chain(top, lambda x: isinstance(x, ValueError)) is None
    assert interrupt_in_chain(ValueError()) is None


@pytest.fixture
def sigint_default():
    """SIGINT at Python's own handler for the test (an xdist worker may run with it ignored), restored after."""
    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def _bytecodes(n: int = 20_000) -> int:
    """Work in Python (the interpreter runs a pending signal's handler between bytecodes)."""
    total = 0
    for i in range(n):
        total += i
    return total


def test_ctrl_c_in_a_deferred_block_takes_effect_when_it_ends(sigint_default):
    from dflash.train.interrupted import interrupts_deferred

    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            _bytecodes()
            done.append("the rest of the block")
    assert done == ["the rest of the block"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with interrupts_deferred():   # no Ctrl-C: nothing raised
        _bytecodes()
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # an ignored SIGINT stays ignored
    with interrupts_deferred():
        os.kill(os.getpid(), signal.SIGINT)
        _bytecodes()


def test_a_reporter_is_never_cut_by_ctrl_c(tmp_path, sigint_default):
    """The metrics sink logs to the reporters (TensorBoard's writer queue: a put cut between its append and its
    writer thread's wake-up froze a Ctrl-C'd sweep for minutes) with Ctrl-C deferred to the end of the log."""
    from dflash.train.metrics import MetricSink

    class Reporter:
        logged: list = []

        def log(self, scalars, step):
            os.kill(os.getpid(), signal.SIGINT)
            _bytecodes()
            self.logged.append(step)

        def close(self):
            pass

    sink = MetricSink(tmp_path, enabled=True, total_steps=10, initial_step=0, progress=False, report_to=())
    sink._reporters = [Reporter(), Reporter()]
    with pytest.raises(KeyboardInterrupt):
        sink.write({"step": 3, "loss": 1.0})
    assert Reporter.logged == [3, 3]
    sink.close()


def test_in_chain_stops_where_raise_from_none_hid_the_context():
    """A dflash error raised `from None` while an interrupt unwinds (the extraction's lost lease wakes the main
    thread with one) is its own reason, not the interrupt."""
    from dflash.errors import DflashError, interrupt_in_chain

    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise DflashError("lost the extraction lease") from None
    except DflashError as e:
        assert isinstance(e.__context__, KeyboardInterrupt) and interrupt_in_chain(e) is None
