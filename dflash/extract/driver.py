"""The per-rank extraction loop: pad a planned batch, run the target up to its deepest tap, pack the real
tokens on the device, encode (bf16 bits or fp8 + scales) on the device, copy to pinned host memory
asynchronously, and hand the bytes to the CacheWriter, whose thread writes and commits shards.

Shapes: B = rows in a batch, S = padded length, T = real tokens written, K = taps, D = hidden size.

Overlap on CUDA: the device->host copy of batch i runs on a side stream and is only waited for after the
kernels of batch i+1 are queued, so the GPU never idles on the copy; the writer's bounded queue is the only
place the loop blocks on the disk, and that time is reported as "waiting on disk".
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from dflash import ctrl_c
from dflash.cache.format import resolve_storage
from dflash.compiled import COMPILE_SETTINGS, target_compiles
from dflash.dtypes import DTYPES, default_dtype, dtype_of
from dflash.errors import ConfigError, DflashError
from dflash.extract.plan import PlannedBatch
from dflash.extract.progress import BYTES, PADDED, SAMPLES, TOKENS, WAIT_S, ProgressReporter, RankCounters
from dflash.store.throughput import StoreRate

log = logging.getLogger(__name__)



@dataclass(frozen=True, kw_only=True)
class ExtractConfig:
    """One `dflash extract` run."""

    model: str
    """Target model folder (HF format) or hub name."""
    data: tuple[str, ...]
    """Conversation sources (.jsonl/.json/.parquet/datasets folders), in order; sample ids follow it."""
    output: str
    """Cache directory: created, or resumed when it holds a cache with the same fingerprint."""
    taps: tuple[int, ...] | None = None
    """Decoder-layer ids to cache (HF hidden_states[id+1]); None = the 5 DFlash default taps."""
    storage: str = "bf16"
    """"bf16" (exact), "fp8" (e4m3 + a float32 scale per token and tap; half the bytes), "int4" (the 4-bit
    format DEFAULT_QUANT4, 0.27x bf16) or any 4-bit format name (dflash.cache.quant4); stored resolved."""
    max_length: int = 4096
    """Longer samples are truncated to this many tokens (skipped if no assistant token remains)."""
    batch_tokens: int = 16384
    """Token budget per forward pass, padding included (sorted-by-length batches)."""
    shard_tokens: int = 1 << 16
    """Tokens per committed shard: the unit of atomic commit and of work lost on a crash."""
    template_kwargs: dict = field(default_factory=dict)
    """Chat-template kwargs, e.g. {"enable_thinking": False} for --no-thinking."""
    dtype: str | None = None
    """Target compute dtype; None = the rule of every command (dflash.dtypes.default_dtype): bfloat16 on CUDA,
    float32 elsewhere. The resolved name is the fingerprint's target_dtype (compute_dtype())."""
    device: str = "auto"
    """"auto" (cuda:LOCAL_RANK when CUDA is available, else cpu), "cpu" or "cuda"."""
    fla_conv: bool = True
    """On CUDA with flash-linear-attention, run Gated-DeltaNet's causal conv1d with FLA's Triton kernel instead
    of transformers' torch fallback (per op 5e-8 relative in fp32; 10.3K vs ~8.9K tokens/s on the 27B shape,
    DESIGN.md). Ignored on CPU and for targets without Gated-DeltaNet layers."""
    compile_elementwise: str = "auto"
    """"auto" (on CUDA), "on" or "off": run the Qwen3.5 layers' RMSNorm / gated RMSNorm / SiLU-gating chains
    torch.compile'd (dflash.target.fused: one fused kernel each instead of ~7 eager fp32 element-wise launches).
    Float rounding only (checked per layer against transformers' layers, tests/gpu/test_target_fused_gpu.py), so
    it is not part of the cache fingerprint. Other architectures are left as they are; on CPU inductor's compile
    costs more than it saves."""
    compile_layers: str = "off"
    """"auto" (on CUDA), "on" or "off": run each decoder layer the taps need whole under torch.compile
    (dflash.target.forward.compile_decoder_layers: one graph per layer class, dynamic shapes), which fuses what
    compile_elementwise leaves eager (residual adds, RoPE, gates); when on, compile_elementwise is not applied
    as well (the layer graph holds those chains). Float rounding only, not in the fingerprint. Off by default
    until timed on the 27B shape (bench_extract.py --compare-compile-layers)."""
    dry_run: bool = False
    """Print the plan (samples, tokens, bytes, ETA) and stop."""
    store_rate: StoreRate | None = None
    """Set by dflash.extract.to_store.extract_to_store for `--output URL`: the store's probed write rate; the plan
    then prints the throughput line (dflash.store.throughput) against the ETA's tokens/s."""
    max_held_shards: int | None = None
    """Set by extract_to_store for `--output URL`: each rank's writer waits while it holds more committed shard
    folders than this (its publisher deletes the ones the store has committed): bounded staging space."""
    repair: bool = False
    """Resume over a damaged cache: verify every committed shard (reads all of it), uncommit and delete those
    that fail, and extract their samples again. Without it a resume refuses when a committed shard is missing,
    has the wrong size, or disagrees with its commit line."""
    report_every: int = 4
    """Batches between progress reductions across ranks."""
    queue_depth: int = 4
    """Batches the writer queue holds before the loop blocks (host memory: depth x batch bytes)."""
    show_progress: bool = True
    """Draw the tqdm bar on rank 0."""

    def __post_init__(self) -> None:
        if not self.data:
            raise ConfigError("data: give at least one --data source")
        object.__setattr__(self, "storage", resolve_storage(self.storage))  # "int4" -> its full format name
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r}: use one of {', '.join(DTYPES)}")
        if self.max_length < 1:
            raise ConfigError(f"max_length={self.max_length}: must be >= 1")
        if self.batch_tokens < self.max_length:
            raise ConfigError(f"batch_tokens={self.batch_tokens} < max_length={self.max_length}: a batch must "
                              f"fit the longest sample; raise --batch-tokens to at least {self.max_length}")
        if self.shard_tokens < 1:
            raise ConfigError(f"shard_tokens={self.shard_tokens}: must be >= 1")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device={self.device!r}: use auto, cpu or cuda")
        if self.compile_elementwise not in COMPILE_SETTINGS:
            raise ConfigError(f"compile_elementwise={self.compile_elementwise!r}: use auto, on or off")
        if self.compile_layers not in COMPILE_SETTINGS:
            raise ConfigError(f"compile_layers={self.compile_layers!r}: use auto, on or off")


    def compute_dtype(self) -> str:
        """The dtype name the target runs in: `dtype`, or default_dtype of the device this config resolves to."""
        if self.dtype is not None:
            return self.dtype
        cuda = self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available())
        return default_dtype("cuda" if cuda else "cpu")


