"""benchmarks/bench_step_tail.py end to end on CPU at a tiny width: both forms run on the same buffers and
optimizer, and the JSON holds what the README and the issue quote."""

from __future__ import annotations

import json
import pathlib
import sys

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_step_tail  # noqa: E402


def test_step_tail_tiny_run_writes_its_json(tmp_path):
    out = bench_step_tail.main(["--tiny", "--reps", "2", "--json", str(tmp_path / "t.json")])
    got = json.loads((tmp_path / "t.json").read_text())
    assert got["num_params"] == out["num_params"] > 0 and got["tiny"] and got["layers"] == 1
    assert len(got["seconds_all_reps"]["before"]) == len(got["seconds_all_reps"]["after"]) == 2
    assert got["ms_before"] > 0 and got["ms_after"] > 0 and got["fused"]  # build_optimizer: fused on CPU too
