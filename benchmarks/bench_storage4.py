"""4-bit storage (issue 16) against fp8 and bf16, in one run per stage: bytes per token on the 27B shape through
the real CacheWriter, extraction tok/s, and training tok/s from the caches.

    python benchmarks/bench_storage4.py --stage bytes                  # CPU or GPU, ~1 min: bytes per token
    python benchmarks/bench_storage4.py --stage extract                # H200, ~6 min: bench_extract fp8 vs int4
    python benchmarks/bench_storage4.py --stage train                  # H200, ~6 min: trainer from fp8 vs int4
    python benchmarks/bench_storage4.py --stage train --tiny           # CPU smoke run of the train stage
    python benchmarks/bench_storage4.py --stage tau --workdir DIR --gguf GGUF --storages bf16,int4 [--resume]
        # H200: held-out tau per storage on the first 2,500 committed whole conversations (1.7M tokens at
        # max-length 1024), 600 steps per drafter, 2 seeds: ~13 minutes (2 calls)
    python benchmarks/bench_storage4.py --stage tau --tiny              # CPU smoke run of the tau stage (~1 min)

bytes: the same features (27B shape: 5 taps x 5120, random normal with massive channels and spikes, the mix
  of benchmarks/common.make_random_fp8_cache) of ShareGPT-length samples written as bf16, fp8 and int4
  (int4-g32-e4m3-h32); per storage the committed shard bytes per token (`dflash cache info`'s bytes_per_token:
  hidden, scales, ids, mask, samples index, metadata, crc32c, chunk padding), the format's hidden bytes per
  token, the ratio to bf16's 51,200 hidden bytes and issue 16's bound (<= 14,340 B/token all in).
extract: benchmarks/bench_extract.py (the real `dflash extract` path on the 27B-shape random target, same
  batches, warm-up, FLA conv) with --storage fp8,int4,fp8,int4: each storage's second run is kept, so both
  are measured after a run of their own (first-call kernels). extract_ratio_vs_fp8 = int4 tok_s / fp8 tok_s
  (first batch to the last commit, fsynced), and the same for the steady state (first batch to last append).
train: one fp8 cache of random features with real ShareGPT lengths (common.make_random_fp8_cache, as
  bench_train_real's "real" workload), re-encoded to int4 on the device (the same samples and features); then
  the trainer (`dflash train`'s path: loader threads, pinned buffers, H2D, decode on the GPU) from the fp8,
  int4, fp8, int4 caches, page cache dropped before each, 27B drafter shape. train_ratio_vs_fp8 = mean int4
  tok_s_aggregate / mean fp8 (bench_train.window_summary: all tokens over all time after the warm-up).

tau: held-out tau per storage with seeds, on the SmolLM2 target (issue 16's tau bound, issue 14's fp8 one). The
  first --records (2500) records of --train-data (regenerated whole conversations) are extracted in bf16, int4 and fp8
  (bench_reference.extract_cache), the MT-Bench + HumanEval target-greedy eval cache is built
  (bench_quality.generate_all, one cache of both sets), and the same drafter (bench_quality's GPU defaults,
  fixed --steps) is trained per storage and seed (bench_reference.train_once, held-out tau at the end through
  --eval-cache: bf16 x 2, int4 x 2, fp8 x 2). Before any work it prints the tokens, a disk preflight (all
  caches at once, or each deleted after its runs: --delete-caches) and the seconds of every step at the H200
  rates (H200Rates). State lives in --workdir (tau_state.json): a call cut at its time limit continues with
  --resume (finished steps kept, a training mid-way from its last checkpoint, every 50 steps). Results
  (tau_summary): tau_rel_diff_mtbench / _humaneval (int4 vs bf16, means over seeds, signed), bf16_seed_spread,
  fp8_rel_diff_mtbench / _humaneval, tau_means, per-run tau under tau.runs, and the SmolLM2-shape tok/s ratios
  (extract_ratio_vs_fp8_smollm2, train_ratio_vs_fp8_smollm2: this stage's own extractions and trainings).

Each stage merges its fields into benchmarks/results/storage4_<name>.json (name: h200 on CUDA, else cpu;
tiny_ first with --tiny): bytes_per_token_4bit, bytes_per_token_bf16 (bytes), extract_ratio_vs_fp8 (extract),
train_ratio_vs_fp8 (train), the tau fields (tau), plus the detail of each stage under its name. The last stdout
line is the stage's JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import say_as, shape_fingerprint, machine_info, package_version  # noqa: E402

ISSUE_BOUND = 14_340  # issue 16: <= 0.28 x bf16's 51,200 hidden bytes per token, all in
BF16_HIDDEN_27B = 5 * 5120 * 2
INT4 = "int4"
# ~6 epochs of --records 2500 (2,362 samples, 1.70M tokens at max-length 1024: ~104 steps an epoch), the paper's
# epoch count. Measured on the H200 (2026-12-02, storage4_h200.json): 100 steps take ~22 s a run (96-98K tok/s),
# and at 100 steps (one epoch) the drafters reach only tau 1.07 / 1.13, where any two storages agree; 600 steps:
# ~130 s a run, ~13 minutes for bf16,int4 x 2 seeds with the eval set and two extractions (2 calls)
TAU_STEPS = 600
TAU_TINY_STEPS = 2


say = say_as("bench_storage4")


def fingerprint(storage: str, *, hidden: int, taps: tuple[int, ...]):
    return shape_fingerprint(storage, hidden=hidden, taps=taps, target="random-27b-shape", max_length=4096)


def random_features(T: int, K: int, D: int, *, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """bf16 [T, K, D] normal features with 8 massive channels (x20) and rare spikes (x50)."""
    x = torch.randn(T, K, D, device=device, generator=generator)
    x[:, :, torch.arange(8, device=device) * (D // 8) + 3] *= 20.0
    x = torch.where(torch.rand(T, K, D, device=device, generator=generator) < 1e-4, x * 50.0, x)
    return x.to(torch.bfloat16)


def bytes_stage(args, device: torch.device, work: pathlib.Path) -> dict:
    from bench_extract import sample_lengths

    from dflash.cache import CacheWriter
    from dflash.cache.format import encode_stored, resolve_storage, stored_layout
    from dflash.cache.verify import cache_info

    K, D, taps = 5, 5120, (1, 16, 31, 46, 61)
    lengths, loss, _ = sample_lengths(args.tokens, seed=args.seed, batch_tokens=16384)
    lengths = np.asarray(lengths, np.int64)
    T = int(lengths.sum())
    rng = np.random.default_rng(args.seed)
    ids = rng.integers(0, 248320, T).astype(np.int32)
    mask = np.ones(T, np.uint8)
    out = {"tokens": T, "samples": len(lengths), "taps": K, "hidden": D, "storages": {}}
    for storage in ("bf16", "fp8", INT4):
        path = work / f"bytes_{storage}"
        g = torch.Generator(device=device).manual_seed(args.seed)  # the same features for every storage
        t0 = time.perf_counter()
        with CacheWriter(path, fingerprint(storage, hidden=D, taps=taps)) as w:
            start = 0
            for s0 in range(0, len(lengths), 16):  # appends of 16 samples, encoded on `device` as extraction does
                lens = lengths[s0:s0 + 16]
                n = int(lens.sum())
                enc = encode_stored(random_features(n, K, D, generator=g, device=device), storage, check_finite=False)
                w.append(sample_ids=np.arange(s0, s0 + len(lens)), lengths=lens, input_ids=ids[start:start + n],
                         loss_mask=mask[start:start + n], hidden=enc.hidden.cpu(),
                         scales=None if enc.scales is None else enc.scales.cpu(),
                         group_scales=None if enc.group_scales is None else enc.group_scales.cpu())
                start += n
        info = cache_info(path)
        layout = stored_layout(storage, D)
        out["storages"][storage] = {
            "storage": resolve_storage(storage), "format": info["storage_format"], "shards": info["shards"],
            "bytes_per_token": info["bytes_per_token"], "bytes_on_disk_per_token": info["bytes_on_disk"] / T,
            "hidden_bytes_per_token": layout.hidden_bytes_per_token(K),
            "ratio_vs_bf16_hidden": info["bytes_per_token"] / BF16_HIDDEN_27B, "write_s": time.perf_counter() - t0}
        shutil.rmtree(path)
        say(f"{storage}: {info['bytes_per_token']:,.1f} B/token in shards ({layout.hidden_bytes_per_token(K):,} "
            f"hidden), {out['storages'][storage]['ratio_vs_bf16_hidden']:.4f}x bf16's {BF16_HIDDEN_27B:,}")
    s4 = out["storages"][INT4]
    out.update(bytes_per_token_4bit=s4["bytes_per_token"], bytes_per_token_bf16=out["storages"]["bf16"]["bytes_per_token"],
               bytes_per_token_fp8=out["storages"]["fp8"]["bytes_per_token"], issue_bound=ISSUE_BOUND,
               meets_bound=s4["bytes_per_token"] <= ISSUE_BOUND)
    return out


def extract_stage(args, work: pathlib.Path) -> dict:
    """bench_extract.py in a child process (its own model build and warm-up), fp8 and int4 twice each."""
    res_dir = work / "extract_results"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_extract.py"), "--tokens", str(args.tokens),
           "--storage", "fp8,int4,fp8,int4", "--peer-tokens", "0", "--work-dir", str(work / "extract"),
           "--result-name", "storage4", "--results-dir", str(res_dir), "--seed", str(args.seed)]
    cmd += ["--tiny"] if args.tiny else ["--fla-conv"]
    say("running " + " ".join(cmd))
    subprocess.run(cmd, check=True)
    r = json.loads((res_dir / "extract_storage4.json").read_text())
    fp8, q4 = r["fp8"], r[INT4]
    keep = ("tok_s", "tok_s_steady", "ratio_vs_forward_only", "bytes_per_token", "disk_write_MB_s",
            "wait_on_disk_s", "seconds", "tokens", "forward_timeline")
    return {"command": " ".join(cmd), "forward_only_tok_s": r["forward_only_tok_s"], "model": r["model"],
            "kernels": r["kernels"], "fp8": {k: fp8.get(k) for k in keep}, INT4: {k: q4.get(k) for k in keep},
            "extract_ratio_vs_fp8": q4["tok_s"] / fp8["tok_s"],
            "extract_ratio_steady_vs_fp8": (q4["tok_s_steady"] / fp8["tok_s_steady"]
                                            if q4["tok_s_steady"] and fp8["tok_s_steady"] else None)}


def transcode(src: pathlib.Path, dst: pathlib.Path, storage: str, *, device: torch.device) -> dict:
    """Re-encode a cache into another storage on `device`: the same samples, ids, masks and (decoded) features."""
    from dflash.cache import CacheReader, CacheWriter
    from dflash.cache.format import decode_stored, encode_stored

    t0 = time.perf_counter()
    with CacheReader(src) as r, CacheWriter(dst, dataclasses.replace(r.fingerprint, storage=storage)) as w:
        for s in range(len(r.index.shard_names)):
            members = np.flatnonzero(r.index.shard == s)
            for part in np.array_split(members, max(1, len(members) // 16)):
                p = r.read_many(part)
                x = decode_stored(*(None if a is None else a.to(device) for a in (p.hidden, p.scales, p.group_scales)),
                                  storage=r.storage, dtype=torch.float32)
                enc = encode_stored(x, storage, check_finite=False)
                w.append(sample_ids=p.sample_ids, lengths=p.lengths, input_ids=p.input_ids, loss_mask=p.loss_mask,
                         hidden=enc.hidden.cpu(), scales=None if enc.scales is None else enc.scales.cpu(),
                         group_scales=None if enc.group_scales is None else enc.group_scales.cpu())
    os.sync()
    return {"bytes": sum(f.stat().st_size for f in dst.rglob("*") if f.is_file()), "write_s": time.perf_counter() - t0}


def train_stage(args, device: torch.device, work: pathlib.Path) -> dict:
    from bench_train import patch_out_saving, run_trainer, shapes, train_kwargs, window_summary
    from bench_train_real import free_device, workload
    from common import drop_page_cache, make_head_only_target, make_random_fp8_cache, matmul_peak, mfu_fields

    from dflash.train.config import TrainConfig

    os.environ["DFLASH_NO_PROGRESS"] = "1"
    sh = shapes(args.tiny)
    batch_tokens = 2 * sh["seq_len"]
    total = args.warmup + args.steps
    make_head_only_target(work / "target", hidden=sh["hidden"], vocab=sh["vocab"], target_layers=sh["target_layers"],
                          device=device)
    peak = matmul_peak(device)
    patch_out_saving()  # checkpoints and the export are no part of a step (bench_train)
    lengths, loss = workload("real", sh, steps=total, batch_tokens=batch_tokens, seed=args.seed, tiny=args.tiny)
    caches = {"fp8": work / "cache_fp8", INT4: work / "cache_int4"}
    made = {"fp8": make_random_fp8_cache(caches["fp8"], work / "target", sh, num_samples=len(lengths),
                                         seed=args.seed, device=device, lengths=lengths, loss_tokens=loss)}
    made[INT4] = transcode(caches["fp8"], caches[INT4], INT4, device=device)
    say(f"{len(lengths)} samples, {int(lengths.sum()):,} tokens: fp8 cache {made['fp8']['bytes'] / 1e9:.2f} GB, "
        f"int4 {made[INT4]['bytes'] / 1e9:.2f} GB")
    kw = train_kwargs(sh, cache=caches["fp8"], target=work / "target", steps=total, batch_tokens=batch_tokens,
                      log_every=args.log_every, peak=peak, seed=args.seed, num_readers=2, prefetch=4)
    runs: dict[str, list[dict]] = {"fp8": [], INT4: []}
    for rep in range(args.repeats):
        for storage in ("fp8", INT4):
            free_device(device)
            cold = drop_page_cache(caches[storage])
            out = work / f"run_{storage}_{rep}"
            t = time.perf_counter()
            recs = run_trainer(TrainConfig(output=str(out), **{**kw, "cache": str(caches[storage])}), device)
            a = window_summary(recs, warmup=args.warmup)
            runs[storage].append({"tok_s": a["tok_s_aggregate"], **mfu_fields(a["mfu_aggregate"], peak=peak),
                                  "stall_frac": a["stall_frac"], "peak_mem_gib": a["peak_mem_gib"],
                                  "wall_s": time.perf_counter() - t, "page_cache": cold,
                                  "final_loss": recs[-1]["loss"]})
            shutil.rmtree(out, ignore_errors=True)
            say(f"run {rep} {storage}: {a['tok_s_aggregate']:,.0f} tok/s, trainer wait {a['stall_frac']:.3f}")
    mean = {s: float(np.mean([r["tok_s"] for r in rs])) for s, rs in runs.items()}
    return {"shape": "tiny drafter" if args.tiny else "Qwen3.5-27B drafter shape", "samples": len(lengths),
            "tokens": int(lengths.sum()), "batch_tokens": batch_tokens, "warmup_steps": args.warmup,
            "steps": args.steps, "cache_bytes": {s: m["bytes"] for s, m in made.items()}, "runs": runs,
            "tok_s_mean": mean, "train_ratio_vs_fp8": mean[INT4] / mean["fp8"]}


# ------------------------------------------------------------------------------------------------ tau stage

TAU_STORAGES = ("bf16", INT4, "fp8")  # int4 right after bf16: a call cut before fp8 still answers issue 16
EVAL_DATASETS = ("mtbench", "humaneval")
TAU_RESERVE_BYTES = 2 << 30  # eval cache (~0.5 GB at 86K tokens) + the drafter folders, beside the caches
RATIO_SHAPE = ("SmolLM2-135M target (5 taps x 576 hidden), bench_quality's drafter (tau.config): the extraction "
               "and training tok/s of this stage's own runs. The 27B-shape ratios of issue 16 are the top-level "
               "extract_ratio_vs_fp8 / train_ratio_vs_fp8 of --stage extract / --stage train")


@dataclasses.dataclass(frozen=True, kw_only=True)
class H200Rates:
    """What the tau stage's steps cost on one H200 with the SmolLM2 target: the estimate printed before it starts.
    Sources: issue 14/16 device notes and the H200 result files named per field."""

    plan_s: float = 10.0
    """The extraction dry run that counts the training tokens (tokenization of the records on the host)."""
    convert_target_s: float = 30.0
    """GGUF -> HF folder (quality_reference_attempt_h200.json a_target 30.4 s)."""
    generate_eval_s: float = 72.0
    """Target-greedy MT-Bench (80) + HumanEval (164) responses at 256 new tokens (the same file: 37.7 + 34.0 s)."""
    extract_bf16_tok_s: float = 45_000.0
    """bf16 extraction of 5.2M SmolLM2 tokens (30 GB) ran 45K tok/s, bound by ~260 MB/s to the disk (same file);
    smaller storages scale by bytes up to extract_max_tok_s."""
    extract_max_tok_s: float = 51_000.0
    """fp8 extraction of the same 5.2M tokens ran 51K tok/s (half bf16's bytes: no longer bound by them)."""
    extract_setup_s: float = 15.0
    """Per extraction: tokenize the records, load the target, open the writer."""
    train_tok_s: float = 85_000.0
    """Training at bench_quality's GPU shape: 80-88K context tok/s, ~0.19 s per step (same file, steps 75-125)."""
    train_setup_s: float = 10.0
    """Per run: loader, drafter, target head, held-out evaluator."""
    train_first_extra_s: float = 30.0
    """The first run of a process also compiles (149.9 s vs 117 s for 400 steps, quality_smollm2.json)."""
    eval_s: float = 20.0
    """One held-out evaluation of the 244 eval sequences (19.8 s, quality_reference_attempt_h200.json, with the
    chain-following evaluator; the batched one of dflash/eval/batched.py should take far less: kept as a bound)."""


def tau_bytes_per_token(storage: str, *, hidden_size: int, num_taps: int) -> int:
    from dflash.cache.format import TOKEN_BYTES, stored_layout

    return stored_layout(storage, hidden_size).hidden_bytes_per_token(num_taps) + TOKEN_BYTES


def tau_estimate(*, tokens: int, storages: tuple[str, ...], hidden_size: int, num_taps: int, seeds: int, steps: int,
                 batch_tokens: int, eval_every: int, convert_target: bool, make_eval_cache: bool, seed0: int = 0,
                 rates: H200Rates = H200Rates()) -> list[tuple[str, float]]:
    """(step, seconds) of the tau stage at the H200 rates, in run order; the steps are named as in the state file
    (a_target: the GGUF conversion, c_plan: the dry run, d/e: the eval cache, f: extractions, g: trainings)."""
    disk_B_s = rates.extract_bf16_tok_s * tau_bytes_per_token("bf16", hidden_size=hidden_size, num_taps=num_taps)
    rows = [("a_target", rates.convert_target_s)] if convert_target else []
    rows.append(("c_plan", rates.plan_s))
    if make_eval_cache:
        rows += [("d_generate_eval", rates.generate_eval_s), ("e_extract_eval", rates.extract_setup_s)]
    run_s = steps * batch_tokens / rates.train_tok_s + rates.train_setup_s + -(-steps // eval_every) * rates.eval_s
    for i, s in enumerate(storages):
        bpt = tau_bytes_per_token(s, hidden_size=hidden_size, num_taps=num_taps)
        rows.append((f"f_extract_{s}", rates.extract_setup_s + tokens / min(rates.extract_max_tok_s, disk_B_s / bpt)))
        rows += [(f"g_train_{s}_seed{seed0 + k}", run_s + (rates.train_first_extra_s if i == k == 0 else 0.0))
                 for k in range(seeds)]
    return rows


def format_estimate(rows: list[tuple[str, float]], *, call_s: float) -> str:
    total, lines = 0.0, []
    for name, sec in rows:
        total += sec
        lines.append(f"  {name:<28} {sec:7.0f} s   (cumulative {total:6.0f} s)")
    lines.append(f"  total ~{total:.0f} s at the H200 rates = {-(-total // call_s):.0f} call(s) of {call_s:.0f} s "
                 "(--resume continues a cut call)")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiskPlan:
    """What fits on the work folder's disk: all caches at once, or one at a time (each deleted after its runs)."""

    free_bytes: int
    """Free bytes on the work folder's file system at planning time."""
    cache_bytes: dict
    """storage -> estimated cache bytes (dflash.extract.space.estimate_cache_bytes)."""
    reserve_bytes: int
    """Kept free beside the caches: eval cache, drafter folders, margin."""
    keep_all: bool
    """True: every cache stays until all runs are done; False: a cache is deleted once its runs are done."""

    def describe(self) -> str:
        gb = {s: f"{b / 1e9:.1f} GB" for s, b in self.cache_bytes.items()}
        how = ("all caches fit at once: none deleted before the end" if self.keep_all else
               "not all caches fit at once: each cache is deleted when its runs are done")
        return f"disk: {self.free_bytes / 1e9:.1f} GB free; caches {gb} + {self.reserve_bytes / 1e9:.1f} GB reserve: {how}"


def disk_plan(*, cache_bytes: dict[str, int], free_bytes: int, reserve_bytes: int, delete: str) -> DiskPlan:
    """delete: "auto" (delete as we go only when the caches do not fit together), "always" or "never".
    Raises SystemExit before any work when even the largest cache alone does not fit (or all of them with never)."""
    need_all = sum(cache_bytes.values()) + reserve_bytes
    need_one = max(cache_bytes.values()) + reserve_bytes
    if need_one > free_bytes or (delete == "never" and need_all > free_bytes):
        need = need_all if delete == "never" else need_one
        raise SystemExit(f"tau stage: needs {need / 1e9:.1f} GB on the work folder's disk, {free_bytes / 1e9:.1f} GB "
                         "free: lower --records, free space or choose another --workdir")
    keep = delete == "never" or (delete == "auto" and need_all <= free_bytes)
    return DiskPlan(free_bytes=free_bytes, cache_bytes=dict(cache_bytes), reserve_bytes=reserve_bytes, keep_all=keep)


def _rel(x: float, base: float) -> float:
    return (x - base) / base


def tau_summary(runs: dict[str, dict], extracts: dict[str, dict]) -> dict:
    """The issue-16/14 numbers from per-run records ({storage, seed, tau_<dataset>, tokens_per_s}) and per-storage
    extraction records (bench_reference.extract_cache): means over seeds, signed relative differences to bf16
    (int4: tau_rel_diff_*, fp8: fp8_rel_diff_*), paired per-seed differences, the bf16 seed spread
    ((max - min) / mean over seeds; the top-level number is the larger of the two datasets'), tok/s ratios."""
    def taus(storage: str, ds: str) -> dict[int, float]:
        return {r["seed"]: r[f"tau_{ds}"] for r in runs.values()
                if r["storage"] == storage and r.get(f"tau_{ds}") is not None}

    storages = sorted({r["storage"] for r in runs.values()}, key=lambda s: (s != "bf16", s))
    means = {s: {ds: statistics.mean(v.values()) for ds in EVAL_DATASETS if (v := taus(s, ds))} for s in storages}
    out: dict = {"tau_means": means, "seeds": {s: sorted({r["seed"] for r in runs.values() if r["storage"] == s})
                                               for s in storages}}
    spread, rel, paired = {}, {}, {}
    for ds in EVAL_DATASETS:
        b = taus("bf16", ds)
        if len(b) >= 2:
            spread[ds] = (max(b.values()) - min(b.values())) / means["bf16"][ds]
        for s in storages:
            q = taus(s, ds)
            if s == "bf16" or not b or not q:
                continue
            rel.setdefault(s, {})[ds] = _rel(means[s][ds], means["bf16"][ds])
            paired.setdefault(s, {})[ds] = {str(k): _rel(q[k], b[k]) for k in sorted(b.keys() & q.keys())}
    out.update(rel_diff_vs_bf16=rel, paired_rel_diff_vs_bf16=paired, bf16_seed_spread_per_dataset=spread)
    if spread:
        out["bf16_seed_spread"] = max(spread.values())
    for ds in EVAL_DATASETS:
        for s, key in ((INT4, "tau_rel_diff"), ("fp8", "fp8_rel_diff")):
            if ds in rel.get(s, {}):
                out[f"{key}_{ds}"] = rel[s][ds]
    checks = {}
    for s, name in ((INT4, "int4"), ("fp8", "fp8")):
        if set(rel.get(s, {})) == set(EVAL_DATASETS):
            checks[f"{name}_within_1pct"] = all(abs(v) <= 0.01 for v in rel[s].values())
            if set(spread) == set(EVAL_DATASETS):
                checks[f"{name}_within_bf16_seed_spread"] = all(abs(rel[s][ds]) <= spread[ds] for ds in EVAL_DATASETS)
    out["checks"] = checks
    # extraction: first batch to the last commit (fsynced), only where one call extracted the whole cache
    ext = {s: e["tokens"] / (e["loop_seconds"] + e["drain_seconds"]) for s, e in extracts.items()
           if e.get("committed_before") == 0 and e.get("tokens") and e["loop_seconds"] + e["drain_seconds"] > 0}
    train = {s: statistics.mean(v) for s in storages
             if (v := [r["tokens_per_s"] for r in runs.values() if r["storage"] == s and r.get("tokens_per_s")])}
    written = {s: e["bytes"] / e["tokens"] for s, e in extracts.items()
               if e.get("committed_before") == 0 and e.get("bytes") and e.get("tokens")}
    out.update(extract_tok_s=ext, train_tok_s=train, ratios_shape=RATIO_SHAPE, bytes_written_per_token=written)
    for kind, rates in (("extract", ext), ("train", train)):
        if INT4 in rates and "fp8" in rates:
            out[f"{kind}_ratio_vs_fp8"] = rates[INT4] / rates["fp8"]
        if "bf16" in rates and "fp8" in rates:
            out[f"{kind}_ratio_bf16_vs_fp8"] = rates["bf16"] / rates["fp8"]
    return out


TAU_TOP = ("tau_rel_diff_mtbench", "tau_rel_diff_humaneval", "bf16_seed_spread", "fp8_rel_diff_mtbench",
           "fp8_rel_diff_humaneval", "tau_means")


def tau_top_fields(summary: dict) -> dict:
    """Top-level fields of storage4_<name>.json from the tau summary; the SmolLM2-shape tok/s ratios get a
    _smollm2 suffix so they never overwrite the 27B-shape extract_ratio_vs_fp8 / train_ratio_vs_fp8."""
    top = {k: summary[k] for k in TAU_TOP if k in summary}
    top.update({f"{k}_smollm2": summary[k] for k in ("extract_ratio_vs_fp8", "train_ratio_vs_fp8") if k in summary})
    return top


def tau_train_source(args, work: pathlib.Path) -> list[str]:
    """--train-data, else the regenerated first turns in .assets/, else (GPU) the committed whole conversations
    (bench_reference's data: benchmarks/assets/quality), else (--tiny only) ShareGPT conversations."""
    if args.train_data:
        return [args.train_data]
    asset = ROOT / ".assets" / "sharegpt_first_all-00.jsonl.gz"
    if asset.is_file():
        return [str(asset)]
    if not args.tiny:
        import bench_reference as br

        return br.train_data_inputs(args)
    from dflash.data.assets import sharegpt_conversations

    out = work / "sharegpt_conversations.jsonl"
    out.write_text("".join(json.dumps(c) + "\n" for c in sharegpt_conversations(args.records)), encoding="utf-8")
    return [str(out)]


def tau_plan(args, *, model: str, data: str, work: pathlib.Path, device: torch.device, dtype: str,
             convert_target: bool) -> dict:
    """Tokens of the training records (an extraction dry run), the disk plan and the estimate."""
    import bench_reference as br
    from dflash.extract.space import estimate_cache_bytes
    from dflash.target.taps import default_tap_layer_ids

    res, cfg = br.planned_tokens(model, [data], work, dtype=dtype, device=device.type, max_length=args.max_length,
                                 batch_tokens=args.extract_batch_tokens)
    conf = json.loads((pathlib.Path(model) / "config.json").read_text())
    hidden, taps = conf["hidden_size"], len(default_tap_layer_ids(conf["num_hidden_layers"]))
    tokens, samples = res.planned_tokens, res.planned_samples
    cache_bytes = {s: estimate_cache_bytes(num_tokens=tokens, num_samples=samples, num_taps=taps, hidden_size=hidden,
                                           storage=s, shard_tokens=cfg.shard_tokens).total for s in args.storages}
    disk = disk_plan(cache_bytes=cache_bytes, free_bytes=shutil.disk_usage(work).free,
                     reserve_bytes=TAU_RESERVE_BYTES, delete=args.delete_caches)
    rows = tau_estimate(tokens=tokens, storages=args.storages, hidden_size=hidden, num_taps=taps, seeds=args.seeds,
                        steps=args.steps, batch_tokens=args.batch_tokens, eval_every=args.eval_every,
                        convert_target=convert_target, make_eval_cache=not args.eval_cache, seed0=args.seed)
    plan = {"samples": samples, "tokens": tokens, "skipped": res.skip_counts, "hidden_size": hidden, "taps": taps,
            "disk": dataclasses.asdict(disk), "disk_text": disk.describe(), "estimate_s": dict(rows),
            "estimate_text": format_estimate(rows, call_s=args.call_seconds)}
    say(plan_text(plan))
    return plan


def plan_text(plan: dict) -> str:
    return (f"{plan['samples']:,} training samples, {plan['tokens']:,} tokens; {plan['disk_text']}\n"
            f"estimate per step (H200 rates):\n{plan['estimate_text']}")


def tau_run(args, *, model: str, cache: pathlib.Path, eval_cache: pathlib.Path, out: pathlib.Path,
            device: torch.device, storage: str, seed: int) -> dict:
    """One drafter (bench_reference.train_once, held-out tau at the end) and its record."""
    import bench_reference as br
    from common import drop_page_cache

    cold = None if args.tiny else drop_page_cache(cache)  # every storage's run reads its cache from the disk
    r = br.train_once(args, model=model, cache=cache, out=out, device=device.type, steps=args.steps,
                      eval_cache=str(eval_cache), eval_every=args.eval_every, log_every=None, seed=seed)
    c = br.curve(r["metrics"])
    last = r["metrics"][-1] if r["metrics"] else {}
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # ~0.5 GB per run; the run is recorded, never resumed
    rec = {"storage": storage, "seed": seed, "steps": r["steps"], "seconds": r["seconds"],
           "tokens_per_s": r["tokens_per_s"], "resumed": r["resumed"], "page_cache": cold,
           "tau_heldout": c["heldout_tau"][-1] if c["heldout_tau"] else None,
           **{f"tau_{ds}": br.set_tau(c, ds) for ds in EVAL_DATASETS},
           "final_loss": last.get("loss"), "final_train_accept_len": last.get("accept_len"), "curve": c}
    say(f"tau {storage} seed {seed}: MT-Bench {rec['tau_mtbench']}, HumanEval {rec['tau_humaneval']}, "
        f"{rec['tokens_per_s']} tok/s")
    return rec


class StopAfter(Exception):
    """--stop-after NAME: the call ends after that step, as a call cut at its time limit would (tests, planning)."""


class TauStages:
    """bench_quality.Stages over the tau stage's state file, also writing the results file after each step.
    With a budget (call_s, estimate_s: step -> seconds at the H200 rates, from the plan), a step not yet done
    whose estimate would end the call past call_s seconds is left for the next call (StopAfter): a clean stop
    between steps instead of a kill mid-extraction (which would lose that storage's extraction rate)."""

    def __init__(self, stages, on_save, *, stop_after: str | None, call_s: float | None = None,
                 clock=time.perf_counter, t0: float | None = None) -> None:
        self.stages, self.on_save, self.stop_after = stages, on_save, stop_after
        self.call_s, self.clock, self.t0 = call_s, clock, clock() if t0 is None else t0
        self.estimate_s: dict[str, float] = {}

    def run(self, name: str, fn, *, into: tuple[dict, str] | None = None):
        """Run (or recall) step `name`; its output also goes to into[0][into[1]] before the state is saved."""
        est = self.estimate_s.get(name)
        if (self.call_s is not None and est is not None and not self.stages.done(name)
                and self.clock() - self.t0 + est > self.call_s):
            raise StopAfter(f"at {self.clock() - self.t0:.0f} s: {name} (~{est:.0f} s at the H200 rates) would end "
                            f"past --call-seconds {self.call_s:.0f}")
        out = self.stages.run(name, fn)
        if into is not None:
            into[0][into[1]] = out
            self.stages.save()
        self.on_save(self.stages.result)
        if name == self.stop_after:
            raise StopAfter(f"after {name} (--stop-after)")
        return out


def reused_eval_cache(path: pathlib.Path) -> dict:
    """--eval-cache: an eval cache an earlier bench_reference / tau run built (its cache_eval), checked to be
    target-greedy and to hold both eval sets (held-out tau per set is keyed by their file names)."""
    import bench_reference as br

    from dflash.cache import CacheReader

    with CacheReader(path) as r:
        fp, n = r.fingerprint, len(r)
    names = br.source_names(fp)
    if not fp.target_greedy or not set(br.EVAL_SETS.values()) <= names:
        raise SystemExit(f"--eval-cache {path}: needs a target-greedy cache of {sorted(br.EVAL_SETS.values())} "
                         f"(bench_reference's cache_eval); it is target_greedy={fp.target_greedy}, sources "
                         f"{sorted(names)}")
    return {"path": str(path), "reused": True, "samples": n, "sources": sorted(names)}


def _drop_cache(cache: pathlib.Path, storage: str, deleted: list) -> None:
    if cache.exists():
        shutil.rmtree(cache)
        deleted.append(storage)
        say(f"deleted {cache}")


def tau_stage(args, device: torch.device, work: pathlib.Path, *, write, argv: list[str] | None = None) -> dict:
    """Held-out tau per storage with seeds (see the module docstring); `write(section, top)` merges into the
    results file after every step, so a call cut at its time limit leaves what it measured."""
    import bench_quality as bq
    import bench_reference as br

    dtype = "bfloat16" if device.type == "cuda" else "float32"
    state = work / "tau_state.json"
    earlier = json.loads(state.read_text()) if args.resume and state.is_file() else None
    head = bq.result_header(args, bench="storage4_tau", device=device.type, argv=argv)
    head["calls"] = bq.call_history(earlier, head)
    head = json.loads(json.dumps(head, default=str))  # as the state file holds it (tuples are lists there)
    if earlier is not None:
        for key in ("records", "steps", "seeds", "storages", "batch_tokens", "layers"):
            if earlier["config"].get(key) != head["config"].get(key):
                raise SystemExit(f"--resume: --{key.replace('_', '-')} was {earlier['config'].get(key)!r} in the "
                                 f"run being continued, {head['config'].get(key)!r} now")
        head["config"] = earlier["config"]  # the settings are the first call's
    result = {**head, "runs": {}, "extracts": {}, "deleted": list((earlier or {}).get("deleted", []))}

    def section(r: dict) -> tuple[dict, dict]:
        summ = tau_summary(r["runs"], r["extracts"])
        body = {k: r[k] for k in ("date", "calls", "config", "versions", "device") if k in r}
        body.update(plan=r.get("plan"), runs=r["runs"], extracts=r["extracts"], eval_cache=r.get("eval_cache"),
                    deleted=r["deleted"], stage_seconds=r.get("stage_seconds"), summary=summ)
        return body, tau_top_fields(summ)

    st = TauStages(bq.Stages(result, state, earlier=earlier), lambda r: write(*section(r)), stop_after=args.stop_after,
                   call_s=args.call_seconds if device.type == "cuda" else None,  # the rates are the H200's
                   t0=bq.T0)  # the call's clock starts at the imports
    model = st.run("a_target", lambda: args.model or bq.target_folder(args, work))
    srcs = tau_train_source(args, work)
    data = st.run("b_train_data", lambda: br.first_records(
        list(srcs), args.records, work / f"train_first{args.records}.jsonl"))
    st.run("c_plan", lambda: tau_plan(args, model=model, data=data, work=work, device=device, dtype=dtype,
                                      convert_target=not args.model), into=(result, "plan"))
    if "c_plan" in (earlier or {}).get("stage_out", {}):
        say(plan_text(result["plan"]))  # planned by the first call: shown again
    st.estimate_s = result["plan"]["estimate_s"]
    kw = dict(device=device.type, dtype=dtype, max_length=args.max_length, batch_tokens=args.extract_batch_tokens)
    if args.eval_cache:
        eval_cache = pathlib.Path(args.eval_cache)
        st.run("e_extract_eval", lambda: reused_eval_cache(eval_cache), into=(result, "eval_cache"))
    else:
        st.run("d_generate_eval", lambda: bq.generate_all(args, model, bq.eval_prompt_files(args), work, device.type,
                                                          dtype))
        eval_cache = work / "cache_eval"
        st.run("e_extract_eval", lambda: br.extract_cache(model, [str(work / f) for f in br.EVAL_SETS.values()],
                                                          eval_cache, storage="bf16", **kw), into=(result, "eval_cache"))
    for s in args.storages:
        cache = work / f"cache_{s}"
        st.run(f"f_extract_{s}", lambda s=s, cache=cache: br.extract_cache(model, [data], cache, storage=s, **kw),
               into=(result["extracts"], s))
        for seed in range(args.seed, args.seed + args.seeds):
            st.run(f"g_train_{s}_seed{seed}", lambda s=s, cache=cache, seed=seed: tau_run(
                args, model=model, cache=cache, eval_cache=eval_cache, out=work / f"run_{s}_seed{seed}", device=device,
                storage=s, seed=seed), into=(result["runs"], f"{s}_seed{seed}"))
        if not result["plan"]["disk"]["keep_all"]:
            _drop_cache(cache, s, result["deleted"])  # its runs are done (recorded in the state file)
    if not args.keep_caches:  # every run is done: the caches are no longer needed (64 GiB disk on the H200)
        for s in args.storages:
            _drop_cache(work / f"cache_{s}", s, result["deleted"])
    st.stages.save()
    body, top = section(result)
    write(body, top)
    return {**body, "top": top}


def tau_args(args, rest: list[str]) -> None:
    """Resolve the tau stage's settings in place. Drafter, generation and extraction settings are
    bench_quality's (--tiny or GPU defaults; its flags pass through: --gguf-parts, --batch-tokens, --layers, ...)."""
    import bench_quality as bq

    args.steps = args.steps or (TAU_TINY_STEPS if args.tiny else TAU_STEPS)
    args.records = args.records or (4 if args.tiny else 2500)
    args.eval_every = args.eval_every or args.steps  # held-out tau once, at the end (it is timed out of tok/s)
    args.storages = tuple(args.storages.split(","))
    if "bf16" not in args.storages:
        raise SystemExit("--storages: bf16 is the baseline every difference is read against; include it")
    q = bq.parse_args((["--tiny"] if args.tiny else []) + rest)
    for k, v in vars(q).items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if "--save-every" not in rest:  # a call cut mid-run loses at most 50 steps
        args.save_every = min(args.save_every, 50)


def merge_results(path: pathlib.Path, *, top: dict, name: str, section: dict) -> None:
    """Merge one stage into the results file: its top-level numbers and its section under `name`."""
    from dflash.durable import replace_text

    merged = json.loads(path.read_text()) if path.exists() else {"benchmark": "storage4", "storage": "int4-g32-e4m3-h32"}
    merged.update(top)
    merged[name] = section
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_text(path, json.dumps(merged, indent=1, default=str) + "\n")


def format_tau(body: dict, top: dict) -> str:
    lines = [f"{'run':<16} {'steps':>6} {'MT-Bench':>9} {'HumanEval':>9} {'tok/s':>8}"]
    for k, r in body["runs"].items():
        lines.append(f"{k:<16} {r['steps']:>6} {r['tau_mtbench'] or 0:>9.4f} {r['tau_humaneval'] or 0:>9.4f} "
                     f"{r['tokens_per_s'] or 0:>8.0f}")
    lines += [f"{k:<32} {v:+.4%}" if isinstance(v, float) and "ratio" not in k else f"{k:<32} {v}"
              for k, v in top.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict | None:
    """Run one stage; the tau stage returns its results section (with `top`), None when stopped early."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", choices=("bytes", "extract", "train", "tau"), required=True)
    p.add_argument("--tokens", type=int, default=None,
                   help="tokens of the bytes stage (default 16384) or per extraction (default 200000; tiny 4000)")
    p.add_argument("--steps", type=int, default=None, help=f"train: measured steps per run (default 20; tiny 2); "
                   f"tau: steps of every drafter (default {TAU_STEPS}; tiny {TAU_TINY_STEPS})")
    p.add_argument("--warmup", type=int, default=None, help="train: warm-up steps per run (default 4; tiny 2)")
    p.add_argument("--log-every", type=int, default=None, help="trainer log interval (train: 2; tau: bench_quality's)")
    p.add_argument("--repeats", type=int, default=2, help="train: fp8/int4 run pairs")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run; tau: few records, 1-layer "
                   "drafter, few steps)")
    p.add_argument("--work-dir", "--workdir", dest="work_dir", default=None, help="local-disk folder (bytes/extract/"
                   "train: wiped first, default /tmp/dflash_bench_storage4; tau: kept for --resume, default "
                   "/tmp/dflash_bench_storage4_tau)")
    p.add_argument("--seed", type=int, default=0, help="data seed; tau: the first drafter seed")
    p.add_argument("--result-name", default=None, help="results file suffix (default: h200 on CUDA, cpu)")
    p.add_argument("--results-dir", default=str(ROOT / "benchmarks" / "results"))
    t = p.add_argument_group("tau stage (other flags go to bench_quality's parser: --gguf-parts, --batch-tokens, ...)")
    t.add_argument("--train-data", help="regenerated conversations (default .assets/sharegpt_first_all-00.jsonl.gz)")
    t.add_argument("--records", type=int, help="first N records of --train-data (default 2500; tiny 4)")
    t.add_argument("--seeds", type=int, default=2, help="drafter seeds per storage (init, anchors, data order)")
    t.add_argument("--storages", default=",".join(TAU_STORAGES), help="storages in run order (bf16 first)")
    t.add_argument("--eval-every", type=int, help="held-out tau every N steps (default: only at the end)")
    t.add_argument("--model", help="converted SmolLM2 HF folder (default: --gguf/--gguf-parts, else the package)")
    t.add_argument("--eval-cache", help="reuse this target-greedy MT-Bench + HumanEval eval cache (an earlier "
                   "bench_reference or tau run's cache_eval, same target) instead of generating one (~87 s)")
    t.add_argument("--resume", action="store_true", help="continue a cut call: same --workdir, finished steps kept")
    t.add_argument("--delete-caches", choices=("auto", "always", "never"), default="auto",
                   help="delete each cache once its runs are done: auto = only when they do not fit together")
    t.add_argument("--keep-caches", action="store_true", help="keep the caches after the last run")
    t.add_argument("--call-seconds", type=float, default=560.0, help="one device call: the estimate counts calls of "
                   "it, and on CUDA a step that would end past it (at the H200-rate estimate) waits for --resume")
    t.add_argument("--stop-after", help="end the call after this step (a state-file stage name, e.g. c_plan to "
                   "print the plan and estimate only; g_train_int4_seed0); --resume continues")
    args, rest = p.parse_known_args(argv)
    if rest and args.stage != "tau":
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = args.result_name or (("tiny_" if args.tiny else "") + ("h200" if device.type == "cuda" else "cpu"))
    path = pathlib.Path(args.results_dir) / f"storage4_{name}.json"
    if args.stage == "tau":
        tau_args(args, rest)
        work = pathlib.Path(args.work_dir or "/tmp/dflash_bench_storage4_tau")
        if not args.resume and work.is_dir() and any(work.iterdir()):
            raise SystemExit(f"--workdir {work} holds an earlier run: pass --resume to continue it, or remove it")
        work.mkdir(parents=True, exist_ok=True)

        def write(body: dict, top: dict) -> None:
            merge_results(path, top=top, name="tau", section={**body, "machine": machine_info(device)})

        try:
            out = tau_stage(args, device, work, write=write, argv=argv)
        except StopAfter as e:
            say(f"stopped {e}: continue with the same command and --resume")
            return None
        print(format_tau(out, out["top"]), flush=True)
        print(json.dumps({**out["top"], "tau": out["summary"]}, default=str))
        return out
    if args.tokens is None:
        args.tokens = 16384 if args.stage == "bytes" else (4000 if args.tiny else 200_000)
    args.steps = args.steps or (2 if args.tiny else 20)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.tiny else 4)
    args.log_every = args.log_every or 2
    work = pathlib.Path(args.work_dir or "/tmp/dflash_bench_storage4")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0 = time.perf_counter()
    if args.stage == "bytes":
        stage = bytes_stage(args, device, work)
        top = {k: stage[k] for k in ("bytes_per_token_4bit", "bytes_per_token_bf16")}
    elif args.stage == "extract":
        stage = extract_stage(args, work)
        top = {"extract_ratio_vs_fp8": stage["extract_ratio_vs_fp8"]}
    else:
        stage = train_stage(args, device, work)
        top = {"train_ratio_vs_fp8": stage["train_ratio_vs_fp8"]}
    stage.update(command=" ".join(["python"] + sys.argv), date=time.strftime("%Y-%m-%d %H:%M:%S"),
                 seconds=time.perf_counter() - t0, machine=machine_info(device),
                 versions={"python": platform.python_version(), "torch": torch.__version__,
                           "fla": package_version("fla-core")})
    shutil.rmtree(work, ignore_errors=True)
    merge_results(path, top=top, name=args.stage, section=stage)
    for k, v in top.items():
        print(f"{k:28s} {v:,.4f}")
    print(json.dumps({**top, args.stage: {k: v for k, v in stage.items() if k != "runs"}}))
    return None


if __name__ == "__main__":
    main()
