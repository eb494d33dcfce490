"""Whole-conversation regeneration with continuous batching: one request per turn, the next turn queued the
moment its previous response arrives.

Why: a static batch runs until its longest row ends, and turn r+1 of a conversation can only start after turn
r, so round-by-round batching leaves most rows idle once the long conversations are the only ones left (on the
H200: 944 tok/s on whole ShareGPT conversations, benchmarks/results/regen_runs_h200.json). Two engines serve
the requests: dflash.generate.slots.SlotEngine (one KV slot per conversation, a compiled fixed-shape decode
step; Llama-family models) and, for other models, transformers' ContinuousBatchingManager (ContinuousEngine
below; paged attention; 2.5-2.8K tok/s on the H200 without flash-attn, continuous_probe_h200.json).

Chunks stay the unit of commit and resume: chunks are admitted in order while fewer than `window`
conversations are in flight, and a chunk is yielded (committed) when its last conversation ends, so chunks
may commit out of order; the output is merged in chunk order. Which requests share a forward step depends on
the order responses finish, so in bf16 a rerun can part from an earlier run after a near-tie (as any two
batchings can); in fp32 on CPU the responses equal HF generate's (tests).
"""

from __future__ import annotations

import math
import os
from collections import deque
from dataclasses import dataclass, field

from dflash.errors import ConfigError, DflashError
from dflash.generate.dialog import ConversationRun, DialogRules, chunk_records, new_chunk_stats
from dflash.generate.decode import Decoded, split_at_stop


class GenerationFailed(DflashError):
    """The continuous-batching engine failed a request or stopped."""


SLOT_STEPS = ("eager", "graphs", "compiled")


@dataclass(frozen=True, kw_only=True)
class ContinuousConfig:
    """Sizes of the continuous-batching engine."""

    max_requests: int = 512
    """Most sequences in one forward step (transformers' max_requests_per_batch)."""
    window: int = 2048
    """Most conversations in flight; chunks are admitted in order while fewer are."""
    max_length: int = 4096
    """Longest sequence (prompt + response) a request can reach: sizes the KV cache off CUDA."""
    request_timeout: float = 600.0
    """Seconds without any finished request before the run is declared stuck."""
    cuda_graphs: bool | None = None
    """transformers' use_cuda_graph (None: its own choice); False also keeps the slot decoder's step eager."""
    slot_attention: str = field(default_factory=lambda: os.environ.get("DFLASH_SLOT_ATTENTION", "bmm"))
    """The slot decoder's decode attention: "bmm" (scores as one batched matmul) or "sdpa" (with a mask);
    benchmarks/bench_slots.py times both (the environment variable is its switch). H200, 512 slots,
    kv 2048, graph-captured step: bmm 14.0 ms, sdpa 15.3 ms (benchmarks/results/slot_probe_h200.json)."""
    slot_step: str = field(default_factory=lambda: os.environ.get("DFLASH_SLOT_STEP", "graphs"))
    """How the slot decoder runs its decode step on CUDA (env DFLASH_SLOT_STEP): "graphs" (captured as a CUDA
    graph per kv bucket; eager if a capture fails), "eager", or "compiled" (torch.compile reduce-overhead).
    The eager step is launch-bound: on the H200 at 512 slots it took 22.7-29.4 ms against 14.0 ms replayed as a
    graph (slot_probe_h200.json), and whole-conversation regeneration ran at 12.6-13.0K response tok/s with
    graphs against 8.3-9.5K eager (regen_runs_h200.json); the compiled step's compiles (one per kv bucket)
    took 1.9 s a step averaged over a 2-minute call. Off CUDA the step is always eager."""

    temperature: float = 0.0
    """0: greedy; > 0: sampled (dflash.generate.sampling), in the slot decoder only."""
    seed: int = 0
    """Sampling seed (temperature > 0)."""

    def __post_init__(self) -> None:
        if self.slot_attention not in ("bmm", "sdpa"):
            raise ConfigError(f"slot_attention={self.slot_attention!r} (DFLASH_SLOT_ATTENTION): choose bmm or sdpa")
        if self.slot_step not in SLOT_STEPS:
            raise ConfigError(f"slot_step={self.slot_step!r} (DFLASH_SLOT_STEP): choose {', '.join(SLOT_STEPS)}")


