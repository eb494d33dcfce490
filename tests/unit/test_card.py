"""The model card of an exported drafter (dflash.drafter.card): a real exported folder, a real cache manifest and a
real HeldoutResult; the card holds the tau table per source, the data summary, the recipe and the serving lines,
its JSON block reads back, and the folder still loads as a drafter."""

import json
import pathlib
import sys

import pytest
import torch

from dflash.drafter.card import read_card_data, write_model_card
from dflash.drafter.config import DrafterConfig
from dflash.drafter.export import export_drafter, load_drafter
from dflash.drafter.model import DFlashDrafter
from dflash.errors import ModelNotFoundError
from dflash.eval.evaluate import TauStats
from dflash.eval.heldout import HeldoutResult

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from train_helpers import tiny_cache, tiny_target  # noqa: E402


def _result(steps_by_source):
    overall = TauStats(name="overall", block_size=4)
    per = []
    for name, seqs in steps_by_source.items():
        st = TauStats(name=name, block_size=4)
        for steps in seqs:
            st.add(steps, sum(steps))
            overall.add(steps, sum(steps))
        per.append(st)
    return HeldoutResult(overall=overall, per_source=tuple(per), seconds=0.5, exact=True)


def test_card_written_and_read_back(tmp_path):
    target = tiny_target(tmp_path / "target")
    cache = tiny_cache(tmp_path / "cache", target, num_samples=6)
    manifest = json.loads((cache / "manifest.json").read_text())
    cfg = DrafterConfig(hidden_size=64, intermediate_size=64, target_layer_ids=(0, 1, 2), num_target_layers=4,
                        mask_token_id=258, vocab_size=264, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, block_size=4)
    ddir = export_drafter(DFlashDrafter(cfg), cfg, tmp_path / "drafter", dtype=torch.float32)
    mt = _result({"question.jsonl": [[1, 2, 4], [3, 1]]})
    he = _result({"HumanEval.jsonl.gz": [[4, 4, 1]]})
    recipe = {"steps": 1200, "lr": 6e-4, "block_size": 4, "noise": {"noise_start": 0.0}, "zeta": "last"}
    path = write_model_card(ddir, heldout=[mt.to_json() | {"name": "mtbench", "step": 1200},
                                           he.to_json() | {"name": "humaneval", "step": 1200}],
                            data=manifest, recipe=recipe, target=str(target))
    text = path.read_text()
    assert path.name == "README.md" and text.isascii()
    assert f"# DFlash drafter for {target}" in text
    assert f"mtbench {mt.tau:.3f}, humaneval {he.tau:.3f}" in text
    assert f"| mtbench | question.jsonl | 1200 | 2 | {mt.tau_by_source['question.jsonl']:.3f} | True |" in text
    assert f"| humaneval | **all** | 1200 | 1 | **{he.tau:.3f}** | True |" in text
    accept = " | ".join(f"{a:.2f}" for a in mt.acceptance_by_position)
    assert f"| mtbench | {accept} |" in text
    assert f"| {target} | 6 | {manifest['totals']['tokens']} | {manifest['totals']['loss_tokens']} | bf16 |" in text
    assert "| steps | 1200 |" in text and '| noise | {"noise_start": 0.0} |' in text
    assert text.index("| steps |") < text.index("| zeta |")  # the known recipe keys first
    from dflash.drafter.serving import shell_line, vllm_server_argv

    # the very command `dflash serve-check` launches (dflash.drafter.serving), K = block_size - 1
    assert shell_line(vllm_server_argv(target=target, drafter=str(ddir), block_size=4)) in text
    assert "python -m vllm.entrypoints.openai.api_server" in text and '"num_speculative_tokens": 3' in text
    assert "--speculative-algorithm DFLASH" in text and f"--speculative-draft-model-path {ddir}" in text
    back = read_card_data(ddir)
    assert back["heldout"][0]["tau"] == mt.tau and back["data"]["samples"] == 6 and back["recipe"] == recipe
    model, _ = load_drafter(ddir)  # the card does not disturb loading
    assert isinstance(model, DFlashDrafter)
    # rewriting replaces it (a later evaluation), without a held-out result the card says so
    write_model_card(ddir, data=manifest, recipe=recipe)
    assert "No held-out evaluation was run." in (ddir / "README.md").read_text()


def test_card_refuses_a_folder_without_drafter(tmp_path):
    with pytest.raises(ModelNotFoundError, match="export it first"):
        write_model_card(tmp_path, data={}, recipe={})
