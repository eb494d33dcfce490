"""End to end on real data: `dflash extract` of real SmolLM2-135M hidden states on ShareGPT conversations, then
`dflash train` on that cache. The loss must fall and block position 1 must be far above chance (1/49152)."""

import json
import time

import numpy as np
import pytest
from click.testing import CliRunner

from cli.main import cli
from dflash.train.metrics import read_metrics

pytestmark = pytest.mark.slow
NUM_CONVERSATIONS = 24


@pytest.fixture(scope="module")
def smol_cache(tmp_path_factory):
    from dflash.data.assets import sharegpt_conversations
    from dflash.extract.driver import ExtractConfig
    from dflash.extract.launch import launch
    from dflash.target.assets import smollm2_hf_dir

    d = tmp_path_factory.mktemp("smol")
    # the folder every SmolLM2 test shares (bf16 weights, computed in float32 here): a float32-stored copy was a
    # second GGUF conversion in CI (~50 s) for no assertion that needs it
    model = str(smollm2_hf_dir())
    lines = [json.dumps(c) for c in sharegpt_conversations(NUM_CONVERSATIONS)]
    (d / "chats.jsonl").write_text("\n".join(lines) + "\n")
    cfg = ExtractConfig(model=model, data=(str(d / "chats.jsonl"),), output=str(d / "cache"), dtype="float32",
                        max_length=256, batch_tokens=2048, show_progress=False)
    t0 = time.time()
    launch(cfg, num_procs=1, echo=lambda *a, **k: None)
    print(f"extract: {time.time() - t0:.1f} s")
    return model, d / "cache"


def test_train_on_real_smollm2_cache(smol_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_NO_PROGRESS", "1")
    model, cache = smol_cache
    out = tmp_path / "run"
    res = CliRunner().invoke(cli, ["train", "--cache", str(cache), "--model", model, "--output", str(out),
                                   "--config", "configs/train_smollm2.yaml", "--steps", "40", "--lr", "3e-3",
                                   "--batch-tokens", "512", "--block-size", "4", "--num-anchors", "16", "--log-every", "1", "--device", "cpu"],
                             prog_name="dflash")
    assert res.exit_code == 0, res.output
    recs = read_metrics(out)
    losses = [r["loss"] for r in recs]
    assert len(losses) == 40
    first, last = np.mean(losses[:5]), np.mean(losses[-5:])
    acc1 = np.mean([r["acc"][0] for r in recs[-5:]])
    print(f"loss {first:.3f} -> {last:.3f}; acc@1 over the last 5 steps {acc1:.3f}; "
          f"accept_len {recs[-1]['accept_len']:.3f}; tokens/s {recs[-1]['tokens_per_s']:.0f}")
    assert last < first - 1.0
    assert acc1 > 0.02  # chance is 1/49152: about 1000x above it
    assert all(0.0 <= r["stall_frac"] <= 1.0 for r in recs)
    assert (out / "drafter" / "model.safetensors").exists()
