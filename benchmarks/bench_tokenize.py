"""Tokenization stage of `dflash extract` on CPU: the first N ShareGPT conversations with the SmolLM2 tokenizer
and chat template (max_length 4096, the extract default).

before: dflash.data.load_samples in one process (what build_preflight did on every rank, on every run).
after:  dflash.extract.tokenized.tokenize_or_load with --workers tokenizer processes (1 rank), storing the part.
rerun:  the same call again: loads the stored part (memory-mapped) instead of tokenizing.
rank share: rank 0's half of a 2-rank run tokenized in-process (each rank's cost when ranks split the ids).
Checks that both give the same samples and skips.

    python benchmarks/bench_tokenize.py --records 4000 --workers 2 --out benchmarks/results/tokenize_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import time

import numpy as np


def _cpu_s() -> float:
    """CPU seconds of this process and its terminated children (the tokenizer workers once joined)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    from dflash.cache.commit import TOKENIZED

    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=4000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--max-length", type=int, default=4096)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from dflash.data import load_samples
    from dflash.data.assets import sharegpt_path
    from dflash.data.readers import iter_raw
    from dflash.data.skips import Skip
    from dflash.extract.tokenized import tokenize_or_load, tokenize_part
    from dflash.target.assets import smollm2_hf_dir

    tokenizer = AutoTokenizer.from_pretrained(smollm2_hf_dir())
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "sharegpt_head.jsonl")
        with open(data, "w") as f:  # the first N records as given (bad ones included, as one line each)
            n = 0
            for item in iter_raw(sharegpt_path()):
                f.write(("{bad" if isinstance(item, Skip) else json.dumps(item[1])) + "\n")
                n += 1
                if n == args.records:
                    break
        t, c = time.perf_counter(), _cpu_s()
        ref, ref_skips = load_samples([data], tokenizer, max_length=args.max_length)
        before_s, before_cpu = time.perf_counter() - t, _cpu_s() - c
        kw = dict(paths=[data], tokenizer=tokenizer, max_length=args.max_length, template_kwargs={},
                  folder=os.path.join(tmp, TOKENIZED, "key"), num_workers=args.workers, show_progress=True)
        c = _cpu_s()
        after = tokenize_or_load(**kw)
        after_cpu = _cpu_s() - c  # this process + its (joined) worker processes
        rerun = tokenize_or_load(**kw)
        t = time.perf_counter()  # one rank's share of a 2-rank run (in-process): the split alone
        half = tokenize_part(paths=[data], tokenizer=tokenizer, max_length=args.max_length, template_kwargs={},
                             rank=0, world_size=2, num_workers=0)
        half_s = time.perf_counter() - t
        assert len(half.sample_ids) == sum(s.sample_id % 2 == 0 for s in ref)
        assert not after.loaded and rerun.loaded
        for tok in (after, rerun):
            assert len(tok.samples) == len(ref) and tok.skips.summary() == ref_skips.summary()
            assert all(a.sample_id == b.sample_id and np.array_equal(a.input_ids, b.input_ids)
                       and np.array_equal(a.loss_mask, b.loss_mask) for a, b in zip(tok.samples, ref))
    tokens = int(sum(len(s.input_ids) for s in ref))
    result = {
        "command": " ".join(["python", "benchmarks/bench_tokenize.py"] + sys.argv[1:]),
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores (shared with other jobs)",
        "records": args.records, "samples": len(ref), "tokens": tokens, "skipped": ref_skips.total,
        "max_length": args.max_length, "workers": args.workers,
        "before_s": round(before_s, 2), "before_samples_per_s": round(len(ref) / before_s, 1),
        "after_s": round(after.seconds, 2), "after_samples_per_s": round(len(ref) / after.seconds, 1),
        "before_cpu_s": round(before_cpu, 2), "after_cpu_s_incl_workers": round(after_cpu, 2),
        "rerun_s": round(rerun.seconds, 3),
        "rank_share_of_2_in_process_s": round(half_s, 2),
        "load_average_1min_at_end": os.getloadavg()[0],
        "speedup_after": round(before_s / after.seconds, 2), "speedup_rerun": round(before_s / rerun.seconds, 1),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
