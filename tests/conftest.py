import fcntl
import json
import os
import resource
import shutil
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

# Two cores on CI: keep torch from oversubscribing when tests spawn worker processes.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

try:  # the GPU machine runs the gpu files without the test extra
    from hypothesis import settings
except ImportError:
    settings = None
if settings is not None:
    # HYPOTHESIS_PROFILE=ci (.ci/run): the same examples on every run, so a landing is never refused by a case
    # a property test happened to draw that day; a plain run draws new ones (how the tail-batch bug of
    # token_budget_batches was found) and prints the failing example to pin with @example.
    settings.register_profile("ci", derandomize=True)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# Seconds per test file and the xdist worker that ran it (under --dist loadfile the longest file and the
# order of the files bound the wall time, which --durations per test does not show), and the CPU seconds the
# file cost (its process and the children it waited for): on a 2-core machine busy with 2 workers, CPU time,
# not a file's wall time, is what the suite's total is made of, and it moves far less with the machine's load
# (~10% between runs at load 5-9 here, against 2-4x for wall time).
FILE_SECONDS: dict[str, float] = defaultdict(float)
FILE_CPU: dict[str, float] = defaultdict(float)
FILE_WORKER: dict[str, str] = {}
SLOWEST_FILES = 15
CPU_KEY = "cpu_s"
CPU_START = pytest.StashKey[float]()


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its waited-for children so far."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item.stash[CPU_START] = cpu_seconds()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    # each phase's report carries the CPU spent since the previous report (xdist sends user_properties to the
    # controller); a new list, because the report's default is the item's own list, shared by every phase
    report = yield
    now = cpu_seconds()
    report.user_properties = [*report.user_properties, (CPU_KEY, now - item.stash[CPU_START])]
    item.stash[CPU_START] = now
    return report


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    FILE_SECONDS[path] += report.duration
    FILE_CPU[path] += sum(v for k, v in report.user_properties if k == CPU_KEY)
    node = getattr(report, "node", None)  # set by xdist in the controller
    if node is not None:
        FILE_WORKER[path] = node.gateway.id


def pytest_terminal_summary(terminalreporter):
    if not FILE_SECONDS or terminalreporter.config.option.durations is None:
        return
    tw = terminalreporter
    tw.write_sep("=", f"slowest {SLOWEST_FILES} test files (setup + call + teardown; wall and CPU seconds)")
    for path, sec in sorted(FILE_SECONDS.items(), key=lambda kv: -kv[1])[:SLOWEST_FILES]:
        tw.write_line(f"{sec:8.1f}s  {FILE_CPU[path]:8.1f}s cpu  {FILE_WORKER.get(path, '-'):4}  {path}")
    by_worker: dict[str, float] = defaultdict(float)
    for path, sec in FILE_SECONDS.items():
        by_worker[FILE_WORKER.get(path, "-")] += sec
    tw.write_line("per worker: " + ", ".join(f"{w} {s:.0f}s" for w, s in sorted(by_worker.items()))
                  + f"; CPU of all files {sum(FILE_CPU.values()):.0f}s")


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real SmolLM2-135M as an HF folder, converted once per machine ($DFLASH_HOME or ~/.cache/dflash).

    Under a flock beside it: on a fresh CI machine both xdist workers reach this fixture within seconds and
    would each convert (~18 s of CPU, the loser's work thrown away); the second waits and reuses the first's."""
    from dflash.target.assets import dflash_home, smollm2_hf_dir

    home = dflash_home()
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".smollm2-convert.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # dropped when the file closes
        return smollm2_hf_dir()


def run_shared_dir(tmp_path_factory, name: str):
    """A folder under this test run's temp root that every xdist worker of the run sees (the workers' own temp
    folders are its children), so that one worker makes an artefact and the others reuse it."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name


