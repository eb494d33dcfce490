"""The batched held-out evaluator (dflash.eval.heldout) gives exactly `dflash eval`'s tau, per sequence and per
source, on a real target-greedy eval cache: a tiny random Qwen3.5 target through `dflash generate` + `dflash
extract` (the CLI), and a drafter overfit in-test to the cached responses so that long accept chains occur
(a random drafter accepts almost nothing and would make the comparison vacuous)."""

import json
import pathlib

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


def tiny_drafter(*, block_size, seed=0, vocab=264, hidden=64, taps=TAPS, mask_token_id=MASK_ID,
                 num_target_layers=4, layers=1):
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=hidden, intermediate_size=128, target_layer_ids=taps,
                        num_target_layers=num_target_layers, mask_token_id=mask_token_id, vocab_size=vocab,
                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        block_size=block_size)
    return DFlashDrafter(cfg).eval(), cfg


@torch.no_grad()
def chain_cache(path, model, dr, embed, head, *, lengths, prompt_len, seed=0, source=None):
    """A target-greedy cache built around the drafter: at each chain position the response continues with
    the drafter's own first k drafts (k random in 0..B-1) and then a token that differs from draft k+1, so the
    accept chain is known by construction (returned per sequence), with long accepts. Features are random,
    rounded to bf16 (what the cache stores), written through the real CacheWriter."""
    import dataclasses

    from dflash.cache import CacheWriter
    from dflash.eval.tau import draft_argmax
    from train_helpers import fingerprint_for

    B, K, D = dr.cfg.block_size, len(dr.cfg.target_layer_ids), dr.cfg.hidden_size
    fp = dataclasses.replace(fingerprint_for(pathlib.Path(model), taps=dr.cfg.target_layer_ids), target_greedy=True,
                             sources=({"path": str(source), "sha256": "-"},) if source else ())
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    all_ids, all_feats, all_mask, expected = [], [], [], []
    for T in lengths:
        feats = torch.randn(T, K, D, generator=g).to(torch.bfloat16).float()
        y = rng.integers(0, 256, size=T)
        pos, steps = prompt_len, []
        while pos < T - 1:
            x = embed[torch.tensor([int(y[pos])] + [MASK_ID] * (B - 1))]
            q_pos = pos + torch.arange(B)
            out = dr(x, dr.context(feats[:pos]), q_pos=q_pos, kv_pos=torch.cat([torch.arange(pos), q_pos]))
            d = draft_argmax(out[1:], head).numpy()
            k = min(int(rng.integers(0, B)), T - 1 - pos)
            y[pos + 1: pos + 1 + k] = d[:k]
            if k < B - 1 and pos + k + 1 < T:
                y[pos + k + 1] = (d[k] + 1 + rng.integers(0, 255)) % 256  # any token but draft k+1
            steps.append(k + 1)
            pos += k + 1
        mask = np.zeros(T, np.uint8)
        mask[prompt_len:] = 1
        all_ids.append(y.astype(np.int32)), all_feats.append(feats), all_mask.append(mask), expected.append(steps)
    with CacheWriter(path, fp, shard_tokens=256) as w:
        w.append(sample_ids=np.arange(len(lengths)), lengths=np.asarray(lengths), input_ids=np.concatenate(all_ids),
                 loss_mask=np.concatenate(all_mask), hidden=torch.cat(all_feats))
    return str(path), expected


def eval_steps(cache, dr, embed, head, taps, *, chunk_anchors=16):
    """`dflash eval`'s per-sequence accept chains (tau.sequence_steps over CacheReader.read)."""
    from dflash.cache import CacheReader
    from dflash.eval.tau import sequence_steps

    with CacheReader(cache) as reader:
        return [sequence_steps(dr, embed_VD=embed, lm_head_VD=head,
                               input_ids_T=torch.from_numpy(s.input_ids.astype(np.int64)), hidden_TKD=s.hidden,
                               loss_mask_T=s.loss_mask, mask_token_id=dr.cfg.mask_token_id,
                               chunk_anchors=chunk_anchors)
                for s in (reader.read(i, taps=taps, dequantize=True) for i in range(len(reader)))]


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



def known_chains(tiny_eval, tmp_path):
    """A 2-layer block-8 drafter and a cache of 5 sequences whose accept chains are known (chain_cache)."""
    from dflash.target.head import embedding_and_head

    _, model = tiny_eval
    dr, cfg = tiny_drafter(block_size=8, layers=2)
    embed, head, _ = embedding_and_head(model, dtype=torch.float32)
    (tmp_path / "src.jsonl").write_text("".join("{}\n" for _ in range(5)))
    cache, expected = chain_cache(tmp_path / "chain", model, dr, embed, head, lengths=[60, 97, 41, 130, 75],
                                  prompt_len=12, source=tmp_path / "src.jsonl")
    return model, dr, cfg, embed, head, cache, expected

def test_known_chains_with_long_accepts(tiny_eval, tmp_path):
    """Chains known by construction (accepts of 0..B-1 drafts): dflash eval and the evaluator both find them,
    also when a small context budget splits each iteration into several forwards of different widths."""
    model, dr, cfg, embed, head, cache, expected = known_chains(tiny_eval, tmp_path)
    assert max(max(s) for s in expected) == cfg.block_size and np.mean([np.mean(s) for s in expected]) > 3
    assert eval_steps(cache, dr, embed, head, TAPS) == expected
    for budget in (4096, 7):
        ev = HeldoutEvaluator.from_cache(cache, taps=TAPS, device="cpu", model=model,
                                         cfg=HeldoutConfig(chunk_anchors=budget))
        dr.train()
        res = ev.evaluate(dr, embed_VD=embed, lm_head_VD=head)
        assert dr.training, "evaluate must restore train mode"
        assert all(p.grad is None for p in dr.parameters())
        assert res.overall.per_sequence_tau == [float(np.mean(s)) for s in expected]
        counts = np.bincount(np.concatenate(expected), minlength=cfg.block_size + 1)
        assert res.overall.step_counts == counts.tolist()
        assert res.tau_by_source == {"src.jsonl": res.tau}
    dr.eval()


