"""The publishable model card: Hub front matter, the target's Hub id, both engines' commands (dflash.drafter.serving),
and the held-out tau per eval source, written alike by `dflash train` (end of run) and `dflash export` (from the
run's checkpoint and metrics.jsonl)."""

import dataclasses
import json
import pathlib
import shlex
import sys

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import train_helpers  # noqa: E402
from train_helpers import tiny_cache, tiny_target  # noqa: E402

from cli.main import cli  # noqa: E402
from dflash.drafter.card import read_card_data, render_card, target_hub_id  # noqa: E402
from dflash.drafter.export import MODELING_TEMPLATE  # noqa: E402
from dflash.drafter.serving import (VLLM_API_SERVER, shell_line, sglang_command, vllm_command,  # noqa: E402
                                    vllm_server_argv, vllm_speculative_config)
from dflash.train.metrics import read_metrics  # noqa: E402

FRONT = "---\nlibrary_name: transformers\ntags:\n- dflash\n- speculative-decoding\n---\n"


def test_vllm_and_sglang_commands():
    argv = vllm_command(target="Qwen/Qwen3-8B", drafter="me/d", block_size=16)
    assert argv[:3] == ["vllm", "serve", "Qwen/Qwen3-8B"] and argv[3] == "--speculative-config"
    assert json.loads(argv[4]) == {"method": "dflash", "model": "me/d", "num_speculative_tokens": 15}
    api = vllm_command(target="/m", drafter="/d", block_size=4, launcher=("/venv/bin/python", *VLLM_API_SERVER[1:]),
                       extra=["--dtype", "float32"])
    assert api[:5] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"]
    assert api[-2:] == ["--dtype", "float32"] and json.loads(api[6])["num_speculative_tokens"] == 3
    sg = sglang_command(target="/m", drafter="/d", block_size=16)
    assert sg == ["python", "-m", "sglang.launch_server", "--model-path", "/m", "--speculative-algorithm", "DFLASH",
                  "--speculative-draft-model-path", "/d", "--speculative-num-draft-tokens", "16"]
    for argv in (api, sg):  # the rendered line is the same command for a shell
        assert shlex.split(shell_line(argv).replace("\\\n", " ")) == argv
    with pytest.raises(ValueError, match="block_size=1"):
        vllm_speculative_config(drafter="/d", block_size=1)