@dataclass(frozen=True, kw_only=True)
class GreedyEval:
    """SmolLM2's greedy responses and their target-greedy eval cache (the smollm2_greedy_eval fixture)."""

    root: Path
    """Folder holding mt.jsonl and he.jsonl (`dflash generate` output) and cache/ (read it, never write it)."""
    model: str
    """The SmolLM2 folder that generated and extracted them (smollm2_dir)."""
    records: list[dict]
    """The generated records, MT-Bench first, in file order."""
    sources: tuple[tuple[str, int], ...]
    """(source file name, number of prompts) in extraction order: ("mt.jsonl", 3), ("he.jsonl", 2)."""
    max_new_tokens: int
    """`dflash generate --max-new-tokens` of the responses."""


GREEDY_EVAL_PROMPTS = (("mt.jsonl", "mtbench_questions_path", 3), ("he.jsonl", "humaneval_path", 2))
GREEDY_EVAL_MAX_NEW = 24


@pytest.fixture(scope="session")
def smollm2_greedy_eval(tmp_path_factory, smollm2_dir) -> GreedyEval:
    """`dflash generate` (fp32, greedy) of 3 MT-Bench + 2 HumanEval prompts on the real SmolLM2, then `dflash
    extract` of them (fp32, default taps; marked target_greedy): once per test run for every file that needs a
    real target-greedy eval cache (each made its own: ~40 s of CPU apiece), under a flock across xdist workers."""
    from click.testing import CliRunner

    import dflash.data.assets as assets
    from cli.main import cli

    def invoke(args):
        res = CliRunner().invoke(cli, args, prog_name="dflash")
        assert res.exit_code == 0, res.output

    root = run_shared_dir(tmp_path_factory, "smollm2_greedy_eval")
    root.mkdir(parents=True, exist_ok=True)
    model = str(smollm2_dir)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "done").is_file():
            for left in [p for p in root.iterdir() if p.name != ".lock"]:  # an earlier worker's failed attempt
                shutil.rmtree(left) if left.is_dir() else left.unlink()
            for name, path_fn, n in GREEDY_EVAL_PROMPTS:
                invoke(["generate", "--model", model, "--prompts", str(getattr(assets, path_fn)()), "--output",
                        str(root / name), "--limit", str(n), "--max-new-tokens", str(GREEDY_EVAL_MAX_NEW),
                        "--batch-size", str(n), "--device", "cpu", "--dtype", "float32"])
            invoke(["extract", "--model", model, *[a for name, _, _ in GREEDY_EVAL_PROMPTS
                                                    for a in ("--data", str(root / name))],
                    "--output", str(root / "cache"), "--dtype", "float32", "--max-length", "1024"])
            (root / "done").write_text("")
    records = [json.loads(x) for name, _, _ in GREEDY_EVAL_PROMPTS for x in (root / name).read_text().splitlines()]
    return GreedyEval(root=root, model=model, records=records,
                      sources=tuple((name, n) for name, _, n in GREEDY_EVAL_PROMPTS),
                      max_new_tokens=GREEDY_EVAL_MAX_NEW)


@pytest.fixture(scope="session")
def smollm2_trained_drafter(tmp_path_factory, smollm2_greedy_eval) -> Path:
    """The demo's drafter shape (1 layer, block 4) trained by `dflash train` on smollm2_greedy_eval's own
    responses and exported (tests/e2e/helpers_drafters.py; ~80 CPU-s, tau ~3.5 on that cache): made once per
    test run for every file that needs a drafter with long accept chains, under a flock across xdist workers.
    Read it, never write it: a test that writes into a drafter folder (a card, a serve-check record) copies it."""
    from tests.e2e.helpers_drafters import dflash_trained_drafter

    root = run_shared_dir(tmp_path_factory, "smollm2_trained_drafter")
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "done").is_file():
            shutil.rmtree(root / "run", ignore_errors=True)  # an earlier worker's failed attempt
            dflash_trained_drafter(smollm2_greedy_eval.root / "cache", smollm2_greedy_eval.model, root / "run")
            (root / "done").write_text("")
    return root / "run" / "drafter"
