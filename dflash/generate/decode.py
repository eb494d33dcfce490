"""Batched greedy decoding of the target: prompt ids in, response ids out, in the given order.

Two backends run the same HF `generate(do_sample=False)` loop over left-padded batches:
- "eager": the default dynamic cache, no compilation. On the H200 this is dispatch-bound (~85 ms per decode
  step at batch 80; SmolLM2 shape at batch 512: 7,008 tok/s).
- "static": a preallocated StaticCache whose decode step transformers compiles (torch.compile, mode
  reduce-overhead = CUDA graphs); same model, 38,062 tok/s at batch 512 after a 33 s compile. A compiled graph
  is specialised to its shapes (batch rows, cache length), so prompts are padded to a few bucketed widths and
  batches to power-of-two row counts: the run meets a handful of shapes, not one per batch.
"auto" is static on CUDA and eager elsewhere (no CUDA graphs on CPU; the static path without compilation
still runs there, which the tests use to check it against eager).

Exactness: both are greedy paths of the target at its dtype. Padding and kernels change the matmul shapes, so
in bf16 two backends can part after a near-tie (benchmarks/bench_generate.py measures how often); in fp32 on
CPU they agree (tests). Rows are stopped at the first stop token: tokenizer eos, generation-config eos and the
chat template's end-of-turn token.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from dflash.errors import ConfigError

log = logging.getLogger(__name__)

BACKENDS = ("auto", "eager", "static")


@dataclass(frozen=True, kw_only=True)
class DecodeConfig:
    """How prompts are batched and decoded."""

    max_new_tokens: int = 512
    """Most tokens generated per prompt (the stop token counts)."""
    batch_size: int = 8
    """Most prompts per generate() call; prompts are sorted by length first so left padding stays small."""
    backend: str = "auto"
    """"eager" (HF dynamic cache), "static" (static cache, compiled on CUDA) or "auto" (static on CUDA)."""
    compile: bool = True
    """static backend on CUDA: let transformers compile the decode step (off: static cache, eager kernels)."""
    compile_dynamic: bool | None = False
    """torch.compile's `dynamic` for that step. False: one static graph per (rows, cache length) shape, so a
    repeated call replays the same kernels and gives the same tokens. None (torch's default) turns a second
    shape into a dynamic-shape graph that the first shape then also runs: on the H200 the bench's second call
    differed from its first (generate_h200.json of f996fed, second_call_identical_to_first false)."""
    cache_len: int | None = None
    """static backend: one cache length for every call, and every batch padded to batch_size rows, so the
    compiled decode step meets ONE shape (batch_size, cache_len) instead of one per (rows, width) bucket; each
    new shape costs a compile (~10-30 s on the H200), and a whole-conversation job meets dozens of widths.
    Must be >= every batch's padded width + its new tokens. None: the bucketed shapes."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens}: must be >= 1")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size={self.batch_size}: must be >= 1")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend={self.backend!r}: choose one of {', '.join(BACKENDS)}")
        if self.cache_len is not None and self.cache_len <= self.max_new_tokens:
            raise ConfigError(f"cache_len={self.cache_len}: must exceed max_new_tokens={self.max_new_tokens}")


@dataclass(frozen=True, kw_only=True)
class Decoded:
    """One prompt's greedy response."""

    response_ids: list[int]
    """Generated ids, ending with the stop token when stop_reason == 'eos'."""
    stop_reason: str
    """'eos' (a stop token was generated) or 'length' (the row's token budget was reached)."""


def resolve_backend(backend: str, device_type: str) -> str:
    """The backend "auto" stands for on this device (static needs CUDA graphs to pay off)."""
    if backend == "auto":
        return "static" if device_type == "cuda" else "eager"
    return backend


def bucket_width(n: int) -> int:
    """Prompt width padded up for the static backend: multiples of 64 up to 512, then 4 buckets per doubling
    (640, 768, 896, 1024, 1280, ...). At most 25% padding, ~4 distinct widths per doubling of prompt length."""
    assert n >= 1
    if n <= 512:
        return -(-n // 64) * 64
    step = (1 << (int(n - 1).bit_length() - 1)) // 4
    return -(-n // step) * step


def bucket_rows(n: int, *, batch_size: int) -> int:
    """Rows of a static batch: the next power of two (at least 8), capped at batch_size; extra rows repeat a
    real prompt and are dropped (the last batch of each round costs a few rows, not a recompile per size)."""
    assert n >= 1
    return min(batch_size, max(8, 1 << int(n - 1).bit_length()))


def length_sorted_batches(lengths: Sequence[int], *, batch_size: int) -> list[np.ndarray]:
    """Indices sorted by (length, index) and cut into batches of batch_size: a function of the lengths only,
    so a rerun batches the same prompts together (same padding, same numerics)."""
    order = np.lexsort((np.arange(len(lengths)), np.asarray(lengths, dtype=np.int64)))
    return [order[b: b + batch_size] for b in range(0, len(order), batch_size)]


def chat_end_token_id(tokenizer, template_kwargs: dict) -> int | None:
    """The token the chat template puts right after an assistant message (ChatML <|im_end|>, Llama-3 <|eot_id|>),
    found by rendering a dummy exchange; None when the template ends the turn with plain text."""
    marker = "DFLASHMARKER"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}],
            tokenize=False, **template_kwargs)
    except Exception:  # templates may reject the dummy chat (e.g. need a system turn); fall back to eos only
        return None
    if marker not in text:
        return None
    suffix = text.split(marker, 1)[1]
    ids = tokenizer(suffix, add_special_tokens=False)["input_ids"] if suffix else []
    if not ids:
        return None
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}).keys())
    return int(ids[0]) if ids[0] in special else None


