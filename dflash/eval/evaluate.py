"""`dflash eval`: exact greedy tau of a drafter over every sequence of an eval cache, per source and overall.

The cache must be marked target_greedy (its responses are the target's own greedy outputs, `dflash generate`
then `dflash extract`); on any other cache the accept chain follows a path the target would not have taken,
so the number is only an approximation and is refused unless `approximate=True`.
tau of one sequence = mean tokens per target step along its accept chain (tau.py); tau of a source = mean
over its sequences; overall = mean over all sequences (method doc 6: per prompt, then over prompts).
L(a) at every anchor comes from dflash.eval.batched: chunks of <= chunk_anchors blocks over consecutive
sequences, each chunk's sequences read from the cache when it runs (memory: one chunk's sequences and
chunk_anchors x block size query rows). Held-out eval during training (heldout.py) runs the same plan on the
same sequences held on the device, so the two agree bit for bit at the same dtype and chunk_anchors.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np

from dflash.dtypes import check_dtype_name, default_dtype, dtype_of
from dflash.errors import CacheMismatchError, ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """How `dflash eval` runs."""

    chunk_anchors: int | None = None
    """Blocks per masked drafter forward (memory ~ chunk_anchors x block_size query rows); None =
    batched.DEFAULT_CHUNK_ANCHORS, what held-out eval uses (the same value gives the same forwards)."""
    approximate: bool = False
    """Allow a cache that is not marked target_greedy (tau is then only an approximation)."""
    device: str | None = None
    """cuda / cpu; default cuda when available."""
    dtype: str | None = None
    """Drafter compute dtype; default bfloat16 on GPU (serving dtype), float32 on CPU."""
    limit: int | None = None
    """Evaluate only the first `limit` sequences of the cache (by sample id)."""

    def __post_init__(self) -> None:
        if self.chunk_anchors is not None and self.chunk_anchors < 1:
            raise ConfigError(f"chunk_anchors={self.chunk_anchors}: must be >= 1 (or unset for the default)")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"limit={self.limit}: must be >= 1")
        if self.dtype is not None:
            check_dtype_name(self.dtype)


@dataclass(kw_only=True)
class TauStats:
    """Accept-chain statistics of a group of sequences."""

    name: str
    block_size: int
    per_sequence_tau: list[float] = field(default_factory=list)
    sequence_ids: list[int] = field(default_factory=list)
    """sequence_ids[i]: the sample id (cache index) of per_sequence_tau[i]; a 1-token response has neither."""
    step_counts: list[int] = field(default_factory=list)
    """step_counts[k] = target steps that emitted k tokens (index 0 unused; k = 1..block_size)."""
    per_sequence_steps: list[np.ndarray] = field(default_factory=list)
    """per_sequence_steps[i]: the tokens each target step of sequence i emitted, in order (its accept chain;
    int16, so a large eval set's chains stay small)."""
    response_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.step_counts:
            self.step_counts = [0] * (self.block_size + 1)

    def add(self, steps: list[int], response_tokens: int, sequence_id: int = -1) -> None:
        if not steps:
            return  # a 1-token response has no step to count
        self.per_sequence_tau.append(float(np.mean(steps)))
        self.per_sequence_steps.append(np.asarray(steps, dtype=np.int16))
        self.sequence_ids.append(sequence_id)
        for s in steps:
            self.step_counts[s] += 1
        self.response_tokens += response_tokens

    @property
    def num_sequences(self) -> int:
        return len(self.per_sequence_tau)

    @property
    def tau(self) -> float:
        return float(np.mean(self.per_sequence_tau)) if self.per_sequence_tau else float("nan")

    @property
    def num_steps(self) -> int:
        return sum(self.step_counts)

    def to_json(self) -> dict:
        n = self.num_steps
        return {"name": self.name, "tau": self.tau, "num_sequences": self.num_sequences, "num_steps": n,
                "response_tokens": self.response_tokens,
                "tau_token_weighted": (sum(k * c for k, c in enumerate(self.step_counts)) / n) if n else None,
                "accept_length_counts": {str(k): c for k, c in enumerate(self.step_counts) if k},
                "accept_length_fraction": {str(k): c / n for k, c in enumerate(self.step_counts) if k and n}}


@dataclass(frozen=True, kw_only=True)
class EvalResult:
    overall: TauStats
    per_source: list[TauStats]
    target_greedy: bool
    """False only with approximate=True on an unmarked cache."""
    drafter: str
    cache: str
    block_size: int
    dtype: str
    seconds: float

    def to_json(self) -> dict:
        return {"tau": self.overall.tau, "exact": self.target_greedy, "drafter": self.drafter, "cache": self.cache,
                "block_size": self.block_size, "dtype": self.dtype, "seconds": self.seconds,
                "overall": self.overall.to_json(), "sources": [s.to_json() for s in self.per_source]}


def chain_stats(accept_T: np.ndarray, *, lengths: np.ndarray, spans: np.ndarray, names: list[str],
                block_size: int, sample_ids: np.ndarray | None = None) -> tuple[TauStats, list[TauStats]]:
    """Walk every sequence's accept chain over L(a) (packed int64 [T], batched.accept_lengths_chunks) and
    gather (overall, per source in first-seen order); names[i] = sequence i's source, sample_ids[i] its id
    (TauStats.sequence_ids; default its position i)."""
    from dflash.eval.tau import walk_accept_chain

    ids = np.arange(len(lengths)) if sample_ids is None else np.asarray(sample_ids)
    assert len(ids) == len(lengths) == len(names), "one id and one source name per sequence"
    overall = TauStats(name="overall", block_size=block_size)
    groups: dict[str, TauStats] = {}
    off = 0
    for i, ((start, end), n) in enumerate(zip(np.asarray(spans).tolist(), np.asarray(lengths).tolist())):
        steps = walk_accept_chain(accept_T[off: off + n], start, end) if end > start else []
        sid = int(ids[i])
        overall.add(steps, end - start, sid)
        groups.setdefault(names[i], TauStats(name=names[i], block_size=block_size)).add(steps, end - start, sid)
        off += n
    return overall, list(groups.values())


def source_of_sample_ids(sources: list[dict], sample_ids: np.ndarray) -> list[str]:
    """Name (file name) of the data source each sample id came from.

    Sample ids are the running record index over all sources in order (dflash.data), so counting the
    records of each source file gives the ranges. A source file that is gone or has changed (sha256)
    makes every later sample 'unknown'."""
    from dflash.data.readers import iter_raw

    names, bounds, total = [], [], 0
    for s in sources:
        path = s.get("path", "")
        if not os.path.exists(path):
            log.warning("source %s is gone: samples from it on are reported as 'unknown'", path)
            break
        total += sum(1 for _ in iter_raw(path))
        names.append(os.path.basename(path.rstrip("/")))
        bounds.append(total)
    out = []
    for sid in sample_ids.tolist():
        k = int(np.searchsorted(np.asarray(bounds), sid, side="right")) if bounds else 0
        out.append(names[k] if k < len(names) else "unknown")
    return out


def check_target(fingerprint, model_path: str) -> int:
    """The frozen embedding/head must be the cache's target: the rule train applies (hidden size, layer count,
    tokenizer, config.json hash; dflash.target.check). Returns the target's decoder layer count (the cache's
    when model_path is a hub name, which is not checked)."""
    if not os.path.isdir(model_path):
        return fingerprint.num_target_layers
    from transformers import AutoConfig, AutoTokenizer

    from dflash.target.check import check_target_matches
    from dflash.target.load import text_config

    tc = text_config(AutoConfig.from_pretrained(model_path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as e:  # a target folder without tokenizer files
        raise ConfigError(f"cannot load the tokenizer of {model_path!r} ({e}); the cache check needs it") from e
    check_target_matches(fingerprint, model_dir=model_path, tokenizer=tokenizer, embed_hidden=int(tc.hidden_size),
                         num_target_layers=int(tc.num_hidden_layers))
    return int(tc.num_hidden_layers)


def check_greedy(fingerprint, *, cache_dir: str, approximate: bool) -> None:
    if not fingerprint.target_greedy and not approximate:
        raise ConfigError(
            f"cache {cache_dir} is not marked target_greedy: its extraction could not show that the responses are "
            "this target's own greedy outputs (its `target_greedy False (...)` line says why), so tau would not be "
            "exact. Make the eval set with `dflash generate` and extract that, or pass --approximate")


def evaluate_cache(*, drafter_dir: str, cache_dir: str, model: str, cfg: EvalConfig,
                   progress: bool = True) -> EvalResult:
    """Exact greedy tau of the drafter at drafter_dir on the cache at cache_dir (frozen embedding/head of model)."""
    import torch
    from tqdm import tqdm

    from dflash.cache import CacheReader
    from dflash.drafter.export import load_drafter
    from dflash.eval.batched import DEFAULT_CHUNK_ANCHORS, accept_lengths_chunks, forward_only, plan_chunks
    from dflash.eval.tau import response_spans
    from dflash.target.check import DRAFTER_HINT, check_drafter_matches
    from dflash.target.head import embedding_and_head

    t0 = time.perf_counter()
    reader = CacheReader(cache_dir)
    fp = reader.fingerprint
    check_greedy(fp, cache_dir=cache_dir, approximate=cfg.approximate)
    if not fp.target_greedy:
        log.warning("cache %s is not target_greedy: tau is approximate (--approximate)", cache_dir)
    num_target_layers = check_target(fp, model)
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype_name = cfg.dtype or default_dtype(device)
    log.info("drafter dtype %s (%s)", dtype_name, "given" if cfg.dtype else "default for " + device)
    dtype = dtype_of(dtype_name)
    drafter, dcfg = load_drafter(drafter_dir, device=device, dtype=dtype)
    embed_VD, head_VD, info = embedding_and_head(model, dtype=dtype)
    check_drafter_matches(dcfg, num_target_layers=num_target_layers, hidden_size=info.hidden_size,
                          vocab_size=info.vocab_size)
    if dcfg.hidden_size != reader.hidden_size:
        raise CacheMismatchError("hidden_size", dcfg.hidden_size, reader.hidden_size, DRAFTER_HINT,
                                 mine="the drafter's", theirs="the cache's")
    reader.tap_positions(dcfg.target_layer_ids)  # ConfigError naming the cache's taps
    embed_VD, head_VD = embed_VD.to(device), head_VD.to(device)

    n = len(reader) if cfg.limit is None else min(cfg.limit, len(reader))
    sample_ids = reader.index.sample_id[:n]
    names = source_of_sample_ids(list(fp.sources), sample_ids)
    meta = reader.read_many(list(range(n)), taps=())  # ids and masks only: lengths and response spans
    lengths = meta.lengths.astype(np.int64)
    spans = response_spans(meta.loss_mask, lengths=lengths)
    chunks = plan_chunks(lengths=lengths, spans=spans, chunk_anchors=cfg.chunk_anchors or DEFAULT_CHUNK_ANCHORS,
                         block_size=dcfg.block_size)
    bar = tqdm(total=n, desc="eval", unit="seq", disable=not progress)

    def fetch(chunk):
        s = reader.read_many(list(chunk.seqs), taps=dcfg.target_layer_ids, dequantize=True, device=device)
        bar.update(chunk.first_seq + chunk.num_seqs - bar.n)
        return s.hidden.to(device), torch.from_numpy(s.input_ids.astype(np.int64)).to(device)

    try:
        with forward_only(drafter):
            accept_T = accept_lengths_chunks(drafter, chunks, fetch=fetch, embed_VD=embed_VD, lm_head_VD=head_VD,
                                             dtype=dtype, lengths=lengths)
    finally:  # also on an error or Ctrl-C: the bar ends before the message
        bar.close()
    overall, per_source = chain_stats(accept_T, lengths=lengths, spans=spans, names=names,
                                      block_size=dcfg.block_size, sample_ids=sample_ids)
    reader.close()
    return EvalResult(overall=overall, per_source=per_source, target_greedy=fp.target_greedy,
                      drafter=str(drafter_dir), cache=str(cache_dir), block_size=dcfg.block_size,
                      dtype=dtype_name, seconds=time.perf_counter() - t0)


def format_result(res: EvalResult) -> str:
    """A small table: source, sequences, steps, tau, and the accept-length distribution."""
    B = res.block_size
    head = f"{'source':<28} {'seqs':>5} {'steps':>7} {'tau':>6}   accepted tokens per step (fraction, 1..{B})"
    lines = [("exact greedy tau" if res.target_greedy else "APPROXIMATE tau (cache not target_greedy)")
             + f" of {res.drafter} on {res.cache} ({res.dtype}, {res.seconds:.1f} s)", head]
    for st in res.per_source + [res.overall]:
        n = st.num_steps
        dist = " ".join(f"{c / n:.2f}" if n else "-" for c in st.step_counts[1:])
        lines.append(f"{st.name[:28]:<28} {st.num_sequences:>5} {n:>7} {st.tau:>6.3f}   {dist}")
    return "\n".join(lines)
