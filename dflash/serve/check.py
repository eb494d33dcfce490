"""`dflash serve-check`: does a served drafter accept what `dflash eval` promises?

It sends every response's prompt of a target-greedy eval cache to a vLLM server running the drafter, greedily,
one request at a time, each with max_tokens = that response's length, reads vLLM's spec-decode counters
before and after (dflash.serve.metrics), and sets them beside the counters `dflash eval` implies on the same
cache (its exact offline accept chains, dflash.eval.evaluate). It also checks that the served text is the
cached greedy response token for token.

In float32 the two are equal exactly wherever the engine's float32 drafter logits agree with torch's to within
the drafter's near-ties: the drafter sees the same features and blocks in both, and a greedy target step accepts
the same drafts (measured on the real SmolLM2 with vLLM's CPU build, tests/e2e; on a Xeon with AVX-512-BF16 two
near-tie drafts of 555 went the other way: docs/serve.md). In bf16
they are not: the target's greedy text itself changes between engines at bf16 near-ties (a different matmul
order flips an argmax), and from there the served requests decode other tokens than the cache holds, so only
a tolerance on the acceptance length and per-position rates makes sense (`tolerance`, docs/serve.md).
The server must serve nothing else during a check: its counters are global.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dflash.serve.metrics import SpecDecodeCounts, counts_from_steps, vllm_counts
from dflash.serve.request import CheckRequest


@dataclass(frozen=True, kw_only=True)
class ServeCheckResult:
    served: SpecDecodeCounts
    offline: SpecDecodeCounts
    offline_tau: float
    """dflash eval's headline tau (mean over sequences), for reference."""
    text_mismatches: list[int]
    """Sample ids whose served tokens differ from the cached greedy response."""
    differences: list[str]
    """What differs beyond the tolerance (empty: the check passes)."""
    tolerance: float
    num_requests: int
    server: str
    """The URL, and the command when launched here."""
    eval_source: str = "-"
    """What the responses came from: the eval cache's folder name, or "responses" (`dflash generate` files)."""
    sources: tuple[str, ...] = ()
    """The data sources of those responses: the cache's per-source names, or the response files' names."""
    dtype: str = "float32"
    """dflash eval's dtype (and a launched server's)."""
    engine: str = "vLLM"
    engine_version: str | None = None
    """What the server's /version answered (None: it did not)."""
    seconds: dict[str, float] = field(default_factory=dict)
    differing_requests: list[dict] = field(default_factory=list)
    """request_differences: the requests whose served counters differ from their own offline accept chain."""

    @property
    def ok(self) -> bool:
        return not self.differences

    def to_json(self) -> dict:
        return {"ok": self.ok, "served": self.served.to_json(), "offline": self.offline.to_json(),
                "offline_tau": self.offline_tau, "text_mismatches": self.text_mismatches,
                "differences": self.differences, "tolerance": self.tolerance, "num_requests": self.num_requests,
                "server": self.server, "eval_source": self.eval_source, "sources": list(self.sources),
                "dtype": self.dtype, "engine": self.engine, "engine_version": self.engine_version,
                "seconds": self.seconds, "differing_requests": self.differing_requests}


def compare_counts(served: SpecDecodeCounts, offline: SpecDecodeCounts, *, tolerance: float = 0.0,
                   text_mismatches: int = 0) -> list[str]:
    """What differs between the served and the offline counters, one line each (empty = agree).

    tolerance 0: every count equal and every served text equal to the cached one. tolerance > 0 (bf16): the
    mean acceptance length and each position's acceptance rate within `tolerance` (absolute), text
    mismatches allowed (a bf16 engine decodes other greedy text at near-ties)."""
    out = []
    K_s, K_o = len(served.accepted_per_position), len(offline.accepted_per_position)
    if K_s != K_o:
        return [f"drafted tokens per step: served {K_s} != offline {K_o}"]
    if served.num_drafts == 0:
        return ["the server verified no draft: is speculative decoding on (--speculative-config)?"]
    if tolerance == 0:
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            a, b = getattr(served, name), getattr(offline, name)
            if a != b:
                out.append(f"{name}: served {a} != offline {b}")
        for i, (a, b) in enumerate(zip(served.accepted_per_position, offline.accepted_per_position)):
            if a != b:
                out.append(f"accepted at position {i}: served {a} != offline {b}")
        if text_mismatches:
            out.append(f"{text_mismatches} served response(s) differ from the cached greedy text")
        return out
    a, b = served.mean_acceptance_length, offline.mean_acceptance_length
    if not abs(a - b) <= tolerance:
        out.append(f"mean acceptance length: served {a:.4f} vs offline {b:.4f} (tolerance {tolerance})")
    for i, (x, y) in enumerate(zip(served.acceptance_by_position, offline.acceptance_by_position)):
        if not abs(x - y) <= tolerance:
            out.append(f"acceptance at position {i}: served {x:.4f} vs offline {y:.4f} (tolerance {tolerance})")
    return out