@dataclass(frozen=True, kw_only=True)
class ExtractResult:
    """What a run did (the same on every rank after the final reduction)."""

    num_samples: int
    num_tokens: int
    num_padded_tokens: int
    bytes_written: int
    wait_s: float
    """Seconds waiting on the writer queue, averaged over ranks."""
    seconds: float
    """End to end: preflight, model load, the loop and the writer's final drain and commit."""
    num_committed_before: int
    skip_counts: dict
    dry_run: bool
    loop_seconds: float = 0.0
    """Steady state: from the start of the first batch to the last append (the slowest rank); excludes
    startup and the final drain of the writer queue, which dominate a short run but not a multi-hour one."""
    setup_seconds: float = 0.0
    """Start to the first batch (rank 0): preflight, tokenization, model load, writer open."""
    drain_seconds: float = 0.0
    """Last append to the end (rank 0): the writer's queue drain, last shard commit, final reduction."""
    drain_parts: dict = field(default_factory=dict)
    """Of drain_seconds (rank 0): batches still queued at the writer's close, the close's wall time, and of it
    the last shard's commit (WriteStats.queued_at_close / seconds_close / seconds_last_commit)."""
    eta_seconds: float | None = None
    """The calibrated estimate of loop_seconds printed before the loop (None: plan too small to calibrate)."""
    planned_samples: int = 0
    """What the plan (the same in a dry run) said this run extracts: samples, tokens, padded tokens, batches."""
    planned_tokens: int = 0
    planned_padded_tokens: int = 0
    planned_batches: int = 0


