"""Probe of transformers' continuous batching on this machine: ShareGPT first-turn prompts through
dflash.generate.continuous.ContinuousEngine, progress printed as results arrive (time to first result,
tokens/s), for each engine setting given; bounded by --seconds per setting.

    python benchmarks/probe_continuous.py --model DIR --data sharegpt_users.jsonl.gz --prompts 512
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from bench_generate import sharegpt_first_turns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/dflash/smollm2-135m-instruct"))
    ap.add_argument("--data", default=None)
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-requests", type=int, default=512)
    ap.add_argument("--settings", default="graphs_off,auto", help="comma list of graphs_off / graphs_on / auto")
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import logging

    logging.basicConfig(level=logging.INFO)
    from dflash.generate.continuous import ContinuousConfig, ContinuousEngine, GenerationFailed
    from dflash.generate.decode import stop_token_ids
    from dflash.target.load import load_target

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model, tok = load_target(args.model, device=dev, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
    stops = stop_token_ids(tok, model.generation_config, {})
    prompts, _ = sharegpt_first_turns(tok, num_prompts=args.prompts, max_prompt_tokens=512, data=args.data)
    rows = []
    for name in args.settings.split(","):
        graphs = {"graphs_off": False, "graphs_on": True, "auto": None}[name]
        t0 = time.perf_counter()
        eng = ContinuousEngine(model, stop_ids=stops, cfg=ContinuousConfig(
            max_requests=args.max_requests, max_length=1024, request_timeout=min(60.0, args.seconds),
            cuda_graphs=graphs))
        t_init = time.perf_counter() - t0
        for i, p in enumerate(prompts):
            eng.submit(f"p{i}", p, args.max_new_tokens)
        done, toks, first, err = 0, 0, None, None
        t1 = time.perf_counter()
        try:
            while done < len(prompts) and time.perf_counter() - t1 < args.seconds:
                _, d = eng.next_result()
                done += 1
                toks += len(d.response_ids)
                first = first or time.perf_counter() - t1
                if done % 64 == 0:
                    dt = time.perf_counter() - t1
                    print(f"[probe {name}] {done} done, {toks} tok in {dt:.1f} s: {toks / dt:,.0f} tok/s", flush=True)
        except GenerationFailed as e:
            err = str(e)
        dt = time.perf_counter() - t1
        eng.close()
        row = {"setting": name, "init_s": round(t_init, 2), "first_result_s": first, "done": done,
               "tokens": toks, "seconds": round(dt, 2), "tok_s": round(toks / dt, 1), "error": err}
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"probe": "continuous", "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                       "max_requests": args.max_requests, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
