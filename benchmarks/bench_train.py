"""Training benchmark: `dflash train` on the Qwen3.5-27B drafter shape, against its floors, in one run.

    python benchmarks/bench_train.py                      # H200: 27B drafter shape, 2 x 2048 tokens per step
    python benchmarks/bench_train.py --tiny               # CPU smoke run (hidden 256, 2 layers, ~1 minute)
    python benchmarks/bench_train.py --compare-loss-impl  # also (C): run B's steps with the other loss_impl

The drafter: 5 layers, hidden 5120, 32/8 heads of 128, MLP 17408, vocab 248320, block 16, 512 anchors per
sequence, 5 taps (1, 16, 31, 46, 61) of a 64-layer target. Measures, on the same micro-batches:
  (A) the real trainer (dflash.train.trainer.train) reading a cold fp8 disk cache: tokens/s (context tokens),
      MFU (FLOPs of dflash.train.metrics.FlopModel over a bf16 8192^3 matmul peak measured here: `mfu`; and
      over the H200's dense bf16 spec of 989 TFLOP/s: `mfu_vs_spec_989`), peak memory, and the trainer's own
      loader-wait fraction;
  (B) the same steps (the training driver itself, train.driver.run_stream, with its loader patched) fed from
      micro-batches resident on the GPU, no loader: loader_stall_fraction = 1 - A / B.
  (C) with --compare-loss-impl: run B again with the other TrainConfig.loss_impl (fused = LM-head logits once
      per supervised row, checkpoint = chunk-checkpointed CE over all rows): tok/s, MFU, memory of both, and
      the largest per-window loss difference between them (the same math up to fp32 summation order).
  (D), (E) with --compare-compile / --compare-wgrad-fusion: run B again with TrainConfig.compile_elementwise /
      wgrad_fusion flipped: tok/s of both and their largest per-window loss difference.
Medians over the measured steps; the warm-up steps (flex attention compilation, allocator growth) are
excluded from both. benchmarks/bench_train_real.py runs (A) and (B) on real ShareGPT lengths too.

Setup (all under --work-dir on the local disk): a target folder with a Qwen3_5TextConfig of the 27B shape, the
tiny byte tokenizer and a model.safetensors holding only the embedding and LM head (random bf16; the trainer
reads nothing else), and a cache written by CacheWriter (fp8) of random token ids, realistic loss masks (a
prompt of 10-40% without loss, then the response) and random-normal hidden states with outlier channels.
Checkpoint writes and the final export (~20 GB at this shape) are no part of a step: they are patched out
unless --keep-checkpoints. Writes benchmarks/results/train_<name>.json; the last stdout line is that JSON
without its per-window records.
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
import statistics
import sys
import threading
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import (SUSTAINED_DENOMINATOR, drop_page_cache, machine_info, make_head_only_target,  # noqa: E402
                    make_random_fp8_cache, matmul_peak, matmul_sustained, mfu_fields, mfu_vs_sustained,
                    package_version, sync)
from kernel_profile import kernel_summary  # noqa: E402
REFERENCE = {"plain_pytorch_tok_s": 7000, "plain_pytorch_mfu": 0.53, "target_mfu": 0.60,
             "target_loader_stall_fraction": 0.02}


def say(msg: str) -> None:
    print(f"[bench_train {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def shapes(tiny: bool) -> dict:
    if tiny:
        return dict(hidden=256, layers=2, heads=None, kv_heads=None, head_dim=None, intermediate=None, vocab=4096,
                    target_layers=8, taps=(1, 2, 3, 4, 5), seq_len=512, anchors=64, mask_token_id=4000)
    return dict(hidden=5120, layers=5, heads=32, kv_heads=8, head_dim=128, intermediate=17408, vocab=248320,
                target_layers=64, taps=(1, 16, 31, 46, 61), seq_len=2048, anchors=512, mask_token_id=248070)


# ------------------------------------------------------------------------------------------------- setup

def patch_out_saving() -> None:
    """Checkpoints (~20 GB of fp32 weights and Adam states at this shape) and the export are no part of a step."""
    import dflash.drafter.card as card
    import dflash.drafter.export as export
    import dflash.train.checkpoint as ckpt

    ckpt.save_checkpoint = lambda *a, **k: None
    export.export_drafter = lambda model, cfg, out_dir, **k: pathlib.Path(out_dir)
    card.write_model_card = lambda *a, **k: None  # the card goes into the export's folder, which is not written


def tail_metrics(path: pathlib.Path, stop: threading.Event, run: str = "A") -> None:
    """Print each metrics.jsonl record as it appears (progress, and a stuck compile is visible)."""
    seen = 0
    while not stop.wait(2.0):
        if not path.exists():
            continue
        lines = [x for x in path.read_text().splitlines() if x.strip()]
        for line in lines[seen:]:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                break  # a record being written; read it next time
            seen += 1
            mfu = f"{r['mfu']:.3f}" if r.get("mfu") is not None else "-"
            say(f"  {run} step {r['step']:4d}  loss {r['loss']:.3f}  {r['tokens_per_s']:9,.0f} tok/s  mfu {mfu}  "
                f"stall {r['stall_frac']:.3f}  mem {r['mem_gb']:.1f} GiB  {r['step_time_s']:.3f} s/step")


def window_summary(recs: list[dict], *, warmup: int) -> dict:
    """The log windows of a metrics.jsonl after the first `warmup` steps: medians (tok_s, mfu, step_time_s,
    stall_frac) and whole-window rates (tok_s_aggregate, mfu_aggregate: all tokens and FLOPs over all time),
    which real lengths need since their windows differ in cost. A window over 2x the median step time (a
    recompile for a new shape) is left out of the whole-window rates and counted in slow_windows_left_out.
    peak_mem_gib is over every window, the warm-up too."""
    measured = [r for r in recs if r["first_step"] > warmup]
    if not measured:
        raise RuntimeError(f"no log window after the {warmup} warm-up steps (steps {[r['step'] for r in recs]})")
    med_step = statistics.median(r["step_time_s"] for r in measured)
    kept = [r for r in measured if r["step_time_s"] <= 2 * med_step]
    secs = [r["step_time_s"] * (r["step"] - r["first_step"] + 1) for r in kept]
    has_mfu = all(r.get("mfu") is not None for r in kept)
    return {"tok_s": statistics.median(r["tokens_per_s"] for r in measured),
            "mfu": statistics.median(r["mfu"] for r in measured) if has_mfu else None,
            "step_time_s": med_step, "stall_frac": statistics.median(r["stall_frac"] for r in measured),
            "tok_s_aggregate": sum(r["tokens_per_s"] * s for r, s in zip(kept, secs)) / sum(secs),
            "mfu_aggregate": sum(r["mfu"] * s for r, s in zip(kept, secs)) / sum(secs) if has_mfu else None,
            "peak_mem_gib": max(r["mem_gb"] for r in recs), "measured_windows": len(measured),
            "slow_windows_left_out": len(measured) - len(kept)}


def train_kwargs(sh: dict, *, cache: pathlib.Path, target: pathlib.Path, steps: int, batch_tokens: int,
                 log_every: int, peak: float, seed: int, **extra) -> dict:
    """TrainConfig fields of the benchmarked drafter (27B shape or tiny): 5 layers, block 16, the paper's
    anchors, no checkpoints during the run; `extra` = further TrainConfig fields."""
    return dict(cache=str(cache), model=str(target), num_layers=sh["layers"], num_attention_heads=sh["heads"],
                num_key_value_heads=sh["kv_heads"], head_dim=sh["head_dim"], intermediate_size=sh["intermediate"],
                block_size=16, rope_theta=1e7, mask_token_id=sh["mask_token_id"], num_anchors=sh["anchors"],
                steps=steps, batch_tokens=batch_tokens, log_every=log_every, save_every=10**9, peak_flops=peak,
                seed=seed, **extra)


def run_trainer(cfg, device: torch.device) -> list[dict]:
    from dflash.train.metrics import read_metrics
    from dflash.train.trainer import train

    stop = threading.Event()
    t = threading.Thread(target=tail_metrics, args=(pathlib.Path(cfg.output) / "metrics.jsonl", stop), daemon=True)
    t.start()
    try:
        res = train(cfg, device=device.type)
    finally:
        stop.set()
        t.join()
    if res.global_step != cfg.steps:
        raise RuntimeError(f"the trainer stopped at step {res.global_step}, expected {cfg.steps}")
    return read_metrics(cfg.output)


# ------------------------------------------------------------------------------------------- run B

class ResidentLoader:
    """The loop's BatchSource over micro-batches already on the device: the same batches as the trainer's
    loader (read once through it), no reads or copies in the timed steps."""

    def __init__(self, batches: list) -> None:
        from dflash.train.loader import LoaderStats

        self.batches, self.stats = list(batches), LoaderStats()

    def next(self):
        return self.batches.pop(0)

    def __enter__(self) -> "ResidentLoader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.batches.clear()


def resident_loader(steps: int):
    """driver.OpenLoader that reads the first `steps` steps of the epoch through the real loader once, onto the
    device, before the first step, and serves them from memory."""
    from dflash.train.driver import streaming_loader

    def open_loader(stream, plan, start_step, host_fn):
        with streaming_loader(stream, plan, start_step, host_fn) as real:
            batches = [real.next() for _ in range((steps - start_step) * stream.cfg.grad_accum)]
        sync(stream.info.device)
        return ResidentLoader(batches)

    return open_loader


def run_resident(cfg, device: torch.device, *, warmup: int, profile_steps: int = 0) -> dict:
    """The training driver (train.driver.run_stream over one DrafterUnit, as `dflash train`) with its loader
    replaced by micro-batches preloaded on the device: no loader in the loop. With profile_steps, the last
    that many steps run under torch.profiler (kernel_summary) and are left out of the medians."""
    from dflash.train.distributed import init_distributed
    from dflash.train.driver import Stream, build_unit, run_stream
    from dflash.train.loader import plan_epoch
    from dflash.train.metrics import read_metrics
    from dflash.train.setup import setup_target

    info = init_distributed(device=device.type)
    target = setup_target(cfg, info=info)
    plan = plan_epoch(target.reader.index.length, seed=cfg.data_seed, epoch=0, batch_tokens=cfg.batch_tokens,
                      world_size=1, grad_accum=cfg.grad_accum)
    if plan.num_steps < cfg.steps:
        raise RuntimeError(f"the cache holds {plan.num_steps} steps of one epoch, the run needs {cfg.steps}: "
                           "raise --samples")
    run_dir = pathlib.Path(cfg.output)
    unit = build_unit(cfg, target, info=info, state=None, name="resident", progress=False)
    stream = Stream(reader=target.reader, taps=tuple(unit.dc.target_layer_ids), info=info,
                    compute_dtype=target.compute_dtype, cfg=cfg)
    stop = threading.Event()
    t = threading.Thread(target=tail_metrics, args=(run_dir / "metrics.jsonl", stop, "B"), daemon=True)
    t.start()
    prof: list = []
    t_prof = [0.0]

    def before_step(step: int) -> None:
        if profile_steps and step == cfg.steps - profile_steps and device.type == "cuda":
            sync(device)
            prof.append(torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                           torch.profiler.ProfilerActivity.CUDA],
                                               record_shapes=True))
            prof[0].__enter__()
            t_prof[0] = time.perf_counter()

    try:
        run_stream([unit], stream, open_loader=resident_loader(cfg.steps), before_step=before_step)
        if prof:
            sync(device)
            t_prof[0] = time.perf_counter() - t_prof[0]
            prof[0].__exit__(None, None, None)
    finally:
        unit.close()
        target.reader.close()
        stop.set()
        t.join()
    profile = kernel_summary(prof[0], steps=profile_steps, wall_s=t_prof[0]) if prof else None
    if profile:
        say(f"profile of {profile_steps} steps: {profile['step_ms']:.0f} ms/step, GPU busy {profile['gpu_busy_ms']:.0f} "
            f"ms; by kind (ms/step): " + ", ".join(f"{k} {v:.1f}" for k, v in profile["ms_per_step_by_kind"].items()))
    recs = read_metrics(run_dir)
    last_unprofiled = cfg.steps - (profile_steps if prof else 0)
    summ = window_summary([r for r in recs if r["step"] <= last_unprofiled], warmup=warmup)
    return {**summ, **mfu_fields(summ["mfu"], peak=cfg.peak_flops), "peak_mem_gib": max(r["mem_gb"] for r in recs),
            "records": recs, "profile": profile}


# ------------------------------------------------------------------------------------------------- main

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="measured optimizer steps (after the warm-up)")
    p.add_argument("--warmup", type=int, default=6, help="warm-up steps excluded from the medians")
    p.add_argument("--batch-tokens", type=int, default=None, help="micro-batch token budget (default 2 sequences)")
    p.add_argument("--samples", type=int, default=None,
                   help="cache samples (default: exactly the sequences of warm-up + measured steps)")
    p.add_argument("--log-every", type=int, default=2, help="trainer log interval (each log syncs the host)")
    p.add_argument("--num-readers", type=int, default=2, help="loader reader threads")
    p.add_argument("--prefetch", type=int, default=4, help="micro-batches read ahead")
    p.add_argument("--work-dir", default="/tmp/dflash_bench_train", help="local-disk folder (wiped first)")
    p.add_argument("--tiny", action="store_true", help="hidden 256, 2 layers, vocab 4096, 512-token sequences (CPU)")
    p.add_argument("--keep-checkpoints", action="store_true", help="let the trainer write its checkpoint/export")
    p.add_argument("--skip-resident", action="store_true", help="skip run B (no loader-stall fraction)")
    p.add_argument("--loss-impl", choices=("fused", "fused_eager", "checkpoint"), default="fused",
                   help="TrainConfig.loss_impl of runs A and B")
    p.add_argument("--compare-loss-impl", action="store_true",
                   help="run C: run B's resident steps with the other loss_impl; report both tok/s")
    p.add_argument("--compile-elementwise", choices=("auto", "on", "off"), default="auto",
                   help="TrainConfig.compile_elementwise of runs A and B (auto = on CUDA)")
    p.add_argument("--compare-compile", action="store_true",
                   help="run D: run B's resident steps with compile_elementwise flipped; report both tok/s")
    p.add_argument("--wgrad-fusion", choices=("auto", "on", "off"), default="auto",
                   help="TrainConfig.wgrad_fusion of runs A and B (weight gradients added into .grad by the matmul)")
    p.add_argument("--compare-wgrad-fusion", action="store_true",
                   help="run E: run B's resident steps with wgrad_fusion flipped; report both tok/s")
    p.add_argument("--profile-steps", type=int, default=2,
                   help="profile the last N resident steps of run B with torch.profiler (CUDA; 0 = off); "
                        "they are left out of B's medians")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-name", default=None, help="results file suffix (default: h200 on CUDA, cpu)")
    args = p.parse_args()
    if args.tiny and args.steps == 20 and args.warmup == 6:
        args.steps, args.warmup = 4, 2
    if args.warmup % args.log_every:
        p.error(f"--warmup {args.warmup} must be a multiple of --log-every {args.log_every} "
                "(medians are over whole log windows after the warm-up)")

    os.environ["DFLASH_NO_PROGRESS"] = "1"  # our own per-record lines instead of a tqdm bar in a log file
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from dflash.compiled import compile_wanted
    from dflash.train.config import TrainConfig

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sh = shapes(args.tiny)
    total_steps = args.warmup + args.steps
    batch_tokens = args.batch_tokens or 2 * sh["seq_len"]
    seqs_per_step = max(1, batch_tokens // sh["seq_len"])
    num_samples = args.samples or seqs_per_step * total_steps
    work = pathlib.Path(args.work_dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    say(f"device {device}, {'tiny' if args.tiny else '27B drafter'} shape, {total_steps} steps "
        f"({args.warmup} warm-up), {seqs_per_step} x {sh['seq_len']} tokens per step, {num_samples} samples")

    t = time.perf_counter()
    make_head_only_target(work / "target", hidden=sh["hidden"], vocab=sh["vocab"],
                          target_layers=sh["target_layers"], device=device)
    say(f"target folder (embedding + head only) written in {time.perf_counter() - t:.1f} s")
    cache_info = make_random_fp8_cache(work / "cache", work / "target", sh, num_samples=num_samples, seed=args.seed,
                            device=device)
    say(f"fp8 cache: {cache_info['bytes'] / 1e9:.2f} GB in {cache_info['write_s']:.1f} s")
    peak = matmul_peak(device)
    say(f"matmul peak measured: {peak / 1e12:.0f} TFLOP/s")

    kw = train_kwargs(sh, cache=work / "cache", target=work / "target", steps=total_steps, batch_tokens=batch_tokens,
                      log_every=args.log_every, peak=peak, seed=args.seed, num_readers=args.num_readers,
                      prefetch=args.prefetch, loss_impl=args.loss_impl, compile_elementwise=args.compile_elementwise,
                      wgrad_fusion=args.wgrad_fusion)
    cfg_a = TrainConfig(output=str(work / "run_a"), **kw)
    if not args.keep_checkpoints:
        patch_out_saving()
    cold = drop_page_cache(work / "cache")
    say(f"run A: the trainer from the disk cache (page cache dropped: {cold})")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t = time.perf_counter()
    recs = run_trainer(cfg_a, device)
    a_wall = time.perf_counter() - t
    summ = window_summary(recs, warmup=args.warmup)
    tok_s, mfu, wait, step_s, mem = (summ[k] for k in ("tok_s", "mfu", "stall_frac", "step_time_s", "peak_mem_gib"))
    reserved = torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None

    resident = None
    if not args.skip_resident:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        say("run B: the same steps from micro-batches resident on the device")
        resident = run_resident(TrainConfig(output=str(work / "run_b"), **kw), device, warmup=args.warmup,
                                profile_steps=args.profile_steps)
    stall = max(0.0, 1.0 - tok_s / resident["tok_s"]) if resident else None

    compare = None
    fused_name = args.loss_impl if args.loss_impl != "checkpoint" else "fused"   # the fused side of run C
    if args.compare_loss_impl:
        other = "checkpoint" if args.loss_impl != "checkpoint" else "fused"
        base = resident
        if base is None:  # --skip-resident: C still needs a resident run of this impl to compare with
            say(f"run B': resident steps with loss_impl={args.loss_impl} (for the comparison)")
            base = _fresh_resident(TrainConfig(output=str(work / "run_b"), **kw), device, args.warmup)
        say(f"run C: the same resident steps with loss_impl={other}")
        compare = compare_runs({args.loss_impl: base, other: _fresh_resident(
            TrainConfig(output=str(work / "run_c"), **{**kw, "loss_impl": other}), device, args.warmup)},
            base=args.loss_impl, fast=fused_name, slow="checkpoint", speedup_key="fused_speedup")

    def flipped_run(run: str, field: str, speedup_key: str) -> dict:
        """Run B's resident steps again with an auto/on/off TrainConfig field flipped: compare_runs of the two."""
        now = "on" if compile_wanted(kw[field], device) else "off"
        flipped = "off" if now == "on" else "on"
        say(f"run {run}: the same resident steps with {field}={flipped}")
        return compare_runs({now: resident, flipped: _fresh_resident(
            TrainConfig(output=str(work / f"run_{run.lower()}"), **{**kw, field: flipped}), device, args.warmup)},
            base=now, fast="on", slow="off", speedup_key=speedup_key)

    compile_cmp = flipped_run("D", "compile_elementwise", "compiled_speedup") \
        if args.compare_compile and resident else None
    wgrad_cmp = flipped_run("E", "wgrad_fusion", "fused_speedup") if args.compare_wgrad_fusion and resident else None

    mfus = mfu_fields(mfu, peak=peak)
    sustained = matmul_sustained(device)  # after the runs: the GPU as warm as they left it
    mfus["mfu_vs_sustained"] = mfu_vs_sustained(mfu, peak=peak, sustained=sustained)
    rows = [("trainer, fp8 disk cache (A)", tok_s, f"MFU {mfu:.3f} of the measured {peak / 1e12:.3g}T "
             f"({mfus['mfu_vs_sustained']:.3f} of the {sustained / 1e12:.3g}T sustained after the runs), "
             f"{mfus['mfu_vs_spec_989']:.3f} of the 989T spec; wait {wait:.3f}; {step_s:.3f} s/step; {mem:.1f} GiB")]
    if resident:
        rows.append(("same steps, GPU-resident batches (B)", resident["tok_s"],
                     f"MFU {resident['mfu']:.3f} (measured peak), {resident['mfu_vs_spec_989']:.3f} (989T spec); "
                     f"{resident['step_time_s']:.3f} s/step"))
        rows.append(("loader stall 1 - A/B", None, f"{stall:.3f} (target <= {REFERENCE['target_loader_stall_fraction']})"))
    for label, cmp, names, ratio in (("loss_impl", compare, ("checkpoint", fused_name),
                                      f"{fused_name} / checkpoint"),
                                     ("compile_elementwise", compile_cmp, ("off", "on"), "compiled / eager"),
                                     ("wgrad_fusion", wgrad_cmp, ("off", "on"), "fused / autograd")):
        if cmp:
            rows.extend(variant_rows(label, cmp, names, ratio))
    rows.append(("reference: plain PyTorch step", REFERENCE["plain_pytorch_tok_s"],
                 f"MFU {REFERENCE['plain_pytorch_mfu']} (target >= {REFERENCE['target_mfu']})"))
    print(f"\n{'what':40s} {'tok/s':>10s}  notes", flush=True)
    for name, rate, note in rows:
        print(f"{name:40s} {'' if rate is None else f'{rate:10,.0f}':>10s}  {note}", flush=True)

    name = args.result_name or (("tiny_" if args.tiny else "") + ("h200" if device.type == "cuda" else "cpu"))
    b_loss = {r["step"]: r["loss"] for r in resident["records"]} if resident else {}
    loss_diff = max((abs(r["loss"] - b_loss[r["step"]]) for r in recs if r["step"] in b_loss), default=None)
    out = {
        "benchmark": "train", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(["python"] + sys.argv),
        "machine": machine_info(device),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": __import__("transformers").__version__, "triton": package_version("triton"),
                     "zarr": package_version("zarr")},
        "model": "tiny drafter" if args.tiny else "Qwen3.5-27B drafter shape, random weights and features",
        "tok_s": tok_s, **mfus,
        "loader_stall_fraction": stall, "trainer_wait_fraction": wait,
        "resident_tok_s": resident["tok_s"] if resident else None,
        "resident_mfu": resident["mfu"] if resident else None,
        "resident_mfu_vs_spec_989": resident["mfu_vs_spec_989"] if resident else None,
        "max_loss_diff_a_vs_b": loss_diff,  # same data, anchors and init: A and B must train the same way
        "step_time_s": step_s, "resident_step_time_s": resident["step_time_s"] if resident else None,
        "peak_mem_gib": mem, "peak_reserved_gib": reserved,
        "resident_peak_mem_gib": resident["peak_mem_gib"] if resident else None,
        "steps": args.steps, "warmup_steps": args.warmup, "matmul_peak_flops": peak,
        "matmul_sustained_flops": sustained, "mfu_vs_sustained_denominator": SUSTAINED_DENOMINATOR,
        "page_cache": cold, "cache": cache_info, "run_a_wall_s": a_wall,
        "config": {**{k: v for k, v in kw.items() if k not in ("cache", "model")},
                   "taps": list(sh["taps"]), "num_target_layers": sh["target_layers"], "vocab_size": sh["vocab"],
                   "hidden_size": sh["hidden"], "seq_len": sh["seq_len"], "storage": "fp8"},
        "loss_impl": args.loss_impl,
        "loss_impl_compare": {k: v for k, v in compare.items() if k != "other_records"} if compare else None,
        "reference": REFERENCE, "trainer_records": recs,
        "resident_records": resident["records"] if resident else None,
        "loss_impl_other_records": compare["other_records"] if compare else None,
        "compile_elementwise": args.compile_elementwise,
        "compile_compare": {k: v for k, v in compile_cmp.items() if k != "other_records"} if compile_cmp else None,
        "compile_other_records": compile_cmp["other_records"] if compile_cmp else None,
        "wgrad_fusion": args.wgrad_fusion,
        "wgrad_compare": {k: v for k, v in wgrad_cmp.items() if k != "other_records"} if wgrad_cmp else None,
        "wgrad_other_records": wgrad_cmp["other_records"] if wgrad_cmp else None,
        "profile": resident["profile"] if resident else None,
    }
    res_dir = ROOT / "benchmarks" / "results"
    res_dir.mkdir(parents=True, exist_ok=True)
    (res_dir / f"train_{name}.json").write_text(json.dumps(out, indent=2) + "\n")
    say(f"wrote {res_dir / f'train_{name}.json'}")
    # the per-window records stay in the file; the last stdout line is the rest (short enough for a log tail)
    print(json.dumps({k: v for k, v in out.items()
                      if k not in ("trainer_records", "resident_records", "loss_impl_other_records")}), flush=True)


