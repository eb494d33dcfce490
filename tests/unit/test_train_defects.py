"""Defects of issues 18 and 19 in the training loop, each a test that failed on the code before its fix (CPU,
real tiny target and cache): online sweeps, metrics across a cut + resume, online on resume, the GradSync view
check, the CPU-size warning, --resume refusals."""

import dataclasses
import json
import logging
import pathlib
import shutil
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from train_helpers import tiny_cache, tiny_config, tiny_target  # noqa: E402

from dflash.errors import ConfigError  # noqa: E402
from dflash.train.checkpoint import checkpoint_path, list_checkpoints  # noqa: E402
from dflash.train.metrics import read_metrics  # noqa: E402
from dflash.train.trainer import train  # noqa: E402


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("defects")
    target = tiny_target(d / "target")
    return str(target), str(tiny_cache(d / "cache", target, num_samples=12))


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("DFLASH_NO_PROGRESS", "1")


def _steps_and_losses(run):
    recs = read_metrics(run)
    steps = [s for r in recs for s in range(r["first_step"], r["step"] + 1)]
    return steps, [x for r in recs for x in r["step_losses"]]


def _cut_and_resume_losses(run, kw, *, cut):
    """The step losses of a run stopped after `cut` steps and resumed to the end."""
    train(tiny_config(output=str(run), stop_after_steps=cut, **kw), device="cpu")
    train(tiny_config(output=str(run), **kw), resume=True, device="cpu")
    return _steps_and_losses(run)[1]


def _refuses_on_resume(kw, **changed):
    """A resume whose config differs from the run's in `changed` is refused, naming the field."""
    from dflash.train.config import check_resume_compatible

    cfg = tiny_config(output="unused", **kw)
    (name,) = changed
    with pytest.raises(ConfigError, match=f"different '{name}'"):
        check_resume_compatible(cfg.to_json(), dataclasses.replace(cfg, **changed))


def test_sweep_runs_online_when_the_spec_says_so(assets, tmp_path):
    """`online: true` in a sweep spec: the group's features come from the live target (no hidden bytes read),
    and each run equals the same run trained alone with --online."""
    from dflash.sweep.runner import run_sweep
    from dflash.sweep.spec import spec_from_dict

    model, cache = assets
    base = dict(num_layers=1, block_size=4, num_anchors=8, batch_tokens=200, lr=3e-3, warmup_ratio=0.1,
                log_every=1, save_every=2, num_readers=1, prefetch=2, intermediate_size=64, steps=3, online=True)
    out = tmp_path / "sw"
    spec = spec_from_dict({"base": base, "grid": {"seed": [0, 1]}}, cache=cache, model=model, output=str(out))
    res = run_sweep(spec, output=out, device="cpu")
    assert res.bytes_read == 0  # ids and masks only: the spec's online is not ignored
    alone = train(tiny_config(cache=cache, model=model, output=str(tmp_path / "alone"), steps=3, seed=1,
                              shuffle_seed=0, online=True), device="cpu")
    assert alone.cache_bytes_read == 0
    assert _steps_and_losses(out / "runs" / "seed1")[1] == _steps_and_losses(tmp_path / "alone")[1]


def test_online_cannot_change_on_resume(assets):
    model, cache = assets
    _refuses_on_resume(dict(cache=cache, model=model), online=True)


