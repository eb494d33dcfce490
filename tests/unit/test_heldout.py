"""The batched held-out evaluator (dflash.eval.heldout) gives exactly `dflash eval`'s tau, per sequence and per
source, on a real target-greedy eval cache: a tiny random Qwen3.5 target through `dflash generate` + `dflash
extract` (the CLI), and a drafter overfit in-test to the cached responses so that long accept chains occur
(a random drafter accepts almost nothing and would make the comparison vacuous)."""

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from cli.main import cli
from dflash.drafter.config import DrafterConfig
from dflash.drafter.model import DFlashDrafter
from dflash.errors import ConfigError
from dflash.eval.heldout import HeldoutConfig, HeldoutEvaluator, acceptance_by_position

TAPS = (1, 2)
MASK_ID = 257  # a ChatML special of the tiny byte tokenizer the responses never contain


def _invoke(args):
    res = CliRunner().invoke(cli, args, prog_name="dflash")
    assert res.exit_code == 0, res.output
    return res


def overfit_drafter(cache_dir, model, *, block_size, steps, seed=0, vocab=264, hidden=64):
    """A 1-layer drafter pulled toward the cached responses' next-token embeddings (cheap cosine loss)."""
    from dflash.cache import CacheReader
    from dflash.target.head import embedding_and_head
    from dflash.train.objective import build_blocks, packed_layout

    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=hidden, intermediate_size=128, target_layer_ids=TAPS, num_target_layers=4,
                        mask_token_id=MASK_ID, vocab_size=vocab, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, block_size=block_size)
    dr = DFlashDrafter(cfg)
    embed, head, _ = embedding_and_head(model, dtype=torch.float32)
    with CacheReader(cache_dir) as reader:
        packed = reader.read_many(list(range(len(reader))), taps=TAPS, dequantize=True)
    ids = torch.from_numpy(packed.input_ids.astype(np.int64))
    mask = torch.from_numpy(packed.loss_mask.astype(np.uint8))
    feats = packed.hidden.float()
    offs = np.concatenate([[0], np.cumsum(packed.lengths)]).tolist()
    batches = []  # one sequence per step: its context and response anchors only (dense CPU attention is O(Q x C))
    for i in range(len(packed.lengths)):
        sl = slice(offs[i], offs[i + 1])
        a = torch.arange(int(mask[sl].nonzero()[0]), offs[i + 1] - offs[i] - 1)
        b = build_blocks(ids[sl], mask[sl], a, block_size=block_size, mask_token_id=MASK_ID)
        lay = packed_layout(lengths=[offs[i + 1] - offs[i]], anchors=[a], block_size=block_size)
        tgt = torch.nn.functional.normalize(head[b.labels_JB.flatten().clamp(min=0)], dim=-1)
        batches.append((feats[sl], embed[b.block_ids_JB.flatten()], lay, tgt, b.weights_JB.flatten()))
    opt = torch.optim.AdamW(dr.parameters(), lr=1e-2)
    total_w = sum(float(b[-1].sum()) for b in batches)
    for _ in range(steps):
        opt.zero_grad()
        for f, x, lay, tgt, w in batches:  # gradients of all sequences per step
            out = dr(x, dr.context(f), q_pos=lay.q_pos_Q, kv_pos=lay.kv_pos_K, mask=lay)
            loss = ((1 - (torch.nn.functional.normalize(out, dim=-1) * tgt).sum(-1)) * w).sum() / total_w
            loss.backward()
        opt.step()
    return dr, cfg, embed, head


@pytest.fixture(scope="module")
def tiny_eval(tmp_path_factory):
    """A real target-greedy eval cache of a tiny random Qwen3.5: 3 MT-Bench + 3 HumanEval prompts."""
    from dflash.data.assets import humaneval_path, mtbench_questions_path
    from dflash.target.testing import tiny_qwen35_dir

    root = tmp_path_factory.mktemp("heldout")
    model = str(tiny_qwen35_dir(root / "target", num_layers=4))
    for name, src in (("mt.jsonl", mtbench_questions_path()), ("he.jsonl", humaneval_path())):
        _invoke(["generate", "--model", model, "--prompts", str(src), "--output", str(root / name), "--limit", "3",
                 "--max-new-tokens", "40", "--batch-size", "3", "--device", "cpu", "--dtype", "float32"])
    _invoke(["extract", "--model", model, "--data", str(root / "mt.jsonl"), "--data", str(root / "he.jsonl"),
             "--output", str(root / "cache"), "--dtype", "float32", "--max-length", "2048", "--taps", "1,2"])
    return root, model


