"""Extraction benchmark: `dflash extract` against its floors, in one run (GPU machine).

    python benchmarks/bench_extract.py --tokens 400000 --storage bf16,fp8      # H200, 27B shape
    python benchmarks/bench_extract.py --tiny --tokens 4000                    # CPU smoke run

Measures on the same samples (lengths drawn from real ShareGPT token lengths, benchmarks/assets):
  (a) full `dflash extract` (dflash.extract.driver.run_rank: plan, tapped forward, GPU packing/fp8, async
      D2H, writer thread, atomic shard commits to the local disk) in tokens/s, per storage dtype. `tok_s` counts
      from the first batch to the end of the run (the last shard committed and fsynced, os.sync done): the rate
      a run sustains. The one-time setup before the first batch (tokenizing, which a rerun loads from the
      cache folder; loading the target, minutes for a real 27B checkpoint and ~0 here) is reported apart as
      `setup_seconds`, and `tok_s_end_to_end` includes it;
  (b) a forward-only pass over exactly the same batches (TappedForward, nothing packed or written);
  (c) the FLOP floor: the forward's FLOPs (layers 0..deepest tap) over a bf16 matmul peak measured here
      (`floor_tok_s`; `mfu` is tok_s over it), and over the H200 dense bf16 spec of 989 TFLOP/s
      (`floor_tok_s_at_spec_989`; `mfu_vs_spec_989`);
  (a') on CUDA, the GPU time of the forwards inside each extraction and inside (b) (`forward_timeline`), so a
      gap to forward-only splits into slower forwards and time between them;
  (d) the peers' way (peer_style): full-depth HF forward with output_hidden_states=True on padded batches
      (attention mask, dataset order, fixed batch size) and one torch.save file per sample written by a pool of
      saver threads with a bounded queue (SpecForge's ThreadPoolExecutor + --io-queue-size; ModelOpt/EAGLE
      also save one file per sample), over >= 100K tokens, after an untimed pass of the same forwards (warm
      kernels and allocator, as (a) and (b) get). `ratio_vs_peer_style` is reported only for a run of at least
      PEER_MIN_TOKENS tokens: the 2026-12-01 figure (38x) timed ~7 cold samples, mostly first-call compiles.
--compile-elementwise (ExtractConfig.compile_elementwise, default auto = on CUDA, as `dflash extract`) runs
dflash.target.fused's compiled Qwen3.5 norm/gate chains in the extractions and the forward-only floor (the
same setting on both sides of ratio_vs_forward_only). --compare-compile times the forward-only pass once more
with the setting flipped (a compiled flip first makes an untimed compiling pass), in the same run:
compile_compare.speedup is compiled over eager. The peer-style run is eager, as the peers' HF path is.
--compile-layers (ExtractConfig.compile_layers, default off) runs each decoder layer whole under torch.compile in
place of the compiled chains; --compare-compile-layers times the forward-only pass once more with it flipped
(compile_layers_compare.speedup: layers compiled whole over the chains compiled; an FLA kernel that dynamo
cannot trace is recorded as the compare's error). --storage none skips the extractions, so a compare alone fits
one call: --storage none --tokens 300000 --peer-tokens 0 --compare-compile-layers --result-name h200_compile_layers.
--profile runs the forward-only pass once more under torch.profiler (`forward_profile`: GPU ms a batch by kernel
kind, the top kernels, the eager ops; benchmarks/kernel_profile.py), to split the forward's gap to the matmul peak.

The 27B-shape target has random weights built directly on the GPU: a 54 GB checkpoint cannot be written to
the 64 GB disk beside the cache, so `load_target` is replaced by a function returning that model (with the
same kernel selection the real loader applies) after `--load-seconds` (default 5 s on CUDA): a real load takes
minutes, and the pinned-buffer pool fills in the background meanwhile (dflash.extract.pinned); an instant
load would instead pin ~5-10 GB while the first batches run, which no real run does. That time is setup, so it
is in `tok_s_end_to_end` and not in `tok_s`. Everything else is the real extraction path.

Warm-up, untimed: one small extraction (Triton compiles, allocator growth, writer path), then a forward-only
pass over the measured batches. FLA compiles and autotunes some kernels per batch size (the cumsum kernels take
B as a compile-time constant); a real run meets each of its batch sizes once (17 distinct in the 291-batch
plan of the 8.7M-token ShareGPT length asset, dflash.data.batching) and amortizes that, while this slice would
charge all of it to whichever storage dtype ran first (bf16 measured 0.74 of forward-only cold vs fp8 0.94 right
after it, 2026-11-30).
Writes benchmarks/results/extract_<name>.json; the last stdout line is that JSON. The file is written first right
after the extractions and the forward-only pass ("complete": false), then again at the end: a call cut in the
compares (a first compile of 64 layers per batch size can take minutes) still brings the extraction figures back.
"""

