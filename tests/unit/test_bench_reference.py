"""bench_reference.py / bench_eval_overhead.py pieces on CPU: a real training (`train_once`, the library `dflash
train`) with held-out eval on a real target-greedy cache gives held-out curves in metrics.jsonl; the curve, the
summary numbers of issue 14, the data-scaling subsets, the plot and the evaluator comparison work on them."""

import dataclasses
import json
import pathlib
import shutil
import sys
import time
import types

import numpy as np
import pytest
import torch

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "benchmarks"))
import bench_reference as br  # noqa: E402
from train_helpers import fingerprint_for, tiny_cache, tiny_target  # noqa: E402


def greedy_eval_cache(path, target, sources):
    """A target_greedy-marked cache of 4 sequences from two sources (2 each), written with CacheWriter."""
    from dflash.cache import CacheWriter

    fp = dataclasses.replace(fingerprint_for(target, taps=(0, 1, 2)), target_greedy=True,
                             sources=tuple({"path": str(s), "sha256": "-"} for s in sources))
    g = torch.Generator().manual_seed(5)
    lengths = np.array([30, 25, 40, 22])
    T = int(lengths.sum())
    mask = np.zeros(T, np.uint8)
    off = 0
    for n in lengths:
        mask[off + 8: off + n] = 1
        off += n
    with CacheWriter(path, fp) as w:
        w.append(sample_ids=np.arange(4), lengths=lengths, input_ids=torch.randint(0, 256, (T,), generator=g).numpy()
                 .astype(np.int32), loss_mask=mask, hidden=torch.randn(T, 3, 64, generator=g))
    return path


def test_train_once_with_heldout_curve_summary_and_plot(tmp_path):
    target = tiny_target(tmp_path / "target")
    cache = tiny_cache(tmp_path / "cache", target, num_samples=12)
    srcs = []
    for name in br.EVAL_SETS.values():  # the eval sets' file names: per-source tau is keyed by them
        (tmp_path / name).write_text("{}\n{}\n")
        srcs.append(tmp_path / name)
    ev = greedy_eval_cache(tmp_path / "eval", target, srcs)
    args = types.SimpleNamespace(layers=1, block_size=4, num_anchors=8, lr=3e-3, batch_tokens=200, log_every=2,
                                 save_every=4, intermediate_size=64)
    r = br.train_once(args, model=str(target), cache=cache, out=tmp_path / "run", device="cpu", steps=6,
                      eval_cache=str(ev), eval_every=2, log_every=None)
    c = br.curve(r["metrics"])
    assert c["step"] == [2, 4, 6] and len(c["heldout_tau"]) == 3
    assert all(1.0 <= t <= 4.0 for t in c["heldout_tau"])
    mt, he = br.set_tau(c, "mtbench"), br.set_tau(c, "humaneval")
    assert mt is not None and he is not None and abs(np.mean([mt, he]) - c["heldout_tau"][-1]) < 1e-12
    # the evaluator comparison on the run's exported drafter: both taus equal (fp32 CPU)
    cmp = br.compare_evaluators(r["drafter"], ev, str(target), "cpu")
    assert cmp["tau_equal"] and cmp["sequences"] == 4 and cmp["dflash_eval_seconds"] > 0
    # summary numbers from runs shaped as main() records them
    base = {"samples": 12, "tokens": 600, "steps": 6, "final_train_accept_len": 2.0, "tokens_per_s": 1.0}
    result = {"reference_storage": "bf16",
              "runs": {"all_bf16": base | {"tau_mtbench": 2.0, "tau_humaneval": 1.6},
                       "all_fp8": base | {"tau_mtbench": 2.01, "tau_humaneval": 1.6},
                       "n4": base | {"samples": 4, "tau_mtbench": 1.2, "tau_humaneval": 1.1}}}
    br.summarise(result)
    assert result["tau_mtbench"] == 2.0 and result["train_acceptance_over_heldout"] == 2.0 / 1.8
    assert abs(result["fp8_rel_diff_mtbench"] - 0.005) < 1e-12 and result["fp8_rel_diff_humaneval"] == 0.0
    assert [row["run"] for row in result["data_scaling"]] == ["n4", "all_bf16"]
    assert result["checks"] == {"tau_at_least_2_3": False, "train_over_heldout_at_most_1_6": True,
                                "fp8_within_1pct": True}
    # a further storage on all the data (--also-storages int4) is read against all_bf16 too, with its own check
    result["runs"]["all_int4"] = base | {"tau_mtbench": 1.97, "tau_humaneval": 1.6}
    br.summarise(result)
    assert abs(result["int4_rel_diff_mtbench"] + 0.015) < 1e-12 and result["int4_rel_diff_humaneval"] == 0.0
    assert result["checks"]["int4_within_1pct"] is False and result["checks"]["fp8_within_1pct"] is True
    # --loss-normalization sequence on the reference data: its held-out tau minus the reference's
    assert "seqnorm_effect" not in result
    result["runs"]["all_seqnorm"] = base | {"tau_mtbench": 2.05, "tau_humaneval": 1.58}
    br.summarise(result)
    assert result["seqnorm_effect"] == pytest.approx({"mtbench": 0.05, "humaneval": -0.02})
    result["runs"]["all_shuffle"] = base | {"tau_mtbench": 1.96, "tau_humaneval": 1.61}
    br.summarise(result)
    assert result["shuffle_block_effect"] == pytest.approx({"mtbench": -0.04, "humaneval": 0.01})
    png = br.plot_curve("run", c, tmp_path / "curve.png")
    assert pathlib.Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "all_bf16" in br.format_table(result)


