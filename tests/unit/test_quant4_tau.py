"""bench_storage4.py --stage tau (issue 16's held-out tau per storage, issue 14's fp8 one): the summary arithmetic,
the disk preflight and the H200 estimate as pure functions, and the whole stage on the real SmolLM2 in --tiny mode
(CPU): two calls, the first stopped after int4's first run and the second continuing it with --resume; every
number in the results file is checked against the runs' own metrics.jsonl and extraction records."""

import json
import pathlib
import statistics
import sys

import pytest

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE.parents[1] / "benchmarks"))
import bench_storage4 as b4  # noqa: E402

DS = ("mtbench", "humaneval")


def _run(storage, seed, mt, he, tok_s):
    return {"storage": storage, "seed": seed, "tau_mtbench": mt, "tau_humaneval": he, "tokens_per_s": tok_s}


def _extract(tokens, loop, drain, before=0):
    return {"tokens": tokens, "loop_seconds": loop, "drain_seconds": drain, "committed_before": before,
            "bytes": 7 * tokens}


def test_tau_summary_means_signed_diffs_spread_and_ratios():
    runs = {"bf16_seed0": _run("bf16", 0, 2.00, 1.50, 100.0), "bf16_seed1": _run("bf16", 1, 2.10, 1.60, 110.0),
            "int4_seed0": _run("int4", 0, 1.98, 1.56, 90.0), "int4_seed1": _run("int4", 1, 2.06, 1.58, 94.0),
            "fp8_seed0": _run("fp8", 0, 2.04, 1.54, 95.0), "fp8_seed1": _run("fp8", 1, 2.06, None, 105.0)}
    ext = {"bf16": _extract(1000, 8.0, 2.0), "fp8": _extract(1000, 4.0, 1.0), "int4": _extract(1000, 3.0, 1.0)}
    s = b4.tau_summary(runs, ext)
    assert s["tau_means"]["bf16"] == pytest.approx({"mtbench": 2.05, "humaneval": 1.55})
    assert s["tau_means"]["int4"] == pytest.approx({"mtbench": 2.02, "humaneval": 1.57})
    assert s["tau_means"]["fp8"] == pytest.approx({"mtbench": 2.05, "humaneval": 1.54})  # the None is left out
    assert s["tau_rel_diff_mtbench"] == pytest.approx((2.02 - 2.05) / 2.05)  # signed: int4 lower here
    assert s["tau_rel_diff_humaneval"] == pytest.approx((1.57 - 1.55) / 1.55)
    assert s["fp8_rel_diff_mtbench"] == pytest.approx(0.0, abs=1e-12)
    assert s["fp8_rel_diff_humaneval"] == pytest.approx((1.54 - 1.55) / 1.55)
    assert s["paired_rel_diff_vs_bf16"]["int4"]["mtbench"] == pytest.approx({"0": -0.01, "1": (2.06 - 2.1) / 2.1})
    assert list(s["paired_rel_diff_vs_bf16"]["fp8"]["humaneval"]) == ["0"]  # seed 1 has no fp8 HumanEval tau
    spread = {"mtbench": 0.10 / 2.05, "humaneval": 0.10 / 1.55}
    assert s["bf16_seed_spread_per_dataset"] == pytest.approx(spread)
    assert s["bf16_seed_spread"] == pytest.approx(max(spread.values()))
    assert s["checks"] == {"int4_within_1pct": False, "int4_within_bf16_seed_spread": True,
                           "fp8_within_1pct": True, "fp8_within_bf16_seed_spread": True}
    assert s["extract_tok_s"] == pytest.approx({"bf16": 100.0, "fp8": 200.0, "int4": 250.0})
    assert s["extract_ratio_vs_fp8"] == pytest.approx(1.25) and s["extract_ratio_bf16_vs_fp8"] == pytest.approx(0.5)
    assert s["train_ratio_vs_fp8"] == pytest.approx(92.0 / 100.0)
    assert s["bytes_written_per_token"] == {"bf16": 7.0, "fp8": 7.0, "int4": 7.0}
    top = b4.tau_top_fields(s)
    assert top["extract_ratio_vs_fp8_smollm2"] == s["extract_ratio_vs_fp8"]
    assert "extract_ratio_vs_fp8" not in top and "train_ratio_vs_fp8" not in top  # the 27B-shape fields stay theirs
    # a resumed extraction (shards committed by an earlier call) gives no rate; one seed gives no spread
    s2 = b4.tau_summary({k: v for k, v in runs.items() if k.endswith("seed0")},
                        {**ext, "int4": _extract(400, 1.0, 0.5, before=3)})
    assert "int4" not in s2["extract_tok_s"] and "extract_ratio_vs_fp8" not in s2
    assert "bf16_seed_spread" not in s2 and "int4_within_bf16_seed_spread" not in s2["checks"]
    assert s2["tau_rel_diff_mtbench"] == pytest.approx(-0.01)