def resolve_device(cfg: ExtractConfig, *, local_rank: int) -> torch.device:
    if cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("device=cuda but CUDA is not available")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def run_rank(cfg: ExtractConfig, *, rank: int = 0, world_size: int = 1, local_rank: int = 0,
             echo=print) -> ExtractResult:
    """Run this rank's share. With world_size > 1, torch.distributed (gloo) must be initialized; a dry
    run with world_size > 1 and no process group plans for world_size ranks and stops.

    Rank 0 of a real run holds the cache's FolderLock from before tokenization to the end, so a second run
    on the same --output fails at once naming this one (LockedError); the other ranks write nothing before
    rank 0 has opened its writer (a barrier), so they never write for a run that lost the lock."""
    from dflash.extract.preflight import check_output
    from dflash.locks import FolderLock

    created_output = not os.path.exists(cfg.output)
    lock = None
    if rank == 0 and not cfg.dry_run:
        check_output(cfg.output)
        lock = FolderLock(cfg.output, purpose=f"dflash extract --output {cfg.output}").acquire()
    try:
        return _run_rank(cfg, rank=rank, world_size=world_size, local_rank=local_rank, echo=echo,
                         created_output=created_output)
    except DflashError:
        if rank == 0 and created_output:  # a refused run leaves no folder behind it
            _remove_created_output(cfg.output)
        raise
    finally:
        if lock is not None:
            lock.release()


