"""`dflash generate --endpoint URL --served-model NAME`: regeneration through an OpenAI-compatible server
(vLLM, SGLang in production; `transformers serve` in the tests), with the same chunks, rounds, shards and
resume as in-process generation (dflash.generate.run).

Requests are chat completions at temperature 0 with max_tokens, `concurrency` in flight (threads; the stdlib
HTTP client, no extra dependency). A request is retried with exponential backoff on connection errors,
timeouts, 408/429 and 5xx; a 400/413/422 is the server refusing this prompt (e.g. longer than its context):
that conversation ends there, counted as endpoint_rejected. The run stops, with one line naming the endpoint
and the last error, after `max_consecutive_errors` failed attempts in a row (over all requests) or when one
request has failed all its attempts; the chunk in flight is not committed (no conversation is silently
dropped from a committed chunk), so a rerun resumes after the last committed chunk.

Records hold the conversation as text only (the server's token ids are not returned), are marked with the
endpoint and served model, and are never target-greedy: a served engine's kernels, batching and sampling
path are not the extraction target's forward, so extraction tokenizes them as ordinary training data.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

from dflash.data.skips import SkipCounter
from dflash.errors import ConfigError, DflashError
from dflash.generate.conversations import TURN_MODES, Conversation, load_conversations
from dflash.generate.dialog import count, first_messages, new_chunk_stats
from dflash.generate.run import RegenerateStats, finished_or_resuming, in_order, job_of, model_fingerprint, run_chunks
from dflash.generate.turns import GENERATE_FIELD

_RETRY_STATUS = {408, 429}
_REJECT_STATUS = {400, 413, 422}


@dataclass(frozen=True, kw_only=True)
class EndpointConfig:
    """One `dflash generate --endpoint` job."""

    url: str
    """Server base URL (http://host:port or .../v1) or the full .../chat/completions URL."""
    served_model: str
    """The model name the server serves (the request's `model`)."""
    output: str
    """Output .jsonl or .jsonl.gz (as in-process)."""
    model: str | None = None
    """Optional local folder of the served model: recorded (config hash) in the job and the records."""
    data: tuple[str, ...] = ()
    prompts: str | None = None
    turns: str | None = None
    """"all", "first" or "last" (None: all for data, first for a prompt file)."""
    max_new_tokens: int = 512
    max_length: int = 4096
    """Not enforced here (no tokenizer): the server refuses prompts over its own context (endpoint_rejected)."""
    chunk_conversations: int = 1024
    template_kwargs: dict = field(default_factory=dict)
    """Sent as `chat_template_kwargs` (vLLM, SGLang) when not empty."""
    limit: int | None = None
    overwrite: bool = False
    keep_shards: bool = False
    """Keep OUTPUT.parts/shards after the merge (as in-process)."""
    concurrency: int = 8
    """Requests in flight."""
    request_timeout: float = 300.0
    """Seconds per request attempt."""
    retries: int = 4
    """Extra attempts per request after the first (backoff 0.5 s, doubling, capped at 30 s, with jitter)."""
    max_consecutive_errors: int = 8
    """Stop the run after this many failed request attempts in a row (over all requests)."""
    backoff_s: float = 0.5

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "chunk_conversations", "concurrency", "max_consecutive_errors"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.retries < 0 or self.request_timeout <= 0:
            raise ConfigError(f"retries={self.retries} / request_timeout={self.request_timeout}: need >= 0 / > 0")
        if self.turns is not None and self.turns not in TURN_MODES:
            raise ConfigError(f"turns={self.turns!r}: choose one of {', '.join(TURN_MODES)}")
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"--endpoint {self.url!r}: expected an http:// or https:// URL")

    @property
    def turn_mode(self) -> str:
        return self.turns or ("all" if self.data else "first")

    @property
    def completions_url(self) -> str:
        u = self.url.rstrip("/")
        if u.endswith("/chat/completions"):
            return u
        return u + ("/chat/completions" if u.endswith("/v1") else "/v1/chat/completions")


@dataclass(frozen=True)
class Failed:
    """A request that produced no completion."""

    reason: str
    """endpoint_rejected (the server refused the prompt) or request_failed (retries exhausted)."""
    detail: str


