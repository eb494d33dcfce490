"""bench_reference.py --methods (the DFlash / DFlash 2 / variable-prefix comparison, methods_h200.json) on CPU:
its plan, that a run's method reaches its TrainConfig, and the summary of methods and seed spreads."""

import pathlib
import sys

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE.parents[1] / "benchmarks"))
import bench_reference as br  # noqa: E402


def test_methods_plan_config_and_summary(tmp_path):
    args = br.parse_args(["--methods"])
    # the reference run's recipe unless a flag says otherwise: its data (greedy + seed-1 sampled regenerations),
    # an int4 cache, 2 epochs, the committed eval responses
    assert [pathlib.Path(f).name for f in args.train_data] == [
        "sharegpt_whole-00.jsonl.gz", "sharegpt_whole-01.jsonl.gz",
        "sharegpt_sampled_t0.8_s1-00.jsonl.gz", "sharegpt_sampled_t0.8_s1-01.jsonl.gz"]
    assert (args.storage, args.epochs, pathlib.Path(args.eval_responses).name) == ("int4", 2, "peer")
    mine = br.parse_args(["--methods", "--epochs", "3", "--storage", "fp8", "--train-data", "x.jsonl"])
    assert (mine.epochs, mine.storage, mine.train_data) == (3, "fp8", ["x.jsonl"])
    assert br.parse_args([]).epochs == 6 and br.parse_args([]).storage == "fp8"   # the reference's own runs
    plan = br.runs_plan(args)
    assert [(p[0], p[1]) for p in plan] == [(name, "train_int4") for name in br.METHOD_RUNS]
    over = dict((p[0], p[2]) for p in plan)
    assert over["all_dflash2"] == {"arch": "dflash2"} and over["all_dflash2_vp"]["objective"] == "variable_prefix"
    assert [p[0] for p in br.runs_plan(br.parse_args(["--methods", "--skip", "all_dflash_vp,all_dflash2_vp"]))] == [
        "all_dflash", "all_dflash_seed1", "all_dflash2", "all_dflash2_seed1"]
    cfg = br.train_config(args, model="m", cache=tmp_path / "c", out=tmp_path / "o", device="cpu", steps=None,
                          eval_cache=None, eval_every=500, log_every=None, epochs=args.epochs,
                          **over["all_dflash2_seed1"])
    assert (cfg.arch, cfg.seed, cfg.block_size, cfg.num_anchors, cfg.epochs) == ("dflash2", 1, 16, 512, 2)

    def run(mt, he, sg, **over):
        return {"tau_mtbench": mt, "tau_humaneval": he, "tau_sharegpt": sg, "step_time_s_median": 0.2,
                "samples": 1, "tokens": 1, "steps": 1, "final_train_accept_len": None, **over}

    result = {"reference_storage": "fp8", "runs": {
        "all_dflash": run(2.0, 2.5, 1.6), "all_dflash_seed1": run(2.02, 2.45, 1.6, seed=1),
        "all_dflash2": run(2.4, 2.5, 2.0, arch="dflash2"), "all_dflash2_seed1": run(2.4, 2.55, 2.0, arch="dflash2",
                                                                                     seed=1)}}
    br.summarise(result)
    m = result["methods"]
    assert set(m) == {"all_dflash", "all_dflash_seed1", "all_dflash2", "all_dflash2_seed1"}
    assert m["all_dflash2"]["arch"] == "dflash2" and abs(m["all_dflash2"]["rel_to_dflash_mtbench"] - 0.2) < 1e-12
    assert abs(result["methods_seed_spread"]["all_dflash"]["mtbench"] - 0.01) < 1e-12
    assert abs(result["methods_seed_spread"]["all_dflash2"]["humaneval"] - 0.02) < 1e-12


def test_tiny_methods_comparison_end_to_end(tmp_path):
    """`bench_reference.py --tiny --methods` on CPU, the real SmolLM2 target: every method trains on one cache, is
    scored by exact held-out tau on the three evals and lands in the result's methods table with its seed spread,
    and each run trained the architecture and objective its name says (its checkpoint's config)."""
    import json
    import os
    import subprocess

    out = tmp_path / "methods_tiny_cpu.json"
    proc = subprocess.run([sys.executable, str(HERE.parents[1] / "benchmarks" / "bench_reference.py"), "--tiny",
                           "--methods", "--steps", "4", "--eval-every", "4", "--log-every", "2",
                           "--workdir", str(tmp_path / "w"), "--json", str(out), "--plot-dir", str(tmp_path / "plots")],
                          capture_output=True, text=True, timeout=900, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["bench"] == "methods" and set(got["methods"]) == set(br.METHOD_RUNS)
    for name, over in br.METHOD_RUNS.items():
        m = got["methods"][name]
        assert (m["arch"], m["objective"], m["seed"]) == (over.get("arch", "dflash"),
                                                          over.get("objective", "dflash"), over.get("seed", 0))
        assert all(m[f"tau_{e}"] >= 1.0 for e in ("mtbench", "humaneval", "sharegpt")), m
        assert m["step_time_s_median"] > 0
        run = tmp_path / "w" / f"run_{name}"
        train = json.loads((run / "config.json").read_text())["train"]
        assert (train["arch"], train["objective"], train["seed"]) == (m["arch"], m["objective"], m["seed"])
        exported = json.loads((run / "drafter" / "config.json").read_text())["architectures"]
        assert exported == [{"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}[m["arch"]]]
    assert got["methods"]["all_dflash"]["rel_to_dflash_mtbench"] == 0.0
    assert set(got["methods_seed_spread"]) == {"all_dflash", "all_dflash2"}
