"""The `dflash generate` driver: conversations in, regenerated conversations out, resumable.

The conversations (in input order) are cut into chunks of `chunk_conversations`; a chunk is regenerated
round by round (round r decodes turn r of every conversation of the chunk still going, in length-sorted
batches) and committed as one shard (dflash.generate.output). The batches depend on the chunk's conversations
only, so a resumed run redoes an uncommitted chunk exactly as an uninterrupted run would. Tradeoff: a bigger
chunk sorts more prompts together (less padding, fuller late rounds) but loses more work to a kill.

A conversation ends early, keeping the turns done, when its next prompt leaves no room under max_length
(over_length) or the template rewrites the history (template_prefix_mismatch); a conversation whose first
prompt is already too long is skipped (prompt_over_length). Both are counted by reason.
"""

from __future__ import annotations

import logging
import os
import pathlib
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from dflash import ctrl_c
from dflash.data.skips import SkipCounter
from dflash.errors import ConfigError
from dflash.generate.conversations import TURN_MODES, Conversation, load_conversations
from dflash.generate.dialog import ConversationRun, DialogRules, chunk_records, count, new_chunk_stats

log = logging.getLogger(__name__)

JOB_BACKENDS = ("auto", "eager", "static", "continuous")


@dataclass(frozen=True, kw_only=True)
class RegenerateConfig:
    """One `dflash generate` job (everything but device placement goes into the job fingerprint)."""

    model: str
    """Target model: local HF folder."""
    output: str
    """Output .jsonl or .jsonl.gz; its parts folder OUTPUT.parts holds the shards until the end."""
    data: tuple[str, ...] = ()
    """Conversation data files (formats of dflash.data); exclusive with prompts."""
    prompts: str | None = None
    """A prompt file (MT-Bench, HumanEval, chats; dflash.generate.conversations)."""
    turns: str | None = None
    """"all", "first" or "last"; None: "all" for data, "first" for a prompt file (eval prompts are turn 1)."""
    max_new_tokens: int = 512
    """Most tokens generated per turn (the stop token counts)."""
    max_length: int = 4096
    """Most tokens of a whole regenerated conversation (prompts + responses)."""
    batch_size: int = 64
    """Most prompts per decode batch."""
    chunk_conversations: int = 1024
    """Conversations per committed shard (the unit of resume)."""
    backend: str = "auto"
    """"eager" / "static" (round-by-round batches, dflash.generate.decode), "continuous" (one request per turn,
    dflash.generate.continuous: the slot decoder of dflash.generate.slots, or transformers' continuous batching
    for models it does not support) or "auto" (static on CUDA, eager elsewhere)."""
    window: int = 2048
    """continuous backend: most conversations in flight (chunks are admitted in order while fewer are)."""
    template_kwargs: dict = field(default_factory=dict)
    """Extra chat-template arguments, e.g. {"enable_thinking": False}."""
    limit: int | None = None
    """Use only the first `limit` usable conversations."""
    dtype: str | None = None
    """Target dtype; None: bfloat16 on CUDA, float32 on CPU."""
    device: str | None = None
    """cuda / cpu; None: cuda when available."""
    overwrite: bool = False
    """Replace an existing output of another job."""
    keep_shards: bool = False
    """Keep OUTPUT.parts/shards after the merge (pieces under 16 MiB to move; in chunk order they are OUTPUT)."""
    temperature: float = 0.0
    """0: greedy (the target's greedy responses: eval caches need them). > 0: sampled from softmax(logits /
    temperature), reproducibly whatever the batching (dflash.generate.sampling); needs the continuous backend's
    slot decoder (backend auto picks it); the records are marked greedy: false with the temperature and seed."""
    seed: int = 0
    """Sampling seed (with temperature > 0): another seed samples other responses to the same conversations."""

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "max_length", "batch_size", "chunk_conversations"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.backend not in JOB_BACKENDS:
            raise ConfigError(f"backend={self.backend!r}: choose one of {', '.join(JOB_BACKENDS)}")
        if self.window < 1:
            raise ConfigError(f"window={self.window}: must be >= 1")
        if self.turns is not None and self.turns not in TURN_MODES:
            raise ConfigError(f"turns={self.turns!r}: choose one of {', '.join(TURN_MODES)}")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"limit={self.limit}: must be >= 1 (or unset for all conversations)")
        if not self.temperature >= 0:
            raise ConfigError(f"temperature={self.temperature}: must be >= 0 (0 = greedy)")
        if self.temperature > 0 and self.backend not in ("auto", "continuous"):
            raise ConfigError(f"temperature={self.temperature} with backend={self.backend}: sampling runs in the "
                              "continuous backend's slot decoder; use --backend continuous (or auto)")

    @property
    def turn_mode(self) -> str:
        return self.turns or ("all" if self.data else "first")


