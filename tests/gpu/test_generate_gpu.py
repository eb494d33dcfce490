"""GPU only: the compiled static-cache decode (dflash.generate.decode, backend "static") against HF eager generate
on the real SmolLM2-135M: in fp32 the greedy tokens agree (kernels differ only in reduction order), a second
call repeats the first exactly, and prompts of many lengths meet only a few compiled shapes."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

QUESTIONS = ["Say hi.", "What is the capital of France?", "Write a haiku about the sea.",
             "Explain gravity to a child in three sentences.", "List five prime numbers.",
             "What is 17 times 23? Show the steps.", "Name a famous painter and one of their works.",
             "Give me a short recipe for pancakes, with quantities for two people and the cooking time."]


def test_static_compiled_decode_matches_eager(smollm2_dir):
    from dflash.generate.decode import DecodeConfig, GreedyDecoder, stop_token_ids
    from dflash.generate.turns import render_prompt_ids
    from dflash.target.load import load_target

    model, tok = load_target(smollm2_dir, device="cuda", dtype=torch.float32)
    stops = stop_token_ids(tok, model.generation_config, {})
    prompts = [render_prompt_ids(tok, [{"role": "user", "content": q * (1 + i % 3)}], {})
               for i, q in enumerate(QUESTIONS * 2)]

    def run(backend):
        dec = GreedyDecoder(model, stop_ids=stops, pad_id=tok.pad_token_id or stops[0],
                            cfg=DecodeConfig(max_new_tokens=32, batch_size=8, backend=backend))
        return dec, dec.decode(prompts)

    _, eager = run("eager")
    dec, fast = run("static")
    again = dec.decode(prompts)
    same = sum(a.response_ids == b.response_ids for a, b in zip(eager, fast))
    assert same >= len(prompts) - 1, [(a.response_ids, b.response_ids) for a, b in zip(eager, fast)]
    assert [r.response_ids for r in again] == [r.response_ids for r in fast]
    assert len(dec.shapes) <= 3 and all(w % 64 == 0 for _, w in dec.shapes)


@pytest.mark.parametrize("step", ["compiled", "graphs"])
def test_slot_engine_compiled_matches_eager_generate(smollm2_dir, step):
    """The continuous backend's slot decoder with its compiled (or CUDA-graph captured) decode step, fp32 on
    CUDA, 4 slots for 16 prompts: the greedy responses of HF eager generate (at most one near-tie apart), and
    that step ran (no fallback to the eager one)."""
    from dflash.generate.decode import DecodeConfig, GreedyDecoder, stop_token_ids
    from dflash.generate.slots import SlotEngine
    from dflash.generate.turns import render_prompt_ids
    from dflash.target.load import load_target

    model, tok = load_target(smollm2_dir, device="cuda", dtype=torch.float32)
    stops = stop_token_ids(tok, model.generation_config, {})
    prompts = [render_prompt_ids(tok, [{"role": "user", "content": q * (1 + i % 3)}], {})
               for i, q in enumerate(QUESTIONS * 2)]
    eager = GreedyDecoder(model, stop_ids=stops, pad_id=tok.pad_token_id or stops[0],
                          cfg=DecodeConfig(max_new_tokens=32, batch_size=1, backend="eager")).decode(prompts)
    eng = SlotEngine(model, stop_ids=stops, slots=4, cache_len=512, compile=step == "compiled",
                     cuda_graphs=step == "graphs")
    for i, p in enumerate(prompts):
        eng.submit(f"p{i}", p, 32)
    got = dict(eng.next_result() for _ in prompts)
    if step == "compiled":
        assert eng.dec._compiled_ok
    else:
        assert eng.dec.cuda_graphs and eng.dec._graphs
    same = sum(got[f"p{i}"].response_ids == e.response_ids for i, e in enumerate(eager))
    assert same >= len(prompts) - 1


def test_sampled_slot_engine_graphs_match_eager_step(smollm2_dir):
    """Sampled regeneration (dflash.generate.sampling) with the decode step replayed as CUDA graphs, fp32: the
    responses of the eager step (the graph reads each slot's request key in place), with 4 slots for 16
    prompts, and not the greedy ones."""
    from dflash.generate.decode import stop_token_ids
    from dflash.generate.slots import SlotEngine
    from dflash.generate.turns import render_prompt_ids
    from dflash.target.load import load_target

    model, tok = load_target(smollm2_dir, device="cuda", dtype=torch.float32)
    stops = stop_token_ids(tok, model.generation_config, {})
    prompts = [render_prompt_ids(tok, [{"role": "user", "content": q * (1 + i % 3)}], {})
               for i, q in enumerate(QUESTIONS * 2)]

    def run(graphs: bool, temperature: float):
        eng = SlotEngine(model, stop_ids=stops, slots=4, cache_len=512, cuda_graphs=graphs,
                         temperature=temperature, seed=5)
        for i, p in enumerate(prompts):
            eng.submit(f"p{i}", p, 32)
        got = dict(eng.next_result() for _ in prompts)
        assert eng.dec.cuda_graphs == graphs
        return [got[f"p{i}"].response_ids for i in range(len(prompts))]

    eager, graphs = run(False, 0.8), run(True, 0.8)
    same = sum(a == b for a, b in zip(eager, graphs))
    assert same >= len(prompts) - 1
    assert run(True, 0.0) != graphs