def test_disk_plan_keeps_all_deletes_as_it_goes_or_refuses():
    caches = {"bf16": 13_000, "int4": 3_600, "fp8": 6_700}
    p = b4.disk_plan(cache_bytes=caches, free_bytes=30_000, reserve_bytes=2_000, delete="auto")
    assert p.keep_all and "none deleted" in p.describe()
    p = b4.disk_plan(cache_bytes=caches, free_bytes=20_000, reserve_bytes=2_000, delete="auto")
    assert not p.keep_all and "deleted when its runs are done" in p.describe()
    assert not b4.disk_plan(cache_bytes=caches, free_bytes=30_000, reserve_bytes=2_000, delete="always").keep_all
    with pytest.raises(SystemExit, match="needs 15.0 GB|needs 0.0 GB"):
        b4.disk_plan(cache_bytes=caches, free_bytes=14_000, reserve_bytes=2_000, delete="auto")
    with pytest.raises(SystemExit, match="free"):
        b4.disk_plan(cache_bytes=caches, free_bytes=20_000, reserve_bytes=2_000, delete="never")


def test_tau_estimate_at_h200_rates():
    r = b4.H200Rates()
    rows = b4.tau_estimate(tokens=2_300_000, storages=("bf16", "int4", "fp8"), hidden_size=576, num_taps=5, seeds=2,
                           steps=100, batch_tokens=16384, eval_every=100, convert_target=True, make_eval_cache=True)
    d = dict(rows)
    assert [n for n, _ in rows] == ["a_target", "c_plan", "d_generate_eval", "e_extract_eval", "f_extract_bf16",
                                    "g_train_bf16_seed0", "g_train_bf16_seed1", "f_extract_int4", "g_train_int4_seed0",
                                    "g_train_int4_seed1", "f_extract_fp8", "g_train_fp8_seed0", "g_train_fp8_seed1"]
    assert d["f_extract_bf16"] == pytest.approx(r.extract_setup_s + 2_300_000 / r.extract_bf16_tok_s)
    # int4 writes ~0.27x bf16's bytes: no longer disk-bound, so it runs at the compute rate
    assert d["f_extract_int4"] == pytest.approx(r.extract_setup_s + 2_300_000 / r.extract_max_tok_s)
    run = 100 * 16384 / r.train_tok_s + r.train_setup_s + r.eval_s
    assert d["g_train_int4_seed1"] == pytest.approx(run)
    assert d["g_train_bf16_seed0"] == pytest.approx(run + r.train_first_extra_s)  # the first run compiles
    text = b4.format_estimate(rows, call_s=560)
    assert f"total ~{sum(d.values()):.0f} s" in text and "2 call(s) of 560 s" in text  # 654 s
    reuse = dict(b4.tau_estimate(tokens=2_300_000, storages=("bf16", "int4", "fp8"), hidden_size=576, num_taps=5,
                                 seeds=2, steps=100, batch_tokens=16384, eval_every=50, convert_target=False,
                                 make_eval_cache=False))  # --model and --eval-cache: no conversion, no eval cache
    assert set(d) - set(reuse) == {"a_target", "d_generate_eval", "e_extract_eval"}
    assert reuse["g_train_int4_seed1"] == pytest.approx(run + r.eval_s)  # eval every 50 of 100 steps: twice


def test_call_budget_stops_before_a_step_that_would_not_fit(tmp_path):
    import bench_quality as bq

    now = [0.0]
    saved = []
    st = b4.TauStages(bq.Stages({}, tmp_path / "state.json"), saved.append, stop_after=None, call_s=100.0,
                      clock=lambda: now[0])
    st.estimate_s = {"f_extract_bf16": 60.0, "g_train_bf16_seed0": 30.0}
    assert st.run("f_extract_bf16", lambda: {"tokens": 1}) == {"tokens": 1}  # 0 + 60 <= 100
    now[0] = 75.0
    with pytest.raises(b4.StopAfter, match="g_train_bf16_seed0 .~30 s at the H200 rates. would end past"):
        st.run("g_train_bf16_seed0", lambda: pytest.fail("must not run"))  # 75 + 30 > 100
    assert st.run("c_plan", lambda: "no estimate: runs") == "no estimate: runs" and len(saved) == 2
    # the next call (--resume) recalls the finished step whatever its estimate, then runs the one left over
    earlier = json.loads((tmp_path / "state.json").read_text())
    st2 = b4.TauStages(bq.Stages({}, tmp_path / "state.json", earlier=earlier), saved.append, stop_after=None,
                       call_s=100.0, clock=lambda: now[0], t0=60.0)
    st2.estimate_s = st.estimate_s
    assert st2.run("f_extract_bf16", lambda: pytest.fail("done before")) == {"tokens": 1}
    assert st2.run("g_train_bf16_seed0", lambda: "trained") == "trained"  # 15 + 30 <= 100


