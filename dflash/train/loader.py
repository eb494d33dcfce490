"""Training data loader: epoch plans (shuffle, token-budget micro-batches, DDP partition) and the streaming
loader that reads them from the cache with reader threads, pinned host buffers and a side-stream H2D copy.

Shapes: T = packed context tokens of a micro-batch, N = samples, K = taps, D = hidden size.

Plan (pure, host-only, identical on every rank): permute the samples with a generator seeded by (seed, epoch),
pack them in that order into micro-batches of at most `batch_tokens` context tokens (a first-fit over a few open
bins, so lengths stay mixed but bins fill well), then cut the micro-batch list into optimizer steps of
world_size x grad_accum micro-batches; micro-batch j of a step goes to rank j % world_size. The last step is
padded with empty micro-batches, so every rank runs the same number of steps and micro-batches and every sample
is seen exactly once per epoch. The packing does not depend on world_size, so 1 rank with grad_accum = W x A sees
the same global batches as W ranks with grad_accum = A. TrainConfig.shuffle_block replaces the permutation with
runs of storage neighbours (permutation.block_permutation), so the micro-batches read long stretches of a shard.

Step balance (given per-sample `costs`, and more than one micro-batch per step): the budget counts context
tokens, but a step's compute is dominated by its block tokens (anchors x block size, which grow with the loss
tokens), so micro-batches of the same budget differ in cost (coefficient of variation ~0.3 on ShareGPT at 4K
tokens) and with DDP every step waits for its costliest rank. So within each window of BALANCE_WINDOW steps the
micro-batches are sorted by estimated cost and cut into steps of similar micro-batches, the window's steps are
shuffled again, and inside a step the micro-batches are dealt to ranks in snake order (for grad_accum > 1).
On the ShareGPT length asset at 4K-token micro-batches this raises the compute-balance bound on 8-rank
efficiency from 0.69 to 0.95 (benchmarks/bench_step_balance.py). Steps then group micro-batches of similar
cost (like length-grouped sampling), still every sample once per epoch and in a seeded random step order.
The costs must not depend on drafter settings (sample_costs): the runs of a sweep share one plan.

Fixed-count steps (TrainConfig.step_samples = K): step s is samples K*s .. K*s+K-1 of the permutation, packed
into its own micro-batches (fixed_count_steps); no cost balancing.
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from dflash.errors import ConfigError
from dflash.train.objective import expected_blocks
from dflash.train.permutation import block_permutation, epoch_permutation, storage_order

if TYPE_CHECKING:
    from dflash.cache.reader import CacheReader, PackedBuffers, PackedSamples, SampleIndex

HostBlocksByRule = Mapping[Any, Any]
"""What the host function returns, carried through unread: the loader sits below the step, so it knows the
anchor draws only by this shape (step.stream_anchors: AnchorRule -> HostBlocks)."""
HostFn = Callable[["PackedSamples", int], HostBlocksByRule]
"""Runs in a reader thread on each packed micro-batch and its epoch: the anchors of the stream's drafters."""

EMPTY = np.zeros(0, dtype=np.int64)
BALANCE_WINDOW = 16  # steps whose micro-batches are regrouped by cost: 8 ranks ~0.95 balanced, 0.5M tokens of mixing
PLAN_ANCHORS, PLAN_BLOCK = 512, 16  # the paper's anchors per sample and block size, for the cost estimate only
# A block token runs every drafter layer and the LM head; a context token only the feature projection and the
# K/V projections: ~30x cheaper at the 27B drafter shape.
CONTEXT_TOKEN_COST = 1 / 32


# ----------------------------------------------------------------------------------------------- pure planning


def pack_micro_batches(order: np.ndarray, lengths: np.ndarray, *, batch_tokens: int,
                       open_bins: int = 4) -> list[np.ndarray]:
    """Pack sample indices, visited in `order`, into micro-batches of sum(length) <= batch_tokens.

    First fit over the `open_bins` most recent bins: a sample goes into the first open bin with room; when none
    has room the oldest bin is closed. A sample longer than the budget gets a micro-batch of its own. The result
    is deterministic and keeps the shuffled mix of lengths within every micro-batch.
    """
    assert open_bins >= 1
    closed: list[list[int]] = []
    bins: list[list[int]] = []
    fill: list[int] = []
    for idx in order.tolist():
        n = int(lengths[idx])
        if n >= batch_tokens:
            closed.append([idx])
            continue
        for b in range(len(bins)):
            if fill[b] + n <= batch_tokens:
                bins[b].append(idx)
                fill[b] += n
                break
        else:
            if len(bins) == open_bins:
                closed.append(bins.pop(0))
                fill.pop(0)
            bins.append([idx])
            fill.append(n)
    closed.extend(bins)
    return [np.asarray(b, dtype=np.int64) for b in closed]