from __future__ import annotations

import argparse
import json
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

from common import (H200_SPEC_BF16, QWEN35_27B, SUSTAINED_DENOMINATOR, error_line, machine_info,  # noqa: E402
                    matmul_peak, matmul_sustained, mfu_fields, mfu_vs_sustained, package_version, sync)
from kernel_profile import kernel_summary  # noqa: E402


def sample_lengths(total_tokens: int, *, seed: int, batch_tokens: int,
                   dataset_samples: int = 17_600) -> tuple[list[int], list[int], float]:
    """A representative slice of a real-size run: draw a ShareGPT-size dataset of real token lengths, plan
    it into token-budget batches exactly as `dflash extract` does, and keep randomly chosen whole batches
    until `total_tokens`. Re-planning the slice reproduces those batches, so the measured padding is the
    padding a full run has (a small random sample would have sparse lengths and pad ~10%).
    Returns lengths, loss-token counts, and the padding fraction of the full dataset's plan."""
    from dflash.data.batching import padding_fraction
    from dflash.extract.plan import extraction_batches

    asset = json.loads((ROOT / "benchmarks" / "assets" / "sharegpt_lengths.json").read_text())
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(asset["lengths"]), size=dataset_samples)
    all_len = np.asarray(asset["lengths"])[pick]
    all_loss = np.asarray(asset["loss_tokens"])[pick]
    batches = extraction_batches(all_len, max_tokens=batch_tokens)
    full_padding = padding_fraction(all_len, batches)
    lengths, loss = [], []
    for b in rng.permutation(len(batches)):
        if sum(lengths) >= total_tokens:
            break
        lengths += [int(all_len[i]) for i in batches[b]]
        loss += [max(1, int(all_loss[i])) for i in batches[b]]
    return lengths, loss, full_padding


def write_pretokenized(path: pathlib.Path, lengths, loss, *, vocab: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for n, m in zip(lengths, loss):
            ids = rng.integers(0, vocab, size=n).tolist()
            mask = [0] * (n - min(m, n)) + [1] * min(m, n)
            f.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")


def make_model_dir(path: pathlib.Path, text_kwargs: dict) -> None:
    from transformers import Qwen3_5TextConfig

    from dflash.target.testing import tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    cfg = Qwen3_5TextConfig(**text_kwargs)
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    cfg.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)


def build_random_model(model_dir: pathlib.Path, device: torch.device, *, fla_conv: bool):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from dflash.target.kernels import select_kernels

    config = AutoConfig.from_pretrained(model_dir)
    config._attn_implementation = "sdpa"
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    finally:
        torch.set_default_dtype(prev)
    model = model.to(torch.bfloat16).eval().requires_grad_(False)
    model.dflash_kernels = select_kernels(model, device, fla_conv=fla_conv)
    return model, AutoTokenizer.from_pretrained(model_dir)


class ForwardTimeline:
    """CUDA events around every TappedForward call (patched on the class, as the driver builds its own): the
    GPU time of the forwards of a run, against the run's loop time. What remains is the GPU time of packing and
    encoding plus the time the GPU idled between forwards; a forward slower than in the forward-only pass was
    slowed by what ran beside it (copies, pinning)."""

    def __init__(self, device: torch.device) -> None:
        from dflash.target.forward import TappedForward

        self.cuda = device.type == "cuda"
        self.events: list = []
        if not self.cuda:
            return
        orig, events = TappedForward.__call__, self.events

        def timed(tapped, *a, **k):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = orig(tapped, *a, **k)
            end.record()
            events.append((start, end))
            return out

        TappedForward.__call__ = timed

    def take(self) -> dict | None:
        """Forward GPU seconds and first-start..last-end GPU seconds since the last take (None on CPU)."""
        events = list(self.events)
        self.events.clear()  # in place: the patched __call__ appends to this list
        if not events:
            return None
        torch.cuda.synchronize()
        forward_s = sum(a.elapsed_time(b) for a, b in events) / 1e3
        span_s = events[0][0].elapsed_time(events[-1][1]) / 1e3
        return {"forwards": len(events), "forward_gpu_s": forward_s, "first_to_last_forward_s": span_s,
                "between_forwards_s": span_s - forward_s}