def test_subsets_joined_files_and_runs_plan(tmp_path):
    src = tmp_path / "data.jsonl"
    src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": str(i)}]}) + "\n" for i in range(10)))
    # a scaling subset keeps the whole file's mix: evenly spread records, not the first ones
    assert br.spread_indices(10, 4) == [0, 2, 5, 7] and br.spread_indices(10, 10) == br.spread_indices(10, 99)
    out = br.spread_records([str(src)], 4, tmp_path / "spread4.jsonl")
    assert [json.loads(x)["messages"][0]["content"] for x in pathlib.Path(out).read_text().splitlines()] == \
        ["0", "2", "5", "7"]
    more = tmp_path / "more.jsonl"
    more.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n")
    joined = br.first_records([str(src), str(more)], None, tmp_path / "joined.jsonl")
    assert [json.loads(x)["messages"][0]["content"] for x in pathlib.Path(joined).read_text().splitlines()] == \
        [str(i) for i in range(10)] + ["x"]
    first = br.first_records([str(src), str(more)], 3, tmp_path / "first3.jsonl")
    assert [json.loads(x)["messages"][0]["content"] for x in pathlib.Path(first).read_text().splitlines()] == \
        ["0", "1", "2"]
    two = br.parse_args(["--tiny", "--train-data", str(src), str(more)])
    assert br.train_data_file(two, "m", tmp_path, "cpu", "float32", {}) == str(tmp_path / "train_joined.jsonl")
    args = br.parse_args(["--tiny", "--skip", "all_seed1"])
    plan = br.runs_plan(args)
    assert [p[0] for p in plan] == ["all_bf16", "all_fp8", "all_noise", "all_seqnorm", "n4", "n8"]
    assert dict((p[0], p[2]) for p in plan)["all_noise"] == {"noise_start": 0.1}
    assert dict((p[0], p[2]) for p in plan)["all_seqnorm"] == {"loss_normalization": "sequence"}
    # --shuffle-block N: one more run on all the data, after the reference's own
    shuffled = br.runs_plan(br.parse_args(["--tiny", "--shuffle-block", "16", "--skip", "all_seed1"]))
    assert [p[0] for p in shuffled] == ["all_bf16", "all_fp8", "all_noise", "all_seqnorm", "all_shuffle", "n4", "n8"]
    assert dict((p[0], p[2]) for p in shuffled)["all_shuffle"] == {"shuffle_block": 16}
    gpu = br.parse_args([])
    assert gpu.eval_every == 500 and gpu.epochs == 6 and gpu.steps is None and gpu.max_length == 2048
    assert gpu.scaling == "2000,8000" and gpu.block_size == 16 and gpu.num_anchors == 512
    # the GPU reference is in fp8 (a bf16 whole-conversation cache does not fit the H200 machine's disk)
    assert gpu.storage == "fp8" and [(p[0], p[1]) for p in br.runs_plan(gpu)] == [
        ("all_fp8", "train_fp8"), ("all_bf16", "train_bf16"), ("all_seed1", "train_fp8"), ("all_noise", "train_fp8"),
        ("all_seqnorm", "train_fp8"), ("n2000", "train_n2000"), ("n8000", "train_n8000")]
    # --compare-online (--bf16-online): all_bf16 reads the token stream of a one-tap cache of the same data
    # (TOKENS_CACHE), its features from the live target rounded to bf16; with an int4 reference the
    # --also-storages fp8 run too, rounded to fp8
    assert (br.TOKENS_CACHE, br.TOKENS_CACHE_TAPS) == ("train_tokens", (0,))
    for flag in ("--bf16-online", "--compare-online"):
        online = dict((p[0], p[1:]) for p in br.runs_plan(br.parse_args([flag])))
        assert online["all_bf16"] == ("train_tokens", {"online": True, "online_storage": "bf16"})
        assert online["all_fp8"] == ("train_fp8", {})
    int4 = dict((p[0], p[1:]) for p in br.runs_plan(br.parse_args(["--storage", "int4", "--compare-online",
                                                                    "--also-storages", "fp8"])))
    assert int4["all_int4"] == ("train_int4", {}) and int4["all_fp8"] == ("train_tokens", {
        "online": True, "online_storage": "fp8"}) and int4["all_bf16"][0] == "train_tokens"
    # --also-storages: one more all_<storage> run from its own cache after the all_* runs; the reference's and
    # the compared storage are not run twice
    more = br.runs_plan(br.parse_args(["--also-storages", "int4,fp8,bf16", "--skip",
                                       "all_noise,all_seed1,all_seqnorm"]))
    assert [(p[0], p[1]) for p in more] == [("all_fp8", "train_fp8"), ("all_bf16", "train_bf16"),
                                            ("all_int4", "train_int4"), ("n2000", "train_n2000"),
                                            ("n8000", "train_n8000")]


def test_assistant_turns_counts_what_extraction_reads(tmp_path):
    recs = [{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
                          {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
                          {"role": "assistant", "content": "d"}, {"role": "user", "content": "dropped"}]},
            {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]},
            {"input_ids": [1, 2, 3, 4, 5, 6], "loss_mask": [0, 1, 1, 0, 1, 0]},  # two responses
            {"messages": []}]  # skipped
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert br.assistant_turns(str(src)) == 2 + 1 + 2


def test_eval_overhead_fraction():
    # one 2 s evaluation per 200 steps of 0.1 s: 2 / (2 + 20)
    assert abs(br.eval_overhead_fraction([1.0, 2.0, 9.0], [0.1, 0.1, 0.5], every=200) - 2 / 22) < 1e-12
    assert br.default_eval_every() == 200


