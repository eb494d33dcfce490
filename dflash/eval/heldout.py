"""Held-out tau during training: exact greedy tau of the live drafter on a target-greedy eval cache.

Shapes: S = eval sequences, T = their tokens packed, K = taps, D = hidden size, V = vocabulary.

Built ONCE per training run on the training device (`HeldoutEvaluator.from_cache`): the cache's taps (the
drafter's target_layer_ids), ids and loss masks of every sequence are read into device memory. Then
`evaluate(drafter, embed_VD=..., lm_head_VD=...)` runs the all-anchor schedule of dflash.eval.batched: L(a) at
every response position in a few large masked forwards (chunks of whole sequences' anchors, sliced out of the
resident set), one host sync, then the accept chains walked on the host. `dflash eval` (evaluate.py) runs
the same plan and the same forwards on the same sequences read from disk, so both report the same tau
bit for bit (also in bf16) for the same drafter, cache, dtype and chunk_anchors.
Cost per evaluation: (response tokens) blocks of B tokens through the drafter and the LM head, in
(response tokens / chunk_anchors) forwards; nothing is kept between calls but the cached features.
Tradeoff: ~tau times the block tokens of following only the chain (a chain visits ~1/tau of the positions),
for a handful of large forwards instead of (longest chain) small sequential ones: the chain-following
version took 19.8 s per evaluation on the H200 (244 SmolLM2 sequences) against 0.19 s per training step.

How the training driver uses it:
    ev = HeldoutEvaluator.from_cache(cfg.eval_cache, taps=drafter.cfg.target_layer_ids, device=device,
                                     model=cfg.model, limit=cfg.eval_limit)          # once, before step 0
    res = ev.evaluate(unit.model, embed_VD=embed, lm_head_VD=head, compute_dtype=compute_dtype)  # every N steps
    metrics.update(res.to_metrics())        # heldout_tau, heldout_tau/<source>, heldout_acc, heldout_seconds
The drafter's train/eval mode, attention backend and compiled element-wise ops are restored after.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from dflash.errors import ConfigError
from dflash.eval.batched import (DEFAULT_CHUNK_ANCHORS, AnchorChunk, accept_lengths_chunks, forward_only,
                                 plan_chunks)
from dflash.eval.evaluate import TauStats, chain_stats, check_greedy, check_target, source_of_sample_ids
from dflash.eval.tau import response_spans

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class HeldoutResult:
    """Held-out tau of one evaluation (the numbers `dflash eval` prints for the same drafter and cache)."""

    overall: TauStats
    """All sequences: tau = mean over sequences of each sequence's mean tokens per target step."""
    per_source: tuple[TauStats, ...]
    """One entry per eval data source (file name), in cache order."""
    seconds: float
    """Wall time of this evaluation (device synchronised)."""
    exact: bool
    """The cache is target_greedy (False only when built with approximate=True on an unmarked cache)."""

    @property
    def tau(self) -> float:
        return self.overall.tau

    @property
    def num_sequences(self) -> int:
        return self.overall.num_sequences

    @property
    def acceptance_by_position(self) -> list[float]:
        """acceptance_by_position[k-1] = fraction of target steps whose draft tokens 1..k were all accepted
        (k = 1..B-1), from the step-length histogram of the accept chains."""
        return acceptance_by_position(self.overall.step_counts)

    @property
    def tau_by_source(self) -> dict[str, float]:
        return {s.name: s.tau for s in self.per_source}

    def to_metrics(self) -> dict:
        """Flat record for metrics.jsonl / TensorBoard (keys prefixed heldout_)."""
        out = {"heldout_tau": self.tau, "heldout_sequences": self.num_sequences,
               "heldout_acc": [round(a, 5) for a in self.acceptance_by_position],
               "heldout_seconds": round(self.seconds, 3)}
        out.update({f"heldout_tau/{name}": tau for name, tau in self.tau_by_source.items()})
        return out

    def to_json(self) -> dict:
        return {"tau": self.tau, "exact": self.exact, "seconds": self.seconds,
                "acceptance_by_position": self.acceptance_by_position, "overall": self.overall.to_json(),
                "sources": [s.to_json() for s in self.per_source]}


def acceptance_by_position(step_counts: list[int]) -> list[float]:
    """From step_counts[k] (target steps that emitted k tokens, k = 1..B): P(L >= k) for k = 1..B-1.

    A step that emitted k tokens accepted k-1 drafts, so the drafts at positions 1..k-1 were accepted."""
    counts = np.asarray(step_counts[1:], dtype=np.float64)  # counts[i] = steps with L = i
    n = counts.sum()
    if n == 0:
        return [float("nan")] * (len(counts) - 1)
    at_least = np.cumsum(counts[::-1])[::-1]  # at_least[i] = steps with L >= i
    return [float(x) for x in at_least[1:] / n]


@dataclass(frozen=True, kw_only=True)
class HeldoutConfig:
    """How the held-out evaluator batches its work."""

    limit: int | None = None
    """Use only the first `limit` sequences of the eval cache (by sample id); None = all."""
    chunk_anchors: int = DEFAULT_CHUNK_ANCHORS
    """Blocks per drafter forward (batched.plan_chunks); `dflash eval` with the same value runs the same
    forwards. Memory ~ chunk_anchors x block size query rows."""
    approximate: bool = False
    """Allow a cache not marked target_greedy (tau then follows a path the target may not take)."""

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"limit={self.limit}: must be >= 1 (or None for every sequence)")
        if self.chunk_anchors < 1:
            raise ConfigError(f"chunk_anchors={self.chunk_anchors}: must be >= 1 (default {DEFAULT_CHUNK_ANCHORS})")


