"""`dflash extract` on real models (tiny random Qwen3.5, real SmolLM2-135M): the cached features equal the
per-sample, unbatched HF `output_hidden_states[k+1]`; the pre-flight (dry run, out-of-space, fingerprint
mismatch) refuses before any model work; bad input is skipped and reported by reason."""

import json
import shutil
from collections import namedtuple

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from cli.main import cli
from dflash.cache import CacheReader
from dflash.extract.driver import ExtractConfig
from dflash.extract.launch import launch

QWEN_TAPS = (0, 2, 4)


def _conversations(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    words = "the cat sat on a mat while dogs ran far away and birds sang songs".split()
    out = []
    for i in range(n):
        q = " ".join(rng.choice(words, size=int(rng.integers(2, 10))))
        a = " ".join(rng.choice(words, size=int(rng.integers(3, 16))))
        msgs = [{"role": "user", "content": f"{i}: {q}?"}, {"role": "assistant", "content": a}]
        if i % 3 == 0:  # some multi-turn
            msgs += [{"role": "user", "content": "and then?"}, {"role": "assistant", "content": a[::-1]}]
        out.append({"messages": msgs})
    return out


BAD_LINES = [
    "{not json",                                                          # bad_json
    json.dumps([1, 2]),                                                   # wrong_type
    json.dumps({"text": "no conversation here"}),                         # no_conversation
    json.dumps({"messages": [{"role": "wizard", "content": "x"}]}),       # unknown_role
    json.dumps({"messages": []}),                                         # empty_conversation
    json.dumps({"messages": [{"role": "user", "content": "hi"}]}),        # no_assistant_turn
    json.dumps({"input_ids": [1, 2, 3]}),                                 # bad_pretokenized
    json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 0, 0]}),         # no_loss_tokens
    json.dumps({"messages": [{"role": "user", "content": "long " * 300},  # over_length
                             {"role": "assistant", "content": "ok"}]}),
]
BAD_REASONS = {"bad_json", "wrong_type", "no_conversation", "unknown_role", "empty_conversation",
               "no_assistant_turn", "bad_pretokenized", "no_loss_tokens", "over_length", "truncated_file"}


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    lines = [json.dumps(c) for c in _conversations(6)]
    lines[3:3] = BAD_LINES  # bad records between good ones: ids of later samples must still be stable
    (d / "chats.jsonl").write_text("\n".join(lines) + "\n")
    good = json.dumps(_conversations(2, seed=1))
    (d / "cut.json").write_text(good[:-1] + ', {"messages": [{"role": "us')  # truncated_file
    return [str(d / "chats.jsonl"), str(d / "cut.json")]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    from dflash.target.testing import tiny_qwen35_dir

    return str(tiny_qwen35_dir(tmp_path_factory.mktemp("qwen")))


@pytest.fixture(scope="module")
def smol_dir():
    from dflash.target.assets import smollm2_hf_dir

    return str(smollm2_hf_dir())  # converted once per machine, ~20 s


def _run(model, data, out, **kw):
    kw.setdefault("max_length", 256)
    cfg = ExtractConfig(model=model, data=tuple(data), output=str(out), dtype="float32", batch_tokens=512,
                        shard_tokens=128, show_progress=False, **kw)
    return launch(cfg, num_procs=1, echo=lambda _m: None)


