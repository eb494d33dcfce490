"""Multi-process extraction and crash-resume, with real processes (gloo on CPU) and a real target:
2 processes write the same content as 1; a run SIGKILLed after some shards committed, rerun with another
process count, ends with exactly the content of an uninterrupted run (same ids, tokens, hidden bytes)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from click.testing import CliRunner

from cli.main import cli
from dflash.cache import CacheReader
from dflash.extract.driver import ExtractConfig
from dflash.extract.launch import launch
from helpers_extract import tiny_target_and_data

ROOT = Path(__file__).resolve().parents[2]
TAPS = "0,2,4"
NUM_GOOD = 24
COMMON = ["--taps", TAPS, "--max-length", "192", "--batch-tokens", "384", "--shard-tokens", "160"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("resume")
    # two lines that are not JSON among the conversations: the extractor skips them
    model, data = tiny_target_and_data(base, num=NUM_GOOD, seed=1, broken_after=(5, 18))
    ref = base / "ref"
    res = launch(_cfg(model, data, ref), num_procs=1, echo=lambda _m: None)
    assert res.num_samples == NUM_GOOD
    return model, str(data), ref


def _cfg(model, data, out):
    return ExtractConfig(model=model, data=(str(data),), output=str(out), taps=(0, 2, 4), max_length=192,
                         batch_tokens=384, shard_tokens=160, show_progress=False)


def _content(path) -> dict:
    """sample id -> (input_ids, loss_mask, hidden bits) bytes; reading checks every chunk's crc32c."""
    r = CacheReader(path)
    out = {}
    for i in range(len(r)):
        s = r.read(i)
        out[s.sample_id] = (s.input_ids.tobytes(), s.loss_mask.tobytes(), s.hidden.view(torch.uint16).numpy().tobytes())
    assert len(out) == len(r), "a sample was committed twice"
    return out


def _committed_lines(out: Path) -> int:
    logs = list((out / "commits").glob("rank-*.jsonl")) if (out / "commits").is_dir() else []
    return sum(len([ln for ln in p.read_text().splitlines() if ln.strip()]) for p in logs)


def _cli_args(model, data, out, procs):
    return [sys.executable, "-m", "cli.main", "extract", "--model", model, "--data", data, "--output", str(out),
            *COMMON, "--gpus", str(procs), "--no-progress"]


def _run_and_kill(model, data, out, procs, *, min_commits=2):
    """Start `dflash extract`, SIGKILL it (the launcher; its ranks die with it) once shards are committed."""
    p = subprocess.Popen(_cli_args(model, data, out, procs), cwd=ROOT, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while _committed_lines(out) < min_commits:
        assert p.poll() is None, f"run ended (rc={p.returncode}) before {min_commits} commits"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(p.pid, signal.SIGKILL)
    assert p.wait() == -signal.SIGKILL
    time.sleep(0.5)  # ranks receive their PDEATHSIG
    return _committed_lines(out)


def test_two_processes_write_the_same_content_as_one(setup, tmp_path):
    model, data, ref = setup
    out = tmp_path / "c2"
    res = launch(_cfg(model, data, out), num_procs=2, echo=lambda _m: None)
    assert res.num_samples == NUM_GOOD and res.skip_counts == {"bad_json": 2}
    assert sorted(p.name[:5] for p in (out / "shards").iterdir()).count("r0001") > 0  # both ranks wrote
    assert _content(out) == _content(ref)


@pytest.mark.parametrize("procs_first,procs_resume", [(1, 2), (2, 1)])
def test_killed_run_resumes_to_identical_content(setup, tmp_path, procs_first, procs_resume):
    model, data, ref = setup
    out = tmp_path / "c"
    _run_and_kill(model, data, out, procs_first)
    partial = _content(out)
    assert 0 < len(partial) < NUM_GOOD, "the kill must land mid-run"
    lines = []
    res = launch(_cfg(model, data, out), num_procs=procs_resume, echo=lines.append)
    assert res.num_committed_before == len(partial) and res.num_samples == NUM_GOOD - len(partial)
    assert f"{len(partial)} already in the cache" in "\n".join(lines)
    assert _content(out) == _content(ref)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["totals"]["samples"] == NUM_GOOD
    info = CliRunner().invoke(cli, ["cache", "info", str(out)])
    assert info.exit_code == 0 and str(NUM_GOOD) in info.output