def request_differences(served: dict[int, SpecDecodeCounts], chains: Mapping[int, Sequence[int]], *,
                        num_speculative_tokens: int) -> list[dict]:
    """The requests (by sample id, ascending) whose served counters differ from the ones their offline accept
    chain implies, each with both accepted-per-position lists and the offline chain: where a mismatch sits, so a
    flip of a few drafts in one response reads apart from a server that runs another drafter (every response
    off). A request with no offline chain (a 1-token response) counts as no step."""
    out = []
    for sid in sorted(served):
        steps = [int(s) for s in chains.get(sid, ())]
        hist = [0] * (num_speculative_tokens + 2)
        for s in steps:
            hist[s] += 1
        offline = counts_from_steps(hist, num_speculative_tokens=num_speculative_tokens)
        got = served[sid]
        if (got.num_drafts, got.accepted_per_position) != (offline.num_drafts, offline.accepted_per_position):
            out.append({"sample_id": sid, "served_accepted_per_position": list(got.accepted_per_position),
                        "offline_accepted_per_position": list(offline.accepted_per_position),
                        "offline_chain": steps})
    return out


def cache_requests(cache_dir: str, *, limit: int | None = None) -> list[CheckRequest]:
    """The prompt (everything before the first assistant span) and the response (that span) of each cached
    sequence with a response of >= 2 tokens (dflash eval counts no step for a 1-token response), cache order."""
    from dflash.cache import CacheReader
    from dflash.eval.tau import response_spans

    reader = CacheReader(cache_dir)
    try:
        n = len(reader) if limit is None else min(limit, len(reader))
        meta = reader.read_many(list(range(n)), taps=())
        lengths = meta.lengths.astype(np.int64)
        spans = response_spans(meta.loss_mask, lengths=lengths)
        offs = np.concatenate([[0], np.cumsum(lengths)])
        ids = meta.input_ids.astype(np.int64)
        out = []
        for i in range(n):
            start, end = (int(x) for x in spans[i])
            if end - start < 2:
                continue
            seq = ids[offs[i]: offs[i + 1]]
            out.append(CheckRequest(sample_id=int(reader.index.sample_id[i]), prompt_ids=seq[:start].tolist(),
                                    response_ids=seq[start:end].tolist()))
        return out
    finally:
        reader.close()


def serve_check(*, drafter_dir: str, model: str, cache_dir: str | None = None, responses: str | None = None,
                url: str | None = None, launch=None,
                workdir: str | Path | None = None, port: int | None = None, tolerance: float = 0.0,
                limit: int | None = None, eval_dtype: str = "float32", chunk_anchors: int | None = None,
                echo=print) -> ServeCheckResult:
    """Run the check against the server at `url`, or one started with `launch` (a server.LaunchConfig) in
    `workdir` (its log and caches), on the responses of an eval cache (`cache_dir`) or of a `dflash generate`
    file (`responses`: the target runs here for the features, dflash.serve.responses). eval_dtype: the dtype
    of dflash eval's side (float32 for the exact check)."""
    import tempfile

    from dflash.drafter.export import read_drafter_config
    from dflash.eval.evaluate import EvalConfig, evaluate_cache
    from dflash.procs import free_port
    from dflash.serve import server as srv

    if (url is None) == (launch is None):
        raise ValueError("give exactly one of url and launch")
    if (cache_dir is None) == (responses is None):
        raise ValueError("give exactly one of cache_dir and responses")
    seconds: dict[str, float] = {}
    drafter_cfg = read_drafter_config(drafter_dir)
    if launch is not None and launch.cpu:
        from dflash.drafter.serving import vllm_cpu_refusal
        from dflash.errors import ConfigError

        why = vllm_cpu_refusal(drafter_cfg)
        if why is not None:
            raise ConfigError(f"{why}: check {drafter_dir} against a GPU vLLM (--url, or --vllm-python with --gpu)")
    block = drafter_cfg.block_size
    K = block - 1
    t0 = time.perf_counter()
    if cache_dir is not None:
        res = evaluate_cache(drafter_dir=drafter_dir, cache_dir=cache_dir, model=model,
                             cfg=EvalConfig(dtype=eval_dtype, limit=limit, chunk_anchors=chunk_anchors),
                             progress=False)
        stats = res.overall
        requests = cache_requests(cache_dir, limit=limit)
        eval_source, sources = Path(str(cache_dir).rstrip("/")).name, tuple(s.name for s in res.per_source)
    else:
        from dflash.serve.responses import offline_stats, read_responses

        requests = read_responses(responses, limit=limit)
        stats = offline_stats(drafter_dir=drafter_dir, model=model, requests=requests, dtype=eval_dtype)
        files = [responses] if isinstance(responses, (str, Path)) else list(responses)
        eval_source, sources = "responses", tuple(Path(f).name for f in files)
    seconds["dflash_eval"] = time.perf_counter() - t0
    offline = counts_from_steps(stats.step_counts, num_speculative_tokens=K)
    chains = dict(zip(stats.sequence_ids, stats.per_sequence_steps))

    def counts(base_url: str) -> SpecDecodeCounts:
        try:
            return vllm_counts(srv.metrics_text(base_url), num_speculative_tokens=K)
        except ValueError as e:   # another drafter's K, or not a vLLM server
            raise srv.ServeError(f"{base_url}/metrics: {e}") from e

    def run(base_url: str, server_desc: str) -> ServeCheckResult:
        name = srv.served_model(base_url)
        before = last = counts(base_url)
        t1 = time.perf_counter()
        mismatches, per_request = [], {}
        for r in requests:   # one at a time, the counters read between each: every request's own counts
            got = srv.greedy_completion(base_url, model=name, prompt_ids=r.prompt_ids,
                                        max_tokens=len(r.response_ids))
            now = counts(base_url)
            per_request[r.sample_id], last = now.minus(last), now
            if got != r.response_ids:
                mismatches.append(r.sample_id)
        seconds["requests"] = time.perf_counter() - t1
        served = last.minus(before)
        diffs = compare_counts(served, offline, tolerance=tolerance, text_mismatches=len(mismatches))
        return ServeCheckResult(served=served, offline=offline, offline_tau=stats.tau,
                                text_mismatches=mismatches, differences=diffs, tolerance=tolerance,
                                num_requests=len(requests), server=server_desc, eval_source=eval_source,
                                sources=sources, dtype=eval_dtype, engine_version=srv.engine_version(base_url),
                                seconds=seconds,
                                differing_requests=request_differences(per_request, chains,
                                                                       num_speculative_tokens=K))

    if url is not None:
        return run(url, url)
    wd = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="dflash-serve-check-"))
    server = srv.LocalVllm(launch, target=model, drafter=str(drafter_dir), block_size=block, workdir=wd,
                           port=port or free_port())
    echo(f"starting vLLM (log {server.log_path}): {' '.join(server.argv)}")
    with server:
        seconds["server_start"] = server.start_seconds
        echo(f"vLLM up at {server.url} after {server.start_seconds:.0f} s")
        return run(server.url, f"{server.url} ({' '.join(server.argv)})")