class EndpointClient:
    """Chat completions with retries and a consecutive-error stop shared by all threads."""

    def __init__(self, cfg: EndpointConfig) -> None:
        self.cfg = cfg
        self._lock = threading.Lock()
        self.consecutive_errors = 0
        self.last_error = ""
        self.stopped = False
        self.stop_reason = ""
        """Why one request stopped the run (empty: the consecutive-attempt limit did)."""

    def _post(self, body: dict) -> dict:
        req = urllib.request.Request(self.cfg.completions_url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=self.cfg.request_timeout) as resp:
            return json.loads(resp.read().decode())

    def _failed_attempt(self, err: str) -> None:
        with self._lock:
            self.consecutive_errors += 1
            self.last_error = err
            if self.consecutive_errors >= self.cfg.max_consecutive_errors and not self.stopped:
                self.stop_reason = f"{self.consecutive_errors} attempts failed in a row"
                self.stopped = True

    def chat(self, messages: Sequence[dict], *, max_tokens: int) -> tuple[str, str, int] | Failed:
        """(text, finish_reason, completion tokens: the server's usage count, else words), or Failed when the
        server refuses this prompt. Every failed attempt counts toward the consecutive-error stop; a request
        that fails all its attempts stops the run too (its conversation would otherwise be lost from a
        committed chunk)."""
        body: dict = {"model": self.cfg.served_model, "messages": list(messages), "max_tokens": max_tokens,
                      "temperature": 0.0}
        if self.cfg.template_kwargs:
            body["chat_template_kwargs"] = dict(self.cfg.template_kwargs)
        for attempt in range(self.cfg.retries + 1):
            if self.stopped:
                break
            retry = True
            try:
                out = self._post(body)
                choice = out["choices"][0]
                text = choice["message"]["content"] or ""
                with self._lock:
                    self.consecutive_errors = 0
                used = (out.get("usage") or {}).get("completion_tokens")
                return text, str(choice.get("finish_reason") or "stop"), int(used if used is not None
                                                                               else len(text.split()))
            except urllib.error.HTTPError as e:
                detail = e.read().decode(errors="replace")[:200] if e.fp is not None else ""
                err = f"HTTP {e.code}: {detail}".strip()
                if e.code in _REJECT_STATUS:
                    return Failed("endpoint_rejected", err)  # this prompt, not the server: no retry, no count
                retry = e.code in _RETRY_STATUS or e.code >= 500  # 401/403/404: retrying cannot help
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                err = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
            except (KeyError, IndexError, TypeError, ValueError) as e:  # not an OpenAI chat completion
                err = f"malformed response: {type(e).__name__}: {e}"
            self._failed_attempt(err)
            if not retry:
                break
            if attempt < self.cfg.retries:
                delay = min(30.0, self.cfg.backoff_s * (2 ** attempt))
                time.sleep(delay * (0.5 + random.random() / 2))
        with self._lock:
            if not self.stopped:
                self.stop_reason = f"a request failed {attempt + 1} time(s)"
            self.stopped = True
        return Failed("request_failed", self.last_error)

    def chat_many(self, requests: Sequence[Sequence[dict]], *, max_tokens: int,
                  on_done: Callable[[int | None], None] | None = None) -> list[tuple[str, str, int] | Failed]:
        """All requests with `concurrency` in flight; results in request order. Raises DflashError once the
        consecutive-error limit is reached."""
        def one(msgs):
            res = self.chat(msgs, max_tokens=max_tokens)
            if on_done is not None:
                on_done(None if isinstance(res, Failed) else res[2])
            return res

        with ThreadPoolExecutor(max_workers=self.cfg.concurrency) as pool:
            results = list(pool.map(one, requests))
        if self.stopped:
            what = self.stop_reason or f"{self.consecutive_errors} attempts failed in a row"
            raise DflashError(f"endpoint {self.cfg.completions_url}: {what}, stopping (last: {self.last_error}); "
                              "committed chunks are kept, rerun the same command to resume")
        return results


