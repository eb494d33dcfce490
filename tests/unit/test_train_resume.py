"""A run killed with SIGKILL and resumed reproduces the uninterrupted run's per-step losses exactly (CPU)."""

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

from dflash.train.checkpoint import checkpoint_path, list_checkpoints  # noqa: E402
from dflash.train.metrics import read_metrics  # noqa: E402
from dflash.train.trainer import train  # noqa: E402

STEPS = 30


def _losses(run):
    recs = read_metrics(run)
    steps = [r["step"] for r in recs]
    assert steps == sorted(set(steps)), f"duplicate or unordered steps {steps}"
    return [x for r in recs for x in r["step_losses"]]


def test_sigkill_then_resume_is_exact(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_NO_PROGRESS", "1")
    target = tiny_target(tmp_path / "target")
    cache = tiny_cache(tmp_path / "cache", target, num_samples=20)
    # 2 epochs and a partial third: the kill and the resume cross epoch boundaries
    kw = dict(cache=str(cache), model=str(target), steps=STEPS, save_every=3, batch_tokens=160)

    ref = train(tiny_config(output=str(tmp_path / "ref"), **kw), device="cpu")
    assert ref.finished and ref.global_step == STEPS
    ref_losses = _losses(tmp_path / "ref")
    assert len(ref_losses) == STEPS

    run = tmp_path / "run"
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})
        from train_helpers import tiny_config
        from dflash.train.trainer import train
        train(tiny_config(output={str(run)!r}, **{kw!r}), device="cpu")
    """)
    env = dict(os.environ, DFLASH_NO_PROGRESS="1")
    proc = subprocess.Popen([sys.executable, "-c", script], env=env)
    deadline = time.time() + 240  # a hang guard only: under .ci/run -n 2 this process shares the cores
    while not checkpoint_path(run, 6).exists():
        assert proc.poll() is None, "training exited before the kill"
        assert time.time() < deadline, "no checkpoint after 240 s"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    killed_at = max(int(p.name[5:13]) for p in list_checkpoints(run))
    assert 6 <= killed_at < STEPS, "the kill must land mid-run"

    res = train(tiny_config(output=str(run), **kw), resume=True, device="cpu")
    assert res.finished and res.global_step == STEPS
    assert _losses(run) == ref_losses  # bit-exact, not approximately


def test_refuses_nonempty_output_without_resume(tmp_path):
    from dflash.errors import ConfigError

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "x").write_text("x")
    with pytest.raises(ConfigError, match="not empty.*--resume"):
        train(tiny_config(cache=str(tmp_path / "nope"), model=str(tmp_path), output=str(tmp_path / "run")),
              device="cpu")


def test_fp8_cache_and_tap_subset(tmp_path, monkeypatch):
    """fp8 bits + scales are dequantised by the loader; a reordered tap subset is read and recorded."""
    monkeypatch.setenv("DFLASH_NO_PROGRESS", "1")
    target = tiny_target(tmp_path / "target")
    cache = tiny_cache(tmp_path / "cache", target, num_samples=8, storage="fp8")
    res = train(tiny_config(cache=str(cache), model=str(target), output=str(tmp_path / "run"), steps=3,
                            taps=(2, 0)), device="cpu")
    assert res.finished and res.last_loss is not None and res.last_loss == res.last_loss  # not NaN
    from dflash.drafter.export import read_drafter_config

    assert read_drafter_config(res.drafter_dir).target_layer_ids == (2, 0)


def test_resume_keeps_the_plan_a_run_started_with(tmp_path, monkeypatch):
    """A checkpoint written before plan versions (no plan_version: packing-order steps) resumes on that plan,
    not on the cost-balanced one, and its later checkpoints keep saying so; a fresh run plans balanced steps."""
    import shutil

    import torch

    from dflash.train import checkpoint as ckpt

    monkeypatch.setenv("DFLASH_NO_PROGRESS", "1")
    target = tiny_target(tmp_path / "target")
    cache = tiny_cache(tmp_path / "cache", target, num_samples=20)
    kw = dict(cache=str(cache), model=str(target), steps=12, save_every=3, keep_checkpoints=10, batch_tokens=160,
              grad_accum=2)  # two micro-batches per step: the plans differ

    monkeypatch.setattr(ckpt, "PLAN_VERSION", 1)  # a run of the code before balanced steps
    train(tiny_config(output=str(tmp_path / "old"), **kw), device="cpu")
    old_losses = _losses(tmp_path / "old")
    monkeypatch.setattr(ckpt, "PLAN_VERSION", 2)

    run = tmp_path / "run"
    shutil.copytree(tmp_path / "old", run)
    for p in list_checkpoints(run):
        if int(p.name[5:13]) > 6:
            p.unlink()
    state = torch.load(checkpoint_path(run, 6), weights_only=False)
    del state["plan_version"]  # as the old code wrote it
    torch.save(state, checkpoint_path(run, 6))
    res = train(tiny_config(output=str(run), **kw), resume=True, device="cpu")
    assert res.finished and _losses(run) == old_losses  # the packing-order plan, bit-exact
    assert ckpt.load_checkpoint(checkpoint_path(run, 12))["plan_version"] == 1

    train(tiny_config(output=str(tmp_path / "new"), **kw), device="cpu")
    assert ckpt.load_checkpoint(checkpoint_path(tmp_path / "new", 12))["plan_version"] == 2
    assert _losses(tmp_path / "new") != old_losses  # the balanced plan is another plan: the check above can fail


def test_read_metrics_leaves_out_a_torn_last_line(tmp_path):
    """A run killed while writing its last record leaves a torn line: the records before it are read; a torn
    line anywhere else is corruption and raises."""
    from dflash.train.metrics import read_metrics

    (tmp_path / "metrics.jsonl").write_text('{"step": 10}\n{"step": 20}\n{"step": 3')
    assert read_metrics(tmp_path) == [{"step": 10}, {"step": 20}]
    (tmp_path / "metrics.jsonl").write_text('{"step": 10}\n{"ste\n{"step": 30}\n')
    with pytest.raises(ValueError):  # json.JSONDecodeError
        read_metrics(tmp_path)
