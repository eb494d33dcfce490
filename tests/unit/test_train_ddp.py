"""Data parallelism: 2 gloo processes (real spawn) take the same steps as 1 process with the same global batch."""

import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from train_helpers import tiny_cache, tiny_config, tiny_target  # noqa: E402

from dflash.train.checkpoint import load_checkpoint  # noqa: E402
from dflash.train.launch import launch  # noqa: E402
from dflash.train.metrics import read_metrics  # noqa: E402


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("ddp")
    target = tiny_target(d / "target")
    return target, tiny_cache(d / "cache", target, num_samples=30)


@pytest.mark.parametrize("accum_one,accum_two,step_samples", [(2, 1, None), (4, 2, 4)])
def test_two_processes_match_one_process(assets, tmp_path, monkeypatch, accum_one, accum_two, step_samples):
    """Token-budget steps, and steps of 4 samples (step_samples: the same micro-batches dealt to 2 ranks)."""
    monkeypatch.setenv("DFLASH_NO_PROGRESS", "1")
    target, cache = assets
    common = dict(cache=str(cache), model=str(target), steps=5, batch_tokens=150, save_every=100,
                  step_samples=step_samples)
    one = tiny_config(output=str(tmp_path / "one"), grad_accum=accum_one, **common)
    two = tiny_config(output=str(tmp_path / "two"), grad_accum=accum_two, **common)
    r1 = launch(one, resume=False, device="cpu", gpus=1)
    assert r1 is not None and r1.finished
    r2 = launch(two, resume=False, device="cpu", gpus=2)  # ran in 2 spawned processes: rank 0's result
    assert r2.finished and r2.global_step == 5 and r2.drafter_dir == tmp_path / "two" / "drafter"

    l1 = [x for rec in read_metrics(tmp_path / "one") for x in rec["step_losses"]]
    l2 = [x for rec in read_metrics(tmp_path / "two") for x in rec["step_losses"]]
    assert len(l1) == len(l2) == 5
    # Tolerance: fp32 on CPU; only the summation order of gradients and loss terms differs (all-reduce of
    # per-rank partial sums vs one process's running sum), so agreement is at fp32 rounding level.
    assert l1 == pytest.approx(l2, rel=1e-5, abs=1e-6)
    assert l1[0] == pytest.approx(l2[0], rel=1e-6)  # first step: identical init and batch
    s1, s2 = load_checkpoint(tmp_path / "one"), load_checkpoint(tmp_path / "two")
    assert s2["world_size"] == 2 and s1["world_size"] == 1
    for name, p in s1["model"].items():
        torch.testing.assert_close(p, s2["model"][name], rtol=1e-4, atol=1e-5)
    assert (tmp_path / "two" / "drafter" / "config.json").exists()