@dataclass(frozen=True, kw_only=True)
class RegenerateStats:
    """What one run produced (totals over every chunk of the job, resumed ones included)."""

    output: str
    records: int
    turns: int
    """Responses generated."""
    stopped_at_eos: int
    hit_max_tokens: int
    response_tokens: int
    skipped: dict
    """Conversations not written, by reason (unreadable records, prompt_over_length, template_error, ...)."""
    truncated: dict
    """Conversations ended before their last turn, by reason (over_length, template_prefix_mismatch)."""
    resumed_chunks: int
    """Chunks found committed by an earlier run."""
    already_complete: bool
    seconds: float
    complete: bool = True
    """False when the run stopped at its time limit (stop_after) with chunks left: rerun to continue."""

    def summary(self) -> str:
        sk = ", ".join(f"{r}={n}" for r, n in sorted(self.skipped.items())) or "none"
        tr = ", ".join(f"{r}={n}" for r, n in sorted(self.truncated.items())) or "none"
        head = ("already complete (same job): " if self.already_complete else
                "" if self.complete else "stopped at the time limit, rerun the same command to continue; so far: ")
        return (f"{head}wrote {self.records} conversations, {self.turns} responses ({self.stopped_at_eos} stopped "
                f"at eos, {self.hit_max_tokens} hit the token limit), {self.response_tokens} response tokens in "
                f"{self.output}; skipped: {sk}; truncated: {tr}")


DecodeFn = Callable[[list[list[int]], list[int]], list]
"""(prompt ids per row, token budget per row) -> dflash.generate.decode.Decoded per row, in order."""


def regenerate_chunk(convs: Sequence[Conversation], *, decode: DecodeFn, rules: DialogRules, meta: dict
                     ) -> tuple[list[dict], dict]:
    """Records of one chunk (input order) and its stats (dflash.generate.dialog.new_chunk_stats). Round r
    decodes turn r of every conversation still going, in one decode() call."""
    stats = new_chunk_stats()
    runs = [ConversationRun(c, rules=rules, stats=stats) for c in convs]
    while True:
        rows = [(run, req) for run in runs if not run.done for req in [run.next_request()] if req is not None]
        if not rows:
            break
        decoded = decode([ids for _, (ids, _) in rows], [budget for _, (_, budget) in rows])
        for (run, _), d in zip(rows, decoded):
            run.take(d.response_ids, stop_reason=d.stop_reason)
    return chunk_records(runs, meta=meta, stats=stats)


def model_fingerprint(model_dir: str, *, earlier: dict | None = None) -> dict:
    """Config hash plus the weight files' names and sizes (hashing the weights of a 27B target would take
    minutes; a changed checkpoint almost always changes a size or the config). `earlier`: the model fingerprint
    of a job already begun in the output, whose config hash is kept when it names this target too
    (identity.target_config_hashes), so that job resumes."""
    from dflash.target.identity import target_config_hash, target_config_hashes

    p = pathlib.Path(model_dir)
    weights = sorted((f.name, f.stat().st_size) for f in p.iterdir()
                     if f.suffix in (".safetensors", ".bin", ".gguf", ".pt")) if p.is_dir() else []
    config_hash = target_config_hash(model_dir) if p.is_dir() else None
    if config_hash and earlier and earlier.get("config_hash") in target_config_hashes(model_dir):
        config_hash = earlier["config_hash"]
    return {"config_hash": config_hash, "weights": [list(w) for w in weights]}


