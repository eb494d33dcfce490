"""`dflash generate`: prompt files, stop tokens, greedy batched generation on the real SmolLM2-135M, the record
format that extraction reads (exact ids), and the CLI."""

import gzip
import json

import pytest
import torch
from click.testing import CliRunner

from cli.main import cli
from dflash.errors import ConfigError, DataError
from dflash.eval.generate import (GenerateConfig, generate_greedy, generation_record, render_prompt_ids,
                                  split_at_stop, stop_token_ids, target_config_hash)
from dflash.eval.prompts import PromptSkips, iter_prompts


# ------------------------------------------------------------------------------------------- prompt files

def test_prompt_shapes_and_skips(tmp_path):
    lines = [
        {"question_id": 81, "turns": ["Turn one?", "Turn two?"]},                       # MT-Bench
        {"task_id": "HumanEval/0", "prompt": "def f(x):\n"},                             # HumanEval
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "old answer"}, {"role": "user", "content": "later"}]},
        {"conversations": [{"from": "human", "value": "Hello"}, {"from": "gpt", "value": "x"}]},  # ShareGPT
        {"text": "no prompt here"},
        {"prompt": "   "},
    ]
    p = tmp_path / "p.jsonl.gz"
    with gzip.open(p, "wt") as f:
        f.write("\n".join(json.dumps(x) for x in lines) + "\nnot json\n")
    skips = PromptSkips()
    got = list(iter_prompts(p, skips=skips))
    assert [g.messages for g in got] == [
        ({"role": "user", "content": "Turn one?"},),
        ({"role": "user", "content": "def f(x):\n"},),
        ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}),
        ({"role": "user", "content": "Hello"},),
    ]
    assert [g.record_id for g in got] == ["81", "HumanEval/0", None, None]
    assert got[1].location == "p.jsonl.gz:2"
    assert skips.counts == {"no_prompt_field": 1, "empty_prompt": 1, "bad_json": 1}
    assert len(list(iter_prompts(p, skips=PromptSkips(), limit=2))) == 2
    with pytest.raises(DataError):
        list(iter_prompts(tmp_path / "missing.jsonl", skips=PromptSkips()))


def test_real_eval_prompt_files():
    from dflash.data.assets import humaneval_path, mtbench_questions_path

    mt = list(iter_prompts(mtbench_questions_path(), skips=PromptSkips()))
    he = list(iter_prompts(humaneval_path(), skips=PromptSkips()))
    assert len(mt) == 80 and len(he) == 164
    assert he[0].record_id == "HumanEval/0" and he[0].messages[0]["content"].startswith("from typing import List")


def test_split_at_stop_and_config_validation():
    assert split_at_stop([5, 6, 2, 2, 2], [2]) == ([5, 6, 2], "eos")
    assert split_at_stop([5, 6, 7], [2, 9]) == ([5, 6, 7], "length")
    assert split_at_stop([9], [2, 9]) == ([9], "eos")
    with pytest.raises(ConfigError, match="max_new_tokens"):
        GenerateConfig(max_new_tokens=0)


# --------------------------------------------------------------------------------- real model generation

@pytest.fixture(scope="module")
def smol(smollm2_dir):
    from dflash.target.load import load_target

    model, tok = load_target(smollm2_dir, device="cpu", dtype=torch.float32)
    return smollm2_dir, model, tok


def test_stop_tokens_of_chatml(smol):
    _, model, tok = smol
    stops = stop_token_ids(tok, model.generation_config, {})
    assert tok.convert_tokens_to_ids("<|im_end|>") in stops


def _prompts(*texts):
    from dflash.eval.prompts import Prompt

    return [Prompt(messages=({"role": "user", "content": t},), location=f"x:{i}") for i, t in enumerate(texts)]


