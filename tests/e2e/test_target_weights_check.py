"""Issue 19: a target whose weights were replaced in place (same config.json and tokenizer) is refused by
`dflash train` and `dflash eval` against a cache extracted from the old weights (dflash.target.check)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from dflash.errors import CacheMismatchError


@pytest.fixture(scope="module")
def swapped(tmp_path_factory):
    """A real tiny extraction, then the target's model.safetensors replaced by another seed's weights."""
    from dflash.extract.driver import ExtractConfig
    from dflash.extract.launch import launch
    from dflash.target.testing import tiny_qwen35_dir

    base = tmp_path_factory.mktemp("weights")
    model = tiny_qwen35_dir(base / "model", num_layers=4)
    rng = np.random.default_rng(0)
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    data = base / "data.jsonl"
    data.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": " ".join(rng.choice(words, size=8))},
        {"role": "assistant", "content": " ".join(rng.choice(words, size=16))}]}) + "\n" for _ in range(6)))
    cache = base / "cache"
    launch(ExtractConfig(model=str(model), data=(str(data),), output=str(cache), taps=(0, 1, 2), max_length=128,
                         batch_tokens=256, shard_tokens=160, show_progress=False), num_procs=1, echo=lambda _: None)
    other = tiny_qwen35_dir(base / "other", num_layers=4, seed=7)
    assert (other / "config.json").read_text() == (model / "config.json").read_text()
    shutil.copyfile(other / "model.safetensors", model / "model.safetensors")
    return str(model), str(cache), base


def test_train_refuses_replaced_weights(swapped, monkeypatch):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
    from train_helpers import tiny_config

    from dflash.train.trainer import train

    monkeypatch.setenv("DFLASH_NO_PROGRESS", "1")
    model, cache, base = swapped
    with pytest.raises(CacheMismatchError) as e:
        train(tiny_config(cache=cache, model=model, output=str(base / "run"), steps=2), device="cpu")
    assert e.value.field == "target_weights_hash"
    assert "target_weights_hash" in str(e.value) and "--model" in str(e.value)


def test_eval_refuses_replaced_weights(swapped):
    from dflash.eval.evaluate import EvalConfig, evaluate_cache

    model, cache, base = swapped
    with pytest.raises(CacheMismatchError) as e:
        # Refused before the drafter is read: no drafter is needed to show it.
        evaluate_cache(drafter_dir=str(base / "no-drafter"), cache_dir=cache, model=model,
                       cfg=EvalConfig(device="cpu", approximate=True), progress=False)
    assert e.value.field == "target_weights_hash"


def test_matching_or_unknown_weights_pass_the_check(swapped):
    """The refusals above are the weights, not the set-up: the same check passes with the current weights'
    hash, and with '' (a cache from before the field, whose weights are unknown)."""
    import dataclasses

    from transformers import AutoTokenizer

    from dflash.cache import CacheReader
    from dflash.target.check import check_target_matches
    from dflash.target.identity import target_weights_hash

    model, cache, _ = swapped
    fp = CacheReader(cache).fingerprint
    now = target_weights_hash(model)
    assert fp.target_weights_hash and fp.target_weights_hash != now
    for recorded in (now, ""):
        check_target_matches(dataclasses.replace(fp, target_weights_hash=recorded), model_dir=model,
                             tokenizer=AutoTokenizer.from_pretrained(model), embed_hidden=fp.hidden_size,
                             num_target_layers=fp.num_target_layers)