def _metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_tau_stage_tiny_two_calls(tmp_path, smollm2_dir, monkeypatch, capsys):
    from dflash.data.assets import sharegpt_conversations

    monkeypatch.setenv("DFLASH_NO_PROGRESS", "1")
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in sharegpt_conversations(3)))
    work, res = tmp_path / "work", tmp_path / "results"
    argv = ["--stage", "tau", "--tiny", "--workdir", str(work), "--results-dir", str(res), "--model", str(smollm2_dir),
            "--train-data", str(data), "--records", "2", "--steps", "2", "--eval-prompts", "1",
            "--eval-max-new-tokens", "4", "--max-new-tokens", "4", "--max-length", "256"]
    assert b4.main(argv + ["--stop-after", "g_train_int4_seed0"]) is None
    first = capsys.readouterr().out
    assert "estimate per step (H200 rates)" in first and "total ~" in first and "disk:" in first
    state = json.loads((work / "tau_state.json").read_text())
    assert list(state["runs"]) == ["bf16_seed0", "bf16_seed1", "int4_seed0"]
    done_mtime = (work / "run_bf16_seed0" / "metrics.jsonl").stat().st_mtime_ns
    out = b4.main(argv + ["--resume"])
    assert "training samples" in capsys.readouterr().out  # the plan is shown again, not recomputed
    assert (work / "run_bf16_seed0" / "metrics.jsonl").stat().st_mtime_ns == done_mtime  # not trained again
    got = json.loads((res / "storage4_tiny_cpu.json").read_text())
    tau = got["tau"]
    assert len(tau["calls"]) == 2 and list(tau["runs"]) == [f"{s}_seed{k}" for s in ("bf16", "int4", "fp8")
                                                          for k in (0, 1)]
    assert out["runs"] == tau["runs"]
    # per-run tau and tok/s come from each run's own metrics.jsonl (held-out tau per eval set at the end)
    for name, r in tau["runs"].items():
        recs = _metrics(work / f"run_{name}")
        assert r["steps"] == 2 and recs[-1]["step"] == 2
        assert r["tau_mtbench"] == recs[-1]["heldout_tau/mtbench_greedy.jsonl"] >= 1.0
        assert r["tau_humaneval"] == recs[-1]["heldout_tau/humaneval_greedy.jsonl"] >= 1.0
        tps = [x["tokens_per_s"] for x in recs[1:]] or [x["tokens_per_s"] for x in recs]
        assert r["tokens_per_s"] == statistics.median(tps)
        assert not (work / f"run_{name}" / "checkpoints").exists()
    # the top-level numbers, recomputed here from the per-run records
    mean = {s: {ds: statistics.mean(tau["runs"][f"{s}_seed{k}"][f"tau_{ds}"] for k in (0, 1)) for ds in DS}
            for s in ("bf16", "int4", "fp8")}
    for ds in DS:
        assert got[f"tau_rel_diff_{ds}"] == pytest.approx((mean["int4"][ds] - mean["bf16"][ds]) / mean["bf16"][ds])
        assert got[f"fp8_rel_diff_{ds}"] == pytest.approx((mean["fp8"][ds] - mean["bf16"][ds]) / mean["bf16"][ds])
    b = [[tau["runs"][f"bf16_seed{k}"][f"tau_{ds}"] for k in (0, 1)] for ds in DS]
    assert got["bf16_seed_spread"] == pytest.approx(max((max(v) - min(v)) / statistics.mean(v) for v in b))
    assert all(got["tau_means"][s] == pytest.approx(mean[s]) for s in mean)
    train = {s: statistics.mean(tau["runs"][f"{s}_seed{k}"]["tokens_per_s"] for k in (0, 1)) for s in ("int4", "fp8")}
    assert got["train_ratio_vs_fp8_smollm2"] == pytest.approx(train["int4"] / train["fp8"])
    e = tau["extracts"]
    rate = {s: e[s]["tokens"] / (e[s]["loop_seconds"] + e[s]["drain_seconds"]) for s in ("int4", "fp8")}
    assert all(e[s]["committed_before"] == 0 and e[s]["tokens"] == e["bf16"]["tokens"] > 0 for s in e)
    assert got["extract_ratio_vs_fp8_smollm2"] == pytest.approx(rate["int4"] / rate["fp8"])
    assert "SmolLM2" in tau["summary"]["ratios_shape"] and tau["plan"]["tokens"] == e["bf16"]["tokens"]
    bpt = tau["summary"]["bytes_written_per_token"]
    assert bpt == {s: e[s]["bytes"] / e[s]["tokens"] for s in e} and bpt["int4"] < bpt["fp8"] < bpt["bf16"]
    # the caches are gone once every run is done; the eval cache (bf16, target-greedy) stays
    assert sorted(tau["deleted"]) == ["bf16", "fp8", "int4"] and not list(work.glob("cache_[bfi]*"))
    assert json.loads((work / "cache_eval" / "manifest.json").read_text())["fingerprint"]["target_greedy"] is True
    # --eval-cache takes that eval cache in a later run; a training cache (not target-greedy) is refused
    assert b4.reused_eval_cache(work / "cache_eval")["sources"] == ["humaneval_greedy.jsonl", "mtbench_greedy.jsonl"]
    sys.path.insert(0, str(HERE))
    from train_helpers import tiny_cache, tiny_target

    with pytest.raises(SystemExit, match="needs a target-greedy cache"):
        b4.reused_eval_cache(tiny_cache(tmp_path / "train_cache", tiny_target(tmp_path / "t"), num_samples=2))
