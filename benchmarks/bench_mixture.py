"""Data mixtures off cached states, on CPU with the real SmolLM2-135M and two ShareGPT subsets:

    python benchmarks/bench_mixture.py            # ~11 minutes on 2 shared cores (the 200 steps: ~8)

Three figures, each against its own floor, measured in one run:
  share_abs_error   |samples seen per cache / all samples - weight share| of a 200-step 3:1 run  (<= 0.02)
  sweep_read_ratio  bytes a 3:1 / 1:1 mixture sweep read / the bytes of reading each sample its runs use once
                    (each alone, a fresh reader: the same chunk-granular accounting)              (<= 1.05)
  grown_equals_union a cache of subset A grown with subset B (`dflash extract --output A --data B`) holds,
                    sample for sample (ids, tokens, masks, hidden bits), what one extraction of A + B holds
The subsets: ShareGPT conversations 0-47 (A) and 48-79 (B), truncated at 256 tokens (35 and 21 usable
samples: the rest has no assistant token left), taps 1,2 (the target runs 3 of its 30 layers), bf16.
Drafter: 1 layer, block 4, 8 anchors, 512-token steps (CPU-sized).
Writes benchmarks/results/mixture_cpu.json; the last stdout line is that JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import machine_info, package_version  # noqa: E402
from dflash.cache.reader import CacheReader, sample_contents  # noqa: E402

TAPS = (1, 2)
MAX_LEN = 256
DRAFTER = dict(num_layers=1, block_size=4, num_anchors=8, batch_tokens=512, lr=1e-3, warmup_ratio=0.05,
               intermediate_size=256, num_readers=1, prefetch=2, save_every=10**6,
               mask_token_id=16)  # <empty_output>, which the chat model never emits (configs/train_smollm2.yaml)


def say(msg: str) -> None:
    print(f"[bench_mixture {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def write_subset(path: pathlib.Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def extract(model: str, data: list[str], out: pathlib.Path) -> None:
    from dflash.extract.driver import ExtractConfig
    from dflash.extract.launch import launch

    launch(ExtractConfig(model=model, data=tuple(data), output=str(out), taps=TAPS, max_length=MAX_LEN,
                         batch_tokens=2048, shard_tokens=2048, show_progress=False), num_procs=1, echo=say)


def share_run(model: str, a: str, b: str, work: pathlib.Path, steps: int) -> dict:
    from dflash.train.config import TrainConfig
    from dflash.train.metrics import read_metrics
    from dflash.train.trainer import train

    cfg = TrainConfig(cache=a, extra_caches=(b,), cache_weights=(3, 1), model=model, output=str(work / "share"),
                      steps=steps, log_every=steps, **DRAFTER)
    t0 = time.perf_counter()
    train(cfg, device="cpu")
    seen = read_metrics(work / "share")[-1]["cache_samples"]
    n = np.array(list(seen.values()), dtype=np.float64)
    share = n / n.sum()
    expected = np.array([0.75, 0.25])
    return {"steps": steps, "weights": [3, 1], "samples_seen": n.astype(int).tolist(), "share": share.tolist(),
            "expected": expected.tolist(), "share_abs_error": float(np.abs(share - expected).max()),
            "seconds": time.perf_counter() - t0}


def sweep_run(model: str, a: str, b: str, work: pathlib.Path, steps: int) -> dict:
    from dflash.cache.mixed import MixedReader
    from dflash.sweep.mixture import plan_uses
    from dflash.sweep.runner import run_sweep
    from dflash.sweep.spec import spec_from_dict
    from dflash.train.checkpoint import PLAN_VERSION
    from dflash.train.loader import plan_costs

    out = work / "sweep"
    spec = spec_from_dict({"base": dict(DRAFTER, steps=steps, log_every=steps),
                           "grid": {"cache_weights": [[3, 1], [1, 1]]}}, cache=a, extra_caches=(b,), model=model,
                          output=str(out))
    t0 = time.perf_counter()
    res = run_sweep(spec, output=out, device="cpu")
    seconds = time.perf_counter() - t0
    rec = json.loads((out / "streams" / "group-0.json").read_text())["mixture"]
    # the floor: each sample any run uses read once, alone, by a fresh reader
    mixed = MixedReader([CacheReader(a), CacheReader(b)])
    costs = plan_costs(mixed.index.length, mixed.index.num_loss_tokens, plan_version=PLAN_VERSION)
    _, used = plan_uses([r.config for r in spec.runs], [steps] * len(spec.runs), index=mixed.index,
                        counts=mixed.counts, costs=costs)
    for g in np.unique(np.concatenate(used)).tolist():
        mixed.read_many([g], taps=TAPS)
    return {"steps": steps, "grid": [[3, 1], [1, 1]], "groups": res.groups, "bytes_read": res.bytes_read,
            "one_pass_bytes": mixed.bytes_read, "sweep_read_ratio": res.bytes_read / mixed.bytes_read,
            "unique_samples": rec["unique_samples"], "sample_uses": rec["sample_uses"],
            "samples_read_from_disk": rec["samples_read_from_disk"], "peak_held_bytes": rec["peak_held_bytes"],
            "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="Steps of the weighted run.")
    ap.add_argument("--sweep-steps", type=int, default=60, help="Steps of each run of the mixture sweep.")
    ap.add_argument("--work-dir", default=None, help="Scratch folder (default: a temporary one, removed).")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "mixture_cpu.json"))
    args = ap.parse_args()
    os.environ["DFLASH_NO_PROGRESS"] = "1"
    torch.manual_seed(0)
    from dflash.data.assets import sharegpt_conversations
    from dflash.target.assets import smollm2_hf_dir

    work = pathlib.Path(args.work_dir or tempfile.mkdtemp(prefix="bench_mixture-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        model = str(smollm2_hf_dir())
        convs = sharegpt_conversations(80)
        a = write_subset(work / "sharegpt_a.jsonl", convs[:48])
        b = write_subset(work / "sharegpt_b.jsonl", convs[48:])
        t0 = time.perf_counter()
        extract(model, [a], work / "cache_a")
        extract(model, [b], work / "cache_b")
        extract(model, [a, b], work / "cache_union")
        shutil.copytree(work / "cache_a", work / "cache_grown")
        extract(model, [b], work / "cache_grown")  # the grow: only B named, A's settings from the cache
        extract_s = time.perf_counter() - t0
        grown, union = sample_contents(work / "cache_grown"), sample_contents(work / "cache_union")
        with CacheReader(str(work / "cache_a")) as cache_a:
            samples_a = len(cache_a)
        growth = {"samples_a": samples_a, "samples_union": len(union),
                  "samples_grown": len(grown), "grown_equals_union": grown == union, "extract_seconds": extract_s}
        say(f"grown == union: {growth['grown_equals_union']} ({len(grown)} samples)")
        share = share_run(model, str(work / "cache_a"), str(work / "cache_b"), work, args.steps)
        say(f"share {share['share']} vs {share['expected']}: |error| {share['share_abs_error']:.4f}")
        sweep = sweep_run(model, str(work / "cache_a"), str(work / "cache_b"), work, args.sweep_steps)
        say(f"sweep read {sweep['bytes_read']} B vs one pass {sweep['one_pass_bytes']} B: "
            f"{sweep['sweep_read_ratio']:.3f}")
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    result = {
        "benchmark": "mixture", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/bench_mixture.py" + (f" --steps {args.steps}" if args.steps != 200 else "")
                   + (f" --sweep-steps {args.sweep_steps}" if args.sweep_steps != 60 else ""),
        "data": {"a": "ShareGPT conversations 0-47", "b": "ShareGPT conversations 48-79", "max_length": MAX_LEN,
                 "taps": list(TAPS), "storage": "bf16", "target": "SmolLM2-135M-Instruct"},
        "drafter": DRAFTER,
        "share_abs_error": share["share_abs_error"], "sweep_read_ratio": sweep["sweep_read_ratio"],
        "grown_equals_union": growth["grown_equals_union"],
        "targets": {"share_abs_error": "<= 0.02", "sweep_read_ratio": "<= 1.05", "grown_equals_union": "true"},
        "share": share, "sweep": sweep, "growth": growth,
        "machine": machine_info(torch.device("cpu")),
        "versions": {"torch": torch.__version__, "transformers": package_version("transformers")},
    }
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
