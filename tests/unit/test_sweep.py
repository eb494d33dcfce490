"""dflash sweep on CPU with a real tiny cache (CacheWriter) and a real tiny target: per-step losses equal to
the runs trained alone, one read of the cache for K runs, SIGKILL + resume, spec expansion/grouping, report
files, CLI --help."""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from train_helpers import tiny_cache, tiny_config, tiny_target  # noqa: E402

from dflash.errors import ConfigError  # noqa: E402
from dflash.sweep.spec import expand_runs, plan_groups, spec_from_dict  # noqa: E402
from dflash.train.checkpoint import checkpoint_path  # noqa: E402
from dflash.train.metrics import read_metrics  # noqa: E402

BASE = dict(num_layers=1, block_size=4, num_anchors=8, batch_tokens=200, lr=3e-3, warmup_ratio=0.1, log_every=1,
            save_every=2, num_readers=1, prefetch=2, intermediate_size=64)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    target = tiny_target(root / "target")
    cache = tiny_cache(root / "cache", target, num_samples=12)
    return root, str(target), str(cache)


def _losses(run_dir):
    return [x for r in read_metrics(run_dir) for x in r["step_losses"]]


def _spec(data, cache, model, out):
    return spec_from_dict(data, cache=cache, model=model, output=str(out))


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("DFLASH_NO_PROGRESS", "1")


