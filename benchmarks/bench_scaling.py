"""Multi-GPU scaling benchmark: `dflash extract` and DDP `dflash train` on 1, 2, 4, ... GPUs of one machine.

    python benchmarks/bench_scaling.py --gpus 1,2          # 2 x H200: one 10-minute device call (~8 min)
    python benchmarks/bench_scaling.py --tiny              # CPU smoke run: gloo processes, N = 1, 2 (~40 s)
    python benchmarks/bench_scaling.py --gpus 1,2 --estimate-only                 # print the time budget only

8 x H200 does not fit one call (~8 min of extraction, ~10 min of training at the defaults): split it over
calls that rewrite the same scaling_h200x8.json (--merge keeps the N entries of the earlier calls):
    python benchmarks/bench_scaling.py --gpus 1,2,4,8 --skip-train --work-dir /tmp/sx   # leaves sx/extract_8/cache
    python benchmarks/bench_scaling.py --gpus 1,2 --skip-extract --train-cache /tmp/sx/extract_8/cache \
        --work-dir /tmp/st --merge
    python benchmarks/bench_scaling.py --gpus 4,8 --skip-extract --train-cache /tmp/sx/extract_8/cache \
        --work-dir /tmp/st --merge
(without --train-cache, e.g. on a fresh machine, training uses bench_train's random fp8 cache).

Extraction at N: the 27B-shape target (DESIGN.md, random weights built on each GPU: a 54 GB checkpoint
cannot be written beside the cache) in N fresh processes, one per GPU, joined by a gloo group exactly as
`dflash extract` under torchrun (dflash.extract.launch): each process builds its model, replaces
dflash.target.load.load_target by a function returning it (as bench_extract does in-process; the library's
own spawner would not carry that patch into its children), runs a warm-up extraction (Triton autotuning,
allocator growth; not timed), then dflash.extract.driver.run_rank on the measured data into a fresh folder on
the local disk. Every N extracts the same samples (ShareGPT lengths, --tokens-per-gpu x the largest N).
Per N: tok_s (end to end incl. the final os.sync, bench_extract's definition), tok_s_steady (ExtractResult
loop_seconds, bench_extract's), and tok_s_sustained = tokens / (first batch .. the last byte synced to disk),
which is the headline: it excludes one-time setup (preflight, writer open) but counts every byte reaching
the disk, so a page cache that absorbs a short run's writes cannot hide a slow disk. Disk limit: a raw
sequential write/read of the same disk is measured first; an N is disk-limited when the loop waited on the
writer (wait_on_disk_s > 5% of the loop) or the final sync took > 10% of the sustained time.

Training at N: the 27B drafter shape and TrainConfig of bench_train (5 layers, block 16, 512 anchors,
micro-batches of 2 x 2048 tokens per GPU) from the cache extracted above (or --train-cache; --train-data
random, or --skip-extract without --train-cache: bench_train's random fp8 cache of 2048-token sequences),
in N processes started by the spawner `dflash train --gpus N` uses (dflash.train.distributed.spawn_local,
NCCL on CUDA, gloo on CPU); each process patches out checkpoint and export writes (bench_train's
patch_out_saving: ~20 GB at this shape; a patch in this process would not reach them) and calls
dflash.train.trainer.train. tok_s is the metrics.jsonl `tokens_per_s` (global: all ranks' tokens of a step
over rank 0's wall time), median over the log windows after the warm-up steps, as bench_train; the
efficiency uses tok_s_aggregate (all measured tokens / their time) because real lengths make windows differ
in cost. The page cache is dropped before each N (cold reads). With real lengths, ranks get micro-batches of different
cost and every step waits for the slowest; `expected_step_imbalance` (from the data plan alone: mean over the
measured steps of the costliest rank's block tokens over the mean rank's) says how much of the efficiency
loss that explains.

Efficiency at N = tok/s at N / (N x tok/s at 1). The result file (default scaling_<gpu>x<count>.json, e.g.
scaling_h200x2.json) is rewritten after every N; top level: extract_efficiency_<N>, train_efficiency_<N>,
extract_disk_limited_<N> for every N > 1 measured. NCCL_NVLS_ENABLE=0 and the other multicast-off variables are
set before torch is imported, so every spawned process inherits them.
"""

from __future__ import annotations

import os

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1"),
               ("DFLASH_NO_PROGRESS", "1")):
    os.environ.setdefault(_k, _v)

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_extract import build_random_model, sample_lengths, write_pretokenized  # noqa: E402
from bench_train import patch_out_saving, shapes, tail_metrics, window_summary  # noqa: E402
from common import (say_as, drop_page_cache, machine_info, make_head_only_target, make_random_fp8_cache,  # noqa: E402
                    mfu_fields, package_version)

