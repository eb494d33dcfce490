"""End to end on the real SmolLM2-135M (CPU, tiny settings): one `dflash sweep` trains the variable_prefix
objective and a mixed sliding-window (8) + full drafter side by side on the session's real
target-greedy cache (3 MT-Bench + 2 HumanEval responses of `dflash generate`, extracted; tests/conftest.py), with
exact held-out tau on that cache during training. Each new run's loss falls and its tau (re-measured by
`dflash eval` on its export) beats an untrained drafter of the same shape; the mixed drafter, cut and resumed,
takes the same steps. The cache is trained on and evaluated: this checks the pipeline (the masks, the objective,
the exact evaluator and the export agree), not generalisation."""

import json
import pathlib
import sys

import numpy as np
import pytest
import torch
from click.testing import CliRunner

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "unit"))
from test_train_defects import _cut_and_resume_losses, _steps_and_losses  # noqa: E402

from cli.main import cli  # noqa: E402
from dflash.train.metrics import read_metrics  # noqa: E402

pytestmark = pytest.mark.slow
BASE = dict(mask_token_id=16, num_layers=2, block_size=4, num_anchors=16, intermediate_size=768, lr=3e-3,
            batch_tokens=512, steps=40, warmup_ratio=0.05, log_every=5, save_every=20, num_readers=1, prefetch=2)
VP = dict(objective="variable_prefix", prefix_weight_base=0.9)
MIXED = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8)


def _invoke(args):
    res = CliRunner().invoke(cli, args, prog_name="dflash")
    assert res.exit_code == 0, res.output
    return res


def _tau(drafter_dir, cache, model):
    out = json.loads(_invoke(["eval", "--drafter", str(drafter_dir), "--cache", cache, "--model", model, "--json",
                              "--device", "cpu", "--dtype", "float32"]).output)
    assert out["exact"] is True
    return out["tau"]


def _untrained_like(drafter_dir, out_dir):
    """An untrained drafter of the same shape (config.json of the trained one, seed 0 init), exported."""
    from dflash.drafter.config import DrafterConfig
    from dflash.drafter.export import export_drafter
    from dflash.drafter.model import DFlashDrafter

    cfg = DrafterConfig.from_hf_config(json.loads((pathlib.Path(drafter_dir) / "config.json").read_text()))
    torch.manual_seed(0)
    return export_drafter(DFlashDrafter(cfg), cfg, out_dir, dtype=torch.float32)


def test_methods_sweep_on_smollm2(smollm2_greedy_eval, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_NO_PROGRESS", "1")
    model, cache = smollm2_greedy_eval.model, str(smollm2_greedy_eval.root / "cache")
    spec = {"base": {**BASE, "eval_cache": cache, "eval_every": 40},
            "runs": [{"name": "vp", **VP}, {"name": "mixed", **MIXED}]}
    (tmp_path / "spec.yaml").write_text(json.dumps(spec))
    out = tmp_path / "sweep"
    _invoke(["sweep", str(tmp_path / "spec.yaml"), "--cache", cache, "--model", model, "--output", str(out),
             "--device", "cpu"])
    results = {}
    for name in ("vp", "mixed"):
        run = out / "runs" / name
        recs = read_metrics(run)
        losses = [x for r in recs for x in r["step_losses"]]
        assert len(losses) == 40
        first, last = np.mean(losses[:5]), np.mean(losses[-5:])
        heldout = recs[-1]["heldout_tau"]
        tau = _tau(run / "drafter", cache, model)
        untrained = _tau(_untrained_like(run / "drafter", tmp_path / f"untrained_{name}"), cache, model)
        results[name] = (first, last, heldout, tau, untrained)
        print(f"{name}: loss {first:.3f} -> {last:.3f}, held-out tau {heldout:.3f}, dflash eval tau {tau:.3f}, "
              f"untrained {untrained:.3f}")
        assert last < first - 0.5
        assert tau == pytest.approx(heldout, abs=1e-6)  # the training-time evaluator and `dflash eval` agree
        assert tau > untrained + 0.03  # measured: vp 1.098, mixed 1.174 against 1.000
    saved = json.loads((out / "runs" / "mixed" / "drafter" / "config.json").read_text())
    assert saved["layer_types"] == MIXED["layer_types"] and saved["sliding_window"] == 8
    assert "heldout_tau" in (out / "results.md").read_text()
    # the mixed drafter alone, cut at step 20 and resumed: the sweep's steps (a sweep run equals the run alone)
    kw = {**BASE, **MIXED, "layer_types": tuple(MIXED["layer_types"]), "cache": cache, "model": model}
    assert _cut_and_resume_losses(tmp_path / "cut", kw, cut=20) == _steps_and_losses(out / "runs" / "mixed")[1]