def _run_rank(cfg: ExtractConfig, *, rank: int, world_size: int, local_rank: int, echo,
              created_output: bool) -> ExtractResult:
    from dflash.extract.eta import estimate_eta
    from dflash.extract.preflight import build_preflight
    from dflash.extract.progress import format_plan
    from dflash.extract.space import check_free_space

    t0 = time.perf_counter()
    distributed = world_size > 1 and dist.is_available() and dist.is_initialized()
    device = resolve_device(cfg, local_rank=local_rank)
    pre = build_preflight(cfg, world_size=world_size, rank=rank, created_output=created_output)
    plan = pre.plan
    if rank == 0:
        shapes = [(len(b.members), b.padded_len) for bs in plan.rank_batches for b in bs]
        eta = estimate_eta(config=pre.config, deepest_tap=max(pre.fingerprint.tap_layer_ids), batch_shapes=shapes,
                           world_size=world_size, device=device,
                           dtype=dtype_of(cfg.compute_dtype())) if shapes else None
        echo(format_plan(num_samples=len(pre.samples), num_committed=plan.num_committed, num_todo=plan.num_todo,
                         num_tokens=plan.num_tokens_todo, padded_tokens=plan.num_padded_tokens,
                         cache_bytes=pre.cache_bytes, eta=eta, world_size=world_size, device=str(device),
                         skips_text=pre.skips.summary()))
        echo(f"taps: {list(pre.fingerprint.tap_layer_ids)}, storage {cfg.storage}, target_greedy "
             f"{pre.fingerprint.target_greedy} ({pre.target_greedy_reason})")
        echo(pre.tokenize_text)
        if pre.fingerprint_note:
            echo(pre.fingerprint_note)
        if cfg.store_rate is not None and plan.num_tokens_todo:
            from dflash.store.throughput import throughput_line

            echo(throughput_line(what="written", bytes_per_token=pre.cache_bytes.total / plan.num_tokens_todo,
                                 ranks=world_size, rate=cfg.store_rate,
                                 tokens_per_s=None if eta is None or eta.seconds <= 0
                                 else plan.num_tokens_todo / world_size / eta.seconds))
    check_free_space(cfg.output, needed_bytes=pre.cache_bytes.total)  # run_rank removes a folder it created
    if cfg.dry_run:
        return _result(cfg, pre, torch.zeros(5, dtype=torch.float64), t0, world_size, dry_run=True)
    if plan.num_todo == 0:  # every rank sees the same plan: none loads the target (a demo rerun took seconds)
        from dflash.cache import CacheWriter

        if rank == 0:
            CacheWriter(cfg.output, pre.fingerprint, rank=rank).close()  # rewrites lagging manifest totals
            _write_sources(cfg.output, pre)
            echo(f"nothing to extract: all {plan.num_committed:,} samples are in the cache")
        return _result(cfg, pre, torch.zeros(5, dtype=torch.float64), t0, world_size, dry_run=False)

    from dflash.cache import CacheWriter
    from dflash.target.forward import TappedForward
    from dflash.target.load import load_target

    my_batches = plan.rank_batches[rank]
    pool = None
    if device.type == "cuda" and my_batches:
        from dflash.extract.pinned import PinnedPool, batch_nbytes

        most = max(sum(len(pre.samples[i].input_ids) for i, w in zip(b.members, b.write) if w) for b in my_batches)
        # Pinned in the background while the target loads (pinned.py says why).
        pool = PinnedPool(count=cfg.queue_depth + 2, prefill=True, nbytes=batch_nbytes(
            tokens=most, num_taps=len(pre.fingerprint.tap_layer_ids), hidden=pre.fingerprint.hidden_size,
            storage=cfg.storage))
    model, _ = load_target(cfg.model, device=device, dtype=dtype_of(cfg.compute_dtype()), fla_conv=cfg.fla_conv)
    chains, layers = target_compiles(cfg.compile_elementwise, cfg.compile_layers, device)
    tapped = TappedForward(model, pre.fingerprint.tap_layer_ids, compile_elementwise=chains, compile_layers=layers)
    if tapped.fused_modules:
        log.info("compiled norm/gate/rotary chains: %s", tapped.fused_modules)
    if layers:
        log.info("compiled decoder layers: %d", tapped.num_layers_run)
    pad_id = pre.tokenizer.pad_token_id if pre.tokenizer.pad_token_id is not None else 0
    counters = RankCounters()
    reporter = ProgressReporter(rank=rank, world_size=world_size if distributed else 1,
                                total_samples=plan.num_todo, total_tokens=plan.num_tokens_todo,
                                enabled=cfg.show_progress)

    def open_writer():
        return CacheWriter(cfg.output, pre.fingerprint, rank=rank, shard_tokens=cfg.shard_tokens,
                           queue_depth=cfg.queue_depth, max_held_shards=cfg.max_held_shards)

    # Rank 0 creates the cache (manifest) before the others open it, so they never race on creation; a growing
    # cache's manifest names its new sources first (dflash.extract.grow).
    if rank == 0 and pre.grown_from is not None:
        from dflash.extract.grow import record_growth

        record_growth(cfg.output, pre.fingerprint)
    writer = open_writer() if rank == 0 else None
    if rank == 0:
        _write_sources(cfg.output, pre)
    if distributed:
        dist.barrier()
    writer = writer or open_writer()
    with writer, reporter:  # an error or Ctrl-C ends the bar before its message is printed
        loop = _BatchLoop(samples=pre.samples, tapped=tapped, device=device, storage=cfg.storage, pad_id=pad_id,
                          writer=writer, counters=counters, pool=pool)
        eta_s = _calibrated_eta(loop, my_batches, pre, device=device, echo=echo) if rank == 0 else None
        t_first = time.perf_counter()
        for r in range(plan.num_rounds):
            ctrl_c.raise_if_came()   # a Ctrl-C whose KeyboardInterrupt was lost in a finalizer
            if r < len(my_batches):
                loop.step(my_batches[r])
            if (r + 1) % cfg.report_every == 0:
                counters.bytes_written = writer.stats.bytes_written
                reporter.report(counters)
        loop.flush()
        t_last = time.perf_counter()
        loop_s = t_last - t_first if my_batches else 0.0
    counters.bytes_written = writer.stats.bytes_written
    totals = reporter.close(counters)
    if distributed:
        slowest = torch.tensor([loop_s], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        loop_s = float(slowest[0])
        dist.barrier()
    result = _result(cfg, pre, totals, t0, world_size if distributed else 1, dry_run=False, loop_s=loop_s,
                     setup_s=t_first - t0, drain_s=time.perf_counter() - t_last, eta_s=eta_s,
                     drain_parts={"queued_batches": writer.stats.queued_at_close,
                                  "writer_close_s": writer.stats.seconds_close,
                                  "last_commit_s": writer.stats.seconds_last_commit})
    if rank == 0:
        echo(format_summary(result, skips_text=pre.skips.summary()))
    return result


def _write_sources(output: str, pre) -> None:
    """CACHE/sources.json (dflash.cache.sources): each source's id range, for `dflash cache info`."""
    from dflash.cache.sources import write_sources

    write_sources(output, list(pre.sources))


def interrupted_text(output: str, *, command: str) -> str:
    """What an interrupted (Ctrl-C) run leaves: the committed samples, and the command that resumes it."""
    from dflash.cache.commit import MANIFEST, read_commit_logs

    records = read_commit_logs(output) if os.path.exists(os.path.join(output, MANIFEST)) else []
    samples = sum(r.num_samples for r in records)
    return (f"interrupted: {samples:,} samples in {len(records):,} shards are committed in {output} (the shard "
            f"being written was dropped); resume with: {command}")


def _remove_created_output(path: str) -> None:
    """A refused run leaves no folder it created: remove it when it holds only the stored tokenization."""
    import shutil

    from dflash.cache.commit import startup_leftovers

    if os.path.isdir(path) and startup_leftovers(path) is not None:
        shutil.rmtree(path, ignore_errors=True)


CALIBRATE_MIN_BATCHES = 6
"""Plans with fewer batches (of rank 0) skip the calibration: its 4 forwards would be a large part of the run."""


def _calibrated_eta(loop, batches, pre, *, device: torch.device, echo) -> float | None:
    """Time real forwards of planned batches (dflash.extract.eta.calibrate) and print the loop's ETA."""
    from dflash.extract.eta import calibrate, forward_flops
    from dflash.extract.progress import format_seconds

    if len(batches) < CALIBRATE_MIN_BATCHES:
        return None
    deepest = max(pre.fingerprint.tap_layer_ids)
    batch_flops = [forward_flops(config=pre.config, deepest_tap=deepest, batch_shapes=[(len(b.members), b.padded_len)])
                   for b in batches]

    def run(i: int) -> None:
        p = loop._forward_pack(batches[i])
        if p.event is not None:
            p.event.synchronize()
        if p.buffer is not None:
            loop.pool.release(p.buffer)

    cal = calibrate(run, batch_flops=batch_flops)
    eta = cal.estimate(batch_flops)
    rate = sum(f for f, _ in cal.timed) / max(sum(t for _, t in cal.timed), 1e-9)
    echo(f"ETA: ~{format_seconds(eta)} for the extraction loop (calibrated on {device.type}: 2 planned batches timed "
         f"after a warm-up, {rate / 1e12:.3g} TFLOP/s, {cal.seconds_per_batch * 1e3:.0f} ms fixed per batch)")
    return eta


def _result(cfg, pre, totals: torch.Tensor, t0: float, world_size: int, *, dry_run: bool,
            loop_s: float = 0.0, setup_s: float = 0.0, drain_s: float = 0.0,
            eta_s: float | None = None, drain_parts: dict | None = None) -> ExtractResult:
    return ExtractResult(
        num_samples=int(totals[SAMPLES]), num_tokens=int(totals[TOKENS]), num_padded_tokens=int(totals[PADDED]),
        bytes_written=int(totals[BYTES]), wait_s=float(totals[WAIT_S]) / max(world_size, 1),
        seconds=time.perf_counter() - t0, num_committed_before=pre.plan.num_committed,
        skip_counts=dict(pre.skips.counts), dry_run=dry_run, loop_seconds=loop_s, setup_seconds=setup_s,
        drain_seconds=drain_s, drain_parts=drain_parts or {}, eta_seconds=eta_s, planned_samples=pre.plan.num_todo,
        planned_tokens=pre.plan.num_tokens_todo, planned_padded_tokens=pre.plan.num_padded_tokens,
        planned_batches=sum(len(b) for b in pre.plan.rank_batches))


def format_summary(result: ExtractResult, *, skips_text: str) -> str:
    from dflash.extract.progress import format_seconds
    from dflash.extract.space import format_bytes

    rate = result.num_tokens / result.seconds if result.seconds else 0.0
    return "\n".join([
        f"done: {result.num_samples:,} samples, {result.num_tokens:,} tokens "
        f"({result.num_padded_tokens:,} with padding), {format_bytes(result.bytes_written)} written "
        f"in {format_seconds(result.seconds)} ({rate:,.0f} tok/s; waiting on disk {result.wait_s:.1f}s per rank)",
        f"resumed: {result.num_committed_before:,} samples were already in the cache",
        *([f"extraction loop: {format_seconds(result.loop_seconds)} (estimated ~{format_seconds(result.eta_seconds)} "
           "before it)"] if result.eta_seconds is not None else []),
        skips_text,
    ])


@dataclass(kw_only=True)
class _Pending:
    """A batch whose device->host copy may still be running."""

    event: object | None
    sample_ids: np.ndarray
    lengths: np.ndarray
    input_ids: np.ndarray
    loss_mask: np.ndarray
    hidden: torch.Tensor
    scales: torch.Tensor | None
    padded_tokens: int
    group_scales: torch.Tensor | None = None
    """4-bit storage: [T, K, G] group scales (format.EncodedHidden)."""
    buffer: torch.Tensor | None = None
    """The pinned pool buffer holding hidden/scales, returned to the pool once the writer consumed it."""


class _BatchLoop:
    """Forward + pack + encode + async copy of one batch; hands the previous batch to the writer."""

    def __init__(self, *, samples, tapped, device: torch.device, storage: str, pad_id: int, writer,
                 counters: RankCounters, pool=None) -> None:
        self.samples, self.tapped, self.device, self.storage = samples, tapped, device, storage
        self.pad_id, self.writer, self.counters, self.pool = pad_id, writer, counters, pool
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.pending: _Pending | None = None

    def step(self, batch: PlannedBatch) -> None:
        staged = self._forward_pack(batch)
        self.flush()  # the previous batch: its copy overlapped with this batch's kernels
        self.pending = staged

    def flush(self) -> None:
        p, self.pending = self.pending, None
        if p is None:
            return
        if p.event is not None:
            p.event.synchronize()
        t = time.perf_counter()
        release = None
        if p.buffer is not None:
            buf, pool = p.buffer, self.pool
            release = lambda: pool.release(buf)  # noqa: E731 - runs on the writer thread
        self.writer.append(sample_ids=p.sample_ids, lengths=p.lengths, input_ids=p.input_ids,
                           loss_mask=p.loss_mask, hidden=p.hidden, scales=p.scales, group_scales=p.group_scales,
                           on_consumed=release)
        self.counters.wait_s += time.perf_counter() - t  # append blocks only when the queue is full
        self.counters.samples += len(p.sample_ids)
        self.counters.tokens += int(p.lengths.sum())
        self.counters.padded_tokens += p.padded_tokens

    def _forward_pack(self, batch: PlannedBatch) -> _Pending:
        rows = [self.samples[i] for i in batch.members]
        B, S = len(rows), batch.padded_len
        ids_BS = np.full((B, S), self.pad_id, dtype=np.int64)
        flat: list[np.ndarray] = []  # positions (row * S + t) of the real tokens we write, in sample order
        for j, s in enumerate(rows):
            n = len(s.input_ids)
            ids_BS[j, :n] = s.input_ids
            if batch.write[j]:
                flat.append(j * S + np.arange(n, dtype=np.int64))
        written = [s for s, w in zip(rows, batch.write) if w]
        index_T = torch.from_numpy(np.concatenate(flat))
        input_BS = torch.from_numpy(ids_BS)
        if self.cuda:
            input_BS = input_BS.pin_memory().to(self.device, non_blocking=True)
            index_T = index_T.pin_memory().to(self.device, non_blocking=True)
        # No attention mask: every layer is causal, so right padding never reaches a real token.
        hidden_BSKD = self.tapped(input_BS, None)
        K, D = hidden_BSKD.shape[2], hidden_BSKD.shape[3]
        # Gather with a host-built index instead of boolean masking: no device sync to learn T.
        hidden_TKD = hidden_BSKD.reshape(B * S, K, D).index_select(0, index_T)
        enc = _encode(hidden_TKD, self.storage)
        event, buffer = None, None
        if self.cuda:
            # A recycled pinned buffer (dflash.extract.pinned: fresh pinning cost 45% of throughput). Waiting
            # for one is disk back-pressure, so it counts as waiting on disk.
            from dflash.extract.pinned import encoded_views

            t = time.perf_counter()
            buffer = self.pool.acquire(check=self.writer.raise_if_failed)
            self.counters.wait_s += time.perf_counter() - t
            host = encoded_views(buffer, enc)
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                for dst, src in ((host.hidden, enc.hidden), (host.scales, enc.scales),
                                 (host.group_scales, enc.group_scales)):
                    if src is not None:
                        dst.copy_(src, non_blocking=True)
                        src.record_stream(self.copy_stream)
                event = torch.cuda.Event()
                event.record(self.copy_stream)
            enc = host
        return _Pending(
            event=event,
            sample_ids=np.array([s.sample_id for s in written], dtype=np.int64),
            lengths=np.array([len(s.input_ids) for s in written], dtype=np.int64),
            input_ids=np.concatenate([np.asarray(s.input_ids, dtype=np.int32) for s in written]),
            loss_mask=np.concatenate([np.asarray(s.loss_mask, dtype=np.uint8) for s in written]),
            hidden=enc.hidden, scales=enc.scales, group_scales=enc.group_scales, padded_tokens=B * S, buffer=buffer)


def _encode(hidden_TKD: torch.Tensor, storage: str):
    """The stored arrays (format.EncodedHidden) on the target's device. 4-bit NaN/Inf checks wait for the host
    copy (CacheWriter.append checks the encoder's NaN marks there): a check here would sync the GPU per batch."""
    from dflash.cache.format import encode_stored

    with torch.inference_mode():
        return encode_stored(hidden_TKD, storage, check_finite=False)


def set_cpu_threads(world_size: int) -> None:
    """Split the cores between local CPU ranks unless the user pinned OMP_NUM_THREADS (why: N ranks with
    all cores each oversubscribe the machine and run slower than one)."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(world_size, 1)))