from dflash.train.metrics import H200_PEAK_BF16  # noqa: E402

MULTICAST_ENV = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
# Rates behind the printed time estimate (H200): bench_extract/bench_train results and DESIGN.md.
EST = dict(proc_start_s=20, model_build_s=6, autotune_s=20, extract_tok_s_per_gpu=8_000, disk_write_B_s=0.75e9,
           target_folder_s=15, train_setup_s=25, train_compile_s=90, train_tok_s_per_gpu=6_300)
WAIT_LIMIT, SYNC_LIMIT = 0.05, 0.10  # disk-limited thresholds (fractions of the loop / sustained time)


say = say_as("bench_scaling")


# ------------------------------------------------------------------------------------------------ workload

def workload_lengths(total_tokens: int, *, cap: int | None, seed: int, batch_tokens: int) -> tuple[list, list]:
    """ShareGPT lengths (bench_extract.sample_lengths) totalling >= total_tokens; with `cap` (tiny runs) each
    sample is cut to cap tokens, its loss tokens with it."""
    if cap is None:
        lengths, loss, _ = sample_lengths(total_tokens, seed=seed, batch_tokens=batch_tokens)
        return lengths, loss
    lengths, loss, _ = sample_lengths(4 * total_tokens, seed=seed, batch_tokens=batch_tokens)
    out_l, out_m = [], []
    for n, m in zip(lengths, loss):
        if sum(out_l) >= total_tokens:
            break
        out_l.append(min(n, cap))
        out_m.append(max(1, min(m, cap)))
    return out_l, out_m


def rank_load_imbalance(lengths, *, batch_tokens: int, world_size: int) -> float:
    """Padded tokens of the busiest rank over the mean rank in extract's plan (1.0 = perfectly even)."""
    from dflash.data import token_budget_batches
    from dflash.extract.plan import make_plan

    plan = make_plan(sample_ids=np.arange(len(lengths)), lengths=np.asarray(lengths), committed=set(),
                     world_size=world_size, max_tokens=batch_tokens, batch_fn=token_budget_batches)
    loads = [sum(b.padded_tokens for b in bs) for bs in plan.rank_batches]
    return max(loads) / (sum(loads) / len(loads))


def train_step_imbalance(cache: pathlib.Path, *, steps: range, batch_tokens: int, world_size: int, seed: int,
                         num_anchors: int, block_size: int) -> float:
    """Mean over `steps` (of epoch 0) of the costliest rank's block tokens over the mean rank's, a step's cost
    being dominated by its block tokens (block_size x min(num_anchors, loss tokens - 1) per sample)."""
    from dflash.cache import CacheReader
    from dflash.train.loader import plan_epoch, sample_costs

    reader = CacheReader(cache, verify=False)
    idx = reader.index
    reader.close()
    plan = plan_epoch(idx.length, seed=seed, epoch=0, batch_tokens=batch_tokens, world_size=world_size,
                      grad_accum=1, costs=sample_costs(idx.length, idx.num_loss_tokens))  # the trainer's plan
    cost = block_size * np.minimum(num_anchors, np.maximum(idx.num_loss_tokens - 1, 0))
    ratios = []
    for s in steps:
        if s >= plan.num_steps:
            break
        per_rank = plan.rank_costs(s, cost)
        if sum(per_rank):
            ratios.append(max(per_rank) / (sum(per_rank) / world_size))
    return float(np.mean(ratios)) if ratios else 1.0


# ---------------------------------------------------------------------------------------------------- disk

def disk_probe(folder: pathlib.Path, *, nbytes: int) -> dict:
    """A plain sequential write (fsynced) and cold read of `nbytes` in `folder`: the floor for disk MB/s."""
    path = folder / "disk_probe.bin"
    block = np.random.default_rng(0).integers(0, 256, size=64 << 20, dtype=np.uint8).tobytes()
    os.sync()
    t = time.perf_counter()
    written = 0
    with open(path, "wb") as f:
        while written < nbytes:
            written += f.write(block[: min(len(block), nbytes - written)])
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t
    cold = drop_page_cache(path)
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass
    read_s = time.perf_counter() - t
    path.unlink()
    return {"bytes": written, "write_MB_s": written / write_s / 1e6, "read_MB_s": written / read_s / 1e6,
            "page_cache": cold}


