"""DFlash 2 in the training loop (CPU, the real tiny target and cache of train_helpers): a cut-and-resumed run
equals the uninterrupted one bit for bit, the checkpoint and export carry the DFlash 2 config, the selector term
is in the loss, and a resume cannot switch the architecture."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from test_train_defects import _cut_and_resume_losses, _refuses_on_resume, _steps_and_losses  # noqa: E402
from train_helpers import tiny_cache, tiny_config, tiny_target  # noqa: E402

from dflash.train.trainer import train  # noqa: E402

DFLASH2 = dict(arch="dflash2", selector_rank=8, selector_top_k=4, conv_group_size=8, steps=6)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("dflash2_train")
    target = tiny_target(d / "target")
    return str(target), str(tiny_cache(d / "cache", target, num_samples=12))


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("DFLASH_NO_PROGRESS", "1")


def test_cut_and_resume_equals_uninterrupted(assets, tmp_path):
    model, cache = assets
    kw = dict(cache=cache, model=model, **DFLASH2)
    train(tiny_config(output=str(tmp_path / "ref"), **kw), device="cpu")
    ref = _steps_and_losses(tmp_path / "ref")
    assert ref[0] == list(range(1, 7))
    assert _cut_and_resume_losses(tmp_path / "cut", kw, cut=3) == ref[1]  # bit-exact, not approximately

    from dflash.drafter.dflash2 import DFlash2Config
    from dflash.drafter.export import read_drafter_config
    from dflash.train.checkpoint import load_checkpoint

    assert load_checkpoint(tmp_path / "cut")["drafter_config"]["arch"] == "dflash2"
    cfg = read_drafter_config(tmp_path / "cut" / "drafter")
    assert type(cfg) is DFlash2Config and (cfg.selector_rank, cfg.selector_top_k, cfg.conv_group_size) == (8, 4, 8)
    # `dflash export` of the run's checkpoint writes the same DFlash 2 folder
    from dflash.train.export import export_checkpoint

    res = export_checkpoint(tmp_path / "cut", tmp_path / "exported")
    assert res.step == 6 and read_drafter_config(res.path) == cfg
    assert (res.path / "model.safetensors").read_bytes() == (tmp_path / "cut" / "drafter" / "model.safetensors"
                                                               ).read_bytes()


def test_selector_weight_is_in_the_loss(assets, tmp_path):
    """The same run with selector_weight 0 logs the block CE alone; the first step's (identical weights, data
    and anchors) loss differs by selector_weight x the selector term, which is >= 0."""
    model, cache = assets
    kw = dict(cache=cache, model=model, **{**DFLASH2, "steps": 1})
    train(tiny_config(output=str(tmp_path / "w0"), selector_weight=0.0, **kw), device="cpu")
    train(tiny_config(output=str(tmp_path / "w2"), selector_weight=2.0, **kw), device="cpu")
    (l0,), (l2,) = _steps_and_losses(tmp_path / "w0")[1], _steps_and_losses(tmp_path / "w2")[1]
    assert l2 > l0


def test_resume_cannot_switch_the_architecture(assets):
    model, cache = assets
    _refuses_on_resume(dict(cache=cache, model=model), arch="dflash2")
    _refuses_on_resume(dict(cache=cache, model=model, arch="dflash2"), selector_weight=0.5)


def test_cli_train_arch_dflash2_then_eval(assets, tmp_path):
    """`dflash train --arch dflash2 --selector-weight` and `dflash eval` of its export: the tau printed is the
    accept chain of the drafts block_drafts gives for a DFlash 2 drafter (the selector's path)."""
    import json

    import numpy as np
    import torch
    from click.testing import CliRunner

    from cli.main import cli
    from dflash.cache import CacheReader
    from dflash.drafter.export import load_drafter
    from dflash.eval.tau import sequence_steps
    from dflash.target.head import embedding_and_head

    model, cache = assets
    out = tmp_path / "run"
    res = CliRunner().invoke(cli, ["train", "--cache", cache, "--model", model, "--output", str(out),
                                   "--device", "cpu", "--arch", "dflash2", "--selector-weight", "0.5", "--layers", "1",
                                   "--block-size", "4", "--num-anchors", "8", "--batch-tokens", "200", "--steps", "3",
                                   "--config", str(_yaml(tmp_path))], prog_name="dflash")
    assert res.exit_code == 0, res.output
    assert json.loads((out / "config.json").read_text())["train"]["selector_weight"] == 0.5
    res = CliRunner().invoke(cli, ["eval", "--drafter", str(out / "drafter"), "--cache", cache, "--model", model,
                                   "--approximate", "--json", "--device", "cpu"], prog_name="dflash")
    assert res.exit_code == 0, res.output
    tau = json.loads(res.output)["tau"]
    dr, cfg = load_drafter(out / "drafter", dtype=torch.float32)  # `dflash eval` on CPU: float32
    embed, head, _ = embedding_and_head(model, dtype=torch.float32)
    taus = []  # `dflash eval`'s tau: the mean of the sequences' taus
    with CacheReader(cache) as reader:
        for i in range(len(reader)):
            s = reader.read(i, taps=cfg.target_layer_ids, dequantize=True)
            taus.append(np.mean(sequence_steps(dr, embed_VD=embed, lm_head_VD=head,
                                    input_ids_T=torch.from_numpy(s.input_ids.astype(np.int64)),
                                    hidden_TKD=s.hidden.float(), loss_mask_T=s.loss_mask,
                                    mask_token_id=cfg.mask_token_id)))
    assert tau == pytest.approx(np.mean(taus))


def _yaml(tmp_path):
    p = tmp_path / "small.yaml"
    p.write_text("selector_rank: 8\nselector_top_k: 4\nconv_group_size: 8\nintermediate_size: 64\n")
    return p


def test_dflash2_with_variable_prefix_and_a_sliding_window_layer(assets, tmp_path):
    """The three methods options compose: a DFlash 2 drafter of one sliding-window and one full layer trained with
    the variable-prefix objective resumes bit for bit, differs from the same run without the window, and exports
    every field a serving engine reads."""
    import json

    model, cache = assets
    combo = dict(cache=cache, model=model, **{**DFLASH2, "steps": 4}, num_layers=2,
                 layer_types=("sliding_attention", "full_attention"), sliding_window=3, objective="variable_prefix")
    train(tiny_config(output=str(tmp_path / "ref"), **combo), device="cpu")
    ref = _steps_and_losses(tmp_path / "ref")
    assert _cut_and_resume_losses(tmp_path / "cut", combo, cut=2) == ref[1]
    plain = {**combo, "layer_types": ("full_attention", "full_attention"), "sliding_window": None}
    train(tiny_config(output=str(tmp_path / "plain"), **plain), device="cpu")
    assert _steps_and_losses(tmp_path / "plain")[1] != ref[1]
    hf = json.loads((tmp_path / "ref" / "drafter" / "config.json").read_text())
    assert hf["architectures"] == ["DFlash2DraftModel"]
    assert hf["layer_types"] == ["sliding_attention", "full_attention"] and hf["sliding_window"] == 3
    assert hf["dflash_config"]["training_mode"] == "vp_drafter"
    # DFlash 2 has no remote-code module (its config names no auto_map), so the folder carries none
    assert "auto_map" not in hf and not (tmp_path / "ref" / "drafter" / "dflash.py").exists()