def stop_token_ids(tokenizer, generation_config, template_kwargs: dict) -> tuple[int, ...]:
    """All ids that end a response: tokenizer eos, generation-config eos (int or list), chat end-of-turn."""
    ids: list[int] = []
    gen_eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    for x in (tokenizer.eos_token_id, gen_eos, chat_end_token_id(tokenizer, template_kwargs)):
        for i in (x if isinstance(x, (list, tuple)) else [x]):
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    if not ids:
        raise ConfigError("the tokenizer defines no eos token and the chat template no end-of-turn token: "
                          "cannot tell where a response ends")
    return tuple(ids)


def split_at_stop(generated: Sequence[int], stop_ids: Sequence[int]) -> tuple[list[int], str]:
    """Cut one generated row after its first stop token: (ids incl. the stop token, 'eos'), else (all, 'length')."""
    stops = set(stop_ids)
    for k, t in enumerate(generated):
        if t in stops:
            return list(generated[: k + 1]), "eos"
    return list(generated), "length"


class GreedyDecoder:
    """Greedy responses of `model` for lists of prompt ids (one target load, many calls)."""

    def __init__(self, model, *, stop_ids: Sequence[int], pad_id: int, cfg: DecodeConfig) -> None:
        self.model = model
        self.cfg = cfg
        self.stop_ids = tuple(int(i) for i in stop_ids)
        self.pad_id = int(pad_id)
        self.device = next(model.parameters()).device
        self.backend = resolve_backend(cfg.backend, self.device.type)
        self.shapes: set[tuple[int, int]] = set()
        """(rows, width) of every static batch run so far: each new one is a compile or a CUDA-graph record."""
        if self.backend == "static" and self.device.type == "cuda" and cfg.compile:
            import torch._dynamo

            # one graph per (rows, cache length) until dynamo turns the dims dynamic; keep room for all buckets
            dyn = torch._dynamo.config
            name = "recompile_limit" if hasattr(dyn, "recompile_limit") else "cache_size_limit"
            setattr(dyn, name, max(getattr(dyn, name), 64))
            from transformers import CompileConfig

            # one instance for every call: transformers rebuilds its compiled wrapper when the config changes
            self.compile_config = CompileConfig(dynamic=cfg.compile_dynamic)
        else:
            self.compile_config = None

    def _generation_config(self, max_new_tokens: int):
        from transformers import GenerationConfig

        kw: dict = dict(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, eos_token_id=list(self.stop_ids),
                        pad_token_id=self.pad_id)
        if self.backend == "static":
            kw["cache_implementation"] = "static"
            kw["disable_compile"] = not (self.cfg.compile and self.device.type == "cuda")
            if self.compile_config is not None:
                kw["compile_config"] = self.compile_config
            if self.cfg.cache_len is not None:
                kw["max_cache_len"] = self.cfg.cache_len  # transformers >= 5.2x sizes the cache to it
        return GenerationConfig(**kw)

    def decode(self, prompts: Sequence[Sequence[int]], *, budgets: Sequence[int] | None = None,
               on_batch=None) -> list[Decoded]:
        """Responses in prompt order. budgets[i] (<= max_new_tokens) cuts row i shorter ('length'); on_batch(n,
        tokens) is called after each generate() call with its prompts and response tokens."""
        import torch

        n = len(prompts)
        budgets = [self.cfg.max_new_tokens] * n if budgets is None else [int(b) for b in budgets]
        out: list[Decoded | None] = [None] * n
        for idx in length_sorted_batches([len(p) for p in prompts], batch_size=self.cfg.batch_size):
            idx = idx.tolist()
            width = max(len(prompts[i]) for i in idx)
            rows = len(idx)
            max_new = min(self.cfg.max_new_tokens, max(budgets[i] for i in idx))
            if self.backend == "static" and self.cfg.cache_len is not None:
                width = bucket_width(width)
                rows = self.cfg.batch_size
                if width + max_new > self.cfg.cache_len:
                    raise ConfigError(f"a batch of {width}-token prompts (padded) plus {max_new} new tokens does "
                                      f"not fit the static cache of {self.cfg.cache_len} positions")
                self.shapes.add((rows, self.cfg.cache_len))
                # transformers sizes a new static cache to max(this call, every earlier call): start at the
                # fixed length, so every call gets the same cache shape (older versions lack max_cache_len)
                self.model._previous_max_cache_length = self.cfg.cache_len
            elif self.backend == "static":
                width = bucket_width(width)
                rows = bucket_rows(len(idx), batch_size=self.cfg.batch_size)
                self.shapes.add((rows, width))
                # transformers sizes a new static cache to max(this call, every earlier call): reset so each
                # bucket keeps its own cache length instead of attending over the longest one seen
                self.model._previous_max_cache_length = -1
            # left padding: every row's last prompt token sits at the same column, so new tokens line up
            ids_BS = torch.full((rows, width), self.pad_id, dtype=torch.long)
            att_BS = torch.zeros((rows, width), dtype=torch.long)
            for r in range(rows):
                p = prompts[idx[min(r, len(idx) - 1)]]  # extra rows repeat the last real prompt
                ids_BS[r, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
                att_BS[r, width - len(p):] = 1
            with torch.no_grad():
                out_BS = self.model.generate(input_ids=ids_BS.to(self.device), attention_mask=att_BS.to(self.device),
                                             generation_config=self._generation_config(max_new))
            gen = out_BS[: len(idx), width:].tolist()
            tokens = 0
            for r, i in enumerate(idx):
                resp, reason = split_at_stop(gen[r][: budgets[i]], self.stop_ids)
                out[i] = Decoded(response_ids=resp, stop_reason=reason)
                tokens += len(resp)
            if on_batch is not None:
                on_batch(len(idx), tokens)
        assert all(o is not None for o in out)
        return out  # type: ignore[return-value]
