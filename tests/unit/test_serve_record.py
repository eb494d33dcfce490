"""Where a serve-check's result goes: the card's "Served acceptance" section (dflash.drafter.card.render_card, a pure
function) and the record beside the drafter (dflash.serve.record): serve_check.json written atomically into a real
exported folder, its model card rendered again from its own card data, a later check of the same kind replacing the
earlier one, a folder the check may not write left alone, and a re-export showing no served figure."""

import json
import pathlib
import sys

import pytest
import torch

from dflash.drafter.card import SERVE_CHECK_NAME, read_card_data, read_served_checks, render_card, write_model_card
from dflash.drafter.config import DrafterConfig
from dflash.drafter.export import export_drafter
from dflash.drafter.model import DFlashDrafter
from dflash.errors import ModelNotFoundError
from dflash.serve.check import ServeCheckResult, compare_counts
from dflash.serve.metrics import counts_from_steps
from dflash.serve.record import merge_checks, record_check, record_entry, unwritable_reason

sys.path.insert(0, str(pathlib.Path(__file__).parent))

CONFIG = {"block_size": 4, "num_hidden_layers": 1, "hidden_size": 64,
          "dflash_config": {"target_layer_ids": [0, 1, 2], "mask_token_id": 258}}


def _result(step_counts, *, served_steps=None, dtype="float32", tolerance=0.0, eval_source="eval",
            sources=("mt.jsonl", "he.jsonl"), version="0.32.0"):
    offline = counts_from_steps(step_counts, num_speculative_tokens=3)
    served = counts_from_steps(served_steps or step_counts, num_speculative_tokens=3)
    return ServeCheckResult(served=served, offline=offline, offline_tau=2.5, text_mismatches=[],
                            differences=compare_counts(served, offline, tolerance=tolerance), tolerance=tolerance,
                            num_requests=5, server="http://127.0.0.1:8000", eval_source=eval_source,
                            sources=tuple(sources), dtype=dtype, engine_version=version)


def test_card_without_a_serve_check_says_nothing_about_it():
    text = render_card(config=CONFIG, heldout=[], data={}, recipe={}, target="/m/t")
    assert "served" not in text.lower().replace("serve-check", "")
    assert "Served acceptance" not in text and "serve_check" not in text


def test_card_shows_the_served_acceptance():
    # steps emitting 1, 2, 3, 4 tokens: 10, 6, 3, 1 of them -> 20 drafts, 6 + 6 + 3 = 15 accepted, per position
    # 10 / 4 / 1, mean acceptance length 1.75
    ok = record_entry(_result([0, 10, 6, 3, 1]), weights_sha256="ab" * 32)
    bad = record_entry(_result([0, 10, 6, 3, 1], served_steps=[0, 12, 5, 2, 1], dtype="bfloat16", tolerance=0.01,
                               eval_source="responses", sources=("mt.jsonl",)), weights_sha256="ab" * 32)
    text = render_card(config=CONFIG, heldout=[], data={}, recipe={}, target="/m/t", served=[ok, bad])
    assert "## Served acceptance" in text
    assert ("| vLLM 0.32.0 | eval (mt.jsonl, he.jsonl) | 5 | float32 | **1.750** | 1.750 | 20 | 15 | yes, exactly |"
            in text)
    # a check that differs shows the served figure beside dflash eval's and says it does not match, and why
    assert "| vLLM 0.32.0 | responses (mt.jsonl) | 5 | bfloat16 | **1.600** | 1.750 | 20 | 12 | no: " in text
    assert "mean acceptance length: served 1.6000 vs offline 1.7500 (tolerance 0.01)" in text
    assert "| k=1 | k=2 | k=3 |" in text
    assert "| vLLM 0.32.0 | eval (mt.jsonl, he.jsonl) | 10 | 4 | 1 |" in text
    assert "| vLLM 0.32.0 | responses (mt.jsonl) | 8 | 3 | 1 |" in text
    assert f"sha256 `{'ab' * 32}`" in text
    head = text.split("## Held-out acceptance", 1)[0]
    assert "vLLM 0.32.0 (float32) on eval: 1.750, equal to dflash eval's" in head
    assert "vLLM 0.32.0 (bfloat16) on responses: 1.600, NOT dflash eval's" in head
    assert text.index("## Held-out acceptance") < text.index("## Served acceptance") < text.index("## Training data")


def _drafter(tmp_path, name="drafter"):
    cfg = DrafterConfig(hidden_size=64, intermediate_size=64, target_layer_ids=(0, 1, 2), num_target_layers=4,
                        mask_token_id=258, vocab_size=264, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, block_size=4)
    torch.manual_seed(0)
    model = DFlashDrafter(cfg)
    return model, cfg, export_drafter(model, cfg, tmp_path / name, dtype=torch.float32)


