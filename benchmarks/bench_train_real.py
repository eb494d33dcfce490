"""Training on real ShareGPT lengths and on equal-length sequences, 27B drafter shape, from a disk cache.

    python benchmarks/bench_train_real.py                       # H200: both workloads (~6-7 min)
    python benchmarks/bench_train_real.py --workloads real      # H200: real lengths only (~4 min)
    python benchmarks/bench_train_real.py --tiny                # CPU smoke run (tiny drafter, < 60 s)

Why a second training benchmark: bench_train.py times equal 2,048-token sequences, the cheapest case for
the drafter step (every sequence has 512 anchors, every micro-batch the same shape). Real data has short and
long conversations: fewer blocks per context token, a shape that changes every micro-batch, and loader reads
that vary with it. The H200 runs of 2026-12-01 gave MFU 0.69 of the measured peak on equal lengths
(train_h200.json) and 0.62 of 790 TFLOP/s on real lengths (scaling_h200x2.json, N=1).

Workloads (each its own fp8 cache under --work-dir, random features of the 27B shape, written by
CacheWriter; a head-only target folder as bench_train):
  real:  sample lengths and loss-token counts of real ShareGPT conversations (benchmarks/assets/
         sharegpt_lengths.json, via bench_scaling.workload_lengths: whole batches of extraction's plan of a
         ShareGPT-size draw, so the length mix is the dataset's); the loss mask is the last loss_tokens
         tokens of each sample. --tiny caps lengths at the tiny sequence length.
  equal: every sample seq_len (2,048) tokens with a 10-40% prompt, as bench_train.
For each: (A) the trainer (dflash.train.trainer.train, as `dflash train`) reading the cache after the page
cache is dropped; (B) the same steps from micro-batches resident on the device (bench_train.run_resident);
loader_stall_fraction = 1 - A/B over whole-window rates (tok_s_aggregate: all tokens over all time after the
warm-up, since real-length windows differ in cost; bench_train.window_summary); on CUDA B's last --profile-steps
steps run under torch.profiler (each workload's `profile`: where its step goes, outside B's rates). MFU = FlopModel FLOPs over the
bf16 matmul peak measured here (`mfu`) and over the H200 dense bf16 spec 989 TFLOP/s (`mfu_vs_spec_989`).

Writes benchmarks/results/train_real_lengths_<name>.json (name: h200 on CUDA, else cpu; tiny_ first with
--tiny). Top level: the real workload's run A (`tok_s`, `mfu`, `mfu_vs_spec_989`, `loader_stall_fraction`,
`peak_mem_gib`), `equal_lengths` the same keys for the equal workload, `workloads` everything. The last stdout
line is that JSON without the per-window records.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import pathlib
import platform
import shutil
import sys
import time

import numpy as np
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_scaling import workload_lengths  # noqa: E402
from bench_train import (patch_out_saving, run_resident, run_trainer, shapes, train_kwargs,  # noqa: E402
                         window_summary)
from common import (SUSTAINED_DENOMINATOR, drop_page_cache, machine_info, make_head_only_target,  # noqa: E402
                    make_random_fp8_cache, matmul_peak, matmul_sustained, mfu_fields, mfu_vs_sustained,
                    package_version)

WORKLOADS = ("real", "equal")
HEADLINE = ("tok_s", "mfu", "mfu_vs_spec_989", "mfu_vs_sustained", "loader_stall_fraction", "trainer_wait_fraction",
            "peak_mem_gib", "mfu_denominator", "mfu_vs_spec_989_denominator")


def say(msg: str) -> None:
    print(f"[bench_train_real {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def workload(kind: str, sh: dict, *, steps: int, batch_tokens: int, seed: int,
             tiny: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """Sample lengths (and loss-token counts; None = bench_train's random prompts) of a workload with at least
    `steps` micro-batches in epoch 0 of the trainer's plan (loader.plan_epoch at this batch_tokens)."""
    from dflash.train.loader import plan_epoch

    if kind == "equal":
        return np.full(max(1, batch_tokens // sh["seq_len"]) * steps, sh["seq_len"], np.int64), None
    tokens = steps * batch_tokens
    while True:
        lengths, loss = workload_lengths(tokens, cap=sh["seq_len"] if tiny else None, seed=seed,
                                         batch_tokens=batch_tokens)
        lengths_N = np.asarray(lengths, np.int64)
        plan = plan_epoch(lengths_N, seed=seed, epoch=0, batch_tokens=batch_tokens, world_size=1, grad_accum=1)
        if plan.num_steps >= steps:
            return lengths_N, np.asarray(loss, np.int64)
        tokens = int(tokens * 1.25)


def free_device(device: torch.device) -> None:
    """Drop the previous run's model and optimizer before the next, and restart the peak-memory count."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def measure(kind: str, *, args, sh: dict, work: pathlib.Path, peak: float, device: torch.device) -> dict:
    """Runs A and B of one workload (module docstring)."""
    from dflash.train.config import TrainConfig

    total = args.warmup + args.steps
    lengths, loss = workload(kind, sh, steps=total, batch_tokens=args.batch_tokens, seed=args.seed, tiny=args.tiny)
    cache = work / f"cache_{kind}"
    info = make_random_fp8_cache(cache, work / "target", sh, num_samples=len(lengths), seed=args.seed,
                                 device=device, lengths=lengths if loss is not None else None, loss_tokens=loss)
    say(f"{kind}: {info['samples']} samples, {info['tokens']:,} tokens (mean {lengths.mean():.0f}, max "
        f"{lengths.max()}), fp8 cache {info['bytes'] / 1e9:.2f} GB written in {info['write_s']:.1f} s")
    kw = train_kwargs(sh, cache=cache, target=work / "target", steps=total, batch_tokens=args.batch_tokens,
                      log_every=args.log_every, peak=peak, seed=args.seed, num_readers=args.num_readers,
                      prefetch=args.prefetch)
    free_device(device)
    # --tiny (CPU smoke run): the page cache is kept; dropping it as root would slow every other process here
    cold = "kept (--tiny)" if args.tiny else drop_page_cache(cache)
    say(f"{kind} run A: the trainer from the disk cache (page cache dropped: {cold})")
    t = time.perf_counter()
    cfg_a = TrainConfig(output=str(work / f"run_{kind}_a"), **kw)
    recs = run_trainer(cfg_a, device)
    a = window_summary(recs, warmup=args.warmup)
    out = {"train_config": cfg_a.to_json(), "samples": info["samples"], "tokens": info["tokens"],
           "mean_length": float(lengths.mean()),
           "cache_bytes": info["bytes"], "page_cache": cold, "run_a_wall_s": time.perf_counter() - t,
           "tok_s": a["tok_s_aggregate"], **mfu_fields(a["mfu_aggregate"], peak=peak),
           "trainer_wait_fraction": a["stall_frac"], "peak_mem_gib": a["peak_mem_gib"],
           "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None,
           "run_a": a, "run_a_records": recs}
    if args.skip_resident:
        out["loader_stall_fraction"] = None
        return out
    free_device(device)
    say(f"{kind} run B: the same steps from micro-batches resident on the device")
    b = run_resident(TrainConfig(output=str(work / f"run_{kind}_b"), **kw), device, warmup=args.warmup,
                     profile_steps=args.profile_steps)
    out["loader_stall_fraction"] = max(0.0, 1.0 - a["tok_s_aggregate"] / b["tok_s_aggregate"])
    # where a step of this workload goes (CUDA): the last --profile-steps resident steps, outside B's rates
    out["profile"] = b["profile"]
    out["run_b"] = {k: v for k, v in b.items() if k not in ("records", "profile")}
    out["run_b_records"] = b["records"]
    # same data, anchors and init: A and B must train alike (float rounding only)
    b_loss = {r["step"]: r["loss"] for r in b["records"]}
    out["max_loss_diff_a_vs_b"] = max((abs(r["loss"] - b_loss[r["step"]]) for r in recs if r["step"] in b_loss),
                                      default=None)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: real, equal")
    p.add_argument("--steps", type=int, default=24, help="measured optimizer steps (after the warm-up)")
    p.add_argument("--warmup", type=int, default=6, help="warm-up steps excluded from the rates")
    p.add_argument("--batch-tokens", type=int, default=None, help="micro-batch token budget (default 2 x seq_len)")
    p.add_argument("--log-every", type=int, default=2, help="trainer log interval (each log syncs the host)")
    p.add_argument("--num-readers", type=int, default=2, help="loader reader threads")
    p.add_argument("--prefetch", type=int, default=4, help="micro-batches read ahead")
    p.add_argument("--skip-resident", action="store_true", help="skip run B (no loader-stall fraction)")
    p.add_argument("--profile-steps", type=int, default=2,
                   help="run B's last N steps under torch.profiler (CUDA; 0 = off): GPU time by kernel kind, the top "
                        "kernels and the host's CUDA calls per step, in each workload's 'profile'; left out of B's "
                        "rates")
    p.add_argument("--work-dir", default="/tmp/dflash_bench_train_real", help="local-disk folder (wiped first)")
    p.add_argument("--tiny", action="store_true", help="bench_train's tiny drafter, lengths capped at 512 (CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-name", default=None, help="results file suffix (default: h200 on CUDA, cpu)")
    p.add_argument("--results-dir", default=str(ROOT / "benchmarks" / "results"), help="folder of the result JSON")
    args = p.parse_args()
    kinds = [k for k in args.workloads.split(",") if k]
    if not kinds or set(kinds) - set(WORKLOADS):
        p.error(f"--workloads {args.workloads!r}: choose from {', '.join(WORKLOADS)}")
    if args.tiny and args.steps == 24 and args.warmup == 6:
        args.steps, args.warmup = 2, 0   # a smoke run: CPU rates mean nothing, the path is what is checked
    if args.warmup % args.log_every or args.steps < args.log_every or args.warmup < 0:
        p.error(f"--warmup {args.warmup} must be a multiple of --log-every {args.log_every} and --steps at least "
                "that (the rates are over whole log windows after the warm-up)")

    os.environ["DFLASH_NO_PROGRESS"] = "1"
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sh = shapes(args.tiny)
    args.batch_tokens = args.batch_tokens or 2 * sh["seq_len"]
    work = pathlib.Path(args.work_dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    say(f"device {device}, {'tiny' if args.tiny else '27B drafter'} shape, workloads {kinds}, "
        f"{args.warmup} + {args.steps} steps of {args.batch_tokens} tokens")
    make_head_only_target(work / "target", hidden=sh["hidden"], vocab=sh["vocab"],
                          target_layers=sh["target_layers"], device=device)
    peak = matmul_peak(device)
    say(f"matmul peak measured: {peak / 1e12:.3g} TFLOP/s")
    patch_out_saving()  # checkpoints and the export are no part of a step (bench_train)

    results = {}
    for kind in kinds:
        results[kind] = measure(kind, args=args, sh=sh, work=work, peak=peak, device=device)
        shutil.rmtree(work / f"cache_{kind}")  # the disk holds one workload's cache at a time
    sustained = matmul_sustained(device)  # after the workloads: the GPU as warm as they left it
    say(f"matmul rate sustained for 3 s after the workloads: {sustained / 1e12:.3g} TFLOP/s")
    for r in results.values():
        r["mfu_vs_sustained"] = mfu_vs_sustained(r["mfu"], peak=peak, sustained=sustained)

    print(f"\n{'workload':10s} {'tok/s':>10s} {'MFU meas.':>9s} {'MFU 989T':>9s} {'stall':>7s} {'wait':>7s} "
          f"{'GiB':>6s}", flush=True)
    for kind, r in results.items():
        stall = "-" if r["loader_stall_fraction"] is None else f"{r['loader_stall_fraction']:.3f}"
        print(f"{kind:10s} {r['tok_s']:10,.0f} {r['mfu']:9.3f} {r['mfu_vs_spec_989']:9.3f} {stall:>7s} "
              f"{r['trainer_wait_fraction']:7.3f} {r['peak_mem_gib']:6.1f}", flush=True)
    print(f"MFU meas. = over the measured matmul peak {peak / 1e12:.3g} TFLOP/s; MFU 989T = over the H200 dense "
          "bf16 spec; stall = 1 - A/B; wait = the trainer's own loader-wait fraction", flush=True)

    name = args.result_name or (("tiny_" if args.tiny else "") + ("h200" if device.type == "cuda" else "cpu"))
    head = results.get("real") or results[kinds[0]]
    out = {
        "benchmark": "train_real_lengths", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(["python"] + sys.argv), "machine": machine_info(device),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": __import__("transformers").__version__, "triton": package_version("triton")},
        "model": "tiny drafter" if args.tiny else "Qwen3.5-27B drafter shape, random weights and features",
        "headline_workload": "real" if "real" in results else kinds[0],
        **{k: head[k] for k in HEADLINE},
        "equal_lengths": {k: results["equal"][k] for k in HEADLINE} if "equal" in results else None,
        "matmul_peak_flops": peak, "matmul_sustained_flops": sustained,
        "mfu_vs_sustained_denominator": SUSTAINED_DENOMINATOR,
        "steps": args.steps, "warmup_steps": args.warmup,
        "config": {**{k: v for k, v in train_kwargs(sh, cache=work, target=work, steps=args.warmup + args.steps,
                                                    batch_tokens=args.batch_tokens, log_every=args.log_every,
                                                    peak=peak, seed=args.seed).items()
                      if k not in ("cache", "model")},
                   "taps": list(sh["taps"]), "vocab_size": sh["vocab"], "hidden_size": sh["hidden"],
                   "seq_len": sh["seq_len"], "storage": "fp8", "num_readers": args.num_readers,
                   "prefetch": args.prefetch},
        "workloads": results,
    }
    res_dir = pathlib.Path(args.results_dir)
    res_dir.mkdir(parents=True, exist_ok=True)
    path = res_dir / f"train_real_lengths_{name}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    say(f"wrote {path}")
    short = {**out, "workloads": {k: {m: v for m, v in r.items() if not m.endswith("_records")}
                                  for k, r in results.items()}}
    print(json.dumps(short), flush=True)


if __name__ == "__main__":
    main()