def job_of(cfg, *, model: dict, extra: dict) -> dict:
    """The job fingerprint of a RegenerateConfig or EndpointConfig: the model, the inputs with their hashes,
    and every option that changes the records (extra: the backend's own, e.g. batch size and dtype). Paths
    are not part of it (file names and hashes are), so a parts folder carried to another machine resumes."""
    from dflash.data.hashes import sha256_source

    inputs = list(cfg.data) if cfg.data else [cfg.prompts]
    return {"model": model,
            "inputs": [{"name": os.path.basename(os.path.normpath(p)), "sha256": sha256_source(p)} for p in inputs],
            "options": {"turns": cfg.turn_mode, "max_new_tokens": cfg.max_new_tokens, "max_length": cfg.max_length,
                        "chunk_conversations": cfg.chunk_conversations,
                        "template_kwargs": dict(cfg.template_kwargs), "limit": cfg.limit, **extra}}


ChunkResults = Iterator[tuple[int, list[dict], dict]]
"""(chunk index, its records in input order, its stats) for each finished chunk, in any order."""
ProcessChunks = Callable[[list[tuple[int, list[Conversation]]], Callable[[int, int], None], Callable[[int], bool]],
                         ChunkResults]
"""(uncommitted chunks in order, on_batch(rows, tokens), may_start(i)) -> finished chunks. A processor calls
may_start(i) before it starts chunk i and starts no chunk (i nor later) once it returns False."""


def in_order(process_chunk: Callable[[list[Conversation], Callable[[int, int], None]], tuple[list[dict], dict]]
             ) -> ProcessChunks:
    """A ProcessChunks that runs one chunk at a time with process_chunk(chunk, on_batch) -> (records, stats)."""
    def run(todo, on_batch, may_start) -> ChunkResults:
        for i, chunk in todo:
            if not may_start(i):
                return
            records, stats = process_chunk(chunk, on_batch)
            yield i, records, stats
    return run


class _OutOfTime(Exception):
    """stop_after passed while chunks were in flight (raised from on_batch, caught by run_chunks)."""


def run_chunks(*, cfg, convs: list[Conversation], out, process_chunks: ProcessChunks, read_skips: SkipCounter,
               progress: bool, t0: float, stop_after: float | None = None) -> RegenerateStats:
    """Process the uncommitted chunks, commit each as it finishes, merge at the end; totals over all chunks.
    cfg: RegenerateConfig or EndpointConfig (chunk_conversations, turn_mode, output).
    stop_after: seconds since t0 within which the run must end: no chunk is started unless it fits, judged by
    the slowest chunk so far, start to commit, and chunks still in flight at that time are dropped uncommitted
    (a rerun redoes them): a time-limited device call ends cleanly instead of being killed."""
    from tqdm import tqdm

    size = cfg.chunk_conversations
    chunks = [convs[i: i + size] for i in range(0, len(convs), size)]
    mode = cfg.turn_mode
    planned = [sum(c.num_generated(mode) for c in ch) for ch in chunks]
    done_turns = sum(p for i, p in enumerate(planned) if i in out.committed)
    bar = tqdm(total=sum(planned), initial=done_turns, unit="turn", desc="generate", disable=not progress,
               dynamic_ncols=True)
    counts = {"records": 0, "tokens": 0}
    resumed = len(out.committed)
    started: dict[int, float] = {}
    slowest = 0.0
    start = time.perf_counter()

    def on_batch(rows: int, tokens: int) -> None:
        if stop_after is not None and time.perf_counter() - t0 > stop_after:
            raise _OutOfTime
        counts["tokens"] += tokens
        bar.update(rows)
        dt = max(time.perf_counter() - start, 1e-9)
        bar.set_postfix_str(f"{counts['records'] / dt:.1f} rec/s, {counts['tokens'] / dt:,.0f} tok/s")

    def may_start(i: int) -> bool:
        if stop_after is not None and time.perf_counter() - t0 + slowest > stop_after:
            return False
        started[i] = time.perf_counter()
        return True

    todo = [(i, chunk) for i, chunk in enumerate(chunks) if i not in out.committed]
    try:
        for i, records, stats in process_chunks(todo, on_batch, may_start):
            out.commit(i, records, stats)
            ctrl_c.raise_if_came()   # a Ctrl-C whose KeyboardInterrupt was lost in a finalizer
            slowest = max(slowest, time.perf_counter() - started[i])
            counts["records"] += len(records)
            bar.update(planned[i] - stats["turns"])  # turns that ended early were planned but never decoded
    except _OutOfTime:
        log.info("generate: --stop-after reached with chunks in flight; they are redone by the next run")
    finally:  # also on an error or Ctrl-C: a bar left open is redrawn at exit, after the error's message
        bar.close()
    totals = new_chunk_stats()
    for i in sorted(out.committed):
        st = out.committed[i]["stats"]
        for k in ("records", "turns", "eos", "length", "response_tokens"):
            totals[k] += st[k]
        for k in ("skipped", "truncated"):
            for reason, n in st[k].items():
                count(totals[k], reason, n)
    for reason, n in read_skips.counts.items():
        count(totals["skipped"], reason, n)
    if len(out.committed) < len(chunks):
        return _stats(cfg, totals, resumed_chunks=resumed, complete=False, t0=t0, finished=False)
    out.finish(num_chunks=len(chunks), summary={"totals": totals}, keep_shards=getattr(cfg, "keep_shards", False))
    return _stats(cfg, totals, resumed_chunks=resumed, complete=False, t0=t0)


