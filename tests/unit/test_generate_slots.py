"""The slot decoder of the continuous backend (dflash.generate.slots): its mask rule, and greedy responses equal
to HF generate's in fp32 on SmolLM2-135M, with fewer slots than conversations and a later turn that prefills
only its new ids on the kept slot."""

import pytest
import torch

from dflash.errors import ConfigError
from dflash.generate.slots import (SlotDecoder, SlotEngine, check_supported, counters_line, kv_bucket,
                                  prefill_batches, query_positions, visible_mask)


def test_query_rows_and_mask():
    pos = torch.tensor([[3, 4], [0, 1]])
    q = query_positions(pos, groups=3)
    assert q.tolist() == [[3, 4, 3, 4, 3, 4], [0, 1, 0, 1, 0, 1]]  # row g*T + t is token t of head g
    m = visible_mask(q, cache_len=6)
    assert m.shape == (2, 1, 6, 6)
    assert m[0, 0, 0].tolist() == [True] * 4 + [False] * 2  # position 3 sees keys 0..3
    assert m[1, 0, 1].tolist() == [True, True] + [False] * 4


def test_kv_bucket():
    assert [kv_bucket(n, cache_len=2048) for n in (1, 256, 257, 700, 1025, 2048)] == [256, 256, 512, 1024, 2048,
                                                                                          2048]
    assert kv_bucket(300, cache_len=300) == 300  # capped at the cache


def test_prefill_batches_bound_padding_and_budget():
    lengths = [500, 10, 12, 30, 900, 11, 3000]
    got = prefill_batches(lengths, budget=2048)
    assert sorted(i for b in got for i in b) == list(range(len(lengths)))
    assert got == [[1, 5, 2], [3], [0, 4], [6]]  # 10,11,12 | 30 | 500,900 | 3000 alone (over the budget)
    for b in got:
        longest = max(lengths[i] for i in b)
        assert len(b) == 1 or (len(b) * longest <= 2048 and longest <= 2 * min(lengths[i] for i in b))


def test_counters_line():
    c = dict(decode_steps=10, decode_rows=40, decode_s=0.5, prefill_calls=2, prefill_rows=6, prefill_tokens=300,
             prefill_padded_tokens=400, prefill_s=0.1)
    assert counters_line(c, slots=8) == ("slot engine: 10 decode steps in 0.5 s (50.0 ms each, 50% of 8 slots busy), "
                                         "2 prefills of 6 rows in 0.1 s (300 ids, 75% of the padded batches)")


