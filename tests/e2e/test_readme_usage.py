"""The README's Usage commands as pasted (issue 19): each ```bash block of README.md's "## Usage" section runs
with bash, in order, in a temporary working folder prepared the way the README assumes: `bash scripts/demo.sh`
was run there (the real `dflash demo`, small: demo_out/conversations.jsonl and demo_out/train_run/drafter), and
configs/ is the repository's. MODEL comes from the README's own line, with DFLASH_HOME set so that it resolves to
the converted SmolLM2 of the smollm2_dir fixture; `. .venv/bin/activate` is replaced by this interpreter's bin
folder on PATH.

Not run: the `dflash sweep` block (configs/sweep_example.yaml is 6 runs of 200-400 steps, about an hour of CPU);
the test asserts the block is there and says so on stdout. Nothing else is left out: a block that fails, a
missing expected output, or a README layout this parser does not know fails the test with the block's text.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ACTIVATE = ". .venv/bin/activate"
BLOCK_TIMEOUT_S = 300


def usage_blocks(readme: str) -> list[str]:
    """The ```bash blocks of the "## Usage" section, in order."""
    m = re.search(r"^## Usage\n(.*?)(?=^## )", readme, flags=re.M | re.S)
    assert m, "README.md has no '## Usage' section followed by another '## ' section"
    return re.findall(r"^```bash\n(.*?)^```", m.group(1), flags=re.M | re.S)


def run_block(block: str, *, cwd: Path, env: dict, preamble: str) -> subprocess.CompletedProcess:
    # -e: a failing first command fails the block, as a user would stop there; the preamble is the README's
    # first block (MODEL, MTBENCH), which a user's shell keeps for the later blocks.
    script = "set -eo pipefail\n" + preamble + "\n" + block
    res = subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=BLOCK_TIMEOUT_S)
    assert res.returncode == 0, (f"README Usage block failed (rc {res.returncode}):\n{block}\n--- stdout\n"
                                 f"{res.stdout[-3000:]}\n--- stderr\n{res.stderr[-3000:]}")
    return res


def children_cpu_seconds() -> float:
    """CPU seconds of the finished child processes (a block's commands), which a loaded machine's wall time hides."""
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return kids.ru_utime + kids.ru_stime


PLAN_PREFIXES = ("samples:", "tokens:", "bytes on disk:", "ranks:", "taps:")
"""extract's plan lines (what it will extract, with padding, bytes, ranks, taps): the same for the dry run and
the real run with the same options. The ETA is left out: it is measured, so it differs between runs."""


def plan_lines(text: str) -> dict[str, list[str]]:
    return {p: [line for line in text.splitlines() if line.startswith(p)] for p in PLAN_PREFIXES}


def test_readme_usage_blocks_as_pasted(tmp_path, smollm2_dir, monkeypatch):
    home = Path(smollm2_dir).parent
    assert Path(smollm2_dir).name == "smollm2-135m-instruct", smollm2_dir
    blocks = usage_blocks((ROOT / "README.md").read_text())
    assert len(blocks) >= 8, f"README Usage has {len(blocks)} bash blocks; the parser expects the documented set"

    setup = blocks[0]
    assert setup.splitlines()[0].strip() == ACTIVATE, f"first Usage block does not start with {ACTIVATE!r}"
    assert "MODEL=${DFLASH_HOME:-$HOME/.cache/dflash}/smollm2-135m-instruct" in setup
    preamble = setup.replace(ACTIVATE, "", 1)

    monkeypatch.setenv("DFLASH_HOME", str(home))
    monkeypatch.setenv("DFLASH_NO_PROGRESS", "1")
    env = dict(os.environ, DFLASH_HOME=str(home), DFLASH_NO_PROGRESS="1", OMP_NUM_THREADS="1",
               PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"])
    env.pop("PYTHONPATH", None)
    work = tmp_path / "work"
    work.mkdir()
    (work / "configs").symlink_to(ROOT / "configs")

    # What the README assumes was run first (bash scripts/demo.sh = `dflash demo`): the same library call,
    # with tiny settings (as tests/e2e/test_demo.py) so that the README's own commands get the time budget.
    from dflash.demo import cpu_defaults, run_demo

    t0 = time.perf_counter()
    # (the Usage blocks read 8 conversations, a drafter and an eval cache from it: max_length 128, 2 steps and
    # one 8-token MT-Bench response are enough for those, and cost half of 256 / 3 / 2 x 12)
    run_demo(cpu_defaults(output=str(work / "demo_out"), conversations=8, max_length=128, steps=2, num_anchors=8,
                          block_size=4, batch_tokens=1024, eval_prompts=1, max_new_tokens=8), echo=lambda _: None)
    print(f"demo_out prepared in {time.perf_counter() - t0:.0f} s")
    assert (work / "demo_out" / "train_run" / "drafter" / "config.json").is_file()
    assert len((work / "demo_out" / "conversations.jsonl").read_text().splitlines()) >= 8

    later = blocks[1:]
    sweeps = [b for b in later if b.lstrip().startswith("dflash sweep")]
    assert len(sweeps) == 1, "expected one `dflash sweep` block in Usage"
    print("not run: the README's `dflash sweep` block (about an hour on a 2-core CPU):\n" + sweeps[0])
    later = [b for b in later if b is not sweeps[0]]

    # The held-out block uses runs/eval_cache, which the Generate block after it makes (the README says
    # "`runs/eval_cache` is made in the Generate step below"): pasted in order it fails, so it runs right
    # after the block that makes it, and the test says so. Any other use before the making fails below.
    makes = next(i for i, b in enumerate(later) if "--output runs/eval_cache" in b)
    early = [b for b in later[:makes] if "runs/eval_cache" in b]
    if early:
        assert "`runs/eval_cache` is made in the Generate step below" in (ROOT / "README.md").read_text(), \
            "a Usage block uses runs/eval_cache before the block that makes it:\n" + early[0]
        print("README order: run after the Generate block (it needs runs/eval_cache):\n" + early[0])
        later = [b for b in later[:makes] if b not in early] + [later[makes]] + early + later[makes + 1:]

    out: dict[str, str] = {}
    stdout: dict[str, str] = {}
    for block in later:
        t0, cpu0 = time.perf_counter(), children_cpu_seconds()
        res = run_block(block, cwd=work, env=env, preamble=preamble)
        print(f"{time.perf_counter() - t0:6.1f} s {children_cpu_seconds() - cpu0:6.1f} s cpu  "
              f"{block.splitlines()[-1][:100]}")
        out[block], stdout[block] = res.stdout + res.stderr, res.stdout

    def output_of(marker: str) -> str:
        hits = [text for b, text in out.items() if marker in b]
        assert len(hits) == 1, f"{len(hits)} Usage blocks contain {marker!r}"
        return hits[0]

    def block_with(marker: str) -> str:
        hits = [b for b in out if marker in b]
        assert len(hits) == 1, f"{len(hits)} Usage blocks contain {marker!r}"
        return hits[0]

    # extract: the dry run plans exactly the real run's job
    plans = plan_lines(output_of("--dry-run"))
    for prefix, (dry, real) in ((p, v) for p, v in plans.items() if len(v) == 2):
        assert dry == real, f"the dry run plans {dry!r}, the real run {real!r}"
    assert all(len(v) == 2 for v in plans.values()), f"expected each plan line twice (dry, real): {plans}"
    assert (work / "runs" / "cache" / "manifest.json").is_file()

    info = output_of("dflash cache info")
    assert re.search(r"^target_greedy +no$", info, flags=re.M) and re.search(r"^ok: 1 shards", info, flags=re.M)
    assert (work / "runs" / "train" / "drafter" / "config.json").is_file()
    recs = [json.loads(x) for x in (work / "runs" / "train" / "metrics.jsonl").read_text().splitlines()]
    train_steps = int(re.search(r"--output runs/train .*?--steps (\d+)", block_with("--output runs/train "),
                                re.S).group(1))
    assert recs[-1]["step"] == train_steps  # the README's own --steps: the run finished
    held = [json.loads(x) for x in (work / "runs" / "train_eval" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("heldout_tau") is not None for r in held)
    assert (work / "runs" / "train_eval" / "drafter" / "README.md").is_file()
    assert (work / "runs" / "drafter-export" / "config.json").is_file()
    limit = int(re.search(r"--output runs/mtbench.jsonl --limit (\d+)", block_with("--output runs/mtbench.jsonl")).group(1))
    assert len((work / "runs" / "mtbench.jsonl").read_text().splitlines()) == limit
    assert (work / "runs" / "regen.jsonl.gz").exists() or any((work / "runs").glob("regen.jsonl.gz*"))
    ev = next(stdout[b] for b in stdout if "--json" in b)
    result = json.loads(ev[ev.index('{\n  "tau"'):])  # the --json eval prints last in its block
    assert result["tau"] >= 1.0
    assert "tau" in output_of("dflash eval --drafter runs/train/drafter")