def test_two_runs_equal_runs_alone_and_report(assets, tmp_path):
    """Runs with different seed, lr, layers, taps, step counts and anchor bound, each == the same run trained
    alone (c differs from a only in anchor_positions: its own draws in the shared stream)."""
    from dflash.sweep.runner import run_sweep
    from dflash.train.trainer import train

    root, model, cache = assets
    spec = _spec({"base": BASE, "runs": [
        {"name": "a", "seed": 0, "steps": 6},
        {"name": "b", "seed": 1, "lr": 1e-3, "num_layers": 2, "taps": [2, 0], "steps": 4, "block_size": 3},
        {"name": "c", "seed": 0, "steps": 6, "anchor_positions": "full_blocks"}]},
        cache, model, tmp_path / "sw")
    res = run_sweep(spec, output=tmp_path / "sw", device="cpu")
    for name, kw in [("a", dict(seed=0, steps=6)),
                     ("b", dict(seed=1, lr=1e-3, num_layers=2, taps=(2, 0), steps=4, block_size=3)),
                     ("c", dict(seed=0, steps=6, anchor_positions="full_blocks"))]:
        alone = train(tiny_config(cache=cache, model=model, output=str(tmp_path / f"alone_{name}"), shuffle_seed=0,
                                  **kw), device="cpu")
        assert alone.finished
        sweep_losses = _losses(tmp_path / "sw" / "runs" / name)
        assert len(sweep_losses) == kw["steps"]
        assert sweep_losses == _losses(tmp_path / f"alone_{name}")  # bit-exact on CPU fp32
        assert (tmp_path / "sw" / "runs" / name / "drafter" / "config.json").exists()
    out = tmp_path / "sw"
    for f in ("results.md", "results.csv", "loss_curves.png", "final_loss.png", "sweep.json"):
        assert (out / f).stat().st_size > 0, f
    csv_head = (out / "results.csv").read_text().splitlines()[0].split(",")
    assert csv_head[:1] == ["name"] and {"seed", "lr", "num_layers", "taps", "steps", "final_loss",
                                         "acc_1", "acc_3", "tau"} <= set(csv_head)
    assert res.best in ("a", "b", "c") and f"Best run: {res.best}" in (out / "results.md").read_text()
    assert _losses(out / "runs" / "a") != _losses(out / "runs" / "c")
    assert (out / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"


def test_bytes_read_of_k_runs_equal_one_run(assets, tmp_path):
    """3 runs on tap subsets whose union is all taps read exactly the bytes of 1 run on all taps."""
    from dflash.sweep.runner import run_sweep

    root, model, cache = assets
    base = {**BASE, "steps": 3}
    one = run_sweep(_spec({"base": base}, cache, model, tmp_path / "one"), output=tmp_path / "one", device="cpu")
    three = run_sweep(_spec({"base": base, "grid": {"taps": [[0, 1, 2], [0, 2], [1]]}}, cache, model,
                            tmp_path / "three"), output=tmp_path / "three", device="cpu")
    assert len(three.rows) == 3 and all(r["finished"] for r in three.rows)
    assert one.bytes_read > 0 and three.bytes_read == one.bytes_read


def test_sigkill_then_resume_equals_uninterrupted(assets, tmp_path):
    from dflash.sweep.runner import run_sweep

    root, model, cache = assets
    data = {"base": {**BASE, "steps": 14, "save_every": 3}, "grid": {"seed": [0, 1]}}
    ref = tmp_path / "ref"
    run_sweep(_spec(data, cache, model, ref), output=ref, device="cpu")
    run = tmp_path / "run"
    script = textwrap.dedent(f"""
        from dflash.sweep.spec import spec_from_dict
        from dflash.sweep.runner import run_sweep
        spec = spec_from_dict({data!r}, cache={cache!r}, model={model!r}, output={str(run)!r})
        run_sweep(spec, output={str(run)!r}, device="cpu")
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], env=dict(os.environ, DFLASH_NO_PROGRESS="1"))
    deadline = time.time() + 240  # a hang guard only: under .ci/run -n 2 this process shares the cores
    while not checkpoint_path(run / "runs" / "seed1", 6).exists():
        assert proc.poll() is None, "the sweep exited before the kill"
        assert time.time() < deadline, "no checkpoint after 240 s"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert not (run / "runs" / "seed0" / "drafter").exists(), "the kill must land mid-run"
    with pytest.raises(ConfigError, match="not empty.*--resume"):
        run_sweep(_spec(data, cache, model, run), output=run, device="cpu")
    res = run_sweep(_spec(data, cache, model, run), output=run, device="cpu", resume=True)
    assert all(r["finished"] and r["steps"] == 14 for r in res.rows)
    for name in ("seed0", "seed1"):
        assert _losses(run / "runs" / name) == _losses(ref / "runs" / name)


def test_groups_in_spawned_processes_equal_one_process(assets, tmp_path):
    """The multi-GPU branch of run_sweep (run_groups_spawned over dflash.procs.spawn) run on the CPU: 2 groups
    in 2 processes give the losses of the same runs in one process (~20 s: each process imports torch; the
    launcher's failure handling is tested in test_procs)."""
    from dflash.sweep.runner import prepare_output, run_groups_spawned, run_sweep

    root, model, cache = assets
    data = {"base": {**BASE, "steps": 3}, "grid": {"seed": [0, 1]}}
    ref = run_sweep(_spec(data, cache, model, tmp_path / "one"), output=tmp_path / "one", device="cpu")
    out = tmp_path / "two"
    spec = _spec(data, cache, model, out)
    groups = plan_groups(spec.runs, gpus=2, max_runs_per_device=None, separate_streams=False)
    assert [[r.name for r in g] for g in groups] == [["seed0"], ["seed1"]]
    jobs = [(i, [r.name for r in g]) for i, g in enumerate(groups)]
    opts = dict(eval_cache=None, approximate=False, resume=False, eval_limit=None)
    prepare_output(out, spec, groups, resume=False)
    per_proc = run_groups_spawned(spec, jobs, output=out, nprocs=2, device_type="cpu", opts=opts)
    assert len(per_proc) == 2 and all(b > 0 for b in per_proc)
    for name in ("seed0", "seed1"):
        assert len(_losses(out / "runs" / name)) == 3
        assert _losses(out / "runs" / name) == _losses(tmp_path / "one" / "runs" / name)
    assert sum(per_proc) == 2 * ref.bytes_read   # two streams read the cache twice


def test_expand_grid_and_runs(tmp_path):
    runs = expand_runs({"lr": 1e-3, "seed": 5}, grid={"lr": [1e-3, 3e-3], "num_layers": [1, 2]},
                       runs=[{"name": "custom", "taps": [1, 2]}], cache="c", model="m", output=str(tmp_path))
    assert [r.name for r in runs] == ["lr0.001_num_layers1", "lr0.001_num_layers2", "lr0.003_num_layers1",
                                      "lr0.003_num_layers2", "custom"]
    assert runs[3].config.lr == 3e-3 and runs[3].config.num_layers == 2
    assert runs[4].config.taps == (1, 2) and runs[4].config.lr == 1e-3
    assert all(r.config.shuffle_seed == 5 and r.config.output == str(tmp_path / "runs" / r.name) for r in runs)
    # no grid, no runs: the base alone
    assert [r.name for r in expand_runs({}, grid=None, runs=None, cache="c", model="m", output="o")] == ["run"]
    spec = spec_from_dict({"base": {"seed": 0}, "grid": {"seed": [0, 1]}, "runs": [{"name": "x", "lr": 1e-2}]},
                          cache="c", model="m", output="o")
    assert spec.varied == ("lr", "seed")


@pytest.mark.parametrize("data, match", [
    ({"grid": {"lr": []}}, "non-empty list"),
    ({"grid": {"cache": ["x"]}}, "cannot be set in a sweep spec"),
    ({"base": {"learning_rate": 1}}, "unknown key 'learning_rate'"),
    ({"runs": [{"name": "a"}, {"name": "a", "lr": 1e-3}]}, "two runs are named 'a'"),
    ({"grid": {"lr": [0.1]}, "epochs": 3}, "unknown keys \\['epochs'\\]"),
    ({"grid": {"num_layers": [0]}}, "num_layers=0"),
])
def test_spec_errors(data, match):
    with pytest.raises(ConfigError, match=match):
        spec_from_dict(data, cache="c", model="m", output="o")


def test_grouping():
    spec = spec_from_dict({"grid": {"lr": [1e-3, 2e-3, 3e-3], "seed": [0, 1]}}, cache="c", model="m", output="o")
    assert [len(g) for g in plan_groups(spec.runs, gpus=1, max_runs_per_device=None, separate_streams=False)] == [6]
    assert [len(g) for g in plan_groups(spec.runs, gpus=1, max_runs_per_device=4, separate_streams=False)] == [4, 2]
    assert [len(g) for g in plan_groups(spec.runs, gpus=4, max_runs_per_device=None,
                                        separate_streams=False)] == [2, 1, 2, 1]
    mixed = spec_from_dict({"grid": {"batch_tokens": [100, 200], "lr": [1e-3, 2e-3]}}, cache="c", model="m",
                           output="o")
    with pytest.raises(ConfigError, match="differ in 'batch_tokens'.*separate_streams"):
        plan_groups(mixed.runs, gpus=1, max_runs_per_device=None, separate_streams=False)
    groups = plan_groups(mixed.runs, gpus=1, max_runs_per_device=None, separate_streams=True)
    assert [[r.config.batch_tokens for r in g] for g in groups] == [[100, 100], [200, 200]]
    with pytest.raises(ConfigError, match="--gpus 0"):
        plan_groups(spec.runs, gpus=0, max_runs_per_device=None, separate_streams=False)
    # the loss normalization is a drafter's own (its weights), not the stream's: both share one read of the cache
    norms = spec_from_dict({"grid": {"loss_normalization": ["token", "sequence"]}}, cache="c", model="m", output="o")
    groups = plan_groups(norms.runs, gpus=1, max_runs_per_device=None, separate_streams=False)
    assert [[r.config.loss_normalization for r in g] for g in groups] == [["token", "sequence"]]
    # the online storage rounding is a run's own (one live target computes the group's features once, each run
    # rounds them); online itself is the stream's
    rounding = spec_from_dict({"base": {"online": True}, "grid": {"online_storage": ["fp8", "int4"]}}, cache="c",
                              model="m", output="o")
    groups = plan_groups(rounding.runs, gpus=1, max_runs_per_device=None, separate_streams=False)
    assert [[r.config.online_storage for r in g] for g in groups] == [["fp8", "int4"]]
    mixed = spec_from_dict({"grid": {"online": [True, False]}}, cache="c", model="m", output="o")
    with pytest.raises(ConfigError, match="differ in 'online'"):
        plan_groups(mixed.runs, gpus=1, max_runs_per_device=None, separate_streams=False)


def test_cli_help_and_example_spec(tmp_path):
    from click.testing import CliRunner

    from cli.main import cli
    from dflash.sweep.spec import load_sweep_spec

    res = CliRunner().invoke(cli, ["sweep", "--help"])
    assert res.exit_code == 0 and "--eval-cache" in res.output and "--gpus" in res.output
    example = pathlib.Path(__file__).parents[2] / "configs" / "sweep_example.yaml"
    spec = load_sweep_spec(example, cache="c", model="m", output=str(tmp_path))
    assert len(spec.runs) >= 4
    res = CliRunner().invoke(cli, ["sweep", str(tmp_path / "nope.yaml"), "--cache", "c", "--model", "m",
                                   "--output", str(tmp_path / "o")])
    assert res.exit_code == 1 and "does not exist" in res.output


def test_stream_taps_of_a_group():
    """A group's stream reads the union of its runs' taps in cache order; an online group's live target
    computes them ascending, also layers the cache does not hold."""
    from dflash.sweep.runner import _union_taps

    assert _union_taps((1, 8, 15, 22), [(8, 1), (22,)], online=False) == (1, 8, 22)
    assert _union_taps((0,), [(14, 1), (27,)], online=True) == (1, 14, 27)
