"""benchmarks/gpu_check.py, the GPU machine's check stage across device calls: which group a call starts, what
it reports, and real groups (processes) passing, failing and cut at the time limit, continued by a later call."""

import pathlib
import re
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import gpu_check as gc  # noqa: E402
from gpu_check import Outcome  # noqa: E402

ORDER = ["a", "b", "c"]


def test_next_group_runs_pending_groups_in_order_and_waits_for_time():
    assert gc.next_group(ORDER, {}, left=500) == ("a", "")
    passed, failed = Outcome(0, 10), Outcome(1, 10)
    assert gc.next_group(ORDER, {"a": passed, "b": failed}, left=500) == ("c", "")   # a failure is not rerun
    assert gc.next_group(ORDER, {"a": passed, "b": passed, "c": passed}, left=500) == (None, "")
    name, why = gc.next_group(ORDER, {"a": passed}, left=gc.MIN_START_S - 1)
    assert name is None and "call again for b" in why
    cut = Outcome(gc.CUT, 200)
    assert gc.next_group(ORDER, {"a": cut}, left=201) == ("a", "")
    name, why = gc.next_group(ORDER, {"a": cut}, left=200)   # no more time than it was cut at: the next call
    assert name is None and "cut at 200 s" in why
    unfit = Outcome(gc.CUT, gc.WHOLE_CALL_S)   # cut after a whole call: never started again
    assert gc.next_group(ORDER, {"a": unfit}, left=600) == ("b", "")


def test_a_waiting_group_is_passed_over_and_stays_pending():
    waiting = {"b": "no SmolLM2 GGUF"}
    assert gc.next_group(ORDER, {"a": Outcome(0, 1)}, left=500, waiting=waiting) == ("c", "")
    done = {"a": Outcome(0, 1), "c": Outcome(0, 1)}
    assert gc.next_group(ORDER, done, left=500, waiting=waiting) == (None, "")
    rc, line = gc.verdict(ORDER, done, waiting=waiting)
    assert rc == 3 and "pending: b" in line and "b waits: no SmolLM2 GGUF" in line
    assert gc.verdict(ORDER, done | {"b": Outcome(0, 1)}, waiting=waiting)[0] == 0


def test_generate_waits_for_the_smollm2_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_SMOLLM2_GGUF", str(tmp_path / "missing.gguf"))
    assert "carry the GGUF parts" in gc.NEEDS["generate"]()
    (tmp_path / "missing.gguf").write_bytes(b"GGUF")
    assert gc.NEEDS["generate"]() is None


def test_verdict():
    ok, cut = Outcome(0, 1), Outcome(gc.CUT, 100)
    assert gc.verdict(ORDER, {n: ok for n in ORDER}) == (0, "every group passed")
    rc, line = gc.verdict(ORDER, {"a": ok, "b": cut})
    assert rc == 3 and line.startswith("pending: b, c")
    rc, line = gc.verdict(ORDER, {"a": Outcome(1, 5), "b": Outcome(gc.CUT, gc.WHOLE_CALL_S + 1), "c": cut})
    assert rc == 1 and "failed: a" in line and "b; split it" in line


def test_groups_across_calls(tmp_path, monkeypatch, capsys):
    py = sys.executable
    monkeypatch.setattr(gc, "GROUPS", {"ok": [py, "-c", "print('3 passed')"],
                                       "bad": [py, "-c", "import sys; print('1 failed'); sys.exit(1)"],
                                       "slow": [py, "-c", "import time; time.sleep(60)"]})
    monkeypatch.setattr(gc, "MIN_START_S", 0.5)
    monkeypatch.setattr(gc, "NEEDS", {})
    args = ["--state", str(tmp_path / "state.json"), "--out", str(tmp_path / "out")]
    assert gc.main(["--budget", "4", *args]) == 1     # bad failed; slow cut at the budget's end
    table = (tmp_path / "out" / "gpu_check.txt").read_text()
    assert "3 passed" in table and "failed (exit 1)" in table and "cut" in table
    assert (tmp_path / "out" / "gpu_check_bad.log").read_text().strip() == "1 failed"
    state = gc.load(tmp_path / "state.json")
    assert state["slow"].cut and 3 < state["slow"].seconds < 10 and state["ok"].rc == 0
    capsys.readouterr()
    # a later call with less time than slow was cut at starts nothing; `ok` and `bad` are not run again
    assert gc.main(["--budget", "2", *args]) == 1
    assert "slow was cut at" in capsys.readouterr().out
    assert gc.main(["--budget", "4", "--only", "ok,slow", *args]) == 3   # ok passed; slow pending
    # cut after a whole call's time: reported, never started again
    monkeypatch.setattr(gc, "WHOLE_CALL_S", 3.0)
    assert gc.main(["--budget", "4", "--only", "ok,slow", *args]) == 1
    assert "slow; split it" in (tmp_path / "out" / "gpu_check.txt").read_text()
    # --fresh forgets a group's record
    monkeypatch.setattr(gc, "GROUPS", gc.GROUPS | {"slow": [py, "-c", "print('2 passed')"]})
    assert gc.main(["--budget", "4", "--only", "ok,slow", "--fresh", *args]) == 0


def test_unknown_group_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        gc.main(["--only", "nope", "--state", str(tmp_path / "s.json"), "--out", str(tmp_path)])
    assert e.value.code == 2 and "unknown group(s) nope" in capsys.readouterr().err


def test_every_group_file_exists():
    root = pathlib.Path(__file__).resolve().parents[2]
    files = [a for argv in gc.GROUPS.values() for a in argv if a.endswith(".py")]
    assert files and all((root / f).is_file() for f in files)
    marked = re.compile(r"^(@pytest\.mark\.gpu|pytestmark = .*mark\.gpu)", re.MULTILINE)
    gpu_files = {str(p.relative_to(root)) for p in (root / "tests").rglob("test_*.py")
                 if p.parent.name == "gpu" or marked.search(p.read_text())}
    assert gpu_files - set(files) == set()   # every file with a gpu test is in a group
