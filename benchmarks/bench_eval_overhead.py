"""What held-out tau during training costs: training tokens/s with and without `--eval-cache`, and the batched
held-out evaluator against `dflash eval` on the same drafter and cache.

Runs (same cache, steps, seed):
  A. `dflash train` without an eval cache;
  B. the same with --eval-cache (MT-Bench turn 1 + HumanEval target-greedy responses in one cache, two sources)
     and --eval-every K (small, so that the run holds several evaluations).
Overhead at the default --eval-every E (TrainConfig.eval_every): one evaluation per E steps, so
    eval_overhead_fraction = median(heldout_seconds) / (median(heldout_seconds) + E * median(step_time_s))
from run B's metrics (a log window's tokens/s excludes the evaluation: unit.py laps the stopwatch around it).
Also reported: the wall-clock ratio of B to A (K evaluations, evaluator build included), and on B's final drafter
the seconds of `dflash eval` (evaluate.evaluate_cache) and of HeldoutEvaluator.evaluate with their two taus
(issue 14 target: overhead <= 5%).

The evaluator (dflash.eval.batched) computes L at every anchor in a few large forwards and walks the chains
on the host; `evaluator_plan` gives its forwards and block rows, `evaluator_vs_dflash_eval.tau_equal` must be true
(dflash eval runs the same forwards).
GPU (the lead): python benchmarks/bench_eval_overhead.py --gguf-parts A B --workdir DIR   (~4 min on the H200;
  or pass --train-cache/--eval-cache/--model of an earlier bench_reference run to skip generation/extraction)
CPU: python benchmarks/bench_eval_overhead.py --tiny   (SmolLM2, a few prompts; numbers are not meaningful)
Writes benchmarks/results/eval_overhead_<h200|tiny_cpu>.json; the last stdout line is that JSON.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_quality as bq  # noqa: E402
import bench_reference as br  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="training throughput with and without held-out eval")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run")
    ap.add_argument("--gguf-parts", nargs="+", metavar="PART", help="SmolLM2 GGUF parts (scripts/split_gguf.sh)")
    ap.add_argument("--model", help="target HF folder (with --train-cache/--eval-cache)")
    ap.add_argument("--train-cache", help="an existing training cache (skips generate + extract)")
    ap.add_argument("--eval-cache", help="an existing target-greedy eval cache")
    ap.add_argument("--train-prompts", type=int, help="prompts regenerated for the training cache (GPU 2000)")
    ap.add_argument("--steps", type=int, help="optimizer steps of each run (GPU 400)")
    ap.add_argument("--measure-every", type=int, help="--eval-every of run B (GPU 100)")
    ap.add_argument("--eval-every", type=int, help="the --eval-every the fraction is computed for (default: "
                    "TrainConfig's)")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--workdir", help="folder for model, caches and runs (default: a temp folder)")
    ap.add_argument("--json", help="result file (default benchmarks/results/eval_overhead_<machine>.json)")
    args = ap.parse_args(argv)
    tiny = dict(train_prompts=24, steps=12, measure_every=4)
    gpu = dict(train_prompts=2000, steps=400, measure_every=100)
    bq.fill_unset(args, tiny if args.tiny else gpu)
    return args


def eval_plan(eval_cache, *, block_size: int) -> dict:
    """The held-out evaluator's work: all-anchor schedule (dflash.eval.batched) of the eval cache."""
    from dflash.cache import CacheReader
    from dflash.eval.batched import DEFAULT_CHUNK_ANCHORS, plan_chunks
    from dflash.eval.tau import response_spans

    with CacheReader(str(eval_cache)) as reader:
        meta = reader.read_many(list(range(len(reader))), taps=())
    lengths = meta.lengths.astype("int64")
    spans = response_spans(meta.loss_mask, lengths=lengths)
    chunks = plan_chunks(lengths=lengths, spans=spans, chunk_anchors=DEFAULT_CHUNK_ANCHORS, block_size=block_size)
    blocks = sum(c.num_blocks for c in chunks)
    return {"schedule": "all anchors (dflash.eval.batched)", "chunk_anchors": DEFAULT_CHUNK_ANCHORS,
            "forwards": len(chunks), "blocks": blocks, "block_rows": blocks * block_size,
            "sequences": len(lengths), "tokens": int(lengths.sum())}


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    machine = "h200" if device == "cuda" else ("tiny_cpu" if args.tiny else "cpu")
    out_json = pathlib.Path(args.json) if args.json else REPO / "benchmarks" / "results" / f"eval_overhead_{machine}.json"
    work = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="dflash-evalov-"))
    work.mkdir(parents=True, exist_ok=True)
    E = args.eval_every or br.default_eval_every()
    qargs = bq.parse_args((["--tiny"] if args.tiny else []) + ["--train-prompts", str(args.train_prompts)]
                          + (["--gguf-parts", *args.gguf_parts] if args.gguf_parts else []))
    qargs.device = device
    t0 = time.perf_counter()
    if args.train_cache and args.eval_cache and args.model:
        model, train_cache, eval_cache = args.model, pathlib.Path(args.train_cache), pathlib.Path(args.eval_cache)
    else:
        data = br.prepare_data(qargs, work, device=device)
        model, train_cache, eval_cache = data["model"], data["train_cache"], data["eval_cache"]
    prep_s = time.perf_counter() - t0
    runs = {}
    for name, ev in (("no_eval", None), ("with_eval", str(eval_cache))):
        runs[name] = br.train_once(qargs, model=model, cache=train_cache, out=work / f"run_{name}", device=device,
                                   steps=args.steps, eval_cache=ev, eval_every=args.measure_every, log_every=None)
    recs = runs["with_eval"]["metrics"]
    evals = [r["heldout_seconds"] for r in recs if r.get("heldout_seconds") is not None]
    step_s = [r["step_time_s"] for r in runs["no_eval"]["metrics"][1:]] or [r["step_time_s"] for r in
                                                                             runs["no_eval"]["metrics"]]
    ev_med, st_med = statistics.median(evals), statistics.median(step_s)
    frac = br.eval_overhead_fraction(evals, step_s, every=E)
    # the batched evaluator against dflash eval on the final drafter
    cmp = br.compare_evaluators(runs["with_eval"]["drafter"], eval_cache, model, device)
    plan = eval_plan(eval_cache, block_size=qargs.block_size)
    result = {
        "bench": "eval_overhead", "tiny": args.tiny, "machine": machine, **bq.run_identity(device=device, argv=argv),
        "eval_every": E, "measure_every": args.measure_every, "steps": args.steps,
        "eval_overhead_fraction": frac, "within_5pct": frac <= 0.05,
        "heldout_seconds_median": ev_med, "heldout_seconds": evals, "step_time_s_median": st_med,
        "tokens_per_s": {k: v["tokens_per_s"] for k, v in runs.items()},
        "wall_s": {k: v["seconds"] for k, v in runs.items()},
        "wall_ratio_with_over_without": runs["with_eval"]["seconds"] / runs["no_eval"]["seconds"],
        "evaluator_vs_dflash_eval": cmp, "evaluator_plan": plan, "prepare_seconds": round(prep_s, 1),
        "eval_cache": str(eval_cache), "train_cache": str(train_cache),
    }
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"eval every {E} steps: one eval {ev_med:.2f} s, one step {st_med:.3f} s -> overhead {frac:.2%}; "
          f"dflash eval {cmp['dflash_eval_seconds']:.2f} s vs batched {cmp['heldout_seconds']:.2f} s "
          f"(tau {cmp['dflash_eval_tau']:.4f} vs {cmp['heldout_tau']:.4f})", flush=True)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
