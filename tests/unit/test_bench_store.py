"""benchmarks/bench_store.py --split-cores: the server and the client each on whole physical cores of their own,
and the server pinned from its first thread on (a real `weed server`, ~3-8 s to start here)."""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_store  # noqa: E402
from store_server import SeaweedServer  # noqa: E402  (bench_store puts tests/ on the path)


def test_split_cores_keeps_hyperthreads_together_and_gives_the_server_the_larger_half():
    assert bench_store.split_cores({0, 1}, {}) == ({0}, {1})
    # 16 cpus, 8 cores of two hyperthreads each (cpu i and i + 8), as sysfs lists them
    ht = {i: f"{i % 8},{i % 8 + 8}" for i in range(16)}
    server, client = bench_store.split_cores(set(range(16)), ht)
    assert server == {0, 1, 2, 3, 8, 9, 10, 11} and client == {4, 5, 6, 7, 12, 13, 14, 15}
    # a sibling outside the allowed cpus (a container's cpuset) leaves its core with one cpu
    assert bench_store.split_cores({0, 1, 2, 9}, ht) == ({0, 9, 1}, {2})
    with pytest.raises(SystemExit, match="needs 2 physical cores"):
        bench_store.split_cores({0, 8}, ht)


def test_the_server_runs_on_its_cores_and_this_process_keeps_its_own(tmp_path):
    own = os.sched_getaffinity(0)
    core = min(own)
    server = SeaweedServer(tmp_path, cpus={core})
    server.start()
    try:
        assert bench_store.thread_cpus(server.proc.pid) == [str(core)]
        assert bench_store.cpu_seconds(server.proc.pid) > 0
        assert os.sched_getaffinity(0) == own
    finally:
        server.stop()