def _stats(cfg, totals: dict, *, resumed_chunks: int, complete: bool, t0: float,
           finished: bool = True) -> RegenerateStats:
    return RegenerateStats(output=cfg.output, records=totals["records"], turns=totals["turns"],
                           stopped_at_eos=totals["eos"], hit_max_tokens=totals["length"],
                           response_tokens=totals["response_tokens"], skipped=dict(totals["skipped"]),
                           truncated=dict(totals["truncated"]), resumed_chunks=resumed_chunks,
                           already_complete=complete, seconds=time.perf_counter() - t0, complete=finished)


def regenerate(cfg: RegenerateConfig, *, progress: bool = True, echo: Callable[[str], None] = print,
               stop_after: float | None = None) -> RegenerateStats:
    """Run (or resume) one job in-process on the target; returns the totals. stop_after: see run_chunks."""
    import torch

    from dflash.dtypes import default_dtype
    from dflash.generate.decode import resolve_backend
    from dflash.generate.output import ShardedOutput, read_job
    from dflash.target.load import check_model_path

    t0 = time.perf_counter()
    model_dir = check_model_path(cfg.model)
    read_skips = SkipCounter()
    convs = load_conversations(data=cfg.data, prompts=cfg.prompts, limit=cfg.limit, skips=read_skips)
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = cfg.dtype or default_dtype(device)   # the one CPU-vs-CUDA rule of every command (dflash.dtypes)
    backend = "continuous" if cfg.temperature > 0 else resolve_backend(cfg.backend, torch.device(device).type)
    mfp = model_fingerprint(model_dir, earlier=(read_job(cfg.output) or {}).get("model"))
    # a greedy job's fingerprint is what it was before sampling existed, so its outputs still resume
    sampled = {"temperature": cfg.temperature, "seed": cfg.seed} if cfg.temperature > 0 else {}
    job = job_of(cfg, model=mfp, extra={"batch_size": cfg.batch_size, "dtype": dtype, "backend": backend,
                                        **sampled})
    out = ShardedOutput(cfg.output, job=job, overwrite=cfg.overwrite)
    try:
        return _regenerate_open(cfg, out=out, convs=convs, read_skips=read_skips, model_dir=model_dir, mfp=mfp,
                                device=device, dtype=dtype, backend=backend, progress=progress, echo=echo,
                                stop_after=stop_after, t0=t0)
    finally:
        out.close()


def finished_or_resuming(cfg, *, out, convs, read_skips: SkipCounter, echo: Callable[[str], None],
                         t0: float) -> RegenerateStats | None:
    """The start of a job (in-process or endpoint) once its output is open: the stats of an output already
    complete (nothing to do), a ConfigError when the input has no usable conversation, a "resuming" line when
    chunks are committed; None: go on and generate."""
    if out.complete is not None:
        return _stats(cfg, out.complete["totals"], resumed_chunks=out.complete["chunks"], complete=True, t0=t0)
    if not convs:
        raise ConfigError(f"no usable conversations in the input ({read_skips.summary()})")
    if out.committed:
        echo(f"resuming: {len(out.committed)} chunks of {cfg.chunk_conversations} conversations already committed")
    return None