def test_record_writes_the_check_and_renders_the_card_again(tmp_path):
    import hashlib

    model, cfg, d = _drafter(tmp_path)
    heldout = [{"name": "mtbench", "step": 7, "tau": 2.25, "exact": True, "sources": [], "overall": {}}]
    write_model_card(d, heldout=heldout, data={"samples": 3}, recipe={"steps": 7}, target="/m/t",
                     drafter_name="me/my-drafter")
    before = (d / "README.md").read_text()
    assert "Served acceptance" not in before

    done = record_check(_result([0, 10, 6, 3, 1]), d)
    assert done.record == d / SERVE_CHECK_NAME and done.card == d / "README.md" and done.why_not is None
    checks = read_served_checks(d)
    assert len(checks) == 1 and checks[0]["ok"] is True and checks[0]["engine_version"] == "0.32.0"
    assert checks[0]["served"]["accepted_per_position"] == [10, 4, 1] and checks[0]["text_mismatches"] == 0
    assert checks[0]["weights_sha256"] == hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()
    assert "server" not in checks[0] and "seconds" not in checks[0]
    text = (d / "README.md").read_text()
    assert "## Served acceptance" in text and "| **1.750** | 1.750 | 20 | 15 | yes, exactly |" in text
    # everything else of the card is as it was: held-out tau, data, recipe, the Hub id in the commands
    card = read_card_data(d)
    assert card["heldout"] == heldout and card["recipe"] == {"steps": 7} and card["drafter_id"] == "me/my-drafter"
    assert card["served"] == checks
    # the sections before and after the new one are as they were (held-out tau, data, recipe, serving commands)
    assert before.split("## Held-out acceptance")[1].split("## Training data")[0].strip() == \
        text.split("## Held-out acceptance")[1].split("## Served acceptance")[0].strip()
    assert "me/my-drafter" in text.split("## Serving")[1] and before.split("## Serving")[1].split("## Card data")[0] \
        == text.split("## Serving")[1].split("## Card data")[0]
    assert not list(d.glob("*.tmp"))

    # the same engine, eval source and dtype again: replaced; another dtype: added
    record_check(_result([0, 5, 5, 5, 5]), d)
    record_check(_result([0, 5, 5, 5, 5], dtype="bfloat16", tolerance=0.05), d)
    checks = read_served_checks(d)
    assert [(c["dtype"], c["served"]["num_drafts"]) for c in checks] == [("float32", 20), ("bfloat16", 20)]
    assert [c["served"]["accepted_per_position"] for c in checks] == [[15, 10, 5]] * 2

    # a re-export is a new folder: its card shows no served figure until it is checked again
    export_drafter(model, cfg, d, dtype=torch.float32, overwrite=True)
    write_model_card(d, heldout=heldout, data={}, recipe={}, target="/m/t")
    assert not (d / SERVE_CHECK_NAME).exists() and "Served acceptance" not in (d / "README.md").read_text()


def test_record_leaves_what_it_may_not_write_alone(tmp_path):
    # a hub cache snapshot: nothing written
    _, _, snap = _drafter(tmp_path, "models--me--d/snapshots/0123abc")
    assert "hub cache snapshot" in unwritable_reason(snap)
    done = record_check(_result([0, 1, 1]), snap)
    assert done.record is None and done.card is None and "hub cache" in done.why_not
    assert not (snap / SERVE_CHECK_NAME).exists()
    # a drafter folder whose README.md dflash did not write: the record, but the README stays as it was
    _, _, other = _drafter(tmp_path, "other")
    (other / "README.md").write_text("# someone else's card\n")
    done = record_check(_result([0, 1, 1]), other)
    assert done.record is not None and done.card is None
    assert (other / "README.md").read_text() == "# someone else's card\n"


def test_merge_and_a_damaged_record(tmp_path):
    a = {"engine": "vLLM", "eval_source": "eval", "sources": ["x"], "dtype": "float32", "n": 1}
    b = {**a, "dtype": "bfloat16"}
    assert merge_checks([a, b], {**a, "n": 2}) == [b, {**a, "n": 2}]
    assert merge_checks([a], {**a, "sources": ["y"]}) == [a, {**a, "sources": ["y"]}]
    _, _, d = _drafter(tmp_path)
    (d / SERVE_CHECK_NAME).write_text("{not json")
    with pytest.raises(ModelNotFoundError, match="serve_check.json is not a `dflash serve-check` record"):
        write_model_card(d, data={}, recipe={})
    (d / SERVE_CHECK_NAME).write_text(json.dumps({"checks": "x"}))
    with pytest.raises(ModelNotFoundError, match="remove it"):
        read_served_checks(d)