def format_check(res: ServeCheckResult) -> str:
    """Served beside offline: mean acceptance length, counts, per-position acceptance, then the verdict."""
    s, o = res.served, res.offline
    rows = [("mean acceptance length", f"{s.mean_acceptance_length:.4f}", f"{o.mean_acceptance_length:.4f}"),
            ("drafts (target steps)", str(s.num_drafts), str(o.num_drafts)),
            ("draft tokens", str(s.num_draft_tokens), str(o.num_draft_tokens)),
            ("accepted tokens", str(s.num_accepted_tokens), str(o.num_accepted_tokens))]
    rows += [(f"accepted at position {i}", f"{a} ({ra:.3f})" if not math.isnan(ra) else str(a),
              f"{b} ({rb:.3f})" if not math.isnan(rb) else str(b))
             for i, (a, b, ra, rb) in enumerate(zip(s.accepted_per_position, o.accepted_per_position,
                                                    s.acceptance_by_position, o.acceptance_by_position))]
    w = max(len(r[0]) for r in rows)
    lines = [f"served by {res.server}", f"{res.num_requests} greedy responses; dflash eval tau (mean over "
             f"sequences) {res.offline_tau:.4f}", f"{'':<{w}}  {'served (vLLM)':>16}  {'dflash eval':>16}"]
    lines += [f"{a:<{w}}  {b:>16}  {c:>16}" for a, b, c in rows]
    lines.append(f"served text equals the cached greedy text: {res.num_requests - len(res.text_mismatches)}"
                 f"/{res.num_requests}")
    if res.ok:
        lines.append("OK: served acceptance equals dflash eval's" + (" exactly" if res.tolerance == 0 else
                                                                       f" within {res.tolerance}"))
    else:
        lines += ["MISMATCH:"] + [f"  {d}" for d in res.differences]
    if res.differing_requests:
        shown = res.differing_requests[:5]
        lines.append(f"responses whose counts differ: {len(res.differing_requests)}/{res.num_requests} "
                     "(sample id: accepted per position, served | dflash eval)")
        lines += [f"  {d['sample_id']}: {' '.join(map(str, d['served_accepted_per_position']))} | "
                  f"{' '.join(map(str, d['offline_accepted_per_position']))}" for d in shown]
        if len(res.differing_requests) > len(shown):
            lines.append(f"  ... and {len(res.differing_requests) - len(shown)} more (--json lists them all)")
    return "\n".join(lines)
