"""`dflash eval` through the CLI on real caches (CacheWriter) and a real exported drafter and tiny target:
refuses a cache that is not target_greedy, runs with --approximate, reports per source, checks the target."""

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from cli.main import cli
from dflash.cache import CacheWriter, Fingerprint
from dflash.drafter.config import DrafterConfig
from dflash.drafter.export import export_drafter
from dflash.drafter.model import DFlashDrafter
from dflash.eval.generate import target_config_hash
from dflash.target.identity import tokenizer_hash

TAPS = (1, 2)
D = 64


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from dflash.target.testing import tiny_qwen35_dir

    root = tmp_path_factory.mktemp("evalcli")
    model = tiny_qwen35_dir(root / "target", num_layers=4)
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=D, intermediate_size=64, target_layer_ids=TAPS, num_target_layers=4,
                        mask_token_id=258, vocab_size=264, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, block_size=4)
    drafter = export_drafter(DFlashDrafter(cfg), cfg, root / "drafter", dtype=torch.float32)
    # two data sources: a.jsonl holds sample ids 0-1, b.jsonl id 2
    (root / "a.jsonl").write_text('{"x": 1}\n{"x": 2}\n')
    (root / "b.jsonl").write_text('{"x": 3}\n')
    return root, str(model), str(drafter)


def make_cache(root, model, name, *, greedy, config_hash=None, taps=TAPS, tok_hash=None, num_target_layers=4,
               sources=None):
    from transformers import AutoTokenizer

    tok_hash = tok_hash or tokenizer_hash(AutoTokenizer.from_pretrained(model))
    sources = sources or ({"path": str(root / "a.jsonl"), "sha256": "-"}, {"path": str(root / "b.jsonl"), "sha256": "-"})
    fp = Fingerprint(target=model, target_config_hash=config_hash or target_config_hash(model),
                     num_target_layers=num_target_layers, hidden_size=D, target_dtype="float32",
                     tokenizer_hash=tok_hash, chat_template_hash="c",
                     tap_layer_ids=taps, storage="bf16", sources=sources, max_length=64, target_greedy=greedy)
    g = torch.Generator().manual_seed(3)
    lengths = np.array([20, 17, 25])
    T = int(lengths.sum())
    ids = torch.randint(0, 258, (T,), generator=g).numpy().astype(np.int32)
    mask = np.zeros(T, np.uint8)
    off = 0
    for n in lengths:
        mask[off + 6: off + n] = 1   # 6 prompt tokens, then the response
        off += n
    with CacheWriter(root / name, fp, shard_tokens=40) as w:
        w.append(sample_ids=np.arange(3), lengths=lengths, input_ids=ids, loss_mask=mask,
                 hidden=torch.randn(T, len(taps), D, generator=g))
        w.close()
    return str(root / name)


def run(*args):
    return CliRunner().invoke(cli, ["eval", *args], prog_name="dflash")


def test_refuses_unmarked_cache(assets):
    root, model, drafter = assets
    cache = make_cache(root, model, "plain", greedy=False)
    res = run("--drafter", drafter, "--cache", cache, "--model", model)
    assert res.exit_code == 1
    assert "not marked target_greedy" in res.output and "--approximate" in res.output

    res = run("--drafter", drafter, "--cache", cache, "--model", model, "--approximate", "--device", "cpu")
    assert res.exit_code == 0, res.output
    assert "APPROXIMATE" in res.output


def test_marked_cache_json_per_source(assets):
    root, model, drafter = assets
    cache = make_cache(root, model, "greedy", greedy=True)
    res = run("--drafter", drafter, "--cache", cache, "--model", model, "--json", "--chunk-anchors", "5",
              "--device", "cpu")
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["exact"] is True and out["block_size"] == 4 and out["dtype"] == "float32"
    assert [(s["name"], s["num_sequences"]) for s in out["sources"]] == [("a.jsonl", 2), ("b.jsonl", 1)]
    ov = out["overall"]
    assert ov["num_sequences"] == 3 and 1.0 <= out["tau"] <= 4.0
    # every response token after the first is emitted by some step (the last step may overshoot by one)
    assert sum(int(k) * c for k, c in ov["accept_length_counts"].items()) >= (14 + 11 + 19) - 3
    assert abs(sum(ov["accept_length_fraction"].values()) - 1) < 1e-9
    assert out["tau"] == pytest.approx(np.mean([s["tau"] for s in out["sources"] for _ in range(s["num_sequences"])]))


def test_wrong_target_and_missing_taps(assets):
    root, model, drafter = assets
    cache = make_cache(root, model, "other", greedy=True, config_hash="0" * 64)
    res = run("--drafter", drafter, "--cache", cache, "--model", model)
    assert res.exit_code == 1 and "target_config_hash" in res.output
    cache = make_cache(root, model, "fewtaps", greedy=True, taps=(1, 3))
    res = run("--drafter", drafter, "--cache", cache, "--model", model, "--device", "cpu")
    assert res.exit_code == 1 and "not in the cache" in res.output


def test_wrong_target_message_names_objects_and_short_hashes(assets):
    root, model, drafter = assets
    cache = make_cache(root, model, "other2", greedy=True, config_hash="ab" * 32)
    res = run("--drafter", drafter, "--cache", cache, "--model", model)
    assert res.exit_code == 1
    found = target_config_hash(model)
    assert f"the target's (--model {model}) target_config_hash {found[:12]} != the cache's {'ab' * 6}" in res.output
    assert found not in res.output and "ab" * 32 not in res.output
    assert "fingerprint" not in res.output and "this run" not in res.output


def test_refuses_a_cache_of_another_tokenizer_or_depth(assets):
    root, model, drafter = assets
    cache = make_cache(root, model, "othertok", greedy=True, tok_hash="cd" * 32)
    res = run("--drafter", drafter, "--cache", cache, "--model", model, "--device", "cpu")
    assert res.exit_code == 1 and "tokenizer_hash" in res.output and "cd" * 6 in res.output, res.output
    cache = make_cache(root, model, "deeper", greedy=True, num_target_layers=8)
    res = run("--drafter", drafter, "--cache", cache, "--model", model, "--device", "cpu")
    assert res.exit_code == 1
    assert "the target's (--model " in res.output and "num_target_layers 4 != the cache's 8" in res.output


def test_refuses_a_drafter_made_for_a_target_of_another_depth(assets):
    """Issue 19: a drafter with num_target_layers 6 against a 4-layer target used to print a tau."""
    root, model, _ = assets
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=D, intermediate_size=64, target_layer_ids=TAPS, num_target_layers=6,
                        mask_token_id=258, vocab_size=264, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, block_size=4)
    deep = export_drafter(DFlashDrafter(cfg), cfg, root / "drafter6", dtype=torch.float32)
    cache = make_cache(root, model, "greedy6", greedy=True)
    res = run("--drafter", str(deep), "--cache", cache, "--model", model, "--device", "cpu")
    assert res.exit_code == 1, res.output
    assert "the drafter's num_target_layers 6 != the target's 4" in res.output


def test_help():
    res = CliRunner().invoke(cli, ["eval", "--help"])
    assert res.exit_code == 0 and "--approximate" in res.output
