"""benchmarks/bench_extract.py's peer baseline: the peers' HF path (padded dataset-order batches, full-depth
output_hidden_states, one torch.save file per sample from saver threads) writes the right features, and the
speed ratio against it is only reported for a run long enough to be warm."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from bench_extract import (PEER_MIN_TOKENS, build_random_model, make_model_dir, peer_ratio,  # noqa: E402
                           peer_style, write_pretokenized)


def test_peer_style_saves_each_samples_tapped_features(tmp_path):
    from dflash.target.testing import tiny_qwen35_text_kwargs

    make_model_dir(tmp_path / "m", tiny_qwen35_text_kwargs(num_layers=4, vocab_size=259))
    model, _ = build_random_model(tmp_path / "m", torch.device("cpu"), fla_conv=False)
    lengths = [5, 40, 12, 33, 7, 25, 18, 9, 30]
    write_pretokenized(tmp_path / "d.jsonl", lengths, [n // 2 for n in lengths], vocab=259, seed=0)
    taps = (1, 3)
    r = peer_style(model, tmp_path / "d.jsonl", tmp_path / "peer", taps, torch.device("cpu"), batch_size=4,
                   max_tokens=10_000, io_threads=2, io_queue=2)
    assert r["samples"] == len(lengths) == r["files"] and r["tokens"] == sum(lengths)
    assert r["padding_fraction"] > 0.1   # shuffled dataset order, padded to each batch's longest
    assert r["tok_s"] > 0 and r["warm_pass_s"] > 0
    for f in sorted((tmp_path / "peer").glob("*.pt")):
        saved = torch.load(f)
        ids = saved["input_ids"]
        with torch.inference_mode():
            hs = model(input_ids=ids[None], output_hidden_states=True).hidden_states
        want = torch.stack([hs[k + 1][0] for k in taps], dim=1)
        assert saved["hidden_states"].shape == (len(ids), len(taps), model.config.hidden_size)
        # the padded batch (attention mask) and the lone sample agree up to bf16 rounding
        torch.testing.assert_close(saved["hidden_states"].float(), want.float(), atol=5e-2, rtol=5e-2)


def test_the_ratio_needs_a_warm_run_of_enough_tokens():
    assert peer_ratio(9000.0, {}) is None
    assert peer_ratio(9000.0, {"tokens": PEER_MIN_TOKENS - 1, "tok_s": 100.0}) is None
    assert peer_ratio(9000.0, {"tokens": PEER_MIN_TOKENS, "tok_s": 100.0}) == pytest.approx(90.0)


def test_tiny_run_writes_a_complete_result(tmp_path):
    """The whole script on CPU (tiny Qwen3.5, fp8): the result JSON ends complete, with the extraction figures
    that its first, early write holds too (what a device call cut in the compares brings back)."""
    import json
    import subprocess

    proc = subprocess.run([sys.executable, str(BENCH / "bench_extract.py"), "--tiny", "--tokens", "4000",
                           "--storage", "fp8", "--peer-tokens", "0", "--work-dir", str(tmp_path / "w"),
                           "--results-dir", str(tmp_path / "r"), "--profile"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads((tmp_path / "r" / "extract_cpu.json").read_text())
    assert got["complete"] and "incomplete" not in got
    assert got["fp8"]["tok_s"] > 0 and got["fp8"]["tokens"] == got["real_tokens"] > 0
    assert 0 < got["fp8"]["ratio_vs_forward_only"] and got["matmul_sustained_flops"] > 0
    # the steady rate leaves out the setup and the final drain, never more time than the whole run's rate
    assert got["fp8"]["mfu_steady"] >= got["fp8"]["mfu"] > 0
    assert json.loads(proc.stdout.strip().splitlines()[-1])["fp8"]["tok_s"] == got["fp8"]["tok_s"]
    # --profile: the forward-only pass once more under torch.profiler, per batch (no CUDA kernels on CPU)
    prof = got["forward_profile"]
    assert prof["real_tokens"] == got["real_tokens"] and prof["batches"] >= 1 and prof["step_ms"] > 0