def compare_runs(runs: dict, *, base: str, fast: str, slow: str, speedup_key: str) -> dict:
    """Two resident runs of one TrainConfig field's values: their speed and memory, fast/slow tok/s, the largest
    per-window loss difference (same data and init: only float rounding may differ) and the other's records."""
    (other,) = [k for k in runs if k != base]
    other_loss = {r["step"]: r["loss"] for r in runs[other]["records"]}
    out: dict = {k: {m: r[m] for m in ("tok_s", "mfu", "mfu_vs_spec_989", "step_time_s", "peak_mem_gib")}
                 for k, r in runs.items()}
    out[speedup_key] = runs[fast]["tok_s"] / runs[slow]["tok_s"]
    out["max_loss_diff"] = max((abs(r["loss"] - other_loss[r["step"]]) for r in runs[base]["records"]
                                if r["step"] in other_loss), default=None)
    out["other_records"] = runs[other]["records"]
    return out


def variant_rows(label: str, cmp: dict, names: tuple[str, str], ratio: str) -> list[tuple]:
    """Table rows for compare_runs' result; names = (slow, fast)."""
    slow, fast = names
    rows = [(f"resident, {label}={k}", cmp[k]["tok_s"],
             f"MFU {cmp[k]['mfu']:.3f}; {cmp[k]['step_time_s']:.3f} s/step; {cmp[k]['peak_mem_gib']:.1f} GiB")
            for k in names]
    rows.append((ratio, None, f"x{cmp[fast]['tok_s'] / cmp[slow]['tok_s']:.3f} tok/s; max window loss diff "
                 f"{cmp['max_loss_diff']:.2e}"))
    return rows


def _fresh_resident(cfg, device: torch.device, warmup: int) -> dict:
    """run_resident after freeing the previous run's model and optimizer, with its own peak-memory count."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return run_resident(cfg, device, warmup=warmup)


if __name__ == "__main__":
    main()