def test_every_step_logged_once_across_cut_and_resume(assets, tmp_path):
    """save_every 3 is not a multiple of log_every 2: a run resumed from step 3 (killed after logging step 4)
    logs steps 1..8 once each with the uninterrupted run's losses; a torn last line is dropped."""
    model, cache = assets
    kw = dict(cache=cache, model=model, steps=8, log_every=2, save_every=3, keep_checkpoints=10)
    train(tiny_config(output=str(tmp_path / "ref"), **kw), device="cpu")
    ref_steps, ref_losses = _steps_and_losses(tmp_path / "ref")
    assert ref_steps == list(range(1, 9))

    run = tmp_path / "run"
    shutil.copytree(tmp_path / "ref", run)
    shutil.rmtree(run / "drafter")
    for p in list_checkpoints(run):
        if p != checkpoint_path(run, 3):
            p.unlink()
    lines = (run / "metrics.jsonl").read_text().splitlines()[:2]  # records of steps 2 and 4, as a kill at 5 leaves
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    torn = tmp_path / "torn"
    shutil.copytree(run, torn)
    res = train(tiny_config(output=str(run), **kw), resume=True, device="cpu")
    assert res.finished
    assert _steps_and_losses(run) == (ref_steps, ref_losses)

    with open(torn / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "loss": 0.1')  # a record torn by a full disk
    train(tiny_config(output=str(torn), **kw), resume=True, device="cpu")
    assert _steps_and_losses(torn) == (ref_steps, ref_losses)


def test_restart_before_the_first_checkpoint_logs_no_step_twice(assets, tmp_path):
    model, cache = assets
    kw = dict(cache=cache, model=model, steps=4, save_every=100)
    run = tmp_path / "run"
    train(tiny_config(output=str(run), **kw), device="cpu")
    ref = _steps_and_losses(run)
    shutil.rmtree(run / "checkpoints")  # as a kill before the first checkpoint leaves it (records, no checkpoint)
    shutil.rmtree(run / "drafter")
    res = train(tiny_config(output=str(run), **kw), resume=True, device="cpu")
    assert res.finished and _steps_and_losses(run) == ref


def test_resume_of_a_folder_without_a_run_is_refused(assets, tmp_path):
    model, cache = assets
    for out in (tmp_path / "missing", tmp_path / "empty"):
        if out.name == "empty":
            out.mkdir()
        with pytest.raises(ConfigError, match="--resume: no training run in"):
            train(tiny_config(cache=cache, model=model, output=str(out), steps=2), resume=True, device="cpu")
        assert not (out / "metrics.jsonl").exists()


def test_grad_sync_view_check_catches_a_misplaced_view():
    from dflash.train.step import GradSync

    lin = torch.nn.Linear(3, 2)
    sync = GradSync(list(lin.parameters()), block_size=4, device=torch.device("cpu"))
    # a view into the buffer, but at another parameter's offset: its gradient would be mixed into the wrong slot
    lin.bias.grad = sync.flat[0:2]
    with pytest.raises(AssertionError, match="not the flat buffer's view"):
        sync.reduce(1)
    lin.bias.grad = torch.zeros(2)  # a fresh tensor, as autograd might have put there
    with pytest.raises(AssertionError):
        sync.check_views()


def test_cpu_run_of_a_gpu_sized_config_warns_with_an_estimate(assets, tmp_path, caplog):
    model, cache = assets
    cfg = tiny_config(cache=cache, model=model, output=str(tmp_path / "big"), num_anchors=512, block_size=16,
                      steps=1)
    with caplog.at_level(logging.WARNING, logger="dflash.train.setup"):
        train(cfg, device="cpu")
    msg = [r.getMessage() for r in caplog.records if "GPU-sized" in r.getMessage()]
    assert len(msg) == 1 and "512 anchors x block 16" in msg[0] and "min for 1 steps" in msg[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dflash.train.setup"):
        train(tiny_config(cache=cache, model=model, output=str(tmp_path / "small"), steps=1), device="cpu")
    assert not [r for r in caplog.records if "GPU-sized" in r.getMessage()]


def test_train_logs_the_drafter_shape(assets, tmp_path, caplog):
    model, cache = assets
    with caplog.at_level(logging.INFO, logger="dflash.train.driver"):
        train(tiny_config(cache=cache, model=model, output=str(tmp_path / "r"), steps=1, num_layers=2),
              device="cpu")
    shape = [r.getMessage() for r in caplog.records if "drafter: 2 layers" in r.getMessage()]
    assert shape and "block 4" in shape[0] and "trainable parameters" in shape[0]
    cfg = json.loads((tmp_path / "r" / "config.json").read_text())
    assert cfg["drafter"]["num_hidden_layers"] == 2


def test_feature_noise_is_applied_and_resumes_exactly(assets, tmp_path):
    """noise_start > 0 (train/noise.py) changes the losses; a cut + resume draws the same noise as an
    uninterrupted run (per-(seed, step, rank, micro-batch) generators); the schedule cannot change on resume."""
    model, cache = assets
    kw = dict(cache=cache, model=model, steps=6, save_every=2, noise_start=0.5, noise_end=0.1, noise_warmup_ratio=0.3)
    train(tiny_config(output=str(tmp_path / "clean"), **{**kw, "noise_start": 0.0, "noise_end": 0.0}), device="cpu")
    train(tiny_config(output=str(tmp_path / "ref"), **kw), device="cpu")
    clean, noisy = _steps_and_losses(tmp_path / "clean")[1], _steps_and_losses(tmp_path / "ref")[1]
    assert clean != noisy and len(noisy) == 6
    assert _cut_and_resume_losses(tmp_path / "run", kw, cut=3) == noisy
    _refuses_on_resume(kw, noise_start=0.2)


def test_benchmark_drives_the_same_loop_with_patched_io(assets, tmp_path):
    """bench_train's run B: train.driver.run_stream with its loader replaced by GPU-resident (here: preloaded)
    micro-batches trains exactly like `dflash train` (same losses to the bit)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
    from bench_train import resident_loader

    from dflash.train.distributed import DistInfo
    from dflash.train.driver import Stream, build_unit, run_stream
    from dflash.train.setup import setup_target

    model, cache = assets
    train(tiny_config(cache=cache, model=model, output=str(tmp_path / "train"), steps=3), device="cpu")
    cfg = tiny_config(cache=cache, model=model, output=str(tmp_path / "resident"), steps=3)
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    target = setup_target(cfg, info=info)
    unit = build_unit(cfg, target, info=info, state=None, progress=False)
    try:
        run_stream([unit], Stream(reader=target.reader, taps=tuple(unit.dc.target_layer_ids), info=info,
                                  compute_dtype=target.compute_dtype, cfg=cfg), open_loader=resident_loader(3))
    finally:
        unit.close()
        target.reader.close()
    assert unit.finished
    assert _steps_and_losses(tmp_path / "resident") == _steps_and_losses(tmp_path / "train")


def test_fixed_count_steps_resume_exactly_across_an_epoch(assets, tmp_path):
    """step_samples: a run cut mid-epoch and resumed takes the same steps as an uninterrupted one (its plan is a
    pure function of seed and epoch), into the next epoch; step_samples cannot change on resume."""
    model, cache = assets
    kw = dict(cache=cache, model=model, steps=8, save_every=2, step_samples=5, grad_accum=3)
    train(tiny_config(output=str(tmp_path / "ref"), **kw), device="cpu")
    ref = _steps_and_losses(tmp_path / "ref")[1]
    assert len(ref) == 8
    # 12 samples: 3 steps an epoch (5, 5, 2 samples); cut at step 4 (save_every 2: resumes from step 4, in epoch 1)
    assert _cut_and_resume_losses(tmp_path / "run", kw, cut=4) == ref
    _refuses_on_resume(kw, step_samples=4)
