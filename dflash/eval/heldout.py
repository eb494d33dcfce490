"""Held-out tau during training: exact greedy tau of the live drafter on a target-greedy eval cache, batched.

Shapes: S = eval sequences, T = their tokens packed, K = taps, D = hidden size, A = active sequences in one
drafter forward, B = block size, W = widest context among them, h = query heads, g = key/value heads,
d = head dim, V = vocabulary.

Built ONCE per training run on the training device (`HeldoutEvaluator.from_cache`): the cache's taps (the
drafter's target_layer_ids), ids and loss masks of every sequence are read into device memory. Then
`evaluate(drafter, embed_VD=..., lm_head_VD=...)` gives the same tau as `dflash eval` (evaluate.py + tau.py)
for the same drafter and cache, by a different schedule of the same computation:

- `dflash eval` computes L(a) at EVERY response position of one sequence at a time (masked chunked forward),
  then walks the accept chain (tau.walk_accept_chain). The chain visits only about 1/tau of the positions.
- Here every sequence has one current anchor (its chain position) per iteration, and one drafter forward runs
  the blocks of all active sequences at once; each block's L decides where its sequence goes next. The block
  at anchor a sees its sequence's context positions < a and its own B slots (method doc 6), exactly the view
  of the masked forward. The context K/V of every drafter layer depend only on each position's own features
  (the context is neither re-normed per layer nor updated, drafter/model.py), so they are computed once per
  evaluation for all positions and gathered per iteration.
Cost per evaluation: one context projection of all T positions per layer, plus (response tokens / tau)
blocks of B tokens through the drafter and the LM head, in (longest chain) iterations.
Tradeoff: exactness is the same math, not the same float order: in fp32 the drafts are identical unless an
argmax is a tie to rounding (the tests compare step lists); in bf16 a near-tie can flip either way, as between
any two batchings of `dflash eval`.

How the training driver uses it:
    ev = HeldoutEvaluator.from_cache(cfg.eval_cache, taps=drafter.cfg.target_layer_ids, device=device,
                                     model=cfg.model, limit=cfg.eval_limit)          # once, before step 0
    res = ev.evaluate(unit.model, embed_VD=embed, lm_head_VD=head, compute_dtype=compute_dtype)  # every N steps
    metrics.update(res.to_metrics())        # heldout_tau, heldout_tau/<source>, heldout_acc, heldout_seconds
The drafter's train/eval mode is restored; nothing is kept between calls but the cached features.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from dflash.drafter.blocks import block_input_ids
from dflash.errors import ConfigError
from dflash.eval.evaluate import TauStats, check_greedy, check_target, source_of_sample_ids
from dflash.eval.tau import draft_argmax, leading_matches, response_span, walk_accept_chain

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
    max_context_tokens: int = 1 << 20
    """Bound on (blocks in one drafter forward) x (widest context among them): the gathered context K/V of one
    layer are this many rows of g x d (1M rows of the 27B drafter's 8 x 128 bf16 K and V = 4 GiB)."""
    approximate: bool = False
    """Allow a cache not marked target_greedy (tau then follows a path the target may not take)."""

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"limit={self.limit}: must be >= 1 (or None for every sequence)")
        if self.max_context_tokens < 1:
            raise ConfigError(f"max_context_tokens={self.max_context_tokens}: must be >= 1")


def _eager_stance():
    """Run torch.compile'd modules eagerly: a training drafter's compiled elementwise modules
    (compile_elementwise) would recompile for each active-sequence count of the accept-chain loop, since the batch
    shrinks as chains end. Measured on the H200 (benchmarks/results/eval_overhead_h200.json, before this guard):
    11.8 s per evaluation inside training vs 1.65 s for the uncompiled exported drafter on the same cache."""
    set_stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