def planned_inputs(cfg, model):
    """The TappedForward of cfg's taps and the input ids of every batch of cfg's plan (rank 0 of 1), with their
    real and padded token counts and distinct batch sizes: what forward_only and profile_forward run."""
    from dflash.extract.preflight import build_preflight
    from dflash.target.forward import TappedForward

    pre = build_preflight(cfg, world_size=1)
    tapped = TappedForward(model, pre.fingerprint.tap_layer_ids)
    batches = pre.plan.rank_batches[0]
    inputs = []
    for b in batches:
        ids = np.zeros((len(b.members), b.padded_len), dtype=np.int64)
        for j, i in enumerate(b.members):
            s = pre.samples[i]
            ids[j, : len(s.input_ids)] = s.input_ids
        inputs.append(torch.from_numpy(ids))
    real = sum(len(pre.samples[i].input_ids) for b in batches for i in b.members)
    padded = sum(b.padded_tokens for b in batches)
    return tapped, inputs, real, padded, len({len(b.members) for b in batches})


def forward_only(cfg, model, device, *, progress: bool = False) -> tuple[float, int, int, int]:
    """Seconds, real tokens, padded tokens and distinct batch sizes of the same planned batches, forward only.
    progress: a line per batch with the time so far (a compiling pass: a call cut inside it shows how far it got)."""
    tapped, inputs, real, padded, batch_sizes = planned_inputs(cfg, model)
    sync(device)
    t = time.perf_counter()
    for i, x in enumerate(inputs):
        out = tapped(x.to(device, non_blocking=True))
        del out
        if progress:
            sync(device)
            print(f"  batch {i + 1}/{len(inputs)} {tuple(x.shape)}: {time.perf_counter() - t:.1f} s", flush=True)
    sync(device)
    return time.perf_counter() - t, real, padded, batch_sizes


def profile_forward(cfg, model, device) -> dict:
    """The forward-only pass once more under torch.profiler (CUDA): where a batch's time goes by kernel kind
    (kernel_profile.kernel_summary, per batch), so the gap between the forward's MFU and the matmul peak is
    split into kernels (FLA's linear attention, SDPA, norms and gates, copies)."""
    tapped, inputs, real, _, _ = planned_inputs(cfg, model)
    sync(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
                                record_shapes=True) as prof:
        t = time.perf_counter()
        for x in inputs:
            out = tapped(x.to(device, non_blocking=True))
            del out
        sync(device)
        wall = time.perf_counter() - t
    summary = kernel_summary(prof, steps=len(inputs), wall_s=wall)
    return {"batches": len(inputs), "real_tokens": real, "wall_s": wall} | summary


def compare_compile_layers(model, layers, layers_on: bool, chains_on: bool, real: int, fo_s: float,
                           timed_pass) -> dict:
    """The forward-only pass once more with ExtractConfig.compile_layers flipped (dflash.compiled.target_compiles:
    compiled layers replace the compiled norm/gate chains). A flip to compiled layers first makes an untimed pass
    (it compiles); a compile that fails is returned as {"error": ...}. Leaves the model flipped: the caller
    restores it (main: eager, for the peer-style run)."""
    from dflash.target.forward import compile_decoder_layers, restore_decoder_layers
    from dflash.target.fused import compile_elementwise, restore_elementwise

    first_s = None
    try:
        if layers_on:
            restore_decoder_layers(layers)
            compile_elementwise(model)
        else:
            restore_elementwise(model)
            compile_decoder_layers(layers)
            print("compiling the decoder layers whole: the first pass", flush=True)
            first_s = timed_pass(progress=True)
        flip_s = timed_pass()
    except Exception as e:  # noqa: BLE001  (an FLA kernel dynamo cannot trace is a finding, not the end of the run)
        return {"error": error_line(e),
                "flipped_to": "eager layers" if layers_on else "compiled"}
    layers_s, chains_s = (fo_s, flip_s) if layers_on else (flip_s, fo_s)
    return {"flipped_to": "eager layers" if layers_on else "compiled", "flipped_tok_s": real / flip_s,
            "chains": "compiled" if chains_on else "eager",
            "layers_forward_only_tok_s": real / layers_s, "chains_forward_only_tok_s": real / chains_s,
            "speedup": chains_s / layers_s, "first_pass_s": first_s}


PEER_MIN_TOKENS = 100_000   # below this the peer-style rate is mostly first-call cost: no ratio is reported