def test_equals_dflash_eval_per_sequence_and_source(tiny_eval):
    from dflash.cache import CacheReader
    from dflash.drafter.export import export_drafter
    from dflash.eval.tau import sequence_steps

    root, model = tiny_eval
    cache = str(root / "cache")
    dr, cfg, embed, head = overfit_drafter(cache, model, block_size=8, steps=40)
    # reference: dflash eval's per-sequence chain (tau.sequence_steps) and the CLI's JSON on the exported drafter
    ref_steps = []
    with CacheReader(cache) as reader:
        for i in range(len(reader)):
            s = reader.read(i, taps=TAPS, dequantize=True)
            ref_steps.append(sequence_steps(dr.eval(), embed_VD=embed, lm_head_VD=head,
                                            input_ids_T=torch.from_numpy(s.input_ids.astype(np.int64)),
                                            hidden_TKD=s.hidden, loss_mask_T=s.loss_mask, mask_token_id=MASK_ID,
                                            chunk_anchors=16))
    assert max(max(s) for s in ref_steps) >= 3, "the overfit drafter should accept several tokens somewhere"
    ddir = export_drafter(dr, cfg, root / "drafter", dtype=torch.float32, overwrite=True)
    cli_out = json.loads(_invoke(["eval", "--drafter", str(ddir), "--cache", cache, "--model", model, "--json",
                                  "--device", "cpu"]).output)

    # a small context budget forces several forwards per iteration (groups of different widths)
    for budget in (1 << 20, 300):
        ev = HeldoutEvaluator.from_cache(cache, taps=TAPS, device="cpu", model=model,
                                         cfg=HeldoutConfig(max_context_tokens=budget))
        dr.train()
        res = ev.evaluate(dr, embed_VD=embed, lm_head_VD=head)
        assert dr.training, "evaluate must restore train mode"
        assert res.exact and res.num_sequences == 6
        per_seq = [float(np.mean(s)) for s in ref_steps if s]
        assert res.overall.per_sequence_tau == per_seq
        assert res.tau == cli_out["tau"]
        assert res.tau_by_source == {s["name"]: s["tau"] for s in cli_out["sources"]}
        assert res.overall.to_json()["accept_length_counts"] == cli_out["overall"]["accept_length_counts"]
        m = res.to_metrics()
        assert m["heldout_tau"] == res.tau and m["heldout_tau/mt.jsonl"] == res.tau_by_source["mt.jsonl"]
        assert len(m["heldout_acc"]) == cfg.block_size - 1


def test_limit_and_refusals(tiny_eval, tmp_path):
    root, model = tiny_eval
    cache = str(root / "cache")
    ev = HeldoutEvaluator.from_cache(cache, taps=TAPS, device="cpu", cfg=HeldoutConfig(limit=2))
    assert ev.num_sequences == 2
    with pytest.raises(ConfigError, match="not in the cache"):
        HeldoutEvaluator.from_cache(cache, taps=(1, 3), device="cpu")
    dr = DFlashDrafter(DrafterConfig(hidden_size=64, intermediate_size=64, target_layer_ids=(2, 1),
                                     num_target_layers=4, mask_token_id=MASK_ID, vocab_size=264,
                                     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     block_size=4))
    with pytest.raises(ConfigError, match="target_layer_ids"):
        ev.evaluate(dr, embed_VD=torch.zeros(264, 64), lm_head_VD=torch.zeros(264, 64))


def test_acceptance_by_position_from_step_histogram():
    # block 4: steps emitting 1, 2, 2, 4 tokens -> accepted drafts 0, 1, 1, 3
    counts = [0, 1, 2, 0, 1]
    assert acceptance_by_position(counts) == [0.75, 0.25, 0.25]
    assert all(np.isnan(acceptance_by_position([0] * 5)))