class ContinuousEngine:
    """Greedy decoding of submitted prompts on a ContinuousBatchingManager; results come back as they finish."""

    def __init__(self, model, *, stop_ids, cfg: ContinuousConfig) -> None:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        self.stop_ids = [int(i) for i in stop_ids]
        self.cfg = cfg
        gen = GenerationConfig(do_sample=False, num_beams=1, eos_token_id=list(self.stop_ids),
                               pad_token_id=self.stop_ids[0], max_new_tokens=cfg.max_length)
        kw: dict = dict(max_requests_per_batch=cfg.max_requests)
        if cfg.cuda_graphs is not None:
            kw["use_cuda_graph"] = cfg.cuda_graphs
        if next(model.parameters()).device.type != "cuda":
            # off CUDA the manager cannot size its cache from free GPU memory: room for every row at max length
            page = 32
            kw.update(page_size=page, num_blocks=cfg.max_requests * math.ceil(cfg.max_length / page) + 8,
                      max_batch_tokens=max(256, cfg.max_requests * 8), use_cuda_graph=False)
        self.manager = model.init_continuous_batching(generation_config=gen,
                                                      continuous_batching_config=ContinuousBatchingConfig(**kw))
        self.manager.start()
        self.model = model
        self.in_flight = 0

    def release(self, stream) -> None:
        """The conversation is over (the manager's prefix cache needs no notice)."""

    def submit(self, key: str, prompt_ids: list[int], budget: int, *, stream=None) -> None:
        rid = self.manager.add_request(list(prompt_ids), request_id=key, max_new_tokens=int(budget),
                                       eos_token_id=list(self.stop_ids))
        if rid is None:
            raise GenerationFailed(f"the generation engine refused request {key} (it is stopping or failed)")
        self.in_flight += 1

    def next_result(self) -> tuple[str, Decoded]:
        """The next finished request: (key, greedy response cut at its first stop token)."""
        while True:
            res = self.manager.get_result(timeout=self.cfg.request_timeout)
            if res is None:
                raise GenerationFailed(f"no request finished in {self.cfg.request_timeout:.0f} s "
                                       f"({self.in_flight} in flight): the generation engine is stuck or crashed")
            if res.error is not None:
                raise GenerationFailed(f"request {res.request_id} failed in the generation engine: {res.error}")
            if res.is_finished():
                self.in_flight -= 1
                ids, reason = split_at_stop(res.generated_tokens, self.stop_ids)
                return res.request_id, Decoded(response_ids=ids, stop_reason=reason)

    def close(self) -> None:
        self.manager.stop(block=True)
        self.model.destroy_cached_continuous_batching_manager()


def continuous_chunks(todo, on_batch, may_start, *, engine, rules: DialogRules, meta: dict, window: int):
    """A dflash.generate.run.ProcessChunks over `engine` (ContinuousEngine or dflash.generate.slots.SlotEngine:
    submit(key, ids, budget, stream=conversation), next_result(), release(conversation)): yields (chunk,
    records, stats) as chunks finish."""
    pending = deque(todo)
    chunks: dict[int, tuple[list[ConversationRun], dict]] = {}
    open_convs: dict[int, int] = {}
    requests: dict[str, tuple[int, int]] = {}
    finished: list[int] = []

    def advance(i: int, k: int) -> None:
        run = chunks[i][0][k]
        req = run.next_request()
        if req is None:
            engine.release((i, k))
            open_convs[i] -= 1
            if open_convs[i] == 0:
                finished.append(i)
            return
        key = f"c{i}.v{k}.t{run.turn}"
        requests[key] = (i, k)
        engine.submit(key, *req, stream=(i, k))

    admitting = True
    while True:
        while admitting and pending and sum(open_convs.values()) < window:
            i, convs = pending[0]
            if not may_start(i):
                admitting = False
                break
            pending.popleft()
            stats = new_chunk_stats()
            chunks[i] = ([ConversationRun(c, rules=rules, stats=stats) for c in convs], stats)
            open_convs[i] = len(convs)
            for k in range(len(convs)):
                advance(i, k)
        while finished:
            i = finished.pop(0)
            runs, stats = chunks.pop(i)
            del open_convs[i]
            records, stats = chunk_records(runs, meta=meta, stats=stats)
            yield i, records, stats
        if not requests:
            if admitting and pending:
                continue
            return
        key, decoded = engine.next_result()
        i, k = requests.pop(key)
        chunks[i][0][k].take(decoded.response_ids, stop_reason=decoded.stop_reason)
        on_batch(1, len(decoded.response_ids))
        advance(i, k)


def engine_slots(*, batch_size: int, window: int, conversations: int) -> int:
    """Slots of the engine: a conversation holds one at a time (its turns run in order), so no more than the
    conversations in flight can be busy. The slot decoder steps every slot at a fixed shape, so idle slots cost
    as much as busy ones (one conversation at the default 512 slots took 145 s on CPU instead of ~20)."""
    return max(1, min(batch_size, window, conversations))


def open_engine(model, *, stop_ids, cfg: ContinuousConfig, log=None):
    """The slot engine (dflash.generate.slots) where it supports the model, else transformers' manager."""
    from dflash.generate.slots import SlotEngine, check_supported

    try:
        check_supported(model.config)
    except DflashError as e:
        if cfg.temperature > 0:
            raise ConfigError(f"sampled regeneration (temperature {cfg.temperature}) runs in the slot decoder: {e}") \
                from None
        if log is not None:
            log(f"continuous backend: {e}; using transformers' continuous batching instead")
        return ContinuousEngine(model, stop_ids=stop_ids, cfg=cfg)
    step = cfg.slot_step if cfg.cuda_graphs is not False else "eager"
    return SlotEngine(model, stop_ids=stop_ids, slots=cfg.max_requests, cache_len=cfg.max_length,
                      compile=step == "compiled", cuda_graphs=step == "graphs", decode_bmm=cfg.slot_attention == "bmm",
                      temperature=cfg.temperature, seed=cfg.seed)
