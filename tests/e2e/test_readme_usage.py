"""The README's code blocks as pasted: every ```bash block of README.md runs with bash, in order, in a temporary
working folder prepared the way the README assumes: `bash scripts/demo.sh` was run there (the real `dflash demo`,
small: demo_out/conversations.jsonl, demo_out/train_run/drafter, demo_out/eval_cache), and configs/ is the
repository's. The first Usage block (`. .venv/bin/activate`, MODEL, MTBENCH) is the shell every later block runs
in: `. .venv/bin/activate` is replaced by this interpreter's bin folder on PATH, and MODEL resolves to the
converted SmolLM2 of the smollm2_dir fixture through a fresh $DFLASH_HOME. A block that names an `s3://` URL runs
against a real S3 server on localhost (SeaweedFS, tests/store_server.py), its bucket created first and its
credentials in the standard AWS_* variables, as a user's would be.

Not run: the two set-up commands (`bash scripts/demo.sh`, `bash scripts/test.sh`: CI runs what they run) and any
block whose first line is `# on a GPU machine`. A block that fails, an expected output that is missing, or a
README block this test does not know fails with the block's text.
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
SETUP_COMMANDS = ("bash scripts/demo.sh", "bash scripts/test.sh")
GPU_ONLY = "# on a GPU machine"
BLOCK_TIMEOUT_S = 300


def bash_blocks(readme: str) -> list[str]:
    """Every ```bash block of the README, in order."""
    return re.findall(r"^```bash\n(.*?)^```", readme, flags=re.M | re.S)


def run_block(block: str, *, cwd: Path, env: dict, preamble: str) -> subprocess.CompletedProcess:
    # -e: a failing first command fails the block, as a user would stop there; the preamble is the README's
    # first Usage block (MODEL, MTBENCH), which a user's shell keeps for the later blocks.
    script = "set -eo pipefail\n" + preamble + "\n" + block
    res = subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=BLOCK_TIMEOUT_S)
    assert res.returncode == 0, (f"README block failed (rc {res.returncode}):\n{block}\n--- stdout\n"
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


def test_readme_bash_blocks_as_pasted(tmp_path, smollm2_dir, monkeypatch, request):
    assert Path(smollm2_dir).name == "smollm2-135m-instruct", smollm2_dir
    blocks = bash_blocks((ROOT / "README.md").read_text())

    setup = [b for b in blocks if b.strip() in SETUP_COMMANDS]
    assert sorted(b.strip() for b in setup) == sorted(SETUP_COMMANDS), "the README's two set-up commands moved"
    gpu = [b for b in blocks if b.startswith(GPU_ONLY)]
    for b in gpu:
        print("not run (GPU only):\n" + b)
    blocks = [b for b in blocks if b not in setup and b not in gpu]
    first = blocks.pop(0)
    assert first.splitlines()[0].strip() == ACTIVATE, f"the first Usage block does not start with {ACTIVATE!r}"
    assert "MODEL=${DFLASH_HOME:-$HOME/.cache/dflash}/smollm2-135m-instruct" in first
    preamble = first.replace(ACTIVATE, "", 1)
    assert len(blocks) >= 8, f"README has {len(blocks)} runnable bash blocks; the checks below expect the jobs' set"

    # A fresh DFLASH_HOME (store staging folders of a URL are named by its hash: a shared home would keep the last
    # run's), holding the converted model of the session fixture.
    home = tmp_path / "dflash_home"
    home.mkdir()
    (home / "smollm2-135m-instruct").symlink_to(smollm2_dir)
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
    # (the blocks read 4 conversations, a drafter and an eval cache from it: max_length 128, 2 steps and one
    # 8-token MT-Bench response are enough for those)
    run_demo(cpu_defaults(output=str(work / "demo_out"), conversations=8, max_length=128, steps=2, num_anchors=8,
                          block_size=4, batch_tokens=1024, eval_prompts=1, max_new_tokens=8), echo=lambda _: None)
    print(f"demo_out prepared in {time.perf_counter() - t0:.0f} s")
    assert (work / "demo_out" / "train_run" / "drafter" / "config.json").is_file()
    assert len((work / "demo_out" / "conversations.jsonl").read_text().splitlines()) >= 8

    out: dict[str, str] = {}
    stdout: dict[str, str] = {}
    for block in blocks:
        block_env = env
        buckets = sorted(set(re.findall(r"s3://([a-z0-9][a-z0-9.-]+)/", block)))
        if buckets:  # the user's object store: a real S3 server, the bucket made, credentials in AWS_*
            from store_server import SeaweedServer

            server = SeaweedServer(tmp_path / "seaweed")
            server.start()
            request.addfinalizer(server.stop)
            for name in buckets:
                server.create_bucket(name)
            block_env = dict(env, **server.env())
        t0, cpu0 = time.perf_counter(), children_cpu_seconds()
        res = run_block(block, cwd=work, env=block_env, preamble=preamble)
        print(f"{time.perf_counter() - t0:6.1f} s {children_cpu_seconds() - cpu0:6.1f} s cpu  "
              f"{block.splitlines()[-1][:100]}")
        out[block], stdout[block] = res.stdout + res.stderr, res.stdout

    def block_with(marker: str) -> str:
        hits = [b for b in out if marker in b]
        assert len(hits) == 1, f"{len(hits)} README blocks contain {marker!r}"
        return hits[0]

    def output_of(marker: str) -> str:
        return out[block_with(marker)]

    # extract: the dry run plans exactly the real run's job
    plans = plan_lines(output_of("--dry-run"))
    for prefix, (dry, real) in ((p, v) for p, v in plans.items() if len(v) == 2):
        assert dry == real, f"the dry run plans {dry!r}, the real run {real!r}"
    assert all(len(v) == 2 for v in plans.values()), f"expected each plan line twice (dry, real): {plans}"
    assert (work / "runs" / "cache" / "manifest.json").is_file()

    # verify
    info = output_of("dflash cache info runs/cache")
    assert re.search(r"^target_greedy +no$", info, flags=re.M) and re.search(r"^ok: 1 shards", info, flags=re.M)

    # train: the README's own --steps finished and exported
    assert (work / "runs" / "train" / "drafter" / "config.json").is_file()
    recs = [json.loads(x) for x in (work / "runs" / "train" / "metrics.jsonl").read_text().splitlines()]
    train_steps = int(re.search(r"--output runs/train .*?--steps (\d+)", block_with("--output runs/train "),
                                re.S).group(1))
    assert recs[-1]["step"] == train_steps

    # generate: as many MT-Bench answers as --limit, a regenerated conversation, an eval cache from them
    limit = int(re.search(r"--output runs/mtbench.jsonl --limit (\d+)",
                          block_with("--output runs/mtbench.jsonl")).group(1))
    assert len((work / "runs" / "mtbench.jsonl").read_text().splitlines()) == limit
    assert (work / "runs" / "regen.jsonl.gz").exists() or any((work / "runs").glob("regen.jsonl.gz*"))
    assert (work / "runs" / "eval_cache" / "manifest.json").is_file()

    # evaluate: tau printed, the --json result parses, held-out tau logged and written into the model card
    assert "tau" in output_of("dflash eval --drafter runs/train/drafter")
    ev = next(stdout[b] for b in stdout if "--json" in b)
    result = json.loads(ev[ev.index('{\n  "tau"'):ev.index("\n}\n", ev.index('{\n  "tau"')) + 2])
    assert result["tau"] >= 1.0
    held = [json.loads(x) for x in (work / "runs" / "train_eval" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("heldout_tau") is not None for r in held)
    assert (work / "runs" / "train_eval" / "drafter" / "README.md").is_file()

    # sweep: every run of the spec trained, evaluated and reported
    sweep_spec = re.search(r"dflash sweep (\S+)", block_with("dflash sweep")).group(1)
    report = (work / "runs" / "sweep" / "results.md").read_text()
    runs = [p.name for p in (work / "runs" / "sweep" / "runs").iterdir() if (p / "drafter" / "config.json").is_file()]
    assert len(runs) >= 2 and all(name in report for name in runs), (sweep_spec, runs, report[:500])

    # export
    assert (work / "runs" / "drafter-export" / "config.json").is_file()

    # object storage: the extraction published to the bucket, info read it there, training read it directly
    store_info = output_of("dflash cache info s3://")
    assert re.search(r"^target_greedy +no$", store_info, flags=re.M), store_info[-2000:]
    assert (work / "runs" / "train_s3" / "drafter" / "config.json").is_file()
