"""`dflash train --eval-cache`: held-out tau (dflash.eval.heldout) of the drafter being trained, every
--eval-every steps and at the end, in metrics.jsonl beside the loss, on a real target-greedy eval cache of a
tiny random Qwen3.5 (dflash generate + dflash extract through the CLI) and a real training cache of that target."""

import json
import pathlib
import sys

import pytest
import torch
from click.testing import CliRunner

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from train_helpers import tiny_cache  # noqa: E402

from cli.main import cli  # noqa: E402
from dflash.train.metrics import read_metrics  # noqa: E402

TAPS = (1, 2)


def _invoke(args):
    res = CliRunner().invoke(cli, args, prog_name="dflash")
    assert res.exit_code == 0, res.output
    return res


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    from dflash.data.assets import humaneval_path, mtbench_questions_path
    from dflash.target.testing import tiny_qwen35_dir

    root = tmp_path_factory.mktemp("train_heldout")
    model = str(tiny_qwen35_dir(root / "target", num_layers=4))
    for name, src in (("mt.jsonl", mtbench_questions_path()), ("he.jsonl", humaneval_path())):
        _invoke(["generate", "--model", model, "--prompts", str(src), "--output", str(root / name), "--limit", "2",
                 "--max-new-tokens", "24", "--batch-size", "2", "--device", "cpu", "--dtype", "float32"])
    _invoke(["extract", "--model", model, "--data", str(root / "mt.jsonl"), "--data", str(root / "he.jsonl"),
             "--output", str(root / "eval"), "--dtype", "float32", "--max-length", "2048", "--taps", "1,2"])
    train_cache = tiny_cache(root / "train", pathlib.Path(model), num_samples=10, taps=TAPS)
    return model, str(train_cache), str(root / "eval")


def test_heldout_tau_every_n_steps_and_at_the_end(caches, tmp_path, monkeypatch):
    from dflash.drafter.config import DrafterConfig
    from dflash.drafter.model import DFlashDrafter
    from dflash.eval.heldout import HeldoutEvaluator
    from dflash.target.head import embedding_and_head
    from dflash.train.checkpoint import load_checkpoint

    monkeypatch.setenv("DFLASH_NO_PROGRESS", "1")
    model, train_cache, eval_cache = caches
    out = tmp_path / "run"
    res = _invoke(["train", "--cache", train_cache, "--model", model, "--output", str(out), "--device", "cpu",
                   "--layers", "1", "--block-size", "4", "--num-anchors", "8", "--batch-tokens", "200",
                   "--steps", "5", "--log-every", "3", "--save-every", "100", "--mask-token-id", "257",
                   "--eval-cache", eval_cache, "--eval-every", "2"])
    recs = read_metrics(out)
    assert [r["step"] for r in recs] == [2, 3, 4, 5]  # eval steps 2, 4 and the end; log step 3
    assert [s for r in recs for s in range(r["first_step"], r["step"] + 1)] == [1, 2, 3, 4, 5]
    evals = [r for r in recs if "heldout_tau" in r]
    assert [r["step"] for r in evals] == [2, 4, 5]
    for r in evals:
        assert r["heldout_tau"] >= 1.0 and r["heldout_sequences"] == 4
        assert {"heldout_tau/mt.jsonl", "heldout_tau/he.jsonl"} <= set(r)
        assert len(r["heldout_acc"]) == 3  # acceptance per block position 1..B-1
        assert r["train_over_heldout"] == pytest.approx(r["accept_len"] / r["heldout_tau"])
    assert f"held-out tau {evals[-1]['heldout_tau']:.3f}" in res.output

    # the last record's tau is the final drafter's (fp32 weights of the last checkpoint, evaluated afresh)
    state = load_checkpoint(out)
    dc = DrafterConfig(**{**state["drafter_config"], "target_layer_ids": tuple(state["drafter_config"]
                                                                              ["target_layer_ids"])})
    dr = DFlashDrafter(dc)
    dr.load_state_dict(state["model"])
    embed, head, _ = embedding_and_head(model, dtype=torch.float32)
    ev = HeldoutEvaluator.from_cache(eval_cache, taps=TAPS, device="cpu", model=model)
    assert ev.evaluate(dr, embed_VD=embed, lm_head_VD=head).tau == evals[-1]["heldout_tau"]
    config = json.loads((out / "config.json").read_text())
    assert config["train"]["eval_cache"] == eval_cache and config["train"]["eval_every"] == 2

    # the exported drafter's model card carries that held-out tau, the training data and the recipe
    from dflash.drafter.card import read_card_data

    card = read_card_data(out / "drafter")
    assert card["heldout"][0]["tau"] == evals[-1]["heldout_tau"] and card["heldout"][0]["step"] == 5
    assert card["data"]["samples"] == 10 and card["recipe"]["eval_every"] == 2
    assert f"{evals[-1]['heldout_tau']:.3f}" in (out / "drafter" / "README.md").read_text()


def test_sweep_reports_heldout_tau_per_run(caches, tmp_path, monkeypatch):
    import csv

    from dflash.sweep.runner import run_sweep
    from dflash.sweep.spec import spec_from_dict

    monkeypatch.setenv("DFLASH_NO_PROGRESS", "1")
    model, train_cache, eval_cache = caches
    base = dict(num_layers=1, block_size=4, num_anchors=8, batch_tokens=200, log_every=1, save_every=100,
                intermediate_size=64, mask_token_id=257, steps=2, eval_cache=eval_cache, eval_every=2)
    out = tmp_path / "sw"
    spec = spec_from_dict({"base": base, "grid": {"seed": [0, 1]}}, cache=train_cache, model=model, output=str(out))
    res = run_sweep(spec, output=out, device="cpu")
    rows = {r["name"]: r for r in csv.DictReader(open(out / "results.csv"))}
    for name in ("seed0", "seed1"):
        last = read_metrics(out / "runs" / name)[-1]
        assert rows[name]["heldout_tau"] == f"{last['heldout_tau']:.4g}" and rows[name]["heldout_step"] == "2"
    assert {r["name"]: r["heldout_tau"] for r in res.rows}["seed1"] == read_metrics(out / "runs" / "seed1")[-1][
        "heldout_tau"]
    assert "heldout_tau" in (out / "results.md").read_text()