def test_equals_dflash_eval_on_generated_cache(tiny_eval):
    """A real target-greedy cache (`dflash generate` + `dflash extract` of a tiny random Qwen3.5): the CLI's
    JSON and the evaluator agree on tau, per source and on the step histogram."""
    from dflash.drafter.export import export_drafter
    from dflash.target.head import embedding_and_head

    root, model = tiny_eval
    cache = str(root / "cache")
    dr, cfg = tiny_drafter(block_size=4, seed=1)
    embed, head, _ = embedding_and_head(model, dtype=torch.float32)
    ref = eval_steps(cache, dr, embed, head, TAPS)
    ddir = export_drafter(dr, cfg, root / "drafter", dtype=torch.float32, overwrite=True)
    cli_out = json.loads(_invoke(["eval", "--drafter", str(ddir), "--cache", cache, "--model", model, "--json",
                                  "--device", "cpu"]).output)
    res = HeldoutEvaluator.from_cache(cache, taps=TAPS, device="cpu", model=model).evaluate(
        dr, embed_VD=embed, lm_head_VD=head)
    assert res.exact and res.num_sequences == 6
    assert res.overall.per_sequence_tau == [float(np.mean(s)) for s in ref if s]
    assert res.tau == cli_out["tau"]
    assert res.tau_by_source == {s["name"]: s["tau"] for s in cli_out["sources"]} and len(res.per_source) == 2
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


@pytest.mark.slow
def test_equals_dflash_eval_on_smollm2(smollm2_greedy_eval):
    """The real SmolLM2-135M: its greedy responses to 3 MT-Bench and 2 HumanEval prompts, extracted (5 taps): the
    session's shared smollm2_greedy_eval (tests/conftest.py; test_eval_pipeline reads the same cache)."""
    from dflash.cache import CacheReader
    from dflash.target.head import embedding_and_head

    model = smollm2_greedy_eval.model
    cache = str(smollm2_greedy_eval.root / "cache")
    with CacheReader(cache) as reader:
        taps = reader.tap_layer_ids
    dr, _ = tiny_drafter(block_size=8, vocab=49152, hidden=576, taps=taps, mask_token_id=16, num_target_layers=30)
    embed, head, _ = embedding_and_head(model, dtype=torch.float32)
    ref = eval_steps(cache, dr, embed, head, taps, chunk_anchors=256)
    res = HeldoutEvaluator.from_cache(cache, taps=taps, device="cpu", model=model).evaluate(
        dr, embed_VD=embed, lm_head_VD=head)
    assert res.overall.per_sequence_tau == [float(np.mean(s)) for s in ref if s]
    assert [(s.name, s.num_sequences) for s in res.per_source] == [("mt.jsonl", 3), ("he.jsonl", 2)]


def test_bf16_equals_dflash_eval_bit_for_bit(tiny_eval, tmp_path):
    """What bench_reference.compare_evaluators checks on the GPU (tau_equal), pinned here on CPU in bf16, where
    two different batchings of the same drafts may break near-ties differently: `dflash eval`
    (evaluate_cache) on the exported bf16 drafter and the held-out evaluator on the same bf16 drafter agree on
    every sequence's steps, also the training form (fp32 master weights under bf16 autocast, compiled
    element-wise ops bound but run eagerly)."""
    from dflash.drafter.export import export_drafter, load_drafter
    from dflash.eval.evaluate import EvalConfig, evaluate_cache
    from dflash.target.head import embedding_and_head

    model, dr, cfg, embed, head, cache, expected = known_chains(tiny_eval, tmp_path)
    ddir = export_drafter(dr, cfg, tmp_path / "drafter", dtype=torch.bfloat16, overwrite=True)
    ref = evaluate_cache(drafter_dir=str(ddir), cache_dir=cache, model=model, cfg=EvalConfig(device="cpu",
                         dtype="bfloat16"), progress=False)
    assert ref.overall.tau > 1.5 and ref.overall.per_sequence_tau != [float(np.mean(s)) for s in expected], \
        "bf16 should follow the long fp32 chains only in part (else the test would not see bf16 rounding)"
    ev = HeldoutEvaluator.from_cache(cache, taps=TAPS, device="cpu", model=model)
    dr16, _ = load_drafter(str(ddir), device="cpu", dtype=torch.bfloat16)
    embed16, head16, _ = embedding_and_head(model, dtype=torch.bfloat16)
    dr.train()
    dr.compile_elementwise()  # bound, never called: forward_only runs the eager ops
    for drafter, dtype in ((dr16, None), (dr, torch.bfloat16)):
        res = ev.evaluate(drafter, embed_VD=embed16, lm_head_VD=head16, compute_dtype=dtype)
        assert res.overall.per_sequence_tau == ref.overall.per_sequence_tau
        assert res.overall.step_counts == ref.overall.step_counts and res.tau == ref.overall.tau
    assert dr.training and dr.elementwise_compiled
