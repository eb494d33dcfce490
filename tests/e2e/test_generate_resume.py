"""kill -9 a real `dflash generate` process mid-run, rerun it, and compare with an uninterrupted run: the same
records in the same order, none lost or duplicated (SmolLM2-135M on CPU, whole conversations); then
`dflash extract` of the output holds exactly its ids and loss masks and is marked target-greedy."""

import gzip
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from cli.main import cli

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUESTIONS = ["Say hi.", "Name a color.", "What is 2+2?", "Name a fruit.", "Say yes.", "Count to three.",
             "Name a city.", "Say no."]


def _data(path):
    with open(path, "w") as f:
        for i, q in enumerate(QUESTIONS):
            f.write(json.dumps({"id": f"c{i}", "conversations": [
                {"from": "human", "value": q}, {"from": "gpt", "value": "old"},
                {"from": "human", "value": "And again?"}, {"from": "gpt", "value": "old"}]}) + "\n")


def _args(model, data, out):
    return ["generate", "--model", str(model), "--data", str(data), "--output", str(out), "--max-new-tokens", "5",
            "--batch-size", "2", "--chunk-conversations", "2", "--device", "cpu"]


def _cmd(model, data, out):
    return [sys.executable, "-m", "cli.main", *_args(model, data, out)]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "TQDM_DISABLE": "1"}


def _records(out):
    with gzip.open(out, "rt") as f:
        return [json.loads(x) for x in f]


def test_kill_9_then_resume_equals_uninterrupted(smollm2_dir, tmp_path, monkeypatch):
    data = tmp_path / "convs.jsonl"
    _data(data)
    ref_out = tmp_path / "ref.jsonl.gz"
    # the uninterrupted reference in this process (the same command through click: ~8 s of CPU less than a
    # process start with its torch + transformers imports); the killed run and its resume are real processes
    monkeypatch.setenv("TQDM_DISABLE", "1")
    res = CliRunner().invoke(cli, _args(smollm2_dir, data, ref_out), prog_name="dflash")
    assert res.exit_code == 0, res.output
    ref = _records(ref_out)
    assert [r["id"] for r in ref] == [f"c{i}" for i in range(len(QUESTIONS))]

    out = tmp_path / "cut.jsonl.gz"
    log = tmp_path / "cut.jsonl.gz.parts" / "commits.jsonl"
    proc = subprocess.Popen(_cmd(smollm2_dir, data, out), cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not (log.exists() and log.read_text().count("\n") >= 1):
            assert proc.poll() is None, "generate ended before its first commit"
            assert time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)  # mid-run: one chunk of four committed, the next one in flight
    finally:
        proc.wait()
    committed = log.read_text().count("\n")
    assert 1 <= committed < 4 and not out.exists()

    res = subprocess.run(_cmd(smollm2_dir, data, out), cwd=ROOT, env=_env(), capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"resuming: {committed} chunks" in res.stdout
    got = _records(out)
    assert [r["id"] for r in got] == [r["id"] for r in ref]  # order kept, nothing lost, nothing twice
    assert got == ref  # and the records themselves are the uninterrupted run's
    assert out.read_bytes() == ref_out.read_bytes()

    # dflash extract reads the merged output: whole conversations, exact ids, marked target-greedy (fp32 both)
    from dflash.cache import CacheReader

    cache = tmp_path / "cache"
    res = CliRunner().invoke(cli, ["extract", "--model", str(smollm2_dir), "--data", str(out), "--output", str(cache),
                                   "--dtype", "float32", "--max-length", "1024", "--no-progress"], prog_name="dflash")
    assert res.exit_code == 0, res.output
    with CacheReader(cache) as reader:
        assert reader.manifest["fingerprint"]["target_greedy"] is True
        assert len(reader) == len(ref)
        packed = reader.read_many(list(range(len(reader))), taps=())
        assert packed.input_ids.tolist() == [t for r in ref for t in r["input_ids"]]
        assert packed.loss_mask.tolist() == [m for r in ref for m in r["loss_mask"]]
