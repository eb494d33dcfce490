"""benchmarks/bench_train_real.py: real-length workloads, the random cache of given lengths, the window rates,
the MFU denominators, and its --tiny CPU run (the path the lead runs on the H200 with the 27B shape)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from bench_train import shapes, window_summary  # noqa: E402
from bench_train_real import workload  # noqa: E402
from common import H200_SPEC_BF16, make_head_only_target, make_random_fp8_cache, mfu_fields  # noqa: E402


def test_real_workload_has_real_lengths_and_enough_steps():
    from dflash.train.loader import plan_epoch

    sh = shapes(False)
    asset = json.loads((BENCH / "assets" / "sharegpt_lengths.json").read_text())
    lengths, loss = workload("real", sh, steps=30, batch_tokens=4096, seed=0, tiny=False)
    assert set(lengths.tolist()) <= set(asset["lengths"])   # drawn from the asset, not made up
    assert len(set(lengths.tolist())) > 20                     # a spread of lengths, not one
    assert (loss >= 1).all() and (loss <= lengths).all()
    assert plan_epoch(lengths, seed=0, epoch=0, batch_tokens=4096, world_size=1, grad_accum=1).num_steps >= 30
    equal, none = workload("equal", sh, steps=30, batch_tokens=4096, seed=0, tiny=False)
    assert none is None and (equal == 2048).all() and len(equal) == 60
    capped, _ = workload("real", shapes(True), steps=3, batch_tokens=1024, seed=0, tiny=True)
    assert capped.max() <= 512


def test_real_workload_is_the_one_of_the_h200_results():
    """The H200 workload (30 steps of 4,096 tokens, seed 0) pinned: it is drawn through extraction's plan, so a
    change there changes what train_real_lengths_h200.json times (3bcc50b did: 88 samples, 124,783 tokens and
    602,976 block tokens before, these after). If this fails, tok/s is no longer comparable with the committed
    result: say so in that JSON (earlier_runs) and the README, then update the numbers here."""
    lengths, loss = workload("real", shapes(False), steps=30, batch_tokens=4096, seed=0, tiny=False)
    blocks = int((16 * np.minimum(512, np.maximum(loss - 1, 0))).sum())  # block rows: what a step's cost follows
    assert (len(lengths), int(lengths.sum()), int(loss.sum()), blocks) == (88, 124253, 96076, 692160)


def test_random_cache_of_given_lengths_has_those_lengths_and_loss_tokens(tmp_path):
    from dflash.cache import CacheReader

    sh = shapes(True)
    make_head_only_target(tmp_path / "t", hidden=sh["hidden"], vocab=sh["vocab"], target_layers=sh["target_layers"])
    lengths = np.array([7, 300, 512, 40, 129], np.int64)
    loss = np.array([3, 299, 100, 40, 1], np.int64)
    info = make_random_fp8_cache(tmp_path / "c", tmp_path / "t", sh, num_samples=5, lengths=lengths, loss_tokens=loss)
    assert info["tokens"] == int(lengths.sum())
    with CacheReader(tmp_path / "c") as r:
        np.testing.assert_array_equal(r.index.length, lengths)
        np.testing.assert_array_equal(r.index.num_loss_tokens, loss)
        s = r.read(1, dequantize=True)
        assert s.loss_mask[:1].sum() == 0 and s.loss_mask[1:].all()   # the prompt first, then the response
        assert tuple(s.hidden.shape) == (300, len(sh["taps"]), sh["hidden"])


def test_window_summary_weights_windows_by_time_and_drops_recompiles():
    rec = lambda step, tok_s, dt, mfu: {"step": step, "first_step": step - 1, "tokens_per_s": tok_s,  # noqa: E731
                                        "step_time_s": dt, "mfu": mfu, "stall_frac": 0.0, "mem_gb": 1.0}
    recs = [rec(2, 10.0, 9.0, 0.1),                       # warm-up
            rec(4, 100.0, 1.0, 0.5), rec(6, 300.0, 1.0, 0.7), rec(8, 100.0, 3.0, 0.5),
            rec(10, 1.0, 50.0, 0.01)]                     # a recompile window (> 2x the median step)
    s = window_summary(recs, warmup=2)
    assert s["measured_windows"] == 4 and s["slow_windows_left_out"] == 1
    assert s["tok_s_aggregate"] == pytest.approx((100 + 300 + 300) / 5.0)   # tokens over time, not a mean
    assert s["mfu_aggregate"] == pytest.approx((0.5 + 0.7 + 1.5) / 5.0)
    assert s["tok_s"] == pytest.approx(100.0)
    with pytest.raises(RuntimeError, match="no log window"):
        window_summary(recs[:1], warmup=2)


def test_mfu_fields_name_both_denominators():
    f = mfu_fields(0.5, peak=790e12)
    assert f["mfu"] == 0.5 and f["mfu_vs_spec_989"] == pytest.approx(0.5 * 790 / 989)
    assert "790" in f["mfu_denominator"] and "989" in f["mfu_vs_spec_989_denominator"]
    assert H200_SPEC_BF16 == 989e12 and mfu_fields(None, peak=1.0)["mfu_vs_spec_989"] is None


def test_tiny_run_writes_the_result_keys(tmp_path):
    """The --tiny CPU run end to end (real lengths: the trainer from the disk cache and the resident run)."""
    res = subprocess.run([sys.executable, str(BENCH / "bench_train_real.py"), "--tiny", "--workloads", "real",
                          "--work-dir", str(tmp_path / "w"), "--results-dir", str(tmp_path / "r")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads((tmp_path / "r" / "train_real_lengths_tiny_cpu.json").read_text())
    assert out["headline_workload"] == "real" and out["equal_lengths"] is None
    assert out["tok_s"] > 0 and 0 < out["mfu"] and out["mfu_vs_spec_989"] == pytest.approx(
        out["mfu"] * out["matmul_peak_flops"] / 989e12)
    assert 0.0 <= out["loader_stall_fraction"] < 1.0 and out["peak_mem_gib"] > 0
    real = out["workloads"]["real"]
    assert real["max_loss_diff_a_vs_b"] < 1e-4       # A (disk) and B (resident) train alike
    assert real["run_a"]["measured_windows"] >= 1 and real["run_a_records"]
    assert json.loads(res.stdout.strip().splitlines()[-1])["benchmark"] == "train_real_lengths"
