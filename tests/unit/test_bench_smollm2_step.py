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


def test_pairs_are_timed_side_by_side(tmp_path):
    """The barrier releases runs together; the overlap share says whether a pair's step times were shared ones."""
    import threading
    import time

    released = []
    t = threading.Thread(target=lambda: (bench.wait_for_all(str(tmp_path), "a", 2), released.append(time.time())))
    t.start()
    time.sleep(0.3)
    assert not released                       # the other run has not arrived
    bench.wait_for_all(str(tmp_path), "b", 2)
    t.join(5)
    assert released
    with pytest.raises(RuntimeError, match="did not reach"):
        bench.wait_for_all(str(tmp_path / "x"), "c", 2, timeout_s=0.2) if (tmp_path / "x").mkdir() is None else None
    assert bench.overlap_fraction([[0, 10], [0, 10]]) == 1.0
    assert bench.overlap_fraction([[0, 10], [5, 20]]) == pytest.approx(5 / 15)
    assert bench.overlap_fraction([[0, 10], [12, 20]]) == 0.0


def test_shared_group_takes_online_modes_only(capsys):
    assert bench.parse_args([]).shared == "online_fp8,online_bf16"
    assert bench.parse_args(["--shared", ""]).shared == ""
    with pytest.raises(SystemExit):
        bench.parse_args(["--shared", "cached,online_fp8"])
    assert "--shared takes online modes only" in capsys.readouterr().err
