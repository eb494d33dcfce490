"""End to end on the real SmolLM2-135M: `dflash generate` (MT-Bench + HumanEval prompts) -> `dflash extract`
(the cache is marked target_greedy) -> a drafter -> `dflash eval --json`, checked against the live greedy
speculative-decoding loop on the same prompts.

The live loop must reproduce the generated responses token for token and give, per prompt, the same step
lengths as the offline chain computed from fp32 features. The cache stores bf16 features, so `dflash eval`
may differ from live where a draft argmax is a near-tie: per prompt tau must agree within 0.25 and the mean
within 0.1 (measured: identical on these prompts, live and cache tau 3.429 3.429 4.0 3.429 3.429).
The drafter is trained by `dflash train` on the cached responses themselves (the session's
smollm2_trained_drafter: the demo's block-4 shape, tau ~3.5 there) so that long accept chains occur.
"""

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from cli.main import cli

pytestmark = pytest.mark.slow
MAX_NEW = 24


def _invoke(args):
    res = CliRunner().invoke(cli, args, prog_name="dflash")
    assert res.exit_code == 0, res.output
    return res


def test_generate_extract_eval_matches_live(smollm2_greedy_eval, smollm2_trained_drafter):
    from dflash.drafter.export import load_drafter
    from dflash.eval.generate import stop_token_ids
    from dflash.eval.live import speculative_generate
    from dflash.eval.tau import accept_lengths, walk_accept_chain
    from dflash.target.head import embedding_and_head
    from dflash.target.load import load_target

    # `dflash generate` (3 MT-Bench + 2 HumanEval prompts, fp32) and `dflash extract` of them: the session's
    # shared smollm2_greedy_eval (tests/conftest.py; test_heldout reads the same cache)
    root, model, records = smollm2_greedy_eval.root, smollm2_greedy_eval.model, smollm2_greedy_eval.records
    assert smollm2_greedy_eval.max_new_tokens == MAX_NEW
    manifest = json.loads((root / "cache" / "manifest.json").read_text())
    assert manifest["fingerprint"]["target_greedy"] is True
    drafter_dir = smollm2_trained_drafter   # only read here

    res = _invoke(["eval", "--drafter", str(drafter_dir), "--cache", str(root / "cache"), "--model", model, "--json",
                   "--device", "cpu", "--chunk-anchors", "16"])
    out = json.loads(res.output)
    assert out["exact"] is True
    assert [(s["name"], s["num_sequences"]) for s in out["sources"]] == [("mt.jsonl", 3), ("he.jsonl", 2)]

    target, tok = load_target(model, device="cpu", dtype=torch.float32)
    embed, head, _ = embedding_and_head(model, dtype=torch.float32)
    dr, cfg = load_drafter(drafter_dir, dtype=torch.float32)
    dr.eval()
    stops = stop_token_ids(tok, target.generation_config, {})
    live_taus = []
    for rec in records:
        meta = rec["dflash_generate"]
        prompt_ids = rec["input_ids"][: meta["num_prompt_tokens"]]
        with torch.no_grad():
            live = speculative_generate(target, dr, embed_VD=embed, lm_head_VD=head, prompt_ids=prompt_ids,
                                        max_new_tokens=MAX_NEW, stop_ids=stops)
            assert live.tokens == meta["response_ids"], "live speculative decoding != dflash generate's greedy output"
            seq = torch.tensor(rec["input_ids"])
            hs = target(seq[None], output_hidden_states=True).hidden_states
            feats = torch.stack([hs[k + 1][0] for k in cfg.target_layer_ids], dim=1)
            start, end = len(prompt_ids), len(seq)
            L = accept_lengths(dr, embed_VD=embed, lm_head_VD=head, input_ids_T=seq, hidden_TKD=feats, start=start,
                               end=end, mask_token_id=cfg.mask_token_id)
        assert walk_accept_chain(L, start, end) == live.steps, "fp32 offline chain != live chain"
        live_taus.append(live.tau)
    # the cache-based (bf16 features) tau of `dflash eval`, per prompt, against live
    from dflash.cache import CacheReader
    from dflash.eval.tau import sequence_steps

    reader = CacheReader(root / "cache")
    cache_taus = []
    for i in range(len(reader)):
        s = reader.read(i, taps=cfg.target_layer_ids, dequantize=True)
        steps = sequence_steps(dr, embed_VD=embed, lm_head_VD=head, input_ids_T=torch.from_numpy(s.input_ids.astype(np.int64)),
                               hidden_TKD=s.hidden.float(), loss_mask_T=s.loss_mask, mask_token_id=cfg.mask_token_id)
        cache_taus.append(float(np.mean(steps)))
    reader.close()
    print(f"live tau {np.round(live_taus, 3).tolist()} cache tau {np.round(cache_taus, 3).tolist()} "
          f"dflash eval {out['tau']:.3f}")
    assert out["tau"] == pytest.approx(np.mean(cache_taus))
    assert max(abs(a - b) for a, b in zip(live_taus, cache_taus)) <= 0.25
    assert abs(out["tau"] - np.mean(live_taus)) <= 0.1
    assert np.mean(live_taus) > 1.8, "the trained drafter should give long accept chains"