def test_disk_plan():
    est = {"eval": 1000, "train_fp8": 50_000, "train_n8000": 10_000}
    d = br.disk_plan(est, free=60_000, drop=False, order=["train_fp8", "train_n8000"])
    assert d["needed_bytes"] == 61_000 and not d["fits"]
    d = br.disk_plan(est, free=60_000, drop=True, order=["train_fp8", "train_n8000"])
    assert d["needed_bytes"] == 51_000 and d["fits"]  # the eval cache stays; each training cache goes after its run


def test_stage_redone_when_its_files_are_gone(tmp_path):
    """A later session (fresh machine, the result JSON carried in) redoes a stage whose files are not there and
    keeps one whose output is only numbers (a finished training run)."""
    import bench_quality as bq

    earlier = {"stage_out": {"a_target": str(tmp_path / "gone"), "e_train_all": {"steps": 7}},
               "stage_seconds": {"a_target": 1.0, "e_train_all": 2.0}, "eval_responses_sha256": {"mtbench": "e"},
               "train_data_sha256": "d", "date": "then"}
    st = bq.Stages({"date": "now"}, tmp_path / "r.json", earlier=earlier)
    st.save()  # a call that fails before visiting a stage keeps its earlier record in the saved JSON
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["stage_out"]["e_train_all"] == {"steps": 7}
    # and the fields later calls check (a failed call must not let the next one score on other data)
    assert saved["eval_responses_sha256"] == {"mtbench": "e"} and saved["train_data_sha256"] == "d"
    assert saved["date"] == "now"  # what this call sets wins
    calls = []
    here = tmp_path / "here"
    here.mkdir()
    got = st.run("a_target", lambda: calls.append("a") or str(here), valid=lambda out: pathlib.Path(out).is_dir())
    assert got == str(here) and calls == ["a"]
    assert st.run("e_train_all", lambda: calls.append("e")) == {"steps": 7} and calls == ["a"]
    st2 = bq.Stages({}, tmp_path / "r.json", earlier={"stage_out": {"a_target": str(here)},
                                                        "stage_seconds": {"a_target": 1.0}})
    assert st2.run("a_target", lambda: calls.append("a2"), valid=lambda out: pathlib.Path(out).is_dir()) == str(here)
    assert calls == ["a"]
    # a stage several runs share (their cache) runs once in a call: the second visit gets the first's output
    assert st2.run("d_cache", lambda: calls.append("d") or {"samples": 3}) == {"samples": 3}
    assert st2.run("d_cache", lambda: calls.append("d") or {"samples": 0}) == {"samples": 3}
    assert calls == ["a", "d"]


def greedy_lines(model_dir, n, tag, **marker):
    """n records as `dflash generate` marks them target-greedy for the folder's config (marker overrides)."""
    from dflash.target.identity import target_config_hash

    meta = {"greedy": True, "target_config_hash": target_config_hash(model_dir)} | marker
    return "".join(json.dumps({tag: i, "dflash_generate": meta}) + "\n" for i in range(n))


def target_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama", "hidden_size": 8}')
    return str(d)


def test_eval_responses_carried_and_checked(tmp_path):
    """--eval-responses copies an earlier session's files (plain or .gz); responses that differ from those the
    earlier calls scored on stop the run with what to pass."""
    import gzip

    model = target_dir(tmp_path)
    src = tmp_path / "carried"
    src.mkdir()
    (src / br.EVAL_SETS["mtbench"]).write_text(greedy_lines(model, 2, "a"))
    (src / (br.EVAL_SETS["humaneval"] + ".gz")).write_bytes(gzip.compress(greedy_lines(model, 1, "b").encode()))
    (src / br.HELDOUT_SETS["sharegpt"]).write_text(greedy_lines(model, 1, "c", dtype="float32"))
    work = tmp_path / "work"
    work.mkdir()
    args = types.SimpleNamespace(eval_responses=str(src))
    out = br.bq.eval_responses(args, model, {}, work, "cpu", "float32", sets=br.HELDOUT_SETS)
    assert out["mtbench"]["prompts"] == 2 and out["humaneval"]["prompts"] == 1
    assert (work / br.EVAL_SETS["humaneval"]).read_text() == greedy_lines(model, 1, "b")
    sha = br.bq.same_eval_responses(work, None, sets=br.HELDOUT_SETS)
    assert br.bq.same_eval_responses(work, sha, sets=br.HELDOUT_SETS) == sha
    (work / br.EVAL_SETS["humaneval"]).write_text(greedy_lines(model, 1, "B"))  # a regenerated response changed
    with pytest.raises(SystemExit, match="humaneval eval responses here differ.*--eval-responses"):
        br.bq.same_eval_responses(work, sha, sets=br.HELDOUT_SETS)
    (src / (br.EVAL_SETS["humaneval"] + ".gz")).unlink()
    with pytest.raises(SystemExit, match="neither humaneval_greedy.jsonl nor"):  # the earlier calls scored on it
        br.bq.eval_responses(args, model, {}, work, "cpu", "float32", sets=br.HELDOUT_SETS,
                                scored=("mtbench", "humaneval"))


@pytest.mark.parametrize("bad, why", [({"greedy": False}, "no dflash_generate greedy marker"),
                                      ({"target_config_hash": "0" * 64}, "generated by another target"),
                                      ({"dtype": "bfloat16"}, "generated in bfloat16; this extraction runs float32")])
