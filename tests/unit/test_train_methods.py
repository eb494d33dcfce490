"""Training with the variable_prefix objective and with a mixed sliding-window / full drafter, on a real tiny
target and cache (CPU): each changes the run, resumes exactly after a cut, cannot change on resume, exports its
layout, and trains in a sweep beside the paper's drafter from one stream (each run equal to the run alone)."""

import json
import pathlib
import sys

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from test_train_defects import _cut_and_resume_losses, _refuses_on_resume, _steps_and_losses  # noqa: E402
from train_helpers import tiny_cache, tiny_config, tiny_target  # noqa: E402

from dflash.train.trainer import train  # noqa: E402

VP = dict(objective="variable_prefix", prefix_weight_base=0.8)
MIXED = dict(num_layers=2, layer_types=("sliding_attention", "full_attention"), sliding_window=6)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("methods")
    target = tiny_target(d / "target")
    return str(target), str(tiny_cache(d / "cache", target, num_samples=12))


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("DFLASH_NO_PROGRESS", "1")


@pytest.mark.parametrize("method", [VP, MIXED], ids=["variable_prefix", "mixed_layers"])
def test_method_changes_the_run_and_resumes_exactly(assets, tmp_path, method):
    model, cache = assets
    kw = dict(cache=cache, model=model, steps=6, save_every=2, num_layers=method.get("num_layers", 1))
    train(tiny_config(output=str(tmp_path / "paper"), **kw), device="cpu")
    train(tiny_config(output=str(tmp_path / "ref"), **{**kw, **method}), device="cpu")
    paper, ref = _steps_and_losses(tmp_path / "paper")[1], _steps_and_losses(tmp_path / "ref")[1]
    assert len(ref) == 6 and ref != paper
    assert _cut_and_resume_losses(tmp_path / "run", {**kw, **method}, cut=3) == ref
    for name, other in (("objective", "dflash"), ("prefix_weight_base", 0.5), ("sliding_window", 4),
                        ("causal", False)):
        if name in method or name == "causal" and "layer_types" in method:
            _refuses_on_resume({**kw, **method}, **{name: other})
    saved = json.loads((tmp_path / "ref" / "drafter" / "config.json").read_text())
    if "layer_types" in method:
        assert saved["layer_types"] == list(method["layer_types"]) and saved["sliding_window"] == 6
        assert saved["use_sliding_window"] is True
        assert "training_mode" not in saved["dflash_config"]
    else:
        assert saved["layer_types"] == ["full_attention"] and saved["sliding_window"] is None
        # SpecForge's marks of a VP-Drafter, in the end-of-run export and in `dflash export` of a checkpoint
        assert saved["dflash_config"]["training_mode"] == "vp_drafter"
        assert saved["dflash_config"]["prefix_weight_base"] == 0.8
    from dflash.train.export import export_checkpoint

    again = export_checkpoint(tmp_path / "ref", tmp_path / "exported", dtype="float32").path
    assert json.loads((again / "config.json").read_text())["dflash_config"] == saved["dflash_config"]


def test_cli_flags_reach_the_drafter(assets, tmp_path):
    from cli.main import cli

    model, cache = assets
    out = tmp_path / "cli"
    res = CliRunner().invoke(cli, ["train", "--cache", cache, "--model", model, "--output", str(out), "--device", "cpu",
                                   "--steps", "2", "--layers", "3", "--block-size", "4", "--num-anchors", "8",
                                   "--batch-tokens", "200", "--mask-token-id", "257", "--layer-types",
                                   "sliding,sliding_attention,full", "--sliding-window", "5", "--causal",
                                   "--objective", "variable_prefix", "--prefix-weight-base", "0.7"],
                             prog_name="dflash")
    assert res.exit_code == 0, res.output
    saved = json.loads((out / "drafter" / "config.json").read_text())
    assert saved["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"]
    assert saved["sliding_window"] == 5 and saved["dflash_config"]["causal"] is True
    run = json.loads((out / "config.json").read_text())
    assert run["train"]["objective"] == "variable_prefix" and run["train"]["prefix_weight_base"] == 0.7
    bad = CliRunner().invoke(cli, ["train", "--cache", cache, "--model", model, "--output", str(tmp_path / "bad"),
                                   "--layers", "2", "--layer-types", "sliding,full"], prog_name="dflash")
    assert bad.exit_code == 1 and "sliding_window=None" in bad.output


def test_sweep_trains_the_methods_side_by_side_from_one_stream(assets, tmp_path):
    from dflash.sweep.runner import run_sweep
    from dflash.sweep.spec import spec_from_dict

    model, cache = assets
    base = dict(num_layers=2, block_size=4, num_anchors=8, batch_tokens=200, lr=3e-3, warmup_ratio=0.1,
                log_every=1, save_every=2, num_readers=1, prefetch=2, intermediate_size=64, steps=3)
    runs = [{"name": "paper"}, {"name": "vp", **VP},
            {"name": "mixed", "layer_types": list(MIXED["layer_types"]), "sliding_window": 6},
            {"name": "mixed_vp", **VP, "layer_types": list(MIXED["layer_types"]), "sliding_window": 6}]
    out = tmp_path / "sw"
    spec = spec_from_dict({"base": base, "runs": runs}, cache=cache, model=model, output=str(out))
    run_sweep(spec, output=out, device="cpu")
    losses = {r["name"]: _steps_and_losses(out / "runs" / r["name"])[1] for r in runs}
    assert len({tuple(v) for v in losses.values()}) == 4 and all(len(v) == 3 for v in losses.values())
    train(tiny_config(cache=cache, model=model, output=str(tmp_path / "alone"), steps=3, num_layers=2, **VP,
                      layer_types=MIXED["layer_types"], sliding_window=6), device="cpu")
    assert losses["mixed_vp"] == _steps_and_losses(tmp_path / "alone")[1]
