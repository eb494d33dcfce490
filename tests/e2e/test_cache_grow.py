"""A cache that grows: `dflash extract --output EXISTING --data NEW` adds the conversations it does not hold
as new shards, and the grown cache equals, sample for sample (ids, tokens, masks, hidden bits), one extraction
of the union; `dflash cache info` lists the sources with their counts (CPU, real tiny target, real processes
of the one launcher)."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli.main import cli
from dflash.cache.reader import sample_contents
from helpers_extract import tiny_target_and_data, write_conversations

COMMON = ["--max-length", "192", "--batch-tokens", "384", "--shard-tokens", "160", "--no-progress"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    base = tmp_path_factory.mktemp("grow")
    model, a = tiny_target_and_data(base, num=10, seed=1)
    b = write_conversations(base / "b_only.jsonl", num=8, seed=2)
    # the new file repeats three conversations the cache already holds (they must not be stored twice)
    b_new = base / "b.jsonl"
    b_new.write_text("".join(Path(a).read_text().splitlines(keepends=True)[:3]) + b.read_text())
    return model, a, str(b_new), base


def _extract(*args):
    r = CliRunner().invoke(cli, ["extract", *args])
    assert r.exit_code == 0, r.output
    return r.output


def test_grown_cache_equals_the_union_extracted_in_one_run(data, tmp_path):
    model, a, b, _ = data
    union = tmp_path / "union"
    _extract("--model", model, "--data", a, "--data", b, "--output", str(union), "--taps", "0,2", *COMMON)
    grown = tmp_path / "grown"
    _extract("--model", model, "--data", a, "--output", str(grown), "--taps", "0,2", *COMMON)
    old_shards = sorted(p.name for p in (grown / "shards").iterdir())
    before = sample_contents(grown)
    assert len(before) == 10
    # the grow names only the new data and none of the cache's settings: they come from the cache
    out = _extract("--model", model, "--data", b, "--output", str(grown), "--no-progress")
    assert "10 already in the cache" in out and "duplicate" in out, out
    assert set(old_shards) < {p.name for p in (grown / "shards").iterdir()}  # new shards beside the old ones
    got, want = sample_contents(grown), sample_contents(union)
    assert len(want) == 18 and got == want
    assert {k: got[k] for k in before} == before
    info = json.loads(CliRunner().invoke(cli, ["cache", "info", "--json", str(grown)]).output)
    assert [(Path(s["path"]).name, s["samples"]) for s in info["source_counts"]] == [("data.jsonl", 10),
                                                                                      ("b.jsonl", 8)]
    table = CliRunner().invoke(cli, ["cache", "info", str(grown)]).output
    assert "b.jsonl: 8 samples" in table
    v = CliRunner().invoke(cli, ["cache", "verify", str(grown)])
    assert v.exit_code == 0, v.output
    # the same command again: nothing to add
    again = _extract("--model", model, "--data", b, "--output", str(grown), "--no-progress")
    assert "nothing to extract" in again, again


def test_grow_refuses_other_settings_and_a_lost_source(data, tmp_path):
    model, a, b, base = data
    cache = tmp_path / "c"
    moved = tmp_path / "a.jsonl"
    moved.write_text(Path(a).read_text())
    _extract("--model", model, "--data", str(moved), "--output", str(cache), "--taps", "0,2", *COMMON)
    r = CliRunner().invoke(cli, ["extract", "--model", model, "--data", b, "--output", str(cache), "--taps", "0,1",
                                 "--no-progress"])
    assert r.exit_code == 1 and "tap_layer_ids" in r.output and len(r.output.strip().splitlines()) == 1, r.output
    moved.unlink()
    r = CliRunner().invoke(cli, ["extract", "--model", model, "--data", b, "--output", str(cache), "--no-progress"])
    assert r.exit_code == 1 and "source" in r.output and "missing" in r.output, r.output


def _commit_lines(out: Path) -> int:
    return sum(len([ln for ln in p.read_text().splitlines() if ln.strip()]) for p in (out / "commits").glob("*.jsonl"))


def test_a_grow_killed_mid_run_resumes_to_the_union(data, tmp_path):
    """SIGKILL a growing extraction once it has committed new shards; the same command again completes it, and
    the cache equals the one-run extraction of both sources (the writer's guarantees hold for a grow)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    model, a, _, base = data
    big = write_conversations(tmp_path / "big.jsonl", num=40, seed=5)
    union = tmp_path / "union"
    _extract("--model", model, "--data", a, "--data", str(big), "--output", str(union), "--taps", "0,2", *COMMON)
    grown = tmp_path / "grown"
    _extract("--model", model, "--data", a, "--output", str(grown), "--taps", "0,2", *COMMON)
    before = _commit_lines(grown)
    root = Path(__file__).resolve().parents[2]
    p = subprocess.Popen([sys.executable, "-m", "cli.main", "extract", "--model", model, "--data", str(big),
                          "--output", str(grown), *COMMON], cwd=root, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while _commit_lines(grown) < before + 2:
        assert p.poll() is None, f"the grow ended (rc={p.returncode}) before it was killed"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(p.pid, signal.SIGKILL)
    assert p.wait() == -signal.SIGKILL
    time.sleep(0.5)
    partial = sample_contents(grown)
    assert 10 < len(partial) < 50
    out = _extract("--model", model, "--data", str(big), "--output", str(grown), *COMMON)
    assert f"{len(partial)} already in the cache" in out, out
    assert sample_contents(grown) == sample_contents(union)