def vm_settings() -> dict:
    """Dirty-page limits and RAM: how much of a short run's writes the page cache can absorb."""
    out = {}
    for name in ("dirty_ratio", "dirty_background_ratio", "dirty_bytes", "dirty_background_bytes"):
        try:
            out[name] = int(pathlib.Path(f"/proc/sys/vm/{name}").read_text())
        except (OSError, ValueError):
            pass
    try:
        out["mem_total_gib"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        pass
    return out


# -------------------------------------------------------------------------------------- extraction (N procs)

def _extract_child(job: dict) -> None:
    """One rank (spawn_local set the torchrun environment): build the random target on this GPU, patch
    load_target, warm up, then the measured run_rank; rank 0 writes the timings to job["result"]."""
    import torch.distributed as dist

    import dflash.target.load as target_load
    from dflash.extract.driver import ExtractConfig, run_rank, set_cpu_threads
    from dflash.extract.launch import PG_TIMEOUT

    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    set_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    dist.init_process_group("gloo", timeout=PG_TIMEOUT)  # as dflash.extract.launch under torchrun
    try:
        device = torch.device("cuda", local) if job["device"] == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        t = time.perf_counter()
        model, tokenizer = build_random_model(pathlib.Path(job["model"]), device, fla_conv=job["fla_conv"])
        build_s = time.perf_counter() - t
        target_load.load_target = lambda *a, **k: (model, tokenizer)  # noqa: E731 - see module docstring

        def cfg(data: str, out: str) -> ExtractConfig:
            return ExtractConfig(model=job["model"], data=(data,), output=out, storage=job["storage"],
                                 max_length=job["max_length"], batch_tokens=job["batch_tokens"],
                                 device=job["device"], show_progress=False)

        quiet = lambda *_: None  # noqa: E731
        t = time.perf_counter()
        run_rank(cfg(job["warm_data"], job["warm_out"]), rank=rank, world_size=world, local_rank=local, echo=quiet)
        warm_s = time.perf_counter() - t
        dist.barrier()
        if rank == 0:
            shutil.rmtree(job["warm_out"])
            os.sync()  # start from a clean disk, as bench_extract
        slowest = torch.tensor([build_s, warm_s], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        dist.barrier()
        echo = (lambda m: say(f"N={world} rank 0: {m}")) if rank == 0 else quiet
        t0 = time.perf_counter()
        res = run_rank(cfg(job["data"], job["out"]), rank=rank, world_size=world, local_rank=local, echo=echo)
        t_done = time.perf_counter()
        if rank == 0:
            os.sync()  # every byte of every rank on the disk: part of the measured time
            t_end = time.perf_counter()
            on_disk = sum(f.stat().st_size for f in pathlib.Path(job["out"]).rglob("*") if f.is_file())
            pathlib.Path(job["result"]).write_text(json.dumps({
                "tokens": res.num_tokens, "samples": res.num_samples, "padded_tokens": res.num_padded_tokens,
                "seconds": t_end - t0, "run_rank_seconds": t_done - t0, "sync_seconds": t_end - t_done,
                "loop_seconds": res.loop_seconds, "setup_seconds": res.setup_seconds,
                "drain_seconds": res.drain_seconds, "sustained_seconds": t_end - t0 - res.setup_seconds,
                "wait_on_disk_s": res.wait_s, "bytes_written": res.bytes_written, "bytes_on_disk": on_disk,
                "model_build_s": float(slowest[0]), "warmup_s": float(slowest[1]),
                "kernels": str(getattr(model, "dflash_kernels", ""))}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_extract(n: int, *, work: pathlib.Path, job: dict, probe: dict | None) -> dict:
    from dflash.train.distributed import spawn_local

    d = work / f"extract_{n}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    job = {**job, "out": str(d / "cache"), "warm_out": str(d / "warm_cache"), "result": str(d / "result.json"),
           "warm_data": str(work / f"warm_{n}.jsonl")}
    t = time.perf_counter()
    spawn_local(_extract_child, n, (job,))
    r = json.loads((d / "result.json").read_text())
    tok = r["tokens"]
    r.update(gpus=n, wall_s=time.perf_counter() - t, tok_s=tok / r["seconds"],
             tok_s_steady=tok / r["loop_seconds"] if r["loop_seconds"] else None,
             tok_s_sustained=tok / r["sustained_seconds"], bytes_per_token=r["bytes_on_disk"] / tok,
             disk_write_MB_s=r["bytes_on_disk"] / r["sustained_seconds"] / 1e6,
             wait_fraction=r["wait_on_disk_s"] / r["loop_seconds"] if r["loop_seconds"] else 0.0,
             sync_fraction=r["sync_seconds"] / r["sustained_seconds"])
    r["disk_write_vs_raw"] = r["disk_write_MB_s"] / probe["write_MB_s"] if probe else None
    why = []
    if r["wait_fraction"] > WAIT_LIMIT:
        why.append(f"the loop waited on the writer {r['wait_fraction']:.0%} of its time")
    if r["sync_fraction"] > SYNC_LIMIT:
        why.append(f"the final sync took {r['sync_fraction']:.0%} of the sustained time")
    r["disk_limited"] = bool(why)
    r["disk_limited_why"] = "; ".join(why) or (f"no: waited {r['wait_fraction']:.1%} of the loop, final sync "
                                               f"{r['sync_fraction']:.1%}")
    return r


# ---------------------------------------------------------------------------------------- training (N procs)

def _train_child(cfg_json: dict, device: str) -> None:
    """One DDP rank: what `dflash train --gpus N` runs per process, with checkpoint/export writes patched out."""
    from dflash.extract.driver import set_cpu_threads
    from dflash.train.config import config_from_dict
    from dflash.train.trainer import train

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if os.environ.get("RANK", "0") != "0":
        logging.getLogger().setLevel(logging.WARNING)
    if device == "cpu":
        set_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    patch_out_saving()
    cfg = config_from_dict(cfg_json)
    res = train(cfg, resume=False, device=device)
    if res.global_step != cfg.steps:
        raise RuntimeError(f"the trainer stopped at step {res.global_step}, expected {cfg.steps}")


def run_train(n: int, *, work: pathlib.Path, kw: dict, device: str, warmup: int) -> dict:
    from dflash.train.config import TrainConfig
    from dflash.train.distributed import spawn_local
    from dflash.train.metrics import read_metrics

    run_dir = work / f"train_{n}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = TrainConfig(output=str(run_dir), **kw)
    cold = drop_page_cache(kw["cache"])
    stop = threading.Event()
    tail = threading.Thread(target=tail_metrics, args=(run_dir / "metrics.jsonl", stop, f"N={n}"), daemon=True)
    tail.start()
    t = time.perf_counter()
    try:
        spawn_local(_train_child, n, (cfg.to_json(), device))
    finally:
        stop.set()
        tail.join()
    wall = time.perf_counter() - t
    recs = read_metrics(run_dir)
    # Whole-window throughput (tok_s_aggregate: sum of tokens / sum of time): with real lengths the windows
    # differ in cost, so this, not the median, is the efficiency basis (bench_train.window_summary).
    w = window_summary(recs, warmup=warmup)
    mfu = mfu_fields(w["mfu"], peak=H200_PEAK_BF16) if w["mfu"] is not None else {}
    return {"gpus": n, "tok_s": w["tok_s"], "tok_s_aggregate": w["tok_s_aggregate"],
            "tok_s_per_gpu": w["tok_s_aggregate"] / n, "slow_windows_left_out": w["slow_windows_left_out"],
            "mfu_per_gpu": w["mfu"], "mfu_per_gpu_vs_spec_989": mfu.get("mfu_vs_spec_989"),
            "stall_frac": w["stall_frac"], "step_time_s": w["step_time_s"],
            "peak_mem_gib": w["peak_mem_gib"], "measured_windows": w["measured_windows"],
            "first_window_s": recs[0]["step_time_s"] * (recs[0]["step"] - recs[0]["first_step"] + 1),
            "wall_s": wall, "page_cache": cold,
            "windows": [{k: r[k] for k in ("step", "first_step", "epoch", "tokens_per_s", "step_time_s", "stall_frac")}
                        for r in recs]}


# ------------------------------------------------------------------------------------------------- results

def add_efficiencies(out: dict) -> None:
    """Efficiency at N vs N x (tok/s at 1) for every N > 1 with both measured; top-level keys and per N."""
    for section, key in (("extract", "tok_s_sustained"), ("train", "tok_s_aggregate")):
        runs = out.get(section, {})
        one = runs.get("1")
        for n_str, r in runs.items():
            n = int(n_str)
            if one is None or "error" in r or "error" in one:
                continue
            r["efficiency"] = r[key] / (n * one[key])
            if section == "extract":
                r["efficiency_e2e"] = r["tok_s"] / (n * one["tok_s"])
                r["efficiency_steady"] = (r["tok_s_steady"] / (n * one["tok_s_steady"])
                                          if r["tok_s_steady"] and one["tok_s_steady"] else None)
            else:
                r["efficiency_median"] = r["tok_s"] / (n * one["tok_s"])
            if n > 1:
                out[f"{section}_efficiency_{n}"] = r["efficiency"]
                if section == "extract":
                    out[f"extract_disk_limited_{n}"] = r["disk_limited"]


def write_json(path: pathlib.Path, out: dict) -> None:
    add_efficiencies(out)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(out, indent=2) + "\n")
    os.replace(tmp, path)


def default_result_name(device: torch.device, tiny: bool) -> str:
    if tiny or device.type != "cuda":
        return "tiny_cpu" if tiny else "cpu"
    name = torch.cuda.get_device_name(0)
    tag = "h200" if "H200" in name else re.sub(r"[^a-z0-9]", "", name.lower().replace("nvidia", ""))
    return f"{tag}x{torch.cuda.device_count()}"


def estimate_s(args, counts: list[int], total_tokens: int, bytes_per_token: float, train_tokens_per_step: int) -> dict:
    e = EST
    est = {"setup": e["target_folder_s"] + (args.disk_probe_mb * 1e6 / e["disk_write_B_s"] * 1.5)}
    warm = args.warmup_tokens_per_gpu / e["extract_tok_s_per_gpu"]
    for n in ([] if args.skip_extract else counts):
        compute = total_tokens / (n * e["extract_tok_s_per_gpu"])
        est[f"extract_{n}"] = (e["proc_start_s"] + e["model_build_s"] + e["autotune_s"] + warm
                               + max(compute, total_tokens * bytes_per_token / e["disk_write_B_s"]))
    steps = args.train_warmup + args.train_steps
    if not args.skip_train and args.train_data == "random" and not args.train_cache:  # make_random_fp8_cache
        est["random_cache"] = steps * max(counts) * train_tokens_per_step * bytes_per_token / 0.45e9
    for n in ([] if args.skip_train else counts):
        est[f"train_{n}"] = (e["proc_start_s"] + e["train_setup_s"] + e["train_compile_s"]
                             + steps * train_tokens_per_step / e["train_tok_s_per_gpu"])
    est["total"] = sum(est.values())
    return {k: round(v) for k, v in est.items()}


# ---------------------------------------------------------------------------------------------------- main

def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", default=None, help="comma-separated process counts (default: 1, 2, 4, ... up to the "
                   "visible GPUs; --tiny: 1,2)")
    p.add_argument("--tokens-per-gpu", type=int, default=None,
                   help="extraction tokens per GPU at the largest N (every N extracts this x max N; default 120000, "
                   "--tiny 3000)")
    p.add_argument("--warmup-tokens-per-gpu", type=int, default=None, help="warm-up extraction per process "
                   "(default: --batch-tokens, so every rank warms up on at least one full batch)")
    p.add_argument("--storage", choices=("bf16", "fp8"), default="fp8", help="cache storage dtype")
    p.add_argument("--batch-tokens", type=int, default=None, help="extract token budget per forward (default "
                   "32768 as bench_extract, --tiny 1024)")
    p.add_argument("--no-fla-conv", action="store_true", help="torch causal conv1d instead of FLA's (CUDA)")
    p.add_argument("--train-steps", type=int, default=None, help="measured training steps (default 12, --tiny 2)")
    p.add_argument("--train-warmup", type=int, default=None, help="warm-up steps, excluded (default 6, --tiny 2)")
    p.add_argument("--log-every", type=int, default=None, help="trainer log window (default 2, --tiny 1)")
    p.add_argument("--train-data", choices=("extracted", "random"), default="extracted",
                   help="train from the extracted cache, or bench_train's random fp8 cache of 2048-token sequences")
    p.add_argument("--skip-extract", action="store_true",
                   help="no extraction: training uses --train-cache, else --train-data random")
    p.add_argument("--train-cache", default=None, help="with --skip-extract: train from this cache (e.g. the one an "
                   "earlier --skip-train run left in WORK/extract_<N>/cache; use another --work-dir, it is wiped)")
    p.add_argument("--skip-train", action="store_true", help="no training")
    p.add_argument("--disk-probe-mb", type=int, default=None, help="raw disk write/read probe size (0 = skip; "
                   "default 2048, --tiny 16)")
    p.add_argument("--work-dir", default="/tmp/dflash_bench_scaling", help="local-disk folder (wiped first)")
    p.add_argument("--tiny", action="store_true", help="tiny target and drafter, gloo CPU processes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-dir", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--result-name", default=None, help="file scaling_<name>.json (default: <gpu>x<count>, "
                   "e.g. h200x2; tiny_cpu with --tiny)")
    p.add_argument("--estimate-only", action="store_true", help="print the time estimate and stop")
    p.add_argument("--merge", action="store_true", help="keep the N entries of an existing result file that this "
                   "run does not measure (split a run over several device calls)")
    args = p.parse_args()
    tiny = args.tiny
    for name, gpu, cpu in (("tokens_per_gpu", 120_000, 3000), ("batch_tokens", 32768, 1024),
                           ("train_steps", 12, 2), ("train_warmup", 6, 2), ("log_every", 2, 1),
                           ("disk_probe_mb", 2048, 16)):
        if getattr(args, name) is None:
            setattr(args, name, cpu if tiny else gpu)
    if args.warmup_tokens_per_gpu is None:
        args.warmup_tokens_per_gpu = args.batch_tokens
    if args.train_warmup % args.log_every or args.train_steps % args.log_every:
        p.error("--train-warmup and --train-steps must be multiples of --log-every (medians over whole windows)")
    if args.train_cache and not args.skip_extract:
        p.error("--train-cache needs --skip-extract")
    if args.skip_extract and not args.train_cache:
        args.train_data = "random"
    return args


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What this run measures, resolved from the arguments."""

    counts: list[int]
    """Process (GPU) counts, in order."""
    device: torch.device
    sh: dict
    """bench_train.shapes(): target and drafter shapes."""
    work: pathlib.Path
    total_tokens: int
    """Extraction tokens at every N: --tokens-per-gpu x max N."""
    cap: int | None
    """Tiny runs: samples cut to the tiny drafter's sequence length."""
    max_length: int
    train_batch_tokens: int
    """Micro-batch budget per GPU: 2 sequences of the drafter shape's length, as bench_train."""


def measure_n(out: dict, errors: list[str], section: str, n: int, fn) -> dict | None:
    """out[section][N] = fn(); a failure is recorded there and in `errors` (and None returned), so what the
    other N measured is kept and the run goes on."""
    try:
        r = fn()
    except Exception as e:  # noqa: BLE001 - reported in the JSON and by the exit code
        errors.append(f"{section} N={n}: {e!r}")
        out[section][str(n)] = {"gpus": n, "error": repr(e)}
        say(f"{section} N={n} FAILED: {e!r}")
        return None
    out[section][str(n)] = r
    return r


def extract_stage(args, plan: Plan, out: dict, save, errors: list[str]) -> pathlib.Path | None:
    """Extraction at every N; returns the last N's cache when training (or a later run) should use it."""
    work, sh, cuda = plan.work, plan.sh, plan.device.type == "cuda"
    lengths, loss = workload_lengths(plan.total_tokens, cap=plan.cap, seed=args.seed, batch_tokens=args.batch_tokens)
    write_pretokenized(work / "data.jsonl", lengths, loss, vocab=sh["vocab"], seed=args.seed)
    for n in plan.counts:
        wl, wm = workload_lengths(args.warmup_tokens_per_gpu * n, cap=plan.cap, seed=args.seed + 1,
                                  batch_tokens=args.batch_tokens)
        write_pretokenized(work / f"warm_{n}.jsonl", wl, wm, vocab=sh["vocab"], seed=args.seed + 1)
    job = {"model": str(work / "target"), "data": str(work / "data.jsonl"), "storage": args.storage,
           "max_length": plan.max_length, "batch_tokens": args.batch_tokens, "device": plan.device.type,
           "fla_conv": cuda and not args.no_fla_conv}
    out["extract_config"] = {"samples": len(lengths), "tokens": int(sum(lengths)),
                             "warmup_tokens_per_gpu": args.warmup_tokens_per_gpu,
                             **{k: job[k] for k in ("storage", "max_length", "batch_tokens", "fla_conv")}}
    keep = None
    for i, n in enumerate(plan.counts):
        say(f"extract N={n}: {len(lengths)} samples, {sum(lengths):,} tokens")

        def measure():
            r = run_extract(n, work=work, job=job, probe=out.get("disk_probe"))
            r["rank_load_max_over_mean"] = rank_load_imbalance(lengths, batch_tokens=args.batch_tokens, world_size=n)
            return r

        r = measure_n(out, errors, "extract", n, measure)
        if r is not None:
            say(f"extract N={n}: {r['tok_s_sustained']:,.0f} tok/s sustained ({r['tok_s']:,.0f} end to end, "
                f"{r['tok_s_steady'] or 0:,.0f} steady), {r['disk_write_MB_s']:,.0f} MB/s to disk, waited "
                f"{r['wait_on_disk_s']:.1f} s on disk, sync {r['sync_seconds']:.1f} s; disk limited: "
                f"{r['disk_limited_why']}; wall {r['wall_s']:.0f} s")
            cache = work / f"extract_{n}" / "cache"
            if i + 1 < len(plan.counts) or (not args.skip_train and args.train_data == "random"):
                shutil.rmtree(cache)  # the disk holds one cache at a time
            else:
                keep = cache
                say(f"kept {cache}" + (" for a later --skip-extract --train-cache run" if args.skip_train
                                       else " for training"))
        save()
    return keep


def train_stage(args, plan: Plan, out: dict, save, errors: list[str], cache: pathlib.Path | None) -> None:
    """DDP training at every N from `cache` (None: bench_train's random fp8 cache, built here)."""
    work, sh = plan.work, plan.sh
    steps = args.train_warmup + args.train_steps
    if cache is None:
        num_samples = max(1, plan.train_batch_tokens // sh["seq_len"]) * steps * max(plan.counts)
        cache = work / "random_cache"
        info = make_random_fp8_cache(cache, work / "target", sh, num_samples=num_samples, seed=args.seed,
                                     device=plan.device)
        if plan.device.type == "cuda":
            torch.cuda.empty_cache()
        say(f"random fp8 training cache: {num_samples} x {sh['seq_len']} tokens, {info['bytes'] / 1e9:.2f} GB")
    kw = dict(cache=str(cache), model=str(work / "target"), num_layers=sh["layers"], num_attention_heads=sh["heads"],
              num_key_value_heads=sh["kv_heads"], head_dim=sh["head_dim"], intermediate_size=sh["intermediate"],
              block_size=16, rope_theta=1e7, mask_token_id=sh["mask_token_id"], num_anchors=sh["anchors"],
              steps=steps, batch_tokens=plan.train_batch_tokens, log_every=args.log_every, save_every=10**9,
              seed=args.seed)  # bench_train's TrainConfig
    from dflash.cache import CacheReader

    with CacheReader(cache, verify=False) as reader:
        cache_tokens = int(reader.index.length.sum())
    on_disk = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
    out["train_config"] = {**{k: v for k, v in kw.items() if k != "model"}, "data": args.train_data,
                           "warmup_steps": args.train_warmup, "measured_steps": args.train_steps,
                           "cache_tokens": cache_tokens, "cache_bytes": on_disk}
    for n in plan.counts:
        say(f"train N={n}: {steps} steps ({args.train_warmup} warm-up)")

        def measure():
            r = run_train(n, work=work, kw=kw, device=plan.device.type, warmup=args.train_warmup)
            r["expected_step_imbalance"] = train_step_imbalance(
                cache, steps=range(args.train_warmup, steps), batch_tokens=plan.train_batch_tokens, world_size=n,
                seed=args.seed, num_anchors=sh["anchors"], block_size=16)
            r["cache_read_MB_s"] = r["tok_s_aggregate"] * on_disk / cache_tokens / 1e6
            return r

        r = measure_n(out, errors, "train", n, measure)
        if r is not None:
            say(f"train N={n}: {r['tok_s_aggregate']:,.0f} tok/s ({r['tok_s_per_gpu']:,.0f} per GPU; median window "
                f"{r['tok_s']:,.0f}), stall {r['stall_frac']:.3f}, {r['cache_read_MB_s']:,.0f} MB/s from the cache, "
                f"expected step imbalance {r['expected_step_imbalance']:.3f}, wall {r['wall_s']:.0f} s")
        save()


def print_table(out: dict) -> None:
    print(f"\n{'what':28s} {'tok/s':>10s} {'per GPU':>9s} {'eff.':>6s}  notes", flush=True)
    for section in ("extract", "train"):
        for n_str, r in sorted(out[section].items(), key=lambda kv: int(kv[0])):
            if "error" in r:
                print(f"{section + ' N=' + n_str:28s} {'FAILED':>10s}  {r['error']}", flush=True)
                continue
            rate = r["tok_s_sustained"] if section == "extract" else r["tok_s_aggregate"]
            eff = r.get("efficiency")
            note = (f"{r['disk_write_MB_s']:,.0f} MB/s disk, disk limited: {r['disk_limited']}"
                    if section == "extract" else f"stall {r['stall_frac']:.3f}, {r['peak_mem_gib']:.1f} GiB, "
                    f"step imbalance {r['expected_step_imbalance']:.2f}")
            print(f"{section + ' N=' + n_str:28s} {rate:10,.0f} {rate / int(n_str):9,.0f} "
                  f"{'' if eff is None else f'{eff:6.3f}':>6s}  {note}", flush=True)


DEFINITIONS = {
    "efficiency": "tok/s at N / (N x tok/s at 1); extract uses tok_s_sustained, train tok_s_aggregate",
    "extract.tok_s": "tokens / (run_rank start .. os.sync done), as bench_extract",
    "extract.tok_s_steady": "tokens / loop_seconds (first batch .. last append, slowest rank), as bench_extract",
    "extract.tok_s_sustained": "tokens / (first batch of rank 0 .. os.sync done): no setup, all bytes on disk",
    "extract.disk_limited": f"wait_on_disk_s > {WAIT_LIMIT} x loop_seconds or final sync > {SYNC_LIMIT} x "
                            "sustained seconds",
    "train.tok_s": "median over measured log windows of metrics.jsonl tokens_per_s (global: every rank's tokens "
                   "of a step / rank 0's wall time), as bench_train",
    "train.tok_s_aggregate": "sum of tokens / sum of time over the measured windows, leaving out windows over 2x "
                             "the median step time (recompiles)",
    "train.mfu_per_gpu": "rank 0's FLOPs / time / peak (nominal 790 TFLOP/s on CUDA)",
    "train.mfu_per_gpu_vs_spec_989": "the same FLOPs / time over the H200 dense bf16 spec 989 TFLOP/s",
    "train.expected_step_imbalance": "from the data plan: mean over measured steps of max rank / mean rank block "
                                     "tokens (1.0 = even; efficiency ceiling ~ 1 / this)",
}


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    visible = torch.cuda.device_count() if cuda else 2
    counts = ([int(x) for x in args.gpus.split(",")] if args.gpus
              else [n for n in (1, 2, 4, 8, 16, 32) if n <= visible])
    if cuda and max(counts) > visible:
        raise SystemExit(f"--gpus {args.gpus}: only {visible} CUDA devices are visible")
    sh = shapes(args.tiny)
    plan = Plan(counts=counts, device=device, sh=sh, work=pathlib.Path(args.work_dir),
                total_tokens=args.tokens_per_gpu * max(counts), cap=sh["seq_len"] if args.tiny else None,
                max_length=sh["seq_len"] if args.tiny else 4096, train_batch_tokens=2 * sh["seq_len"])
    name = args.result_name or default_result_name(device, args.tiny)
    res_path = pathlib.Path(args.result_dir) / f"scaling_{name}.json"
    bytes_per_token = len(sh["taps"]) * sh["hidden"] * (1 if args.storage == "fp8" else 2)
    est = None if args.tiny else estimate_s(args, counts, plan.total_tokens, bytes_per_token, plan.train_batch_tokens)
    say(f"{device}, {'tiny' if args.tiny else '27B'} shapes, N = {counts}, {plan.total_tokens:,} extraction tokens "
        f"per N, {args.train_warmup}+{args.train_steps} training steps of {plan.train_batch_tokens} tokens per GPU "
        f"-> {res_path}")
    if est:
        say(f"time estimate (H200 rates in EST): ~{est['total']} s: {est}")
    if args.estimate_only:
        return
    res_path.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(plan.work, ignore_errors=True)
    plan.work.mkdir(parents=True)

    prev = json.loads(res_path.read_text()) if args.merge and res_path.exists() else {}
    out = {"benchmark": "scaling", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "command": " ".join(["python"] + sys.argv),
           "previous_commands": prev.get("previous_commands", []) + ([prev["command"]] if prev else []),
           "machine": {**machine_info(device), "vm": vm_settings()},
           "env": {k: os.environ.get(k) for k in MULTICAST_ENV},
           "versions": {"python": platform.python_version(), "torch": torch.__version__,
                        "transformers": __import__("transformers").__version__, "fla": package_version("fla-core"),
                        "zarr": package_version("zarr")},
           "model": ("tiny Qwen3.5 target and drafter" if args.tiny
                     else "Qwen3.5-27B target and drafter shapes, random weights"),
           "gpus": sorted(set(prev.get("gpus", [])) | set(counts)), "estimate_s": est, "definitions": DEFINITIONS,
           "extract": prev.get("extract", {}), "train": prev.get("train", {}),
           **{k: prev[k] for k in ("disk_probe", "extract_config", "train_config") if k in prev}}

    def save() -> None:
        write_json(res_path, out)

    save()
    errors: list[str] = []
    t = time.perf_counter()
    make_head_only_target(plan.work / "target", hidden=sh["hidden"], vocab=sh["vocab"],
                          target_layers=sh["target_layers"], device=device)
    if cuda:
        torch.cuda.empty_cache()
    say(f"target folder (config, tokenizer, embedding + head) in {time.perf_counter() - t:.1f} s")
    if args.disk_probe_mb:
        probe = out["disk_probe"] = disk_probe(plan.work, nbytes=args.disk_probe_mb << 20)
        say(f"raw disk: write {probe['write_MB_s']:,.0f} MB/s (fsynced), read {probe['read_MB_s']:,.0f} MB/s "
            f"({probe['page_cache']})")
    cache = None if args.skip_extract else extract_stage(args, plan, out, save, errors)
    if not args.skip_train:
        train_stage(args, plan, out, save, errors, pathlib.Path(args.train_cache) if args.train_cache else cache)
    print_table(out)
    say(f"wrote {res_path}")
    print(json.dumps({k: v for k, v in out.items() if k not in ("extract", "train", "definitions")}), flush=True)
    if errors:
        raise SystemExit("failed: " + "; ".join(errors))


if __name__ == "__main__":
    main()
