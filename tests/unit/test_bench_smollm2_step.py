"""bench_smollm2_step.py: its modes are real `dflash train` configurations (cached, online, online rounded through
a storage) of the reference recipe, and a mode it does not know is refused before anything runs."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "benchmarks"))
import bench_smollm2_step as bench  # noqa: E402


def test_modes_are_the_reference_recipe_cached_or_online(tmp_path):
    args = bench.parse_args([])
    assert (args.conversations, args.steps, args.warmup) == (2000, 120, 20)
    cfgs = {m: bench.train_config(args, model="m", cache="c", out=tmp_path / m, mode=m, seed=0) for m in bench.MODES}
    assert {(c.online, c.online_storage) for c in cfgs.values()} == {
        (False, None), (True, None), (True, "fp8"), (True, "bf16")}
    c = cfgs["online_fp8"]
    assert (c.num_layers, c.block_size, c.num_anchors, c.batch_tokens, c.lr) == (5, 16, 512, 16384, 6e-4)
    assert bench.parse_args(["--tiny"]).steps == 6


def test_unknown_mode_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--pairs", "cached,online_int8"])
    assert "unknown mode 'online_int8'" in capsys.readouterr().err