def test_eval_responses_refuses_what_extraction_would_not_mark_greedy(tmp_path, bad, why):
    """Carried responses that are not this target's greedy output in this dtype (GPU bf16 responses on a CPU
    fp32 run, another target's) stop the run when copied, before any cache is extracted, naming the reason."""
    model = target_dir(tmp_path)
    src, work = tmp_path / "carried", tmp_path / "work"
    src.mkdir()
    work.mkdir()
    (src / br.EVAL_SETS["mtbench"]).write_text(greedy_lines(model, 2, "a", **bad))
    args = types.SimpleNamespace(eval_responses=str(src))
    with pytest.raises(SystemExit, match=f"--eval-responses .*mtbench_greedy.jsonl: not this run's target-greedy "
                                         f"responses .*{why}"):
        br.bq.eval_responses(args, model, {}, work, "cpu", "float32", sets={"mtbench": br.EVAL_SETS["mtbench"]})


def test_eval_responses_generates_a_set_new_to_the_run(tmp_path, monkeypatch):
    """A set the earlier calls did not score on (the ShareGPT set, added after the first reference session) is
    generated when --eval-responses lacks it; the carried ones are copied, and the sha check covers both."""
    src, work = tmp_path / "carried", tmp_path / "work"
    src.mkdir()
    work.mkdir()
    model = target_dir(tmp_path)
    for name in ("mtbench", "humaneval"):
        (src / br.HELDOUT_SETS[name]).write_text(greedy_lines(model, 1, name))
    asked = []

    def generate_all(args, model, prompts, work, device, dtype):
        asked.append(sorted(prompts))
        (work / br.HELDOUT_SETS["sharegpt"]).write_text('{"new": 1}\n')
        return {"sharegpt": {"prompts": 1}}

    monkeypatch.setattr(br.bq, "generate_all", generate_all)
    args = types.SimpleNamespace(eval_responses=str(src))
    out = br.bq.eval_responses(args, model, {"sharegpt": "p.jsonl"}, work, "cpu", "float32",
                               sets=br.HELDOUT_SETS, scored=("mtbench", "humaneval"))
    assert asked == [["sharegpt"]] and sorted(out) == ["humaneval", "mtbench", "sharegpt"]
    now = br.bq.same_eval_responses(work, None, sets=br.HELDOUT_SETS)
    earlier = {k: v for k, v in now.items() if k != "sharegpt"}
    # no earlier sha of sharegpt
    assert set(br.bq.same_eval_responses(work, earlier, sets=br.HELDOUT_SETS)) == set(br.HELDOUT_SETS)


def test_heldout_prompts_avoid_training_turns(tmp_path):
    """The held-out ShareGPT prompts come from the end of the file, distinct, none a training user turn; the run
    trains without every conversation that holds one as a user turn (at any turn, surrounding spaces aside), and
    keeps the training file itself when none does."""
    from make_quality_assets import last_distinct, prompt_texts, user_turns, write_jsonl

    texts = ["a", "b", "", "c", "b", "x" * 50, "d", "c"]
    assert last_distinct(texts, count=3, exclude={"d"}, max_chars=10) == ["a", "b", "c"]
    assert last_distinct(texts, count=9, exclude=set(), max_chars=10) == ["a", "b", "d", "c"]
    prompts, train = tmp_path / "heldout.jsonl", tmp_path / "train.jsonl"
    write_jsonl(prompts, [{"messages": [{"role": "user", "content": t}]} for t in ("p1", "p2")])
    keep = {"id": "k", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "p1"}]}
    drop = {"id": "d", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"},
                                    {"role": "user", "content": " p2 "}, {"role": "assistant", "content": "s"}]}
    write_jsonl(train, [keep, drop, keep])
    assert user_turns([str(train)]) == {"q", "p2"}
    heldout = prompt_texts(prompts)
    out, dropped = br.without_heldout(str(train), heldout, tmp_path / "minus.jsonl")
    assert dropped == 1 and [json.loads(s) for s in open(out)] == [keep, keep]
    assert not user_turns([out]) & heldout
    assert br.without_heldout(out, heldout, tmp_path / "again.jsonl") == (out, 0)
    assert not (tmp_path / "again.jsonl").exists()


def test_committed_heldout_prompts_are_unique_first_turns():
    """The committed held-out ShareGPT prompts are first user turns of the package, each a user turn of exactly
    one conversation: holding them out removes one training conversation each (make_quality_assets)."""
    from collections import Counter

    from dflash.data import iter_records
    from dflash.data.assets import sharegpt_path
    from make_quality_assets import prompt_texts

    held = prompt_texts(br.bq.COMMITTED_ASSETS / br.HELDOUT_PROMPTS)
    uses, firsts = Counter(), set()
    for rec in iter_records(sharegpt_path()):
        msgs = getattr(rec, "messages", None) or []
        uses.update({m["content"].strip() for m in msgs if m["role"] == "user"})
        firsts.update(m["content"].strip() for m in msgs[:1] if m["role"] == "user")
    assert len(held) == 244 and held <= firsts
    assert all(uses[t] == 1 for t in held)


def test_training_data_identity_across_calls(tmp_path):
    """The GPU default trains on the committed regenerated conversations, in file order; their sha256 is the
    run's data identity (a resumed call on other data is refused in main)."""
    args = br.parse_args([])
    inputs = br.train_data_inputs(args)
    assert inputs and [pathlib.Path(p).name for p in inputs] == sorted(pathlib.Path(p).name for p in inputs)
    assert all(pathlib.Path(p).parent == br.bq.COMMITTED_ASSETS for p in inputs)
    assert br.train_data_inputs(br.parse_args(["--tiny"])) == []
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"x" * 3_000_000)
    b.write_bytes(b"y")
    assert br.files_sha256([str(a), str(b)]) != br.files_sha256([str(b), str(a)])
    assert br.files_sha256([str(a)]) == br.files_sha256([str(a)])


