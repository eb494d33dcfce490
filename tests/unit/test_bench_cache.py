"""benchmarks/bench_cache.py at a tiny size: every layout written and read back (cold where the machine allows),
the interleaved rewrite before the reads, the repeated reads and the thread sweep, the result keys."""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def test_tiny_run_writes_the_result_keys(tmp_path):
    import bench_cache

    res = bench_cache.main(["--tokens", "3000", "--hidden", "64", "--threads", "2", "--reps", "2",
                            "--cache-threads", "1", "--out", str(tmp_path / "scratch"), "--result-name", "tiny",
                            "--results-dir", str(tmp_path)])
    saved = json.loads((tmp_path / "cache_tiny.json").read_text())
    assert saved["read_ratio_vs_raw_threaded"] == res["read_ratio_vs_raw_threaded"] > 0
    assert {"read_raw", "read_raw_threaded", "read_cache", "read_per_sample", "read_cache_threads_1"} == \
        set(saved["read_seconds_per_rep"])
    assert all(len(v) == 2 for v in saved["read_seconds_per_rep"].values())
    assert saved["config"]["read_files_rewritten_interleaved"] is True
    assert 0.39 < saved["read_subset_bytes_ratio"] <= 0.41
    assert not (tmp_path / "scratch").exists()
