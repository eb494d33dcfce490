"""A sweep whose runs tie on the ranking metric names no single best run (issue 19): real runs with the same
config train bit-exactly alike on CPU, so they tie on the final loss; tau ties are checked on the rows."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from train_helpers import tiny_cache, tiny_target  # noqa: E402

from dflash.sweep.spec import spec_from_dict  # noqa: E402

BASE = dict(num_layers=1, block_size=4, num_anchors=8, batch_tokens=200, lr=3e-3, warmup_ratio=0.1, log_every=1,
            save_every=100, num_readers=1, prefetch=2, intermediate_size=64)


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("DFLASH_NO_PROGRESS", "1")


def test_tied_runs_are_reported_as_tied(tmp_path):
    """Through the real `dflash sweep` command: results.md and the printed summary name both runs."""
    import json

    from click.testing import CliRunner

    from cli.main import cli
    from dflash.sweep.report import collect_rows
    from dflash.sweep.spec import load_sweep_spec

    target = tiny_target(tmp_path / "target")
    cache = tiny_cache(tmp_path / "cache", target, num_samples=6)
    out = tmp_path / "sw"
    spec_file = tmp_path / "sweep.yaml"  # JSON is YAML
    spec_file.write_text(json.dumps({"base": BASE, "runs": [{"name": "a", "seed": 0, "steps": 2},
                                                            {"name": "b", "seed": 0, "steps": 2}]}))
    res = CliRunner().invoke(cli, ["sweep", str(spec_file), "--cache", str(cache), "--model", str(target),
                                   "--output", str(out), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    spec = load_sweep_spec(spec_file, cache=str(cache), model=str(target), output=str(out))
    loss = {r["name"]: r["final_loss"] for r in collect_rows(out, spec)}
    assert loss["a"] == loss["b"] is not None  # a real tie: same config, bit-exact on CPU
    said = f"No single best run: 2 runs tie on final loss {loss['a']:.4g}: a, b."
    md = (out / "results.md").read_text()
    assert "Best run" not in md and said in md
    assert not any(line.startswith("best run:") for line in res.output.splitlines()) and said in res.output


def _row(name, tau, loss=1.0):
    return {"name": name, "finished": True, "tau": tau, "final_loss": loss}


def test_rank_runs_by_tau_ties_and_single_best():
    from dflash.sweep.report import rank_runs

    tied = rank_runs([_row("x", 1.16), _row("y", 1.16), _row("z", 1.10)])
    assert tied.criterion == "tau" and tied.leaders == ("x", "y") and tied.best is None
    assert tied.describe() == "No single best run: 2 runs tie on tau 1.16: x, y."
    one = rank_runs([_row("x", 1.16), _row("y", 1.20), _row("z", 1.10)])
    assert one.best == "y" and one.describe() == "Best run: y (by tau)."
    # without tau on every finished run: by the final loss, lower is better
    by_loss = rank_runs([_row("x", None, 2.0), _row("y", 1.2, 2.0), _row("z", None, 3.0)])
    assert by_loss.criterion == "final_loss" and by_loss.leaders == ("x", "y")
    assert rank_runs([]).describe() == "No run has results yet."