def test_target_hub_id(tmp_path):
    assert target_hub_id("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"
    snap = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    assert target_hub_id(snap) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    local = tmp_path / "target"
    local.mkdir()
    assert target_hub_id(local) is None                       # no config.json: nothing recorded
    (local / "config.json").write_text(json.dumps({"_name_or_path": str(tmp_path / "elsewhere")}))
    assert target_hub_id(local) is None                       # a path is not an id
    (local / "config.json").write_text(json.dumps({"_name_or_path": "Qwen/Qwen3-8B"}))
    assert target_hub_id(local) == "Qwen/Qwen3-8B"
    assert target_hub_id(None) is None


def test_card_front_matter_names_the_base_model():
    config = {"block_size": 16, "num_hidden_layers": 5, "hidden_size": 4096,
              "dflash_config": {"target_layer_ids": [1, 9], "mask_token_id": 5}}
    text = render_card(config=config, heldout=[], data={}, recipe={}, target="/models/qwen3-8b",
                       drafter_name="me/d", base_model="Qwen/Qwen3-8B")
    assert text.startswith("---\nlibrary_name: transformers\nbase_model: Qwen/Qwen3-8B\ntags:\n- dflash\n"
                           "- speculative-decoding\n---\n")
    assert "license" not in text.split("\n---\n", 1)[0]
    # the commands serve the Hub target, which is what a reader of a published card has
    assert shell_line(vllm_server_argv(target="Qwen/Qwen3-8B", drafter="me/d", block_size=16)) in text
    assert shell_line(sglang_command(target="Qwen/Qwen3-8B", drafter="me/d", block_size=16)) in text


def _greedy_cache(root: pathlib.Path, target: pathlib.Path, monkeypatch) -> pathlib.Path:
    """A tiny eval cache marked target_greedy, its 6 samples from two source files (3 records each)."""
    sources = []
    for name in ("mt.jsonl", "he.jsonl"):
        (root / name).write_text("".join(json.dumps({"i": i}) + "\n" for i in range(3)))
        sources.append({"path": str(root / name), "sha256": "-"})
    plain = train_helpers.fingerprint_for
    with monkeypatch.context() as m:
        m.setattr(train_helpers, "fingerprint_for", lambda *a, **k: dataclasses.replace(
            plain(*a, **k), target_greedy=True, sources=tuple(sources)))
        return tiny_cache(root / "eval", target, num_samples=6, seed=1)


def test_train_and_export_write_the_same_card(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_NO_PROGRESS", "1")
    target = tiny_target(tmp_path / "target")
    cache = tiny_cache(tmp_path / "cache", target, num_samples=12)
    evc = _greedy_cache(tmp_path, target, monkeypatch)
    run = tmp_path / "run"
    res = CliRunner().invoke(cli, ["train", "--cache", str(cache), "--model", str(target), "--output", str(run),
                                   "--device", "cpu", "--layers", "1", "--block-size", "4", "--num-anchors", "8",
                                   "--batch-tokens", "200", "--steps", "4", "--save-every", "2", "--log-every", "2",
                                   "--eval-cache", str(evc), "--eval-every", "2", "--lr", "3e-3"], prog_name="dflash")
    assert res.exit_code == 0, res.output
    evals = [r for r in read_metrics(run) if "heldout_tau" in r]
    assert [r["step"] for r in evals] == [2, 4]

    res = CliRunner().invoke(cli, ["export", str(run), "--output", str(tmp_path / "exp"), "--hub-id", "me/tiny-dflash"],
                             prog_name="dflash")
    assert res.exit_code == 0, res.output
    trained, exported = run / "drafter", tmp_path / "exp"
    for d in (trained, exported):
        text = (d / "README.md").read_text()
        assert text.startswith(FRONT)   # the tiny target records no Hub id: no base_model line
        assert (d / "dflash.py").read_bytes() == MODELING_TEMPLATE.read_bytes()
        card = read_card_data(d)
        assert card["heldout"][0]["step"] == 4 and card["heldout"][0]["name"] == "eval"
        taus = {s["name"]: s["tau"] for s in card["heldout"][0]["sources"]}
        assert taus == {"mt.jsonl": evals[-1]["heldout_tau/mt.jsonl"], "he.jsonl": evals[-1]["heldout_tau/he.jsonl"]}
        assert card["heldout"][0]["tau"] == evals[-1]["heldout_tau"]
        assert f"| eval | mt.jsonl | 4 |" in text and f"**{evals[-1]['heldout_tau']:.3f}**" in text
        assert card["recipe"]["steps"] == 4 and card["recipe"]["eval_every"] == 2
        assert card["data"]["samples"] == 12
    exported_text = (exported / "README.md").read_text()
    assert shell_line(vllm_server_argv(target=str(target), drafter="me/tiny-dflash", block_size=4)) in exported_text
    assert shell_line(sglang_command(target=str(target), drafter="me/tiny-dflash", block_size=4)) in exported_text
    assert '"num_speculative_tokens": 3' in exported_text and "--speculative-num-draft-tokens 4" in exported_text
    assert f"--speculative-draft-model-path {trained}" in (trained / "README.md").read_text()

    # the step-2 checkpoint's card holds step 2's evaluation
    res = CliRunner().invoke(cli, ["export", str(run / "checkpoints" / "step-00000002.pt"), "--output",
                                   str(tmp_path / "exp2")], prog_name="dflash")
    assert res.exit_code == 0, res.output
    card = read_card_data(tmp_path / "exp2")
    assert card["heldout"][0]["step"] == 2 and card["heldout"][0]["tau"] == evals[0]["heldout_tau"]