def test_decode_attention_forms_and_kv_buckets_agree():
    """The batched-matmul decode attention equals SDPA's, and reading only a kv_len bucket equals reading the
    whole cache for every slot whose position is below it (tiny random Llama, fp32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512)
    model = LlamaForCausalLM(cfg).eval()
    outs = []
    for bmm in (False, True):
        dec = SlotDecoder(model, slots=3, cache_len=512, compile=False, decode_bmm=bmm)
        ids = [torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 40, 300)]
        first = dec.prefill([0, 1, 2], ids, [0, 0, 0])
        pos = torch.tensor([len(x) for x in ids])
        steps = [dec.decode(first, pos, kv_len=512)]
        steps.append(dec.decode(first, pos + 1, kv_len=512))
        small = dec.decode(first, pos + 1, kv_len=256)  # rows 0 and 1 are below 256: same tokens
        outs.append(torch.stack(steps))
        assert small[:2].tolist() == steps[1][:2].tolist()
    assert outs[0].tolist() == outs[1].tolist()


def test_unsupported_models_are_refused():
    from transformers import Qwen3_5TextConfig

    with pytest.raises(ConfigError, match="--backend static"):
        check_supported(Qwen3_5TextConfig())


def test_engine_slots_are_bounded_by_the_conversations_in_flight():
    from dflash.generate.continuous import engine_slots

    assert engine_slots(batch_size=512, window=2048, conversations=1) == 1
    assert engine_slots(batch_size=512, window=3, conversations=100) == 3
    assert engine_slots(batch_size=2, window=3, conversations=3) == 2
    assert engine_slots(batch_size=512, window=2048, conversations=0) == 1


def test_slot_decoder_switches_come_from_the_environment(monkeypatch):
    from dflash.generate.continuous import ContinuousConfig

    monkeypatch.delenv("DFLASH_SLOT_STEP", raising=False)
    monkeypatch.delenv("DFLASH_SLOT_ATTENTION", raising=False)
    assert (ContinuousConfig().slot_step, ContinuousConfig().slot_attention) == ("graphs", "bmm")
    monkeypatch.setenv("DFLASH_SLOT_STEP", "eager")
    monkeypatch.setenv("DFLASH_SLOT_ATTENTION", "sdpa")
    assert (ContinuousConfig().slot_step, ContinuousConfig().slot_attention) == ("eager", "sdpa")
    monkeypatch.setenv("DFLASH_SLOT_ATTENTION", "flash")
    with pytest.raises(ConfigError, match="DFLASH_SLOT_ATTENTION"):
        ContinuousConfig()
    monkeypatch.setenv("DFLASH_SLOT_ATTENTION", "sdpa")
    monkeypatch.setenv("DFLASH_SLOT_STEP", "1")
    with pytest.raises(ConfigError, match="DFLASH_SLOT_STEP"):
        ContinuousConfig()


def _prompt(tok, text):
    return list(tok(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=False), add_special_tokens=False)["input_ids"])


def _hf(model, ids, n, stops):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=list(stops),
                         pad_token_id=stops[0])[0, len(ids):].tolist()
    cut = next((i + 1 for i, t in enumerate(out) if t in stops), len(out))
    return out[:cut]


@pytest.mark.parametrize("min_prefill_rows", [1, 2])
def test_slot_engine_equals_hf_generate(smollm2_dir, min_prefill_rows):
    """min_prefill_rows 2: a slot bound to the third conversation waits while the other decodes (its next free
    position gets the dummy writes of those steps, which its prefill then overwrites)."""
    from dflash.generate.decode import stop_token_ids
    from dflash.target.load import load_target

    torch.set_num_threads(1)
    model, tok = load_target(str(smollm2_dir), device="cpu", dtype=torch.float32)
    stops = stop_token_ids(tok, model.generation_config, {})
    prompts = [_prompt(tok, q) for q in ("Name a color.", "What is 2+2?", "Say hi in French.")]
    eng = SlotEngine(model, stop_ids=stops, slots=2, cache_len=256, compile=False)
    eng.min_prefill_rows = min_prefill_rows
    for i, (p, n) in enumerate(zip(prompts, (7, 3, 7))):  # r1 ends first and frees its slot for r2
        eng.submit(f"r{i}", p, n, stream=i)
    got = {}
    while len(got) < 3:
        key, d = eng.next_result()
        got[key] = d.response_ids
        if key != "r0":
            eng.release(int(key[1:]))  # frees a slot for the third conversation
    for i, (p, n) in enumerate(zip(prompts, (7, 3, 7))):
        assert got[f"r{i}"] == _hf(model, p, n, stops), i
    # a second turn on conversation 0: only the ids after its kept context are prefilled
    first = eng.counters["prefill_tokens"]
    follow = prompts[0] + got["r0"] + _prompt(tok, "And another?")[1:]
    eng.submit("r0b", follow, 6, stream=0)
    key, d = eng.next_result()
    prefilled = eng.counters["prefill_tokens"] - first
    assert key == "r0b" and d.response_ids == _hf(model, follow, 6, stops)
    assert prefilled == len(follow) - len(prompts[0]) - len(got["r0"]) + 1  # the last response token was not fed


def _sampled_responses(model, prompts, *, slots: int, seed: int, temperature: float = 1.0, budget: int = 12):
    eng = SlotEngine(model, stop_ids=[0], slots=slots, cache_len=128, compile=False, temperature=temperature,
                     seed=seed)
    for i, p in enumerate(prompts):
        eng.submit(f"c0.v{i}.t0", p, budget, stream=i)
    got = {}
    while len(got) < len(prompts):
        key, d = eng.next_result()
        got[key] = d.response_ids
        eng.release(int(key.split(".")[1][1:]))
    return got


def test_sampled_slot_engine_is_independent_of_the_slot_count():
    """Sampling (dflash.generate.sampling) draws each token from (seed, request key, position): 1 slot (one
    conversation at a time) and 3 slots (all together) give the same responses; another seed other ones; the
    first token of a response is pick_tokens over the model's own logits with that request's key."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash.generate.sampling import pick_tokens, request_key

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512)
    model = LlamaForCausalLM(cfg).eval()
    prompts = [torch.randint(1, 97, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 17, 9)]
    one = _sampled_responses(model, prompts, slots=1, seed=0)
    three = _sampled_responses(model, prompts, slots=3, seed=0)
    assert one == three and all(len(r) > 0 for r in one.values())
    assert _sampled_responses(model, prompts, slots=3, seed=1) != one
    greedy = _sampled_responses(model, prompts, slots=3, seed=0, temperature=0.0)
    assert greedy != one
    with torch.no_grad():
        logits = model(torch.tensor([prompts[1]])).logits[:, -1]
    first = pick_tokens(logits, temperature=1.0, key_B=torch.tensor([request_key(0, "c0.v1.t0")]),
                        pos_B=torch.tensor([len(prompts[1]) - 1]))
    assert one["c0.v1.t0"][0] == int(first)
