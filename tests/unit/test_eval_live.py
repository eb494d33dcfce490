"""Live greedy speculative decoding on the real SmolLM2-135M (fp32, CPU) against plain greedy generation and
against the offline evaluator: same tokens as model.generate(do_sample=False), same per-step accept lengths
(hence the same tau) as walk_accept_chain over the masked-chunk accept lengths.

Two drafters: a random one (tau ~ 1: exercises reject-everything + cache crop) and one overfit in-test to the
prompts' responses so that long accept chains occur (exercises accepted drafts, multi-token context appends
and partial crops). The overfit uses a cosine loss to the tied LM-head rows of the labels: a cheap stand-in
for the DFlash objective (no 49152-wide softmax per step), not the trainer.
"""

import time

import pytest
import torch

from dflash.drafter.config import DrafterConfig
from dflash.drafter.model import DFlashDrafter
from dflash.eval.generate import render_prompt_ids, stop_token_ids
from dflash.eval.live import speculative_generate
from dflash.eval.tau import accept_lengths, walk_accept_chain
from dflash.target.head import embedding_and_head
from dflash.target.load import load_target
from dflash.target.taps import default_tap_layer_ids

PROMPTS = ["What is the capital of France?", "List three colors."]
MAX_NEW = 24
MASK = 16  # <empty_output>, never emitted in chats (configs/train_smollm2.yaml)
B = 8


@pytest.fixture(scope="module")
def setup(smollm2_dir):
    torch.manual_seed(0)
    model, tok = load_target(smollm2_dir, device="cpu", dtype=torch.float32)
    embed, head, _ = embedding_and_head(smollm2_dir, dtype=torch.float32)
    taps = default_tap_layer_ids(model.config.num_hidden_layers)
    stops = stop_token_ids(tok, model.generation_config, {})
    cases = []
    for p in PROMPTS:
        ids = render_prompt_ids(tok, [{"role": "user", "content": p}], {})
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False, num_beams=1,
                                 eos_token_id=list(stops), pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
            seq = torch.tensor(ids + ref)
            hs = model(seq[None], output_hidden_states=True).hidden_states
        feats = torch.stack([hs[k + 1][0] for k in taps], dim=1)  # one prefill of the whole sequence
        cases.append(dict(prompt_ids=ids, ref=ref, seq=seq, feats=feats))
    return model, tok, embed, head, taps, stops, cases


def make_drafter(taps, seed=0):
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=576, intermediate_size=512, target_layer_ids=taps, num_target_layers=30,
                        mask_token_id=MASK, vocab_size=49152, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=64, block_size=B)
    return DFlashDrafter(cfg)


def overfit(drafter, cases, embed, head, steps=150):
    from dflash.train.objective import build_blocks, packed_layout

    anchors = [torch.arange(len(c["prompt_ids"]), len(c["seq"]) - 1) for c in cases]
    masks = []
    for c in cases:
        m = torch.zeros(len(c["seq"]), dtype=torch.uint8)
        m[len(c["prompt_ids"]):] = 1
        masks.append(m)
    lay = packed_layout(lengths=[len(c["seq"]) for c in cases], anchors=anchors, block_size=B)
    blocks = [build_blocks(c["seq"], m, a, block_size=B, mask_token_id=MASK) for c, m, a in zip(cases, masks, anchors)]
    block_ids = torch.cat([b.block_ids_JB for b in blocks]).flatten()
    labels = torch.cat([b.labels_JB for b in blocks]).flatten()
    w = torch.cat([b.weights_JB for b in blocks]).flatten()
    target_dir = torch.nn.functional.normalize(head[labels.clamp(min=0)], dim=-1)
    feats = torch.cat([c["feats"] for c in cases])
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for _ in range(steps):
        out = drafter(embed[block_ids], drafter.context(feats), q_pos=lay.q_pos_Q, kv_pos=lay.kv_pos_K, mask=lay)
        cos = (torch.nn.functional.normalize(out, dim=-1) * target_dir).sum(-1)
        loss = ((1 - cos) * w).sum() / w.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()


def offline_steps(drafter, case, embed, head):
    start, end = len(case["prompt_ids"]), len(case["seq"])
    L = accept_lengths(drafter, embed_VD=embed, lm_head_VD=head, input_ids_T=case["seq"], hidden_TKD=case["feats"],
                       start=start, end=end, mask_token_id=MASK, chunk_anchors=8)
    return walk_accept_chain(L, start, end)


@pytest.mark.parametrize("kind", ["random", "overfit"])
def test_live_equals_greedy_and_offline_tau(setup, kind):
    model, tok, embed, head, taps, stops, cases = setup
    t0 = time.time()
    dr = make_drafter(taps).eval()
    if kind == "overfit":
        dr = overfit(dr.train(), cases, embed, head)
    t1 = time.time()
    live_taus, off_taus = [], []
    for c in cases:
        with torch.no_grad():
            live = speculative_generate(model, dr, embed_VD=embed, lm_head_VD=head, prompt_ids=c["prompt_ids"],
                                        max_new_tokens=MAX_NEW, stop_ids=stops)
            off = offline_steps(dr, c, embed, head)
        assert live.tokens == c["ref"], "speculative decoding must reproduce the target's greedy output"
        assert live.steps == off, "offline accept chain must follow the live decoder step by step"
        assert sum(live.steps) in (len(c["ref"]) - 1, len(c["ref"]))
        live_taus.append(live.tau)
        off_taus.append(sum(off) / len(off))
    print(f"{kind}: live tau {live_taus} offline {off_taus}; overfit {t1 - t0:.1f} s, decode {time.time() - t1:.1f} s")
    assert live_taus == off_taus
    if kind == "overfit":
        assert min(live_taus) > 2.0, "the overfit drafter should accept long runs (tests the accept path)"
    else:
        assert max(live_taus) < 1.5


def test_live_respects_max_new_tokens_and_eos(setup):
    model, tok, embed, head, taps, stops, cases = setup
    dr = make_drafter(taps, seed=1).eval()
    c = cases[0]
    short = speculative_generate(model, dr, embed_VD=embed, lm_head_VD=head, prompt_ids=c["prompt_ids"],
                                 max_new_tokens=3, stop_ids=stops)
    assert short.tokens == c["ref"][:3] and short.stop_reason == "length" and sum(short.steps) == 2
    if c["ref"][-1] in stops:  # the first prompt's answer ends with <|im_end|> well within MAX_NEW
        assert speculative_generate(model, dr, embed_VD=embed, lm_head_VD=head, prompt_ids=c["prompt_ids"],
                                    max_new_tokens=MAX_NEW, stop_ids=stops).stop_reason == "eos"


def test_live_refuses_recurrent_targets(tmp_path):
    from dflash.errors import ConfigError
    from dflash.eval.live import check_attention_only
    from dflash.target.testing import tiny_qwen35_dir

    d = tiny_qwen35_dir(tmp_path / "q", num_layers=4)
    model, _ = load_target(d, device="cpu", dtype=torch.float32)
    with pytest.raises(ConfigError, match="attention-only"):
        check_attention_only(model)