def test_caches_needed_by_runs_still_to_train():
    """A cache is needed while any run reading it is unfinished, also when the first run reading it is done (a new
    session continuing the reference run: all_fp8 done, all_noise to train from the same cache)."""
    plan = br.runs_plan(br.parse_args(["--skip", "all_bf16"]))
    assert br.caches_needed(plan, frozenset()) == {"eval", "train_fp8", "train_n2000", "train_n8000"}
    assert br.caches_needed(plan, frozenset({"all_fp8", "n2000"})) == {"eval", "train_fp8", "train_n8000"}
    done = frozenset({"all_fp8", "all_noise", "all_seed1", "all_seqnorm", "n2000"})
    assert br.caches_needed(plan, done) == {"eval", "train_n8000"}


def test_repeated_tokens_and_repetition(tmp_path):
    """A token counts when the n-gram it completes was completed before in the same response; responses are
    assistant messages (tokenized alone) or the loss-masked spans of pre-tokenized records."""
    assert br.repeated_tokens([1, 2, 3, 1, 2, 3, 1, 2], n=3) == 3
    assert br.repeated_tokens([1, 2, 3, 4, 5], n=3) == 0 and br.repeated_tokens([7] * 5, n=2) == 3
    assert br.repeated_tokens([1, 2], n=3) == 0
    assert br.masked_spans([5, 1, 2, 9, 3], [0, 1, 1, 0, 1]) == [[1, 2], [3]] and br.masked_spans([4], [0]) == []

    class Chars:  # a tokenizer of one id per character
        def __call__(self, text, add_special_tokens):
            return {"input_ids": [ord(c) for c in text]}

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "abcabc"},
                                             {"role": "assistant", "content": "xyxyxy"}]}) + "\n"
                    + json.dumps({"input_ids": [5, 1, 2, 1, 2, 9, 3, 3, 3], "loss_mask": [0, 1, 1, 1, 1, 0, 1, 1, 1]})
                    + "\n")
    got = br.repetition(str(data), Chars(), limit=None, n=2)
    # "xyxyxy": bigrams xy yx xy yx xy -> 3 repeats of 6; [1,2,1,2]: 12 21 12 -> 1 of 4; [3,3,3]: 33 33 -> 1 of 3
    assert (got["tokens"], got["turns"], got["records"]) == (13, 3, 2)
    assert got["repeated_fraction"] == 5 / 13
    assert br.repetition(str(data), Chars(), limit=1, n=2)["turns"] == 1
    assert br.repetition(str(data), Chars(), limit=None)["repeated_fraction"] == 0  # no 8-gram repeats here


def test_concurrent_groups_pairs_pending_runs_of_one_cache():
    plan = [("all_int4", "train_int4", {}), ("all_bf16", "train_int4", {"online": True}),
            ("all_noise", "train_int4", {}), ("all_seed1", "train_int4", {}), ("n2000", "train_n2000", {}),
            ("n8000", "train_n8000", {})]
    g = br.concurrent_groups(plan, finished=frozenset({"all_int4"}), n=2)
    assert g["all_bf16"] == g["all_noise"] == ("all_bf16", "all_noise")
    assert g["all_seed1"] == ("all_seed1",)          # the next pair would cross to another cache
    assert g["n2000"] == ("n2000",) and g["n8000"] == ("n8000",) and "all_int4" not in g
    assert br.concurrent_groups(plan, finished=frozenset(), n=3)["all_noise"] == ("all_int4", "all_bf16", "all_noise")
    # a finished run in between does not split a group: it is not trained
    g = br.concurrent_groups(plan, finished=frozenset({"all_bf16"}), n=2)
    assert g["all_int4"] == ("all_int4", "all_noise")
    assert all(names == (r,) for r, names in br.concurrent_groups(plan, finished=frozenset(), n=1).items())


def _small_jobs(tmp_path, *, save_every: int, **fixed):
    """job(name, **over) -> train_once keyword arguments of a 4-step run on a tiny target and cache."""
    target = tiny_target(tmp_path / "target")
    cache = tiny_cache(tmp_path / "cache", target, num_samples=12)
    args = types.SimpleNamespace(layers=1, block_size=4, num_anchors=8, lr=3e-3, batch_tokens=200, log_every=2,
                                 save_every=save_every, intermediate_size=64)

    def job(name, **over):
        return dict(args=args, model=str(target), cache=cache, out=tmp_path / name, device="cpu", steps=4,
                    eval_cache=None, eval_every=200, log_every=None, **fixed, **over)
    return job


def test_runs_trained_together_equal_runs_trained_alone(tmp_path):
    """--parallel-runs: two runs in two processes at once give each run's losses exactly as training it alone
    (deterministic on CPU), and each record names the run it shared the device with."""
    job = _small_jobs(tmp_path, save_every=4)
    alone = br.train_once(**job("alone", seed=1))
    got = br.train_together({"a": job("a"), "b": job("b", seed=1)})
    assert got["a"]["trained_with"] == ["b"] and got["b"]["trained_with"] == ["a"]
    assert got["b"]["steps"] == alone["steps"] == 4
    assert [m["step_losses"] for m in got["b"]["metrics"]] == [m["step_losses"] for m in alone["metrics"]]
    assert [m["step_losses"] for m in got["a"]["metrics"]] != [m["step_losses"] for m in alone["metrics"]]