class HeldoutEvaluator:
    """The eval cache resident on one device, and the batched accept-chain evaluation (module docstring)."""

    def __init__(self, *, hidden_TKD: torch.Tensor, input_ids_T: torch.Tensor, lengths: np.ndarray,
                 spans: np.ndarray, source_names: list[str], taps: tuple[int, ...], exact: bool,
                 cfg: HeldoutConfig, sample_ids: np.ndarray | None = None) -> None:
        """Prefer from_cache. hidden_TKD: bf16 taps of all sequences packed, on the evaluation device;
        input_ids_T int64 on that device; lengths int64 [S]; spans int64 [S, 2] = response [start, end);
        sample_ids int64 [S]: the ids TauStats.sequence_ids reports (None: chain_stats' default, 0..S-1)."""
        assert hidden_TKD.shape[0] == input_ids_T.shape[0] == int(lengths.sum()), "packed arrays disagree"
        self.hidden_TKD, self.input_ids_T = hidden_TKD, input_ids_T
        self.lengths, self.spans = lengths, spans
        self.offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        self.source_names, self.taps, self.exact, self.cfg = source_names, taps, exact, cfg
        self.sample_ids = sample_ids
        self.device = hidden_TKD.device

    @classmethod
    def from_cache(cls, cache_dir: str, *, taps: tuple[int, ...] | list[int], device: str | torch.device,
                   model: str | None = None, cfg: HeldoutConfig | None = None) -> "HeldoutEvaluator":
        """Read the eval cache's `taps` (the drafter's target_layer_ids), ids and masks onto `device`.

        ConfigError unless the cache is target_greedy (or cfg.approximate) or when a tap is missing;
        CacheMismatchError when `model` (the training target) is not the cache's target."""
        from dflash.cache import CacheReader

        cfg = cfg or HeldoutConfig()
        t0 = time.perf_counter()
        with CacheReader(cache_dir) as reader:
            fp = reader.fingerprint
            check_greedy(fp, cache_dir=str(cache_dir), approximate=cfg.approximate)
            if model is not None:
                check_target(fp, model)
            reader.tap_positions(taps)  # ConfigError naming the cache's taps
            n = len(reader) if cfg.limit is None else min(cfg.limit, len(reader))
            if n == 0:
                raise ConfigError(f"eval cache {cache_dir} holds no sequence")
            packed = reader.read_many(list(range(n)), taps=list(taps), dequantize=True, device=device)
            sample_ids = np.asarray(reader.index.sample_id[:n])
            names = source_of_sample_ids(list(fp.sources), sample_ids)
        lengths = packed.lengths.astype(np.int64)
        spans = response_spans(packed.loss_mask, lengths=lengths)
        ev = cls(hidden_TKD=packed.hidden.to(device), input_ids_T=torch.from_numpy(
                     packed.input_ids.astype(np.int64)).to(device),
                 lengths=lengths, spans=spans, source_names=names, taps=tuple(taps), exact=fp.target_greedy,
                 cfg=cfg, sample_ids=sample_ids)
        log.info("held-out eval set %s: %d sequences, %d tokens, %d response tokens on %s (%.1f s)", cache_dir, n,
                 int(lengths.sum()), int((spans[:, 1] - spans[:, 0]).sum()), device, time.perf_counter() - t0)
        return ev

    @property
    def num_sequences(self) -> int:
        return len(self.lengths)

    def evaluate(self, drafter, *, embed_VD: torch.Tensor, lm_head_VD: torch.Tensor,
                 compute_dtype: torch.dtype | None = None) -> HeldoutResult:
        """Exact greedy tau of `drafter` (a DFlashDrafter on this evaluator's device) on the eval set.

        embed_VD / lm_head_VD: the frozen target embedding and head (any dtype; cast to the compute dtype).
        compute_dtype: None = the drafter's parameter dtype (what `dflash eval` does with an exported drafter);
        a lower precision (bfloat16 with fp32 master weights) runs under autocast, as training does."""
        if tuple(drafter.cfg.target_layer_ids) != self.taps:
            raise ConfigError(f"drafter taps {list(drafter.cfg.target_layer_ids)} are not the evaluator's "
                              f"{list(self.taps)}: build the evaluator with the drafter's target_layer_ids")
        param_dtype = next(drafter.parameters()).dtype
        use_autocast = compute_dtype is not None and compute_dtype != param_dtype
        amp = (torch.autocast(self.device.type, dtype=compute_dtype) if use_autocast
               else contextlib.nullcontext())
        dtype = compute_dtype if use_autocast else param_dtype
        B = drafter.cfg.block_size
        t0 = time.perf_counter()
        chunks = plan_chunks(lengths=self.lengths, spans=self.spans, chunk_anchors=self.cfg.chunk_anchors,
                             block_size=B)
        with forward_only(drafter), amp:
            accept_T = accept_lengths_chunks(drafter, chunks, fetch=self._rows, embed_VD=embed_VD,
                                             lm_head_VD=lm_head_VD, dtype=dtype, lengths=self.lengths)
        overall, per_source = chain_stats(accept_T, lengths=self.lengths, spans=self.spans,
                                          names=self.source_names, block_size=B, sample_ids=self.sample_ids)
        return HeldoutResult(overall=overall, per_source=tuple(per_source), exact=self.exact,
                             seconds=time.perf_counter() - t0)

    def _rows(self, chunk: AnchorChunk) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's sequences packed (views of the resident set)."""
        lo, hi = int(self.offsets[chunk.first_seq]), int(self.offsets[chunk.first_seq] + chunk.lengths.sum())
        return self.hidden_TKD[lo:hi], self.input_ids_T[lo:hi]