def sample_costs(lengths: np.ndarray, loss_tokens: np.ndarray, *, num_anchors: int = PLAN_ANCHORS,
                 block_size: int = PLAN_BLOCK) -> np.ndarray:
    """Estimated compute of each sample in a training step, float64 [N], in block tokens: block_size x the
    anchors it gets (min(num_anchors, loss tokens - 1)) plus its context tokens at CONTEXT_TOKEN_COST. Plans
    use the paper's constants (the defaults) rather than the run's own: the estimate only ranks micro-batches,
    and a plan that does not depend on drafter settings is shared by all runs of a sweep."""
    anchors = expected_blocks(loss_tokens, num_anchors=num_anchors)
    return block_size * anchors + CONTEXT_TOKEN_COST * np.asarray(lengths, dtype=np.float64)


def plan_costs(lengths: np.ndarray, loss_tokens: np.ndarray, *, plan_version: int) -> np.ndarray | None:
    """The `costs` plan_epoch takes for a run on `plan_version` (checkpoint.PLAN_VERSION): None, the packing
    order, for version 1 (runs started before balanced steps)."""
    return sample_costs(lengths, loss_tokens) if plan_version >= 2 else None


def balance_steps(micro: list[np.ndarray], micro_costs: np.ndarray, *, world_size: int, per_step: int,
                  window: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Reorder micro-batches so that each run of `per_step` of them (one optimizer step) holds micro-batches of
    similar cost (see the module docstring). Within each window of `window` steps: sort by cost (stable), cut
    into steps, shuffle the full steps with `rng`; a partial step (only in the last window) goes last. Inside a
    step, every other group of `world_size` is reversed, so round-robin dealing gives each rank a small and a
    large micro-batch in turn."""
    out: list[np.ndarray] = []
    span = window * per_step
    partial: list[np.ndarray] = []
    for start in range(0, len(micro), span):
        chunk = micro[start:start + span]
        order = np.argsort(micro_costs[start:start + span], kind="stable")
        steps = [[chunk[i] for i in order[k:k + per_step]] for k in range(0, len(order), per_step)]
        if len(steps[-1]) < per_step:
            partial = steps.pop()
        for j in rng.permutation(len(steps)):
            step = steps[j]
            for g in range(0, per_step, world_size):
                group = step[g:g + world_size]
                out.extend(group[::-1] if (g // world_size) % 2 else group)
    return out + partial


@dataclass(frozen=True, kw_only=True)
class EpochPlan:
    """The micro-batches of one epoch, per optimizer step and rank."""

    epoch: int
    world_size: int
    grad_accum: int
    steps: tuple[tuple[np.ndarray, ...], ...]
    """steps[s] = the world_size x grad_accum micro-batches of step s (sample indices; empty ones pad the end)."""

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    def rank_step(self, rank: int, step: int) -> list[np.ndarray]:
        """The grad_accum micro-batches rank `rank` runs at `step` (round robin over the step's micro-batches)."""
        return list(self.steps[step][rank::self.world_size])

    def rank_costs(self, step: int, costs: np.ndarray) -> list[float]:
        """Per rank, the summed per-sample `costs` of its micro-batches at `step` (how balanced the step is)."""
        return [sum(float(costs[mb].sum()) for mb in self.rank_step(r, step)) for r in range(self.world_size)]


def plan_epoch(lengths: np.ndarray, *, seed: int, epoch: int, batch_tokens: int, world_size: int,
               grad_accum: int, costs: np.ndarray | None = None, step_samples: int | None = None,
               order: np.ndarray | None = None) -> EpochPlan:
    """Shuffle, pack and partition one epoch (see the module docstring). `lengths`: int64 [N] tokens per sample;
    `costs`: float [N] (sample_costs) to balance steps of several micro-batches; None keeps the packing order.
    step_samples: steps of that many samples instead (fixed_count_steps; costs unused). order: the epoch's
    sample order (a mixture's, train.mixture) instead of the seeded permutation."""
    assert world_size >= 1 and grad_accum >= 1
    if order is None:
        order = epoch_permutation(len(lengths), seed=seed, epoch=epoch)
    per_step = world_size * grad_accum
    if step_samples is not None:
        steps = fixed_count_steps(order, lengths, step_samples=step_samples, batch_tokens=batch_tokens,
                                  per_step=per_step)
        return EpochPlan(epoch=epoch, world_size=world_size, grad_accum=grad_accum, steps=steps)
    micro = pack_micro_batches(order, lengths, batch_tokens=batch_tokens)
    if costs is not None and per_step > 1 and micro:
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, 0xBA1A])))
        micro_costs = np.array([costs[mb].sum() for mb in micro], dtype=np.float64)
        micro = balance_steps(micro, micro_costs, world_size=world_size, per_step=per_step, window=BALANCE_WINDOW,
                              rng=rng)
    num_steps = -(-len(micro) // per_step)
    micro += [EMPTY] * (num_steps * per_step - len(micro))
    steps = tuple(tuple(micro[s * per_step:(s + 1) * per_step]) for s in range(num_steps))
    return EpochPlan(epoch=epoch, world_size=world_size, grad_accum=grad_accum, steps=steps)


def fixed_count_steps(order: np.ndarray, lengths: np.ndarray, *, step_samples: int, batch_tokens: int,
                      per_step: int) -> tuple[tuple[np.ndarray, ...], ...]:
    """Optimizer steps of `step_samples` consecutive samples of `order` each (the last one the rest), each packed
    into micro-batches of at most batch_tokens and padded with empty ones to `per_step` (world_size x grad_accum),
    as trainers that batch by sequence count step (SpecForge: --batch-size 1 x --accumulation-steps). Why: the
    gradient clip rescales every step whose gradient norm exceeds it (the mean of every log window of the SmolLM2
    reference run does), so under token-budget steps a sample's weight is 1 / its step's sample count, larger for
    long samples (fewer fit a budget); here every sample's is 1 / step_samples. ConfigError when a step needs more
    than `per_step` micro-batches."""
    steps = []
    for start in range(0, len(order), step_samples):
        micro = pack_micro_batches(order[start:start + step_samples], lengths, batch_tokens=batch_tokens)
        if len(micro) > per_step:
            raise ConfigError(f"step_samples={step_samples}: a step's samples need {len(micro)} micro-batches of "
                              f"batch_tokens {batch_tokens}, more than world_size x grad_accum = {per_step}; raise "
                              "grad_accum or batch_tokens")
        steps.append(tuple(micro) + (EMPTY,) * (per_step - len(micro)))
    return tuple(steps)


def config_plan(cfg, index: "SampleIndex", *, epoch: int, world_size: int, costs: np.ndarray | None = None,
                counts: np.ndarray | None = None) -> EpochPlan:
    """plan_epoch of the samples of `index` (a reader's: lengths, and where each is stored) with a TrainConfig's
    data settings (data_seed, batch_tokens, grad_accum, step_samples; shuffle_block: runs of storage neighbours,
    block_permutation; cache_weights: the mixture order over caches of `counts` samples each, whose indexes
    `index` concatenates; None counts = one cache)."""
    order = None
    if cfg.cache_weights is not None:
        from dflash.train.mixture import mixture_epoch

        order = mixture_epoch(counts=[len(index.length)] if counts is None else counts, weights=cfg.cache_weights,
                              seed=cfg.data_seed, epoch=epoch).order
    elif cfg.shuffle_block:
        order = block_permutation(storage_order(index.shard, index.offset), block=cfg.shuffle_block,
                                  seed=cfg.data_seed, epoch=epoch)
    return plan_epoch(index.length, seed=cfg.data_seed, epoch=epoch, batch_tokens=cfg.batch_tokens,
                      world_size=world_size, grad_accum=cfg.grad_accum, costs=costs, step_samples=cfg.step_samples,
                      order=order)


def anchor_seed(*, seed: int, epoch: int, sample_id: int) -> int:
    """A 63-bit seed for the anchor generator of one sample in one epoch: independent of rank, step and
    batch composition, so DDP and resume draw the same anchors."""
    return int(np.random.SeedSequence([seed, epoch, sample_id, 0xA7C]).generate_state(1, np.uint64)[0] >> 1)


# ------------------------------------------------------------------------------------------- streaming loader


@dataclass
class MicroBatch:
    """One micro-batch on the compute device. An empty micro-batch (padding of the last step) has N = 0."""

    sample_ids: np.ndarray       # int64 [N] (host)
    lengths: np.ndarray          # int64 [N] (host)
    input_ids_T: torch.Tensor    # int64 [T]
    loss_mask_T: torch.Tensor    # bool [T]
    hidden_TKD: torch.Tensor     # compute dtype [T,K,D]; [T,0,D] from a loader with read_hidden=False (online)
    blocks: HostBlocksByRule = field(default_factory=dict)
    """Anchors drawn by the loader's host_fn in the reader thread, per anchor rule of the stream's drafters."""

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def is_empty(self) -> bool:
        return len(self.sample_ids) == 0


@dataclass
class _HostBatch:
    packed: "PackedSamples | None"   # None: an empty (padding) micro-batch
    blocks: HostBlocksByRule
    buffers: "PackedBuffers | None"  # pinned buffers to give back after the H2D copy


@dataclass
class LoaderStats:
    """Host time spent waiting for the next micro-batch (the loader stall) since the last reset."""

    wait_s: float = 0.0
    batches: int = 0
    last_reset: float = field(default_factory=time.perf_counter)

    def reset(self) -> None:
        self.wait_s, self.batches, self.last_reset = 0.0, 0, time.perf_counter()


class StreamingLoader:
    """Streams this rank's micro-batches of one epoch plan, from `start_step` on.

    Reader threads call `reader.read_many` into pinned host buffers (pinned only when CUDA is available; on CPU
    each read allocates and the tensors are used in place). The main thread copies a finished host batch to the
    device with one non_blocking copy per array on a side stream, makes the compute stream wait for it,
    `record_stream`s the device tensors and hands the buffer back once the copy's event has fired. fp8 bits and
    4-bit codes are decoded on the device (format.decode_stored). Nothing here synchronises the host with the GPU.

    read_hidden=False (`dflash train --online`): the same micro-batches, sample order, ids, loss masks and
    host_fn results, but no hidden or scale bytes are read; hidden_TKD is [T, 0, D] for the caller to fill.
    """

    def __init__(self, reader: "CacheReader", plan: EpochPlan, *, rank: int, start_step: int, taps: Sequence[int],
                 device: torch.device, dtype: torch.dtype, num_readers: int = 2, prefetch: int = 4,
                 host_fn: HostFn | None = None, read_hidden: bool = True) -> None:
        self.reader, self.plan, self.rank = reader, plan, rank
        self.read_hidden = read_hidden
        self.taps, self.device, self.dtype = tuple(taps), device, dtype
        self._read_taps: tuple[int, ...] = self.taps if read_hidden else ()
        self.host_fn = host_fn
        self.stats = LoaderStats()
        self._work: list[np.ndarray] = [mb for s in range(start_step, plan.num_steps)
                                        for mb in plan.rank_step(rank, s)]
        self._pos = 0
        self._cuda = device.type == "cuda"
        self._prefetch = max(1, prefetch)
        self._pool = cf.ThreadPoolExecutor(max_workers=max(1, num_readers), thread_name_prefix="dflash-reader")
        self._futures: list[cf.Future] = []
        self._free: queue.Queue = queue.Queue()
        self._closed = threading.Event()
        if self._cuda:
            self._side = torch.cuda.Stream(device=device)
            max_tokens = max([int(reader.index.length[mb].sum()) for mb in self._work] + [1])
            for _ in range(self._prefetch):
                self._free.put((_alloc_pinned(reader, max_tokens, len(self._read_taps)), None))
        self._next_submit = 0
        self._fill()

    # --- reader side

    def _fill(self) -> None:
        while self._next_submit < len(self._work) and len(self._futures) < self._prefetch:
            self._futures.append(self._pool.submit(self._read, self._work[self._next_submit]))
            self._next_submit += 1

    def _read(self, indices: np.ndarray) -> _HostBatch:
        if len(indices) == 0:
            return _HostBatch(packed=None, blocks={}, buffers=None)
        buffers = None
        if self._cuda:
            buffers, event = self._free.get()
            if event is not None:
                event.synchronize()  # the previous H2D copy out of this buffer must finish before we overwrite it
        packed = self.reader.read_many(indices, taps=self._read_taps, out=buffers)
        blocks = self.host_fn(packed, self.plan.epoch) if self.host_fn is not None else {}
        return _HostBatch(packed=packed, blocks=blocks, buffers=buffers)

    # --- consumer side

    def __len__(self) -> int:
        return len(self._work)

    def __iter__(self) -> Iterator[MicroBatch]:
        while self._pos < len(self._work):
            yield self.next()

    def next(self) -> MicroBatch:
        assert self._pos < len(self._work), "loader exhausted"
        t0 = time.perf_counter()
        host: _HostBatch = self._futures.pop(0).result()
        self.stats.wait_s += time.perf_counter() - t0
        self.stats.batches += 1
        self._pos += 1
        self._fill()
        return self._to_device(host)

    def _to_device(self, host: _HostBatch) -> MicroBatch:
        d = self.device
        if host.packed is None:
            k = len(self.taps)
            hidden_size = int(self.reader.hidden_size)
            return MicroBatch(sample_ids=EMPTY, lengths=EMPTY, input_ids_T=torch.zeros(0, dtype=torch.long, device=d),
                              loss_mask_T=torch.zeros(0, dtype=torch.bool, device=d),
                              hidden_TKD=torch.zeros(0, k, hidden_size, dtype=self.dtype, device=d))
        p = host.packed
        if host.buffers is not None:
            # the pinned tensors themselves: a tensor made from the numpy view would not count as pinned,
            # and a copy from pageable memory synchronises the stream
            T = int(np.asarray(p.lengths).sum())
            arrays = {"input_ids": host.buffers.input_ids[:T], "loss_mask": host.buffers.loss_mask[:T],
                      "hidden": p.hidden}
        else:
            arrays = {"input_ids": _as_tensor(p.input_ids), "loss_mask": _as_tensor(p.loss_mask), "hidden": p.hidden}
        if p.scales is not None:
            arrays["scales"] = p.scales
        if p.group_scales is not None:
            arrays["group_scales"] = p.group_scales
        if not self.read_hidden:  # nothing to copy: the caller computes the taps (online training)
            for name in ("hidden", "scales", "group_scales"):
                arrays.pop(name, None)
        if self._cuda:
            main = torch.cuda.current_stream(d)
            with torch.cuda.stream(self._side):
                dev = {k: v.to(d, non_blocking=True) for k, v in arrays.items()}
                event = torch.cuda.Event()
                event.record(self._side)
            main.wait_stream(self._side)
            for t in dev.values():
                t.record_stream(main)  # the caching allocator must not recycle these while main still uses them
            self._free.put((host.buffers, event))
        else:
            dev = arrays
        if self.read_hidden:
            from dflash.cache.format import decode_stored

            # on the compute device: 4-bit decode (incl. the Hadamard matmul) and fp8 dequantization run there
            hidden = decode_stored(dev["hidden"], dev.get("scales"), dev.get("group_scales"),
                                   storage=self.reader.storage, dtype=self.dtype)
        else:
            T = int(np.asarray(p.lengths).sum())
            hidden = torch.zeros(T, 0, int(self.reader.hidden_size), dtype=self.dtype, device=d)
        return MicroBatch(sample_ids=np.asarray(p.sample_ids, dtype=np.int64),
                          lengths=np.asarray(p.lengths, dtype=np.int64),
                          input_ids_T=dev["input_ids"].long(), loss_mask_T=dev["loss_mask"].bool(),
                          hidden_TKD=hidden, blocks=host.blocks)

    def close(self) -> None:
        for f in self._futures:
            f.cancel()
        self._futures.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "StreamingLoader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _as_tensor(a: Any) -> torch.Tensor:
    return a if isinstance(a, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(a))


def _alloc_pinned(reader: "CacheReader", max_tokens: int, num_taps: int) -> "PackedBuffers":
    from dflash.cache.reader import PackedBuffers

    return PackedBuffers.allocate(tokens=max_tokens, num_taps=num_taps, hidden_size=int(reader.hidden_size),
                                  storage=reader.storage, pin_memory=True)