def _write_metrics(run_dir: pathlib.Path, taus: dict[int, tuple[float, float]]) -> None:
    run_dir.mkdir(parents=True)
    recs = [{"step": s, "loss": 1.0, "accept_len": 2.0, "heldout_tau": (m + h) / 2,
             "heldout_tau/mtbench_greedy.jsonl": m, "heldout_tau/humaneval_greedy.jsonl": h} for s, (m, h) in taus.items()]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_cut_runs_recorded_and_compared_at_the_reference_steps(tmp_path):
    """A run cut short (its session ended) keeps its curve so far: the longer of this machine's and the earlier
    call's, never a finished run's; it is compared with the reference run at the last step both evaluated."""
    plan = [("all_int4", "train_int4", {}), ("all_noise", "train_int4", {"noise_start": 0.1}),
            ("all_seed1", "train_int4", {"seed": 1}), ("n2000", "train_n2000", {})]
    _write_metrics(tmp_path / "run_all_int4", {500: (1.2, 1.3), 1000: (1.5, 1.6)})
    _write_metrics(tmp_path / "run_all_noise", {500: (1.1, 1.2), 1000: (1.4, 1.7), 1500: (1.9, 2.0)})
    _write_metrics(tmp_path / "run_all_seed1", {500: (1.0, 1.0)})
    earlier = {"all_seed1": {"step": [500, 1000], "mtbench_greedy.jsonl": [1.0, 1.3]},
               "n2000": {"step": [100], "mtbench_greedy.jsonl": [1.1]},
               "all_bf16": {"step": [500], "mtbench_greedy.jsonl": [1.2]},   # not in this call's plan
               "all_int4": {"step": [500], "mtbench_greedy.jsonl": [1.2]}}
    got = br.partial_curves(plan, tmp_path, finished=frozenset({"all_int4"}), earlier=earlier)
    # all_int4 finished: in `curves`, not here; all_bf16, skipped by this call, keeps its earlier curve
    assert set(got) == {"all_noise", "all_seed1", "n2000", "all_bf16"} and got["all_bf16"] == earlier["all_bf16"]
    del got["all_bf16"]
    assert got["all_noise"]["step"] == [500, 1000, 1500] and got["all_seed1"] == earlier["all_seed1"]
    assert got["n2000"] == earlier["n2000"]                      # nothing of it on this machine
    ref = br.curve(json.loads(line) for line in (tmp_path / "run_all_int4" / "metrics.jsonl").read_text().splitlines())
    cmp = br.at_last_common_step(got, ref)
    assert cmp["all_noise"]["step"] == 1000                      # 1500 is past the reference curve
    assert cmp["all_noise"]["tau_mtbench"] == 1.4 and cmp["all_noise"]["reference_tau_humaneval"] == 1.6
    assert cmp["all_seed1"]["tau_humaneval"] is None and cmp["all_seed1"]["reference_tau_mtbench"] == 1.5
    assert "n2000" not in cmp                                    # no step in common
    assert br.at_last_common_step(got, None) == {}
    png = pathlib.Path(br.plot_runs({"all_int4": ref}, got, tmp_path / "cut.png"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_online_runs_shared_equal_runs_trained_alone(tmp_path):
    """--parallel-runs with online runs of one cache: one sweep group (one live target, each run's own rounding)
    gives each run exactly the losses of training it alone, and the records say it was shared."""
    job = _small_jobs(tmp_path, save_every=2, online=True)
    got = br.train_shared({"fp8": job("fp8", online_storage="fp8"), "raw": job("raw")}, work=tmp_path)
    assert got["fp8"]["trained_with"] == ["raw"] and got["raw"]["shared_target"] and got["raw"]["steps"] == 4
    for name, over in (("fp8", {"online_storage": "fp8"}), ("raw", {})):
        alone = br.train_once(**job(f"alone_{name}", **over))
        assert [m["step_losses"] for m in got[name]["metrics"]] == [m["step_losses"] for m in alone["metrics"]]
    assert got["fp8"]["metrics"][-1]["step_losses"] != got["raw"]["metrics"][-1]["step_losses"]


def test_cut_run_resumed_from_its_parts_on_a_fresh_machine(tmp_path):
    """The stretch across sessions: a run trained online with int4 rounding (--online-reference) is cut at a call's
    end (--cut-after-steps), its newest checkpoint packed into parts (--pack-runs); on a fresh machine (its run
    folder gone) the carried parts (--run-parts) are joined, checked against the JSON's record and resumed from:
    the run ends with the uncut run's losses, bit for bit (CPU). ~10 s."""
    job = _small_jobs(tmp_path, save_every=2, online=True, online_storage="int4")
    uncut = br.train_once(**job("uncut"))
    cut = job("run_all_int4")
    cut["args"] = types.SimpleNamespace(**vars(cut["args"]), cut_after_steps=2)
    with pytest.raises(SystemExit, match="run_all_int4 stopped at step 2 of 4"):
        br.train_once(**cut)
    plan, pack, carried = [("all_int4", br.TOKENS_CACHE, {})], tmp_path / "pack", tmp_path / "carried"
    packed = br.pack_runs(plan, tmp_path, finished=frozenset(), dest=pack, packed={}, part_bytes=2**16)
    assert packed["all_int4"]["step"] == 2 and packed["all_int4"]["parts"] > 1
    shutil.rmtree(tmp_path / "run_all_int4")          # a fresh machine: only the parts come along
    with pytest.raises(SystemExit, match="all_int4 was cut at step 2 by an earlier call"):   # none carried
        br.restore_runs(plan, tmp_path, finished=frozenset(), folder=None, packed=packed)
    shutil.copytree(pack, carried)
    with pytest.raises(SystemExit, match="step 2, but the result JSON records step 4"):   # another call's parts
        br.restore_runs(plan, tmp_path, finished=frozenset(), folder=carried,
                        packed={"all_int4": {"step": 4, "sha256": "0"}})
    assert br.restore_runs(plan, tmp_path, finished=frozenset(), folder=carried, packed=packed) == {"all_int4": 2}
    resumed = br.train_once(**job("run_all_int4"))
    assert resumed["resumed"] and resumed["steps"] == 4
    assert [m["step_losses"] for m in resumed["metrics"]] == [m["step_losses"] for m in uncut["metrics"]]
    # a warm machine keeps its own newer checkpoint; a finished run's parts and record go
    assert br.restore_runs(plan, tmp_path, finished=frozenset(), folder=carried, packed=packed) == {}
    assert br.pack_runs(plan, tmp_path, finished=frozenset({"all_int4"}), dest=pack, packed=packed) == {}
    assert not list(pack.iterdir())


def test_pack_only_hands_on_the_newest_checkpoint_a_call_left_unpacked(tmp_path):
    """--pack-only (run_h200.sh stretch runs it after the training process, however that ended): a cut run whose
    newest checkpoint the JSON's packed_runs does not record is packed and recorded; called again, nothing is
    packed a second time; without its folders and JSON it refuses."""
    job = _small_jobs(tmp_path, save_every=2, online=True, online_storage="int4")
    cut = job("run_all_int4")
    cut["args"] = types.SimpleNamespace(**vars(cut["args"]), cut_after_steps=2)
    with pytest.raises(SystemExit, match="stopped at step 2"):
        br.train_once(**cut)
    out, pack = tmp_path / "stretch.json", tmp_path / "pack"
    out.write_text(json.dumps({"runs": {}, "packed_runs": {"all_int4": {"step": 0}}}))
    args = types.SimpleNamespace(workdir=str(tmp_path), pack_runs=str(pack))
    got = br.packed_only(args, out)["packed_runs"]
    assert got["all_int4"]["step"] == 2 and json.loads(out.read_text())["packed_runs"] == got
    stamps = {f.name: f.stat().st_mtime_ns for f in pack.iterdir()}
    assert len(stamps) == got["all_int4"]["parts"] + 1      # the parts and their manifest
    assert br.packed_only(args, out)["packed_runs"] == got
    assert {f.name: f.stat().st_mtime_ns for f in pack.iterdir()} == stamps
    with pytest.raises(SystemExit, match="--pack-only needs"):
        br.packed_only(types.SimpleNamespace(workdir=str(tmp_path), pack_runs=None), out)


def test_online_reference_plan_and_the_stretch_figures(tmp_path):
    """--online-reference: every run on all the data reads the one-tap token cache, the live target's taps rounded
    as --storage; --stretch puts a stretch result into the reference's JSON with its figures beside their goals,
    the reference's own runs kept, and refuses one scored on other eval responses."""
    plan = br.runs_plan(br.parse_args(["--storage", "int4", "--online-reference", "--skip",
                                       "all_bf16,all_noise,all_seqnorm,n2000,n8000"]))
    assert plan == [("all_int4", br.TOKENS_CACHE, {"online": True, "online_storage": "int4"}),
                    ("all_seed1", br.TOKENS_CACHE, {"online": True, "online_storage": "int4", "seed": 1})]
    curve = {"step": [500, 1000], "heldout_tau": [2.0, 2.3], "mtbench_greedy.jsonl": [1.9, 2.2],
             "humaneval_greedy.jsonl": [2.1, 2.4]}
    base = {"eval_responses_sha256": {"mtbench": "e"}, "reference_storage": "int4", "tau_mtbench": 2.33,
            "runs": {"all_int4": {"steps": 4088}}, "curves": {"all_int4": curve}}
    run = {"steps": 7900, "tokens": 43_000_000}
    stretch = {"eval_responses_sha256": {"mtbench": "e"}, "reference_storage": "int4", "config": {"epochs": 3},
               "runs": {"all_int4": run}, "curves": {"all_int4": curve}, "tau_mtbench": 2.6, "tau_humaneval": 2.75,
               "tau_sharegpt_heldout": 2.1, "train_acceptance_over_heldout": 1.5}
    got = br.stretch_into(base, stretch)
    assert (got["stretch_tau_mtbench"], got["stretch_tau_humaneval"], got["stretch_steps"], got["stretch_epochs"]) \
        == (2.6, 2.75, 7900, 3)
    assert got["stretch_checks"] == {"tau_mtbench_at_least_2_5": True, "tau_humaneval_at_least_2_8": False,
                                     "train_over_heldout_at_most_1_6": True}
    assert got["tau_mtbench"] == 2.33 and got["runs"] == base["runs"] and got["stretch"] == stretch
    assert got["stretch_finished"] and got["stretch_tokens"] == 43_000_000
    # cut: the figures of its last held-out evaluation, flagged; before the first one, none
    cut = stretch | {"runs": {}, "curves": {},
                     "partial_curves": {"all_int4": curve | {"sharegpt_greedy.jsonl": [2.5, 2.9],
                                                             "train_accept_len": [2.4, 3.45]}}}
    got = br.stretch_into(base, cut)
    assert (got["stretch_tau_mtbench"], got["stretch_tau_humaneval"], got["stretch_tau_sharegpt_heldout"],
            got["stretch_steps"], got["stretch_finished"], got["stretch_tokens"]) == (2.2, 2.4, 2.9, 1000, False, None)
    assert got["stretch_train_acceptance_over_heldout"] == pytest.approx(3.45 / 2.3)
    assert got["stretch_checks"] == {"tau_mtbench_at_least_2_5": False, "tau_humaneval_at_least_2_8": False,
                                     "train_over_heldout_at_most_1_6": True}
    fresh = br.stretch_into(base, cut | {"partial_curves": {}})
    assert fresh["stretch_tau_mtbench"] is None and not any(fresh["stretch_checks"].values())
    with pytest.raises(SystemExit, match="other eval responses"):
        br.stretch_into(base, stretch | {"eval_responses_sha256": {"mtbench": "x"}})
    # the command: --json updated in place, the stretch's curve drawn beside the reference's
    (tmp_path / "r.json").write_text(json.dumps(base))
    (tmp_path / "s.json").write_text(json.dumps(cut))
    br.main(["--json", str(tmp_path / "r.json"), "--stretch", str(tmp_path / "s.json"), "--plot-dir", str(tmp_path)])
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["stretch"]["partial_curves"] == cut["partial_curves"] and saved["stretch_goals"] == br.STRETCH_GOALS
    assert pathlib.Path(saved["stretch_plot"]).read_bytes()[:4] == b"\x89PNG"


def test_watching_prints_each_new_heldout_evaluation(tmp_path, capsys):
    """While runs train, each new held-out evaluation in their metrics.jsonl is one progress line, once."""
    _write_metrics(tmp_path / "run_a", {500: (1.2, 1.3)})        # an earlier call's: not printed again
    path = tmp_path / "run_a" / "metrics.jsonl"
    with br.watching({"a": tmp_path / "run_a", "b": tmp_path / "run_b"}, every_s=0.05):
        with path.open("a") as f:
            f.write(json.dumps({"step": 600, "loss": 1.0}) + "\n")   # a log record without evaluation
            f.write(json.dumps({"step": 1000, "heldout_tau": 1.5, "step_time_s": 0.31, "accept_len": 2.0,
                                "heldout_tau/mtbench_greedy.jsonl": 1.4}) + "\n")
        time.sleep(0.3)
    lines = [x for x in capsys.readouterr().out.splitlines() if "held-out" in x]
    assert len(lines) == 1 and "a step 1000: held-out tau 1.500, MT-Bench 1.400; 0.310 s a step" in lines[0]


def test_results_of_two_gpus_merged(tmp_path):
    """run_h200.sh refpair: two calls train other runs of one reference on two GPUs; --merge adds the runs the
    second finished and keeps the longer curve of a run cut in both; it refuses results of other data."""
    def curve_of(taus):
        return {"step": [500 * (i + 1) for i in range(len(taus))], "heldout_tau": list(taus),
                "mtbench_greedy.jsonl": list(taus), "humaneval_greedy.jsonl": [t + 0.1 for t in taus]}

    def run_of(tau):
        return {"samples": 10, "tokens": 100, "steps": 1000, "tokens_per_s": 5.0, "tau_mtbench": tau,
                "tau_humaneval": tau + 0.1,
                "tau_sharegpt": None, "final_train_accept_len": 3.0}
    head = {"train_data_sha256": "d", "eval_responses_sha256": {"mtbench": "e"}, "reference_storage": "int4",
            "stage_out": {"a_target": "/tmp/bref/t", "e_train_all_int4": {}}, "stage_seconds": {"a_target": 1.0}}
    gpu0 = head | {"runs": {"all_int4": run_of(2.0), "all_bf16": run_of(2.01)},
                   "curves": {"all_int4": curve_of([1.5, 2.0]), "all_bf16": curve_of([1.5, 2.01])},
                   "partial_curves": {"all_seed1": curve_of([1.4]), "all_fp8": curve_of([1.5])},
                   "calls": [{"date": "1", "command": "a"}, {"date": "2", "command": "gpu0"}]}
    gpu1 = head | {"stage_out": {"a_target": "/tmp/bref1/t", "e_train_all_seed1": {}},
                   "stage_seconds": {"a_target": 2.0, "e_train_all_seed1": 9.0},
                   "runs": {"all_int4": run_of(9.9), "all_seed1": run_of(2.02)},
                   "curves": {"all_int4": curve_of([9.9]), "all_seed1": curve_of([1.45, 2.02])},
                   "partial_curves": {"all_noise": curve_of([1.5]), "all_fp8": curve_of([1.6, 1.9])},
                   "calls": [{"date": "1", "command": "a"}, {"date": "3", "command": "gpu1"}]}
    m = br.merged_results(gpu0, gpu1)
    assert set(m["runs"]) == {"all_int4", "all_bf16", "all_seed1"} and m["runs"]["all_int4"]["tau_mtbench"] == 2.0
    assert m["curves"]["all_seed1"] == gpu1["curves"]["all_seed1"]
    assert set(m["partial_curves"]) == {"all_noise", "all_fp8"}            # all_seed1 finished on GPU 1
    assert m["partial_curves"]["all_fp8"]["step"] == [500, 1000]            # the longer of the two
    assert m["partial_at_reference_steps"]["all_fp8"]["tau_mtbench"] == 1.9
    assert m["stage_out"]["a_target"] == "/tmp/bref/t" and "e_train_all_seed1" in m["stage_out"]
    assert [c["command"] for c in m["calls"]] == ["a", "gpu0", "gpu1"]
    assert m["seed_spread"]["mtbench"] == pytest.approx(0.01) and "all_seed1" not in gpu0["runs"]
    with pytest.raises(SystemExit, match="train_data_sha256"):
        br.merged_results(gpu0, gpu1 | {"train_data_sha256": "other"})
    # the command: --json updated in place, the added run's PNG drawn
    base = tmp_path / "r.json"
    base.write_text(json.dumps(gpu0))
    (tmp_path / "g1.json").write_text(json.dumps(gpu1))
    br.main(["--json", str(base), "--merge", str(tmp_path / "g1.json"), "--plot-dir", str(tmp_path)])
    got = json.loads(base.read_text())
    assert got["runs"]["all_seed1"]["plot"] == str(tmp_path / "quality_reference_all_seed1.png")
    assert (tmp_path / "quality_reference_all_seed1.png").read_bytes()[:4] == b"\x89PNG"
    assert got["partial_plot"] == str(tmp_path / "quality_reference_cut_runs.png")
