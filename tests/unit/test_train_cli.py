"""`dflash train` / `dflash export` through click's CliRunner: help texts, refusals and clear errors."""

import json
import pathlib
import sys

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from train_helpers import tiny_cache, tiny_target  # noqa: E402

from cli.main import cli  # noqa: E402


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    target = tiny_target(d / "target")
    other = tiny_target(d / "other", num_layers=2)  # a different target: the cache must refuse it
    return target, other, tiny_cache(d / "cache", target, num_samples=12)


@pytest.fixture
def runner(monkeypatch):
    monkeypatch.setenv("DFLASH_NO_PROGRESS", "1")
    return CliRunner()


@pytest.mark.parametrize("cmd", ["train", "export"])
def test_help(runner, cmd):
    res = runner.invoke(cli, [cmd, "--help"], prog_name="dflash")
    assert res.exit_code == 0, res.output
    assert "Usage: dflash " + cmd in res.output
    if cmd == "train":
        for opt in ("--cache", "--model", "--output", "--config", "--steps", "--epochs", "--taps", "--gpus",
                    "--resume", "--lr", "--batch-tokens", "--grad-accum", "--seed", "--num-anchors", "--layers",
                    "--save-every", "--log-every", "--loss-normalization", "--anchor-positions", "--step-samples"):
            assert opt in res.output


def _args(cache, model, out, *extra):
    return ["train", "--cache", str(cache), "--model", str(model), "--output", str(out), "--device", "cpu",
            "--layers", "1", "--block-size", "4", "--num-anchors", "8", "--batch-tokens", "200", *extra]


def test_train_export_and_refusals(runner, assets, tmp_path):
    target, _, cache = assets
    yaml = tmp_path / "c.yaml"
    yaml.write_text("intermediate_size: 64\nlr: 0.003\nlog_every: 1\n")
    out = tmp_path / "run"
    res = runner.invoke(cli, _args(cache, target, out, "--steps", "3", "--config", str(yaml)))
    assert res.exit_code == 0, res.output
    assert "drafter exported to" in res.output
    # train and sweep print one meaning of "final loss": the last log window's mean (log_every 1 here)
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert f"final loss {last['loss']:.4f} (mean of step 3, the last log window)" in res.output
    resolved = json.loads((out / "config.json").read_text())
    assert resolved["train"]["intermediate_size"] == 64 and resolved["train"]["steps"] == 3
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3

    res = runner.invoke(cli, _args(cache, target, out, "--steps", "3"))
    assert res.exit_code == 1 and "is not empty" in res.output and "--resume" in res.output

    # --resume of a finished run trains nothing more and says so (it used to crash formatting a None loss)
    res = runner.invoke(cli, _args(cache, target, out, "--steps", "3", "--config", str(yaml), "--resume"))
    assert res.exit_code == 0, res.output
    assert "trained 3 steps (already finished)" in res.output
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3

    res = runner.invoke(cli, ["export", str(out), "--output", str(tmp_path / "exp")])
    assert res.exit_code == 0, res.output
    assert "exported step 3 (" in res.output and "step-00000003.pt" in res.output
    hf = json.loads((tmp_path / "exp" / "config.json").read_text())
    assert hf["dflash_config"]["target_layer_ids"] == [0, 1, 2] and hf["block_size"] == 4

    res = runner.invoke(cli, ["export", str(tmp_path / "nothing"), "--output", str(tmp_path / "e2")])
    assert res.exit_code == 1 and "does not exist" in res.output


def test_missing_taps_lists_available(runner, assets, tmp_path):
    target, _, cache = assets
    res = runner.invoke(cli, _args(cache, target, tmp_path / "r", "--steps", "1", "--taps", "0,3"))
    assert res.exit_code == 1
    assert "taps [3] are not in the cache" in res.output and "[0, 1, 2]" in res.output


def test_wrong_target_is_a_cache_mismatch(runner, assets, tmp_path):
    _, other, cache = assets
    res = runner.invoke(cli, _args(cache, other, tmp_path / "r", "--steps", "1"))
    assert res.exit_code == 1
    assert "num_target_layers 2 != the cache's 4" in res.output