def _check_against_hf(model_dir, cache_dir, taps):
    """Every cached sample vs the same model run on that sample alone with output_hidden_states."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    reader = CacheReader(cache_dir)
    assert reader.tap_layer_ids == taps
    num_bit_equal = 0
    for i in range(len(reader)):
        s = reader.read(i)
        with torch.no_grad():
            hs = model(torch.from_numpy(s.input_ids.astype(np.int64))[None], output_hidden_states=True).hidden_states
        ref32_TKD = torch.stack([hs[k + 1][0] for k in taps], dim=1)
        ref_TKD = ref32_TKD.to(torch.bfloat16)
        assert s.hidden.dtype == torch.bfloat16 and s.hidden.shape == ref_TKD.shape
        # bf16 storage of an fp32 run: one bf16 rounding step apart (8e-3 of the element), plus the fp32 noise
        # of batched vs unbatched matmuls, which scales with the row's magnitude, not the element's: ~2 fp32
        # ulps of the row's largest value (on an AVX-512-BF16 Xeon an element of 1.2e-3 in a row reaching 543
        # came out 2.3e-5 apart; 1e-5 of absolute slack held on the CPUs before it).
        err_TKD = (s.hidden.float() - ref_TKD.float()).abs()
        bound_TKD = 8e-3 * ref_TKD.float().abs() + 2.5e-7 * ref32_TKD.abs().amax(-1, keepdim=True)
        assert (err_TKD <= bound_TKD).all(), f"sample {i}: {int((err_TKD > bound_TKD).sum())} values apart, " \
            f"worst {float((err_TKD - bound_TKD).max()):.3g} over the bound"
        num_bit_equal += int(torch.equal(s.hidden.view(torch.uint16), ref_TKD.view(torch.uint16)))
    return len(reader), num_bit_equal


def test_qwen35_cache_matches_unbatched_hidden_states(qwen_dir, data_path, tmp_path):
    res = _run(qwen_dir, data_path, tmp_path / "c", taps=QWEN_TAPS)
    assert res.num_samples == 8 and set(res.skip_counts) == BAD_REASONS
    n, _ = _check_against_hf(qwen_dir, tmp_path / "c", QWEN_TAPS)
    assert n == 8


def test_smollm2_cache_matches_unbatched_hidden_states(smol_dir, data_path, tmp_path):
    res = _run(smol_dir, data_path, tmp_path / "c")  # default taps: (1, 8, 14, 20, 27) of 30 layers
    assert res.num_samples == 8
    n, _ = _check_against_hf(smol_dir, tmp_path / "c", (1, 8, 14, 20, 27))
    assert n == 8


def test_fp8_storage_dequantizes_close(qwen_dir, data_path, tmp_path):
    _run(qwen_dir, data_path[:1], tmp_path / "c", taps=QWEN_TAPS, storage="fp8")
    bf = tmp_path / "b"
    _run(qwen_dir, data_path[:1], bf, taps=QWEN_TAPS)
    r8, r16 = CacheReader(tmp_path / "c"), CacheReader(bf)
    for i in range(len(r8)):
        a, b = r8.read(i, dequantize=True), r16.read(i)
        assert a.sample_id == b.sample_id
        torch.testing.assert_close(a.hidden.float(), b.hidden.float(), rtol=0.07, atol=1e-3)


def _cli(*args):
    return CliRunner().invoke(cli, ["extract", *args], catch_exceptions=False)


def test_help_explains_every_option():
    res = _cli("--help")
    assert res.exit_code == 0
    for opt in ("--model", "--data", "--output", "--taps", "--storage", "--max-length", "--gpus", "--procs",
                "--dry-run", "--batch-tokens", "--no-thinking", "--shard-tokens", "--fla-conv"):
        assert opt in res.output


def test_missing_paths_fail_before_model_work(qwen_dir, data_path, tmp_path):
    res = _cli("--model", str(tmp_path / "nope"), "--data", data_path[0], "--output", str(tmp_path / "c"))
    assert res.exit_code == 1 and "target model not found" in res.output
    res = _cli("--model", qwen_dir, "--data", str(tmp_path / "x.jsonl"), "--output", str(tmp_path / "c"))
    assert res.exit_code == 1 and "does not exist" in res.output
    assert not (tmp_path / "c").exists()


def test_dry_run_reports_and_writes_nothing(qwen_dir, data_path, tmp_path):
    out = tmp_path / "c"
    res = _cli("--model", qwen_dir, *sum([["--data", p] for p in data_path], []), "--output", str(out),
               "--taps", "0,2,4", "--max-length", "256", "--dry-run", "--gpus", "2")
    assert res.exit_code == 0, res.output
    assert "8 to extract" in res.output and "bytes on disk" in res.output and "ETA" in res.output
    for reason in BAD_REASONS:  # every bad-input class with its count and a location
        assert f"{reason}=1" in res.output
    assert "chats.jsonl:4" in res.output  # the first bad line, with file:line
    assert not out.exists()


def test_out_of_space_is_refused(qwen_dir, data_path, tmp_path, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10**6, 10**6 - 10, 10))
    out = tmp_path / "c"
    res = _cli("--model", qwen_dir, "--data", data_path[0], "--output", str(out), "--taps", "0,2,4",
               "--max-length", "256")
    assert res.exit_code == 1 and "not enough space" in res.output
    assert not out.exists()


def test_fingerprint_mismatch_names_the_field(qwen_dir, data_path, tmp_path):
    out = tmp_path / "c"
    _run(qwen_dir, data_path[:1], out, taps=QWEN_TAPS)
    before = sorted(p.name for p in (out / "shards").iterdir())
    common = ["--model", qwen_dir, "--data", data_path[0], "--output", str(out), "--dtype", "float32"]
    for extra, field in ((["--taps", "0,2,4", "--storage", "fp8", "--max-length", "256"], "storage"),
                         (["--taps", "0,2", "--max-length", "256"], "tap_layer_ids"),
                         (["--taps", "0,2,4", "--max-length", "128"], "max_length"),
                         (["--taps", "0,2,4", "--max-length", "256", "--no-thinking"], "template_kwargs")):
        res = _cli(*common, *extra)
        assert res.exit_code == 1 and f"requested {field} " in res.output, res.output
    assert sorted(p.name for p in (out / "shards").iterdir()) == before
    # the same settings resume: nothing left to do
    res = _cli(*common, "--taps", "0,2,4", "--max-length", "256", "--batch-tokens", "512", "--no-progress")
    assert res.exit_code == 0 and "0 to extract" in res.output
    # another data source with the cache's settings grows the cache (tests/e2e/test_cache_grow.py holds it equal
    # to a cache of the union): the stored samples are kept and the new ones come as new shards
    res = _cli("--model", qwen_dir, "--data", data_path[1], "--output", str(out), "--dtype", "float32",
               "--taps", "0,2,4", "--max-length", "256", "--no-progress")
    assert res.exit_code == 0 and "already in the cache" in res.output, res.output
    after = sorted(p.name for p in (out / "shards").iterdir())
    assert set(before) < set(after)
