"""A diverged step (non-finite gradient norm) stops the run before its weights are evaluated, checkpointed or
exported, so the good checkpoints survive the rotation; in a sweep the other runs of the stream go on and the
report says where it diverged (CPU, real tiny target and cache; lr 1e30 makes step 2's loss nan)."""

import json
import math
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from train_helpers import tiny_cache, tiny_config, tiny_target  # noqa: E402

from dflash.errors import TrainingDiverged  # noqa: E402
from dflash.train.checkpoint import list_checkpoints  # noqa: E402
from dflash.train.metrics import read_metrics  # noqa: E402
from dflash.train.trainer import train  # noqa: E402
from dflash.train.unit import DIVERGED_FILE, first_non_finite  # noqa: E402

HUGE_LR = 1e30   # step 1's update leaves the weights ~1e30: step 2's forward overflows and its loss is nan


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("diverge")
    target = tiny_target(d / "target")
    return str(target), str(tiny_cache(d / "cache", target, num_samples=12))


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("DFLASH_NO_PROGRESS", "1")


def test_first_non_finite_names_the_step():
    assert first_non_finite([0.5, 1.0], first_step=7) is None
    step, norm = first_non_finite([0.5, math.inf, math.nan], first_step=7)
    assert step == 8 and norm == math.inf
    assert first_non_finite([math.nan], first_step=1)[0] == 1


@pytest.mark.parametrize("log_every", [1, 4])   # checked at the log step, or at a save between two logs
def test_train_stops_at_the_diverged_step_keeping_the_good_checkpoint(assets, tmp_path, log_every):
    model, cache = assets
    run = tmp_path / "run"
    with pytest.raises(TrainingDiverged, match=r"diverged at step 2 \(gradient norm nan\).*a lower --lr and "
                                               r"--init-from .*step-00000001\.pt \(the newest checkpoint's weights\)"):
        train(tiny_config(cache=cache, model=model, output=str(run), steps=6, lr=HUGE_LR, warmup_ratio=0.0,
                          save_every=1, log_every=log_every), device="cpu")
    assert [p.name for p in list_checkpoints(run)] == ["step-00000001.pt"]   # step 2's nan weights never saved
    assert not (run / "drafter").exists()
    assert json.loads((run / DIVERGED_FILE).read_text())["step"] == 2
    assert all(math.isfinite(x) for r in read_metrics(run) for x in r["step_losses"])   # no nan step logged
    # a resume that trains on (here: to the same divergence, the lr unchanged) clears the old record first
    with pytest.raises(TrainingDiverged):
        train(tiny_config(cache=cache, model=model, output=str(run), steps=6, lr=HUGE_LR, warmup_ratio=0.0,
                          save_every=1, log_every=log_every), resume=True, device="cpu")
    assert json.loads((run / DIVERGED_FILE).read_text())["step"] == 2


def test_a_sweep_run_that_diverges_stops_alone(assets, tmp_path):
    from dflash.sweep.runner import run_sweep
    from dflash.sweep.spec import spec_from_dict

    model, cache = assets
    base = dict(num_layers=1, block_size=4, num_anchors=8, batch_tokens=200, warmup_ratio=0.0, log_every=1,
                save_every=2, num_readers=1, prefetch=2, intermediate_size=64, steps=5)
    out = tmp_path / "sw"
    spec = spec_from_dict({"base": base, "runs": [{"name": "ok", "lr": 3e-3}, {"name": "boom", "lr": HUGE_LR}]},
                          cache=cache, model=model, output=str(out))
    res = run_sweep(spec, output=out, device="cpu")
    assert res.groups == [["ok", "boom"]]   # one stream: the diverged run left it, the other trained on
    assert (out / "runs" / "ok" / "drafter" / "config.json").exists()
    assert read_metrics(out / "runs" / "ok")[-1]["step"] == 5
    assert not (out / "runs" / "boom" / "drafter").exists()
    report = (out / "results.md").read_text()
    assert "diverged at step 2" in report and "Best run: ok" in report