def test_config_errors(runner, assets, tmp_path):
    target, _, cache = assets
    bad = tmp_path / "bad.yaml"
    bad.write_text("learning_rate: 0.1\n")
    res = runner.invoke(cli, _args(cache, target, tmp_path / "r", "--config", str(bad)))
    assert res.exit_code == 1 and "unknown train config keys ['learning_rate']" in res.output
    res = runner.invoke(cli, _args(cache, target, tmp_path / "r", "--grad-accum", "0"))
    assert res.exit_code == 1 and "grad_accum=0" in res.output
    res = runner.invoke(cli, _args(tmp_path / "no-cache", target, tmp_path / "r"))
    assert res.exit_code == 1 and "no-cache" in res.output


def test_loss_normalization_is_recorded_and_pinned_on_resume(runner, assets, tmp_path):
    """--loss-normalization sequence trains, lands in config.json and the drafter card's recipe; a resume with
    the other normalization is refused (it changes the math); a bad value in YAML is a one-line error."""
    target, _, cache = assets
    out = tmp_path / "seq"
    res = runner.invoke(cli, _args(cache, target, out, "--steps", "2", "--loss-normalization", "sequence"))
    assert res.exit_code == 0, res.output
    assert json.loads((out / "config.json").read_text())["train"]["loss_normalization"] == "sequence"
    assert "loss_normalization" in (out / "drafter" / "README.md").read_text()
    res = runner.invoke(cli, _args(cache, target, out, "--steps", "2", "--resume"))
    assert res.exit_code == 1 and "different 'loss_normalization'" in res.output
    res = runner.invoke(cli, _args(cache, target, tmp_path / "x", "--loss-normalization", "samples"))
    assert res.exit_code == 2 and "'samples' is not one of 'token', 'sequence', 'sample'" in res.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("loss_normalization: samples\n")
    res = runner.invoke(cli, _args(cache, target, tmp_path / "y", "--config", str(bad)))
    assert res.exit_code == 1 and "loss_normalization='samples': choose token, sequence or sample" in res.output


def test_anchor_positions_reach_the_draw_and_are_pinned_on_resume(runner, assets, tmp_path):
    """--anchor-positions full_blocks trains on other anchors than the default (the step-1 loss differs, same
    init), lands in config.json and the card; a resume with the default is refused; a bad value is refused."""
    from dflash.train.metrics import read_metrics

    target, _, cache = assets
    losses = {}
    for rule in ("response", "full_blocks"):
        out = tmp_path / rule
        res = runner.invoke(cli, _args(cache, target, out, "--steps", "1", "--log-every", "1",
                                       "--anchor-positions", rule))
        assert res.exit_code == 0, res.output
        assert json.loads((out / "config.json").read_text())["train"]["anchor_positions"] == rule
        losses[rule] = read_metrics(out)[0]["loss"]
    assert losses["response"] != losses["full_blocks"]
    assert "anchor_positions" in (tmp_path / "full_blocks" / "drafter" / "README.md").read_text()
    res = runner.invoke(cli, _args(cache, target, tmp_path / "full_blocks", "--steps", "2", "--resume"))
    assert res.exit_code == 1 and "different 'anchor_positions'" in res.output
    res = runner.invoke(cli, _args(cache, target, tmp_path / "x", "--anchor-positions", "all"))
    assert res.exit_code == 2 and "'all' is not one of 'response', 'full_blocks'" in res.output


def test_shuffle_block_trains_resumes_exactly_and_is_pinned(runner, assets, tmp_path):
    """--shuffle-block 3 lands in config.json; a run cut after 2 of 4 steps and resumed logs the same losses as the
    uncut run (the block order is a function of seed and epoch); a resume with another block is refused."""
    from dflash.train.metrics import read_metrics

    target, _, cache = assets
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    base = ("--steps", "4", "--log-every", "1", "--save-every", "2", "--shuffle-block", "3")
    res = runner.invoke(cli, _args(cache, target, whole, *base))
    assert res.exit_code == 0, res.output
    assert json.loads((whole / "config.json").read_text())["train"]["shuffle_block"] == 3
    stop = tmp_path / "stop.yaml"
    stop.write_text("stop_after_steps: 2\n")
    res = runner.invoke(cli, _args(cache, target, cut, *base, "--config", str(stop)))
    assert res.exit_code == 0, res.output
    assert len(read_metrics(cut)) == 2
    res = runner.invoke(cli, _args(cache, target, cut, *base, "--resume"))
    assert res.exit_code == 0, res.output
    assert [m["loss"] for m in read_metrics(cut)] == [m["loss"] for m in read_metrics(whole)]
    res = runner.invoke(cli, _args(cache, target, cut, "--steps", "6", "--shuffle-block", "0", "--resume"))
    assert res.exit_code == 1 and "different 'shuffle_block'" in res.output
