"""Issue 16 end to end: `dflash extract --storage int4` of a real (tiny, random) Qwen3.5 target and of the real
SmolLM2-135M -> `dflash cache info` / `verify` -> `dflash train` a few steps -> `dflash eval`, all through the CLI.
The 4-bit cache must hold the same samples as a bf16 extraction of the same data, within the format's error
(median per-token relative L2 ~0.08 on real SmolLM2 features: benchmarks/results/quant_probe_cpu.json), at ~0.3x
its hidden bytes."""

import json
import re

import numpy as np
import pytest
from click.testing import CliRunner

from cli.main import cli
from tests.e2e.helpers_extract import write_conversations

pytestmark = pytest.mark.slow


def _invoke(*args):
    res = CliRunner().invoke(cli, [str(a) for a in args], prog_name="dflash")
    assert res.exit_code == 0, res.output
    return res.output


def _relative_errors(int4_cache, bf16_cache):
    from dflash.cache import CacheReader

    with CacheReader(int4_cache) as a, CacheReader(bf16_cache) as b:
        assert np.array_equal(a.index.sample_id, b.index.sample_id) and len(a) > 0
        pa, pb = a.read_many(range(len(a)), dequantize=True), b.read_many(range(len(b)), dequantize=True)
        assert np.array_equal(pa.input_ids, pb.input_ids) and np.array_equal(pa.loss_mask, pb.loss_mask)
        x, y = pb.hidden.float(), pa.hidden.float()
        return ((y - x).norm(dim=-1) / x.norm(dim=-1).clamp(min=1e-30)).flatten()


def _extract_both(tmp, model, data, extra):
    for storage in ("int4", "bf16"):
        _invoke("extract", "--model", model, "--data", data, "--output", tmp / storage, "--storage", storage,
                "--no-progress", *extra)
    return tmp / "int4", tmp / "bf16"


def _info_and_verify(cache, *, hidden_bytes):
    out = _invoke("cache", "info", cache)
    assert re.search(r"storage\s+int4-g32-e4m3-h32\n", out)
    assert "4-bit int4 codes (-7..7), groups of 32 channels, e4m3 group scales x a float32 row scale, " \
           "Hadamard rotation over 32 channels" in out
    info = json.loads(_invoke("cache", "info", cache, "--json"))
    assert info["hidden_bytes_per_token"] == hidden_bytes
    assert "ok:" in _invoke("cache", "verify", cache)
    return info


def test_tiny_qwen35_extract_int4_train_eval(tmp_path, monkeypatch):
    from dflash.target.testing import tiny_qwen35_dir

    monkeypatch.setenv("DFLASH_NO_PROGRESS", "1")
    model = tiny_qwen35_dir(tmp_path / "model", num_layers=4)  # hidden 64: 2 groups of 32, 2 rotation blocks
    data = write_conversations(tmp_path / "data.jsonl", num=8, seed=0)
    int4, bf16 = _extract_both(tmp_path, model, data, ["--taps", "0,1,2", "--max-length", "128",
                                                        "--batch-tokens", "256", "--shard-tokens", "160"])
    info = _info_and_verify(int4, hidden_bytes=3 * (32 + 2 + 4))
    bf16_info = json.loads(_invoke("cache", "info", bf16, "--json"))
    assert info["tokens"] == bf16_info["tokens"] and info["shards"] > 1
    assert info["shard_bytes"] < 0.6 * bf16_info["shard_bytes"]  # ids/mask/index weigh a lot at D=64
    err = _relative_errors(int4, bf16)
    print(f"tiny: relative L2 median {err.median():.4f} max {err.max():.4f}")
    assert float(err.median()) < 0.15 and float(err.max()) < 0.5
    (tmp_path / "train.yaml").write_text("intermediate_size: 64\n")
    _invoke("train", "--cache", int4, "--model", model, "--output", tmp_path / "run", "--steps", 3,
            "--config", tmp_path / "train.yaml", "--layers", 1, "--block-size", 4, "--num-anchors", 8,
            "--batch-tokens", 200, "--log-every", 1, "--device", "cpu")
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 3 and all(np.isfinite(r["loss"]) for r in recs)
    res = json.loads(_invoke("eval", "--drafter", tmp_path / "run" / "drafter", "--cache", int4, "--model", model,
                             "--approximate", "--json", "--device", "cpu"))
    tau = res["overall"]["tau"] if "overall" in res else res["tau"]
    assert tau >= 1.0


def test_smollm2_extract_int4_train(tmp_path, smollm2_dir, monkeypatch):
    from dflash.data.assets import sharegpt_conversations

    monkeypatch.setenv("DFLASH_NO_PROGRESS", "1")
    model = str(smollm2_dir)
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in sharegpt_conversations(4)))
    int4, bf16 = _extract_both(tmp_path, model, data, ["--max-length", "96", "--batch-tokens", "512",
                                                        "--dtype", "float32"])
    _info_and_verify(int4, hidden_bytes=5 * (288 + 18 + 4))  # 1,550 B/token vs bf16's 5,760
    err = _relative_errors(int4, bf16)
    print(f"smollm2: relative L2 median {err.median():.4f} max {err.max():.4f}")
    assert float(err.median()) < 0.15
    _invoke("train", "--cache", int4, "--model", model, "--output", tmp_path / "run",
            "--config", "configs/train_smollm2.yaml", "--steps", 2, "--batch-tokens", 256, "--block-size", 4,
            "--num-anchors", 8, "--layers", 1, "--log-every", 1, "--device", "cpu")
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 2 and all(np.isfinite(r["loss"]) for r in recs)
    assert (tmp_path / "run" / "drafter" / "model.safetensors").exists()