def _regenerate_open(cfg: RegenerateConfig, *, out, convs, read_skips, model_dir, mfp, device, dtype, backend,
                     progress, echo, stop_after, t0) -> RegenerateStats:
    """regenerate() once its output is open (and locked)."""
    import torch

    from dflash.generate.decode import DecodeConfig, GreedyDecoder, bucket_width, chat_end_token_id, stop_token_ids

    done = finished_or_resuming(cfg, out=out, convs=convs, read_skips=read_skips, echo=echo, t0=t0)
    if done is not None:
        return done
    from dflash.target.load import load_target

    model, tokenizer = load_target(model_dir, device=device, dtype=getattr(torch, dtype))
    stops = stop_token_ids(tokenizer, getattr(model, "generation_config", None), cfg.template_kwargs)
    end_id = chat_end_token_id(tokenizer, cfg.template_kwargs)
    if cfg.turn_mode == "all" and end_id is None and any(len(c.turns) > 1 for c in convs):
        raise ConfigError(f"the chat template of {cfg.model} ends a turn with no special token, so later turns "
                          "cannot extend the generated ids exactly; use --turns first or --turns last")
    rules = DialogRules(tokenizer=tokenizer, mode=cfg.turn_mode, max_new_tokens=cfg.max_new_tokens,
                        max_length=cfg.max_length, template_kwargs=dict(cfg.template_kwargs), end_id=end_id)
    meta = {"target": cfg.model, "target_config_hash": mfp["config_hash"], "dtype": dtype,
            "greedy": cfg.temperature == 0, **({"temperature": cfg.temperature, "seed": cfg.seed}
                                               if cfg.temperature > 0 else {}),
            "backend": backend, "max_new_tokens": cfg.max_new_tokens, "max_length": cfg.max_length,
            "turn_mode": cfg.turn_mode, "template_kwargs": dict(cfg.template_kwargs)}
    if backend == "continuous":
        from dflash.generate.continuous import ContinuousConfig, continuous_chunks, engine_slots, open_engine

        ccfg = ContinuousConfig(max_requests=engine_slots(batch_size=cfg.batch_size, window=cfg.window,
                                                          conversations=len(convs)),
                                window=cfg.window, max_length=cfg.max_length, temperature=cfg.temperature,
                                seed=cfg.seed)
        engine = open_engine(model, stop_ids=stops, cfg=ccfg, log=log.info)
        try:
            return run_chunks(cfg=cfg, convs=convs, out=out, read_skips=read_skips, progress=progress, t0=t0,
                              stop_after=stop_after,
                              process_chunks=lambda todo, on_batch, may_start: continuous_chunks(
                                  todo, on_batch, may_start, engine=engine, rules=rules, meta=meta,
                                  window=ccfg.window))
        finally:
            if getattr(engine, "counters", None):
                from dflash.generate.slots import counters_line

                echo(counters_line(engine.counters, slots=len(engine.slots)))
            engine.close()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    # one static shape for the whole job: no prompt is wider than max_length, so its padded width is at most
    # bucket_width(max_length), and no batch asks for more than max_new_tokens
    cache_len = bucket_width(cfg.max_length) + cfg.max_new_tokens if backend == "static" else None
    decoder = GreedyDecoder(model, stop_ids=stops, pad_id=pad,
                            cfg=DecodeConfig(max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size,
                                             backend=backend, cache_len=cache_len))

    def process(chunk, on_batch):
        return regenerate_chunk(chunk, decode=lambda p, b: decoder.decode(p, budgets=b, on_batch=on_batch),
                                rules=rules, meta=meta)

    return run_chunks(cfg=cfg, convs=convs, out=out, process_chunks=in_order(process), read_skips=read_skips,
                      progress=progress, t0=t0, stop_after=stop_after)