def test_generate_stops_at_eos_and_respects_max_tokens(smol):
    d, model, tok = smol
    stops = stop_token_ids(tok, model.generation_config, {})
    prompts = _prompts("What is the capital of France?", "Write a long story about a dragon.", "Say hi.")
    cfg = GenerateConfig(max_new_tokens=16, batch_size=3)
    gens = generate_greedy(model, tok, prompts, cfg=cfg)
    assert [g.prompt for g in gens] == prompts
    by_reason = {g.stop_reason for g in gens}
    assert by_reason == {"eos", "length"}, [(g.stop_reason, g.text) for g in gens]
    for g in gens:
        assert 1 <= len(g.response_ids) <= 16
        if g.stop_reason == "eos":
            assert g.response_ids[-1] in stops and not any(t in stops for t in g.response_ids[:-1])
            assert "<|im_end|>" not in g.text
        else:
            assert len(g.response_ids) == 16 and not any(t in stops for t in g.response_ids)
        # batched (left padded) == unbatched greedy of the same prompt, and == model.generate on it alone
        one = generate_greedy(model, tok, [g.prompt], cfg=GenerateConfig(max_new_tokens=16, batch_size=1))[0]
        assert one.response_ids == g.response_ids
        assert g.prompt_ids == render_prompt_ids(tok, g.prompt.messages, {})


def test_record_is_exact_and_read_as_pretokenized(smol, tmp_path):
    from dflash.data.chat import tokenize_conversation
    from dflash.data.sources import normalise_record
    from dflash.extract.preflight import config_hash, target_greedy_of

    d, model, tok = smol
    cfg = GenerateConfig(max_new_tokens=24, batch_size=2)
    gens = generate_greedy(model, tok, _prompts("What is the capital of France?", "Name a color."), cfg=cfg)
    h = target_config_hash(d)
    assert h == config_hash(str(d))
    recs = [generation_record(g, target=str(d), config_hash=h, cfg=cfg) for g in gens]
    for g, rec in zip(gens, recs):
        r = normalise_record(json.loads(json.dumps(rec)), source="gen.jsonl", location="gen.jsonl:1")
        assert r.input_ids == g.prompt_ids + g.response_ids
        assert r.loss_mask == [0] * len(g.prompt_ids) + [1] * len(g.response_ids)
        assert rec["dflash_generate"]["greedy"] is True and rec["dflash_generate"]["response_ids"] == g.response_ids
        if g.stop_reason == "eos":
            # For these ChatML answers the text also re-tokenizes to the same ids (the template adds "\n"
            # after <|im_end|>); the ids in the record make extraction independent of this.
            ids, mask = tokenize_conversation(tok, rec["messages"])
            assert list(ids[: len(r.input_ids)]) == r.input_ids
    p = tmp_path / "gen.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert target_greedy_of([str(p)], target_config_hashes={h})[0] is True
    assert target_greedy_of([str(p)], target_config_hashes={"0" * 64})[0] is False


def test_generate_cli(smol, tmp_path):
    d, _, _ = smol
    prompts = tmp_path / "q.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "turns": ["What is the capital of France?", "t2"]}) + "\n"
                       + json.dumps({"prompt": "Write a long story about a dragon."}) + "\n"
                       + json.dumps({"prompt": "Say hi."}) + "\n")
    out = tmp_path / "gen.jsonl"
    args = ["generate", "--model", str(d), "--prompts", str(prompts), "--output", str(out), "--max-new-tokens", "12",
            "--batch-size", "2", "--limit", "2", "--device", "cpu"]
    res = CliRunner().invoke(cli, args, prog_name="dflash")
    assert res.exit_code == 0, res.output
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(recs) == 2 and recs[0]["id"] == "1"
    assert recs[0]["messages"][0] == {"role": "user", "content": "What is the capital of France?"}
    assert len(recs[0]["messages"]) == 2  # MT-Bench turn 2 is not part of the first turn's prompt
    assert recs[0]["messages"][-1]["role"] == "assistant"
    assert all(len(r["dflash_generate"]["response_ids"]) <= 12 for r in recs)
    assert recs[1]["dflash_generate"]["stop_reason"] == "length"
    assert "wrote 2 conversations, 2 responses" in res.output
    again = CliRunner().invoke(cli, args, prog_name="dflash")  # the same job: complete, nothing to do
    assert again.exit_code == 0 and "already complete" in again.output
    other = CliRunner().invoke(cli, args[:-1] + ["cpu", "--max-new-tokens", "10"], prog_name="dflash")
    assert other.exit_code == 1 and "max_new_tokens" in other.output and "--overwrite" in other.output
    assert CliRunner().invoke(cli, ["generate", "--help"]).exit_code == 0
