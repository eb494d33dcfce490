import os
from collections import defaultdict

# Two cores on CI: keep torch from oversubscribing when tests spawn worker processes.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

# Seconds per test file and the xdist worker that ran it (under --dist loadfile the longest file and the
# order of the files bound the wall time, which --durations per test does not show).
FILE_SECONDS: dict[str, float] = defaultdict(float)
FILE_WORKER: dict[str, str] = {}
SLOWEST_FILES = 15


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    FILE_SECONDS[path] += report.duration
    node = getattr(report, "node", None)  # set by xdist in the controller
    if node is not None:
        FILE_WORKER[path] = node.gateway.id


def pytest_terminal_summary(terminalreporter):
    if not FILE_SECONDS or terminalreporter.config.option.durations is None:
        return
    tw = terminalreporter
    tw.write_sep("=", f"slowest {SLOWEST_FILES} test files (setup + call + teardown)")
    for path, sec in sorted(FILE_SECONDS.items(), key=lambda kv: -kv[1])[:SLOWEST_FILES]:
        tw.write_line(f"{sec:8.1f}s  {FILE_WORKER.get(path, '-'):4}  {path}")
    by_worker: dict[str, float] = defaultdict(float)
    for path, sec in FILE_SECONDS.items():
        by_worker[FILE_WORKER.get(path, "-")] += sec
    tw.write_line("per worker: " + ", ".join(f"{w} {s:.0f}s" for w, s in sorted(by_worker.items())))


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real SmolLM2-135M as an HF folder, converted once per machine ($DFLASH_HOME or ~/.cache/dflash)."""
    from dflash.target.assets import smollm2_hf_dir

    return smollm2_hf_dir()