def endpoint_chunk(convs: Sequence[Conversation], *, client: EndpointClient, mode: str, max_new_tokens: int,
                   meta: dict, on_batch: Callable[[int, int], None]) -> tuple[list[dict], dict]:
    """Records of one chunk (input order) and its stats, like dflash.generate.run.regenerate_chunk (tokens:
    the server's completion_tokens, or words when it reports no usage)."""
    stats = new_chunk_stats()
    history: list[list[dict] | None] = [None] * len(convs)
    turns: list[list[dict]] = [[] for _ in convs]
    ended = [False] * len(convs)

    def done(tokens: int | None) -> None:
        if tokens is not None:  # failed requests reach the progress bar with the chunk's end
            on_batch(1, tokens)

    for r in range(max(c.num_generated(mode) for c in convs)):
        rows = []
        for k, conv in enumerate(convs):
            if ended[k] or r >= conv.num_generated(mode):
                continue
            new = first_messages(conv, mode) if r == 0 else [dict(m) for m in conv.turns[r].prompt]
            rows.append((k, new))
        if not rows:
            break
        results = client.chat_many([(history[k] or []) + new for k, new in rows], max_tokens=max_new_tokens,
                                   on_done=done)
        for (k, new), res in zip(rows, results):
            if isinstance(res, Failed):
                count(stats["skipped" if r == 0 else "truncated"], res.reason)
                ended[k] = True
                continue
            text, finish, tokens = res
            reason = {"stop": "eos", "length": "length"}.get(finish, finish)
            history[k] = (history[k] or []) + new + [{"role": "assistant", "content": text}]
            turns[k].append({"stop_reason": reason})
            count(stats, reason if reason in ("eos", "length") else "eos")
            stats["turns"] += 1
            stats["response_tokens"] += tokens
    records = []
    for conv, h, t in zip(convs, history, turns):
        if h is not None and t:
            rec = {"messages": h, GENERATE_FIELD: {**meta, "stop_reason": t[0]["stop_reason"], "turns": t,
                                                   "source": conv.location}}
            if conv.record_id is not None:
                rec["id"] = conv.record_id
            records.append(rec)
    stats["records"] = len(records)
    return records, stats


def regenerate_endpoint(cfg: EndpointConfig, *, progress: bool = True, echo: Callable[[str], None] = print,
                        stop_after: float | None = None) -> RegenerateStats:
    """Run (or resume) one endpoint job; the same output and totals as dflash.generate.run.regenerate."""
    from dflash.generate.output import ShardedOutput, read_job

    t0 = time.perf_counter()
    read_skips = SkipCounter()
    convs = load_conversations(data=cfg.data, prompts=cfg.prompts, limit=cfg.limit, skips=read_skips)
    earlier = (read_job(cfg.output) or {}).get("model") or {}
    served = {"endpoint": cfg.completions_url, "served_model": cfg.served_model,
              "local": model_fingerprint(cfg.model, earlier=earlier.get("local")) if cfg.model else None}
    out = ShardedOutput(cfg.output, job=job_of(cfg, model=served, extra={"endpoint": True}), overwrite=cfg.overwrite)
    try:
        return _run_open(cfg, out=out, convs=convs, read_skips=read_skips, progress=progress, echo=echo,
                         stop_after=stop_after, t0=t0)
    finally:
        out.close()


def _run_open(cfg: EndpointConfig, *, out, convs, read_skips, progress, echo, stop_after, t0) -> RegenerateStats:
    """regenerate_endpoint() once its output is open (and locked)."""
    done = finished_or_resuming(cfg, out=out, convs=convs, read_skips=read_skips, echo=echo, t0=t0)
    if done is not None:
        return done
    client = EndpointClient(cfg)
    meta = {"endpoint": cfg.completions_url, "served_model": cfg.served_model, "target": cfg.model,
            "greedy": False, "temperature": 0.0, "max_new_tokens": cfg.max_new_tokens, "turn_mode": cfg.turn_mode,
            "template_kwargs": dict(cfg.template_kwargs)}

    def process(chunk, on_batch):
        return endpoint_chunk(chunk, client=client, mode=cfg.turn_mode, max_new_tokens=cfg.max_new_tokens,
                              meta=meta, on_batch=on_batch)

    return run_chunks(cfg=cfg, convs=convs, out=out, process_chunks=in_order(process), read_skips=read_skips,
                      progress=progress, t0=t0, stop_after=stop_after)