def drain_text(parts: dict) -> str:
    """ExtractResult.drain_parts in words (empty parts: a result without them)."""
    if not parts:
        return "no breakdown"
    return (f"{parts['queued_batches']} batch(es) queued at close, writer close {parts['writer_close_s']:.2f}s, "
            f"last commit {parts['last_commit_s']:.2f}s")


def peer_ratio(tok_s: float, peer: dict) -> float | None:
    """tok_s over the peer-style rate, or None when there is no peer run or it is under PEER_MIN_TOKENS."""
    return tok_s / peer["tok_s"] if peer and peer["tokens"] >= PEER_MIN_TOKENS else None


def peer_style(model, jsonl: pathlib.Path, out_dir: pathlib.Path, taps, device, *, batch_size: int,
               max_tokens: int, io_threads: int = 8, io_queue: int = 50, seed: int = 0) -> dict:
    """The peers' HF extraction path, warmed: batches of `batch_size` samples in dataset order padded to the
    longest (attention mask), a full-depth forward with output_hidden_states=True, the tapped layers of each
    sample copied to the host, and one torch.save file per sample by `io_threads` saver threads with at most
    `io_queue` files pending (SpecForge's defaults are all cores and 50). The same forwards run once untimed
    first. Dataset order = the records shuffled with `seed`: the bench's data file is grouped by extraction
    batch (similar lengths together), which no real dataset is. Files hold the sample's own tokens (SpecForge
    also keeps the padding), which favours the peer. Returns the rate and what it was measured on."""
    from concurrent.futures import ThreadPoolExecutor

    rows = [json.loads(line)["input_ids"] for line in open(jsonl)]
    rows = [rows[i] for i in np.random.default_rng(seed).permutation(len(rows))]
    kept, total = [], 0
    for r in rows:
        if total >= max_tokens:
            break
        kept.append(r)
        total += len(r)
    batches = []
    for start in range(0, len(kept), batch_size):
        chunk = kept[start: start + batch_size]
        S = max(len(r) for r in chunk)
        ids = torch.zeros(len(chunk), S, dtype=torch.long)
        mask = torch.zeros(len(chunk), S, dtype=torch.long)
        for j, r in enumerate(chunk):
            ids[j, : len(r)] = torch.tensor(r)
            mask[j, : len(r)] = 1
        batches.append((start, chunk, ids, mask))

    def forward(ids, mask):
        return model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True).hidden_states

    with torch.inference_mode():
        sync(device)
        t = time.perf_counter()
        for _start, _chunk, ids, mask in batches:   # warm-up: the same shapes, nothing saved
            forward(ids, mask)
        sync(device)
        warm_s = time.perf_counter() - t
        out_dir.mkdir(parents=True, exist_ok=True)
        pending: list = []
        with ThreadPoolExecutor(max_workers=io_threads) as pool:
            t = time.perf_counter()
            for start, chunk, ids, mask in batches:
                hs = forward(ids, mask)
                for j, r in enumerate(chunk):
                    feats = torch.stack([hs[k + 1][j, : len(r)] for k in taps], dim=1).cpu()
                    while len(pending) >= io_queue:   # back-pressure: wait for the oldest file
                        pending.pop(0).result()
                    pending.append(pool.submit(torch.save, {"input_ids": torch.tensor(r), "hidden_states": feats},
                                               out_dir / f"{start + j}.pt"))
                del hs
            for f in pending:
                f.result()
        sync(device)
        os.sync()
        secs = time.perf_counter() - t
    padded = sum(ids.numel() for _, _, ids, _ in batches)
    return {"seconds": secs, "tokens": total, "tok_s": total / secs, "samples": len(kept), "batch_size": batch_size,
            "padding_fraction": 1 - total / padded, "warm_pass_s": warm_s, "io_threads": io_threads,
            "io_queue": io_queue, "files": len(list(out_dir.glob("*.pt")))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=400_000, help="real tokens per measured extraction")
    p.add_argument("--storage", default="bf16,fp8", help="comma-separated storage dtypes to measure; none: no "
                   "extraction, the forward-only pass and the compares alone (so a compare fits one call)")
    p.add_argument("--batch-tokens", type=int, default=32768, help="extract token budget per forward")
    p.add_argument("--peer-tokens", type=int, default=100_000, help="tokens for the peer-style run (0 = skip)")
    p.add_argument("--peer-batch-size", type=int, default=4, help="peer-style samples per padded batch")
    p.add_argument("--peer-io-threads", type=int, default=8, help="peer-style saver threads")
    p.add_argument("--work-dir", default="/tmp/dflash_bench_extract", help="local-disk folder for caches")
    p.add_argument("--tiny", action="store_true", help="tiny random Qwen3.5 (CPU smoke run)")
    p.add_argument("--fla-conv", action="store_true", help="FLA Triton causal_conv1d in place of the torch fallback")
    p.add_argument("--compile-elementwise", choices=("auto", "on", "off"), default="auto",
                   help="ExtractConfig.compile_elementwise of the extractions and the forward-only floor (auto = on "
                        "CUDA): torch.compile'd Qwen3.5 norm/gate chains (dflash.target.fused)")
    p.add_argument("--compare-compile", action="store_true",
                   help="also time the forward-only pass with --compile-elementwise flipped (compile_compare)")
    p.add_argument("--compile-layers", choices=("auto", "on", "off"), default="off",
                   help="ExtractConfig.compile_layers of the extractions and the forward-only floor: each decoder "
                        "layer whole under torch.compile (in place of the norm/gate chains)")
    p.add_argument("--profile", action="store_true",
                   help="after the timed passes, the forward-only pass once more under torch.profiler: GPU time "
                        "per batch by kernel kind, the top kernels and eager ops (`forward_profile`; on CPU only its "
                        "wall time)")
    p.add_argument("--compare-compile-layers", action="store_true",
                   help="also time the forward-only pass with --compile-layers flipped (compile_layers_compare; a "
                        "failing compile is recorded, the rest of the run goes on)")
    p.add_argument("--load-seconds", type=float, default=None,
                   help="stand-in for the checkpoint load before each extraction (default: 5 on CUDA, 0 on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-name", default=None, help="results file name suffix (default: h200 on CUDA, cpu)")
    p.add_argument("--results-dir", default=str(ROOT / "benchmarks" / "results"), help="folder of the result JSON")
    args = p.parse_args()

    import dflash.target.load as target_load
    from dflash.extract.driver import ExtractConfig, run_rank
    from dflash.target.flops import target_flops
    from dflash.target.testing import tiny_qwen35_text_kwargs

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    work = pathlib.Path(args.work_dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    text_kwargs = tiny_qwen35_text_kwargs(num_layers=8, vocab_size=259) if args.tiny else dict(QWEN35_27B)
    model_dir = work / "target"
    make_model_dir(model_dir, text_kwargs)
    lengths, loss, full_padding = sample_lengths(args.tokens, seed=args.seed, batch_tokens=args.batch_tokens)
    data = work / "data.jsonl"
    write_pretokenized(data, lengths, loss, vocab=text_kwargs["vocab_size"], seed=args.seed)
    warm = work / "warm.jsonl"
    wl, wm, _ = sample_lengths(min(args.tokens // 8, 60_000), seed=args.seed + 1, batch_tokens=args.batch_tokens)
    write_pretokenized(warm, wl, wm, vocab=text_kwargs["vocab_size"], seed=args.seed + 1)

    t = time.perf_counter()
    model, tokenizer = build_random_model(model_dir, device, fla_conv=args.fla_conv)
    build_s = time.perf_counter() - t
    from dflash.compiled import target_compiles
    from dflash.target.forward import compile_decoder_layers, restore_decoder_layers, text_decoder
    from dflash.target.fused import compile_elementwise, restore_elementwise

    compiled, layers_on = target_compiles(args.compile_elementwise, args.compile_layers, device)  # as the driver
    # the driver's TappedForward compiles this same model instance too (idempotent); forward_only's sees it
    fused_modules = compile_elementwise(model) if compiled else {}
    layers = text_decoder(model).layers
    if layers_on:
        compile_decoder_layers(layers)
    print(f"compiled norm/gate chains: {fused_modules or 'none (eager)'}; decoder layers compiled whole: "
          f"{layers_on}", flush=True)
    load_s = args.load_seconds if args.load_seconds is not None else (5.0 if device.type == "cuda" else 0.0)

    def load_prebuilt(*_a, **_k):  # see module docstring
        time.sleep(load_s)
        return model, tokenizer

    target_load.load_target = load_prebuilt
    timeline = ForwardTimeline(device)
    peak = matmul_peak(device)

    def cfg_for(src, storage, out):
        return ExtractConfig(model=str(model_dir), data=(str(src),), output=str(out), storage=storage,
                             max_length=4096, batch_tokens=args.batch_tokens, show_progress=False,
                             compile_elementwise="on" if compiled else "off",
                             compile_layers="on" if layers_on else "off",
                             dtype="bfloat16")  # the forward-only floor runs bf16 (also on CPU)

    quiet = lambda *_: None  # noqa: E731
    # Warm-up: Triton autotuning, cuBLAS heuristics, allocator growth (not timed).
    storages = [] if args.storage == "none" else args.storage.split(",")
    if storages:
        run_rank(cfg_for(warm, "bf16", work / "warm_cache"), echo=quiet)
        shutil.rmtree(work / "warm_cache")
    warm_s, _, _, _ = forward_only(cfg_for(data, "bf16", work / "fo_cache"), model, device)
    timeline.take()
    print(f"warm-up forward pass over the measured batches: {warm_s:.1f} s", flush=True)

    from dflash.extract.preflight import build_preflight

    taps = build_preflight(cfg_for(data, "bf16", work / "fo_cache"), world_size=1).fingerprint.tap_layer_ids
    results = {}
    for storage in storages:
        out = work / f"cache_{storage}"
        os.sync()
        t = time.perf_counter()
        timeline.take()
        res = run_rank(cfg_for(data, storage, out), echo=quiet)
        forwards = timeline.take()
        os.sync()
        secs = time.perf_counter() - t
        on_disk = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        results[storage] = {"seconds": secs, "tokens": res.num_tokens, "tok_s_end_to_end": res.num_tokens / secs,
                            "tok_s": res.num_tokens / (secs - res.setup_seconds),
                            # steady state: first batch start .. last append (no startup, no final drain)
                            "loop_seconds": res.loop_seconds, "setup_seconds": res.setup_seconds,
                            "drain_seconds": res.drain_seconds, "drain_parts": res.drain_parts,
                            "tok_s_steady": res.num_tokens / res.loop_seconds if res.loop_seconds else None,
                            "wait_on_disk_s": res.wait_s, "bytes_on_disk": on_disk,
                            "bytes_per_token": on_disk / res.num_tokens,
                            "disk_write_MB_s": on_disk / secs / 1e6, "forward_timeline": forwards}
        shutil.rmtree(out)

    # After the extraction runs, so both see the same warmed kernels (Triton autotunes per new shape).
    timeline.take()
    fo_s, real, padded, batch_sizes = forward_only(cfg_for(data, "bf16", work / "fo_cache"), model, device)
    fo_timeline = timeline.take()
    num_layers_run = max(taps) + 1
    flops = target_flops(model.config, num_layers_run=num_layers_run)
    total_flops = flops.forward_flops(lengths)
    floor_tok_s = peak * real / total_flops
    compiled_cmp, layers_cmp, peer, sustained, fo_profile = None, None, {}, None, None

    def publish(*, complete: bool) -> dict:
        """The result JSON from what is measured so far (see below); the table and the JSON line once complete."""
        return write_result(args, device, complete=complete, results=results, peer=peer, compiled_cmp=compiled_cmp,
                            layers_cmp=layers_cmp, real=real, padded=padded, total_flops=total_flops, peak=peak,
                            sustained=sustained, fo_s=fo_s, fo_timeline=fo_timeline, floor_tok_s=floor_tok_s,
                            extra={"model": "tiny Qwen3.5" if args.tiny else "Qwen3.5-27B shape, random weights",
                                   "kernels": str(getattr(model, "dflash_kernels", "")),
                                   "compile_elementwise": args.compile_elementwise,
                                   "compiled_elementwise_modules": fused_modules, "peer_style_elementwise": "eager",
                                   "taps": list(taps), "layers_run": num_layers_run, "samples": len(lengths),
                                   "padding_fraction_full_dataset_plan": full_padding,
                                   "model_build_s": build_s, "load_seconds_stand_in": load_s,
                                   "warm_forward_pass_s": warm_s, "distinct_batch_sizes": batch_sizes,
                                   # the warm-up pass met batch sizes (and kernel compiles) the warm-up extraction
                                   # had not
                                   "first_pass_compile_s": warm_s - fo_s,
                                   "compile_layers": args.compile_layers, "forward_profile": fo_profile})

    # The extraction figures first, so a call cut in the compares or the peer run below still brings them back.
    publish(complete=False)
    if args.profile:
        fo_profile = profile_forward(cfg_for(data, "bf16", work / "fo_cache"), model, device)
        timeline.take()
        print(f"profile of the forward-only pass: {fo_profile['step_ms']:.0f} ms a batch, GPU busy "
              f"{fo_profile['gpu_busy_ms']:.0f} ms; by kind (ms a batch): "
              + ", ".join(f"{k} {v:.1f}" for k, v in fo_profile["ms_per_step_by_kind"].items()), flush=True)
        publish(complete=False)
    if args.compare_compile:  # the same batches once more with the setting flipped, then back
        if compiled:
            restore_elementwise(model)
            counts, first_s = fused_modules, None
        else:
            counts = compile_elementwise(model)
            first_s, *_ = forward_only(cfg_for(data, "bf16", work / "fo_cache"), model, device)  # compiles
        flip_s, *_ = forward_only(cfg_for(data, "bf16", work / "fo_cache"), model, device)
        timeline.take()
        fc_s, eager_s = (fo_s, flip_s) if compiled else (flip_s, fo_s)
        compiled_cmp = {"modules": counts, "forward_only_tok_s": real / fc_s,
                        "eager_forward_only_tok_s": real / eager_s,
                        "speedup": eager_s / fc_s, "first_pass_s": first_s,
                        "flipped_to": "eager" if compiled else "compiled"}
    layers_cmp = compare_compile_layers(model, layers, layers_on, compiled, real, fo_s,
                                        lambda **k: forward_only(cfg_for(data, "bf16", work / "fo_cache"), model,
                                                                 device, **k)[0]
                                        ) if args.compare_compile_layers else None
    restore_decoder_layers(layers)
    restore_elementwise(model)  # the peer-style run below is HF's eager forward, as the peers run it
    sustained = matmul_sustained(device)  # after the timed passes: the GPU as warm as they left it
    if args.peer_tokens:
        peer = peer_style(model, data, work / "peer", taps, device, batch_size=args.peer_batch_size,
                          max_tokens=args.peer_tokens, io_threads=args.peer_io_threads, seed=args.seed)
        shutil.rmtree(work / "peer")
    publish(complete=True)


def write_result(args, device, *, complete: bool, results: dict, peer: dict, compiled_cmp: dict | None,
                 layers_cmp: dict | None, real: int, padded: int, total_flops: float, peak: float,
                 sustained: float | None, fo_s: float, fo_timeline: dict | None, floor_tok_s: float,
                 extra: dict) -> dict:
    """Write benchmarks/results/extract_<name>.json from the runs so far; `complete` once every requested part
    ran (then the table and the JSON line are printed too). main writes it first right after the extractions and
    the forward-only pass, without the compares, the peer-style run and the sustained-rate probe."""
    fo_tok_s = real / fo_s
    rows = [("forward only (same batches)", fo_tok_s, "")]
    summary = {}
    def mfu_at(tok_s: float) -> float:
        return tok_s * total_flops / real / peak

    for storage, r in results.items():
        mfu = mfu_at(r["tok_s"])
        summary[storage] = {
            "tok_s": r["tok_s"], "tok_s_end_to_end": r["tok_s_end_to_end"],
            "ratio_end_to_end_vs_forward_only": r["tok_s_end_to_end"] / fo_tok_s,
            "forward_only_tok_s": fo_tok_s, "floor_tok_s": floor_tok_s,
            **mfu_fields(mfu, peak=peak),
            "mfu_vs_sustained": None if sustained is None else mfu_vs_sustained(mfu, peak=peak, sustained=sustained),
            "ratio_vs_forward_only": r["tok_s"] / fo_tok_s,
            "tok_s_steady": r["tok_s_steady"], "loop_seconds": r["loop_seconds"],
            "setup_seconds": r["setup_seconds"], "drain_seconds": r["drain_seconds"], "drain_parts": r["drain_parts"],
            "ratio_steady_vs_forward_only": r["tok_s_steady"] / fo_tok_s if r["tok_s_steady"] else None,
            # the final drain (the last batch's write and commit) is a fixed cost: its share of a 50 s bench is
            # ~2%, of an hours-long extraction nil, so the steady MFU is what a long extraction converges to
            "mfu_steady": mfu_at(r["tok_s_steady"]) if r["tok_s_steady"] else None,
            "ratio_vs_peer_style": peer_ratio(r["tok_s"], peer),
            "padding_fraction": 1 - real / padded, "storage": storage,
            "bytes_per_token": r["bytes_per_token"], "disk_write_MB_s": r["disk_write_MB_s"],
            "wait_on_disk_s": r["wait_on_disk_s"], "seconds": r["seconds"], "tokens": r["tokens"],
            "forward_timeline": r["forward_timeline"],
        }
        rows.append((f"dflash extract ({storage})", r["tok_s"], f"{r['bytes_per_token']:.0f} B/tok, "
                     f"{r['disk_write_MB_s']:.0f} MB/s, waited {r['wait_on_disk_s']:.1f}s on disk"))
        rows.append((f"  end to end, setup too ({storage})", r["tok_s_end_to_end"],
                     f"setup {r['setup_seconds']:.1f}s before the first batch"))
        if r["tok_s_steady"]:
            rows.append((f"  steady state ({storage})", r["tok_s_steady"],
                         f"MFU {summary[storage]['mfu_steady']:.3f}, first batch .. last append, "
                         f"{r['loop_seconds']:.1f}s of {r['seconds']:.1f}s "
                         f"(setup {r['setup_seconds']:.1f}s, drain {r['drain_seconds']:.2f}s: "
                         f"{drain_text(r['drain_parts'])})"))
        t = r["forward_timeline"]
        if t and fo_timeline:
            rows.append((f"  GPU forwards only ({storage})", real / t["forward_gpu_s"],
                         f"{t['forward_gpu_s']:.1f}s of forwards (forward-only pass "
                         f"{fo_timeline['forward_gpu_s']:.1f}s), "
                         f"{t['between_forwards_s']:.1f}s between them (packing, encoding, idle)"))
    if peer:
        rows.append(("peer style (full fwd + torch.save)", peer["tok_s"],
                     f"{peer['tokens']:,} tokens warmed, batch {peer['batch_size']}, padding "
                     f"{peer['padding_fraction']:.2f}, {peer['io_threads']} saver threads"
                     + ("" if peer["tokens"] >= PEER_MIN_TOKENS else f"; < {PEER_MIN_TOKENS:,} tokens: no ratio")))
    if compiled_cmp:
        flip = compiled_cmp["flipped_to"]
        first = compiled_cmp["first_pass_s"]
        rows.append((f"forward only, {flip} norm/gate chains",
                     compiled_cmp[("eager_" if flip == "eager" else "") + "forward_only_tok_s"],
                     f"compiled x{compiled_cmp['speedup']:.3f} of eager forward only"
                     + (f"; first compiled pass {first:.1f}s (compiles)" if first is not None else "")))
    if layers_cmp and "error" not in layers_cmp:
        rows.append((f"forward only, layers {layers_cmp['flipped_to']}", layers_cmp["flipped_tok_s"],
                     f"layers compiled whole x{layers_cmp['speedup']:.3f} of the layers eager, norm/gate chains "
                     f"{layers_cmp['chains']}"
                     + (f"; first pass {layers_cmp['first_pass_s']:.1f}s (compiles)"
                        if layers_cmp["first_pass_s"] is not None else "")))
    elif layers_cmp:
        rows.append(("forward only, layers compiled whole", float("nan"), layers_cmp["error"]))
    rows.append(("FLOP floor", floor_tok_s, f"{total_flops / real / 1e9:.1f} GFLOP/tok, measured peak "
                 f"{peak / 1e12:.3g} TFLOP/s"))
    rows.append(("FLOP floor at the 989T spec", H200_SPEC_BF16 * real / total_flops, "H200 dense bf16 spec"))

    name = args.result_name or ("h200" if device.type == "cuda" else "cpu")
    out = {
        "benchmark": "extract", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(["python"] + sys.argv),
        "machine": machine_info(device),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": __import__("transformers").__version__,
                     "fla": package_version("fla-core"), "zarr": package_version("zarr")},
        "complete": complete,
        **({} if complete else {"incomplete": "written before the compares, the peer-style run and the sustained "
                                              "matmul probe: a call cut after the extractions keeps their figures"}),
        **extra, "real_tokens": real, "padded_tokens": padded, "batch_tokens": args.batch_tokens,
        "matmul_peak_flops": peak, "matmul_sustained_flops": sustained,
        "mfu_vs_sustained_denominator": SUSTAINED_DENOMINATOR, "forward_flops_per_token": total_flops / real,
        "forward_only_tok_s": fo_tok_s, "forward_only_timeline": fo_timeline, "floor_tok_s": floor_tok_s,
        "floor_tok_s_at_spec_989": H200_SPEC_BF16 * real / total_flops, "peer_min_tokens_for_ratio": PEER_MIN_TOKENS,
        "peer_style": peer, "compile_compare": compiled_cmp, "compile_layers_compare": layers_cmp, **summary,
    }
    res_dir = pathlib.Path(args.results_dir)
    res_dir.mkdir(parents=True, exist_ok=True)
    (res_dir / f"extract_{name}.json").write_text(json.dumps(out, indent=2) + "\n")
    if complete:
        print(f"\n{'what':40s} {'tok/s':>10s}  notes")
        for row_name, rate, note in rows:
            print(f"{row_name:40s} {rate:10,.0f}  {note}")
        print(json.dumps(out))
    return out

if __name__ == "__main__":
    main()