class HeldoutEvaluator:
    """The eval cache resident on one device, and the batched accept-chain evaluation (module docstring)."""

    def __init__(self, *, hidden_TKD: torch.Tensor, input_ids_T: torch.Tensor, lengths: np.ndarray,
                 spans: np.ndarray, source_names: list[str], taps: tuple[int, ...], exact: bool,
                 cfg: HeldoutConfig) -> None:
        """Prefer from_cache. hidden_TKD: bf16 taps of all sequences packed, on the evaluation device;
        input_ids_T int64 on that device; lengths int64 [S]; spans int64 [S, 2] = response [start, end)."""
        assert hidden_TKD.shape[0] == input_ids_T.shape[0] == int(lengths.sum()), "packed arrays disagree"
        self.hidden_TKD, self.input_ids_T = hidden_TKD, input_ids_T
        self.lengths, self.spans = lengths, spans
        self.offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        self.source_names, self.taps, self.exact, self.cfg = source_names, taps, exact, cfg
        self.device = hidden_TKD.device
        # position of every packed row inside its own sequence (RoPE of the context keys)
        self.pos_T = (torch.arange(hidden_TKD.shape[0], device=self.device)
                      - torch.from_numpy(np.repeat(self.offsets, lengths)).to(self.device))

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
            names = source_of_sample_ids(list(fp.sources), reader.index.sample_id[:n])
        lengths = packed.lengths.astype(np.int64)
        offs = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        spans = np.array([response_span(packed.loss_mask[offs[i]: offs[i + 1]]) for i in range(n)],
                         dtype=np.int64).reshape(n, 2)
        ev = cls(hidden_TKD=packed.hidden.to(device), input_ids_T=torch.from_numpy(
                     packed.input_ids.astype(np.int64)).to(device),
                 lengths=lengths, spans=spans, source_names=names, taps=tuple(taps), exact=fp.target_greedy,
                 cfg=cfg)
        log.info("held-out eval set %s: %d sequences, %d tokens, %d response tokens on %s (%.1f s)", cache_dir, n,
                 int(offs[-1]), int((spans[:, 1] - spans[:, 0]).sum()), device, time.perf_counter() - t0)
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
        was_training = drafter.training
        param_dtype = next(drafter.parameters()).dtype
        use_autocast = compute_dtype is not None and compute_dtype != param_dtype
        amp = (torch.autocast(self.device.type, dtype=compute_dtype) if use_autocast
               else contextlib.nullcontext())
        dtype = compute_dtype if use_autocast else param_dtype
        t0 = time.perf_counter()
        drafter.eval()
        try:
            with torch.no_grad(), amp, _eager_stance():
                accept_T = self._accept_chains(drafter, embed_VD.to(self.device, dtype),
                                               lm_head_VD.to(self.device), dtype)
        finally:
            drafter.train(was_training)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        B = drafter.cfg.block_size
        overall = TauStats(name="overall", block_size=B)
        groups: dict[str, TauStats] = {}
        for i in range(self.num_sequences):
            (start, end), off = self.spans[i], self.offsets[i]
            steps = walk_accept_chain(accept_T[off: off + self.lengths[i]], int(start), int(end)) if end > start else []
            overall.add(steps, int(end - start))
            name = self.source_names[i]
            groups.setdefault(name, TauStats(name=name, block_size=B)).add(steps, int(end - start))
        return HeldoutResult(overall=overall, per_source=tuple(groups.values()), exact=self.exact,
                             seconds=time.perf_counter() - t0)

    # ------------------------------------------------------------------------------------------ internals

    def _context_kv(self, drafter, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k [g, T, d] normed and rotated at each row's own position, v [g, T, d])."""
        T, cfg = self.hidden_TKD.shape[0], drafter.cfg
        rows = max(1, (1 << 27) // max(1, self.hidden_TKD[0].numel() * 4))  # fc input chunk <= 128 MiB fp32
        ctx_TD = torch.cat([drafter.context(self.hidden_TKD[i: i + rows].to(dtype)) for i in range(0, T, rows)])
        ctx_TD = ctx_TD.to(dtype)  # as DFlashDrafter.forward casts the context to the block dtype
        cos, sin = _rope(drafter, self.pos_T, dtype)
        kv = []
        for layer in drafter.layers:
            at = layer.self_attn
            k = at.k_norm(at.k_proj(ctx_TD).view(T, at.num_kv_heads, at.head_dim)).transpose(0, 1)
            v = at.v_proj(ctx_TD).view(T, at.num_kv_heads, at.head_dim).transpose(0, 1)
            kv.append((at.rope_fn(k, cos, sin).to(v.dtype), v))
        del cfg
        return kv

    def _accept_chains(self, drafter, embed_VD: torch.Tensor, lm_head_VD: torch.Tensor,
                       dtype: torch.dtype) -> np.ndarray:
        """L(pos) at every position the accept chains visit (int64 [T], packed; 0 elsewhere)."""
        B, mask_id = drafter.cfg.block_size, drafter.cfg.mask_token_id
        kv = self._context_kv(drafter, dtype)
        accept_T = np.zeros(self.hidden_TKD.shape[0], dtype=np.int64)
        pos_S = self.spans[:, 0].copy()
        end_S = self.spans[:, 1]
        while True:
            active = np.flatnonzero(pos_S < end_S - 1)  # the rule of walk_accept_chain: steps while pos < end-1
            if active.size == 0:
                break
            # widest contexts first, so each forward's padding to its widest member stays small
            active = active[np.argsort(-pos_S[active], kind="stable")]
            for group in _groups(pos_S[active], budget=self.cfg.max_context_tokens):
                seqs = active[group]
                L_A = self._blocks(drafter, kv, embed_VD, lm_head_VD, seqs=seqs, anchors=pos_S[seqs],
                                   ends=end_S[seqs], block_size=B, mask_token_id=mask_id)
                accept_T[self.offsets[seqs] + pos_S[seqs]] = L_A
                pos_S[seqs] += np.minimum(L_A, end_S[seqs] - 1 - pos_S[seqs]) + 1
        return accept_T

    def _blocks(self, drafter, kv, embed_VD, lm_head_VD, *, seqs: np.ndarray, anchors: np.ndarray,
                ends: np.ndarray, block_size: int, mask_token_id: int) -> np.ndarray:
        """One drafter forward over the blocks anchored at `anchors` of sequences `seqs`: L per block."""
        dev, B = self.device, block_size
        A, W = len(seqs), int(anchors.max())
        off_A = torch.from_numpy(self.offsets[seqs]).to(dev)
        a_A = torch.from_numpy(anchors).to(dev)
        end_A = torch.from_numpy(ends).to(dev)
        offs_B = torch.arange(B, device=dev)
        q_pos_AB = a_A[:, None] + offs_B
        ids_AB = block_input_ids(self.input_ids_T[off_A + a_A], block_size=B, mask_token_id=mask_token_id)
        # context rows of each block: its sequence's positions 0..anchor-1 (padded to W, masked off)
        j_W = torch.arange(W, device=dev)
        rows_AW = (off_A[:, None] + j_W).clamp(max=self.hidden_TKD.shape[0] - 1)
        mask_ABK = torch.cat([(j_W[None] < a_A[:, None]), torch.ones(A, B, dtype=torch.bool, device=dev)], 1)
        mask_ABK = mask_ABK[:, None, None, :]  # [A, 1, 1, W+B]: every head and block slot sees the same keys
        cos, sin = _rope(drafter, q_pos_AB.reshape(-1), embed_VD.dtype)
        x_QD = embed_VD[ids_AB.reshape(-1)]
        for layer, (k_ctx, v_ctx) in zip(drafter.layers, kv):
            at = layer.self_attn
            h, g, d = at.num_heads, at.num_kv_heads, at.head_dim
            y_QD = layer.input_layernorm(x_QD)
            q = at.q_norm(at.q_proj(y_QD).view(A * B, h, d)).transpose(0, 1)
            k = at.k_norm(at.k_proj(y_QD).view(A * B, g, d)).transpose(0, 1)
            v = at.v_proj(y_QD).view(A * B, g, d).transpose(0, 1)
            q = at.rope_fn(q, cos, sin).to(v.dtype)
            k = at.rope_fn(k, cos, sin).to(v.dtype)
            # [g, A*B, d] -> [A, g, B, d]; context [g, A, W, d] -> [A, g, W, d]; keys = [context; own block]
            k_all = torch.cat([k_ctx[:, rows_AW].transpose(0, 1).to(v.dtype), k.view(g, A, B, d).transpose(0, 1)], 2)
            v_all = torch.cat([v_ctx[:, rows_AW].transpose(0, 1).to(v.dtype), v.view(g, A, B, d).transpose(0, 1)], 2)
            o = F.scaled_dot_product_attention(q.view(h, A, B, d).transpose(0, 1), k_all, v_all,
                                               attn_mask=mask_ABK, enable_gqa=True)  # [A, h, B, d]
            x_QD = x_QD + at.o_proj(o.transpose(1, 2).reshape(A * B, h * d))
            x_QD = x_QD + layer.mlp(layer.post_attention_layernorm(x_QD))
        out_ABD = drafter.norm(x_QD).view(A, B, -1)
        draft_AW = draft_argmax(out_ABD[:, 1:].reshape(A * (B - 1), -1), lm_head_VD).view(A, B - 1)
        pos_AW = q_pos_AB[:, 1:]
        ref_AW = torch.where(pos_AW < end_A[:, None],
                             self.input_ids_T[(off_A[:, None] + pos_AW).clamp(max=self.input_ids_T.shape[0] - 1)],
                             -1)
        return leading_matches(draft_AW, ref_AW).cpu().numpy()


def _rope(drafter, pos_N: torch.Tensor, dtype: torch.dtype):
    from dflash.drafter.model import rope_cos_sin

    cfg = drafter.cfg
    return rope_cos_sin(pos_N, head_dim=cfg.head_dim, theta=cfg.rope_theta, dtype=dtype)


def _groups(widths_desc: np.ndarray, *, budget: int) -> list[np.ndarray]:
    """Cut sequences sorted by context width (descending) into forwards of count x widest <= budget
    (at least one sequence each)."""
    groups, i, n = [], 0, len(widths_desc)
    while i < n:
        take = max(1, budget // max(1, int(widths_desc[i])))
        groups.append(np.arange(i, min(n, i + take)))
        i += take
    return groups
