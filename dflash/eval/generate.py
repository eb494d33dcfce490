"""Greedy responses of the target for a prompt file (`dflash generate`), written as conversations for extraction.

Exact greedy tau (dflash.eval.tau) needs eval sequences whose responses are the target's own greedy output.
This runs batched HF generation (left padding, do_sample=False) and stops each row at the first stop token: the
tokenizer's eos, the generation config's eos ids and the chat template's end-of-turn token.

Exactness: re-tokenizing the decoded text does not always give back the generated ids (BPE merges across the
prompt/response boundary, special tokens, whitespace). So every record also carries the ids themselves in
dflash.data's pre-tokenized form, `input_ids` = prompt ids + generated ids (the stop token included when the
row stopped on it) and `loss_mask` = 1 exactly on the generated ids; dflash.data prefers that form over
`messages`, so the cache holds exactly the target's greedy sequence (docs/generate.md, "Output records").
Tradeoff: batching with left padding changes the matmul shapes, so in bf16 a row can differ from unbatched
greedy decoding after a near-tie; in fp32 this is rare. The response is still a greedy path of the target.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from dflash.errors import ConfigError
from dflash.eval.prompts import Prompt
from dflash.generate.decode import (DecodeConfig, GreedyDecoder, chat_end_token_id, split_at_stop,  # noqa: F401
                                    stop_token_ids)
from dflash.generate.turns import GENERATE_FIELD, render_prompt_ids  # noqa: F401
from dflash.target.identity import target_config_hash


@dataclass(frozen=True, kw_only=True)
class GenerateConfig:
    """What `dflash generate` does with one prompt file."""

    max_new_tokens: int = 512
    """Most tokens generated per prompt (the stop token counts); a row that reaches it has stop_reason 'length'."""
    batch_size: int = 8
    """Prompts per generate() call; prompts are sorted by length first so left padding stays small."""
    template_kwargs: dict = field(default_factory=dict)
    """Extra chat-template arguments, e.g. {"enable_thinking": False} for --no-thinking."""
    limit: int | None = None
    """Use only the first `limit` usable prompts of the file."""
    backend: str = "auto"
    """dflash.generate.decode backend: "eager", "static" or "auto" (static, compiled, on CUDA; eager elsewhere)."""
    max_length: int = 4096
    """Most tokens of prompt + response (generate_file): a longer prompt is skipped, counted prompt_over_length.
    It also sizes the static cache of the compiled CUDA path (one shape per job), so keep it near the prompts."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens}: must be >= 1")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size={self.batch_size}: must be >= 1")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"limit={self.limit}: must be >= 1 (or unset for all prompts)")


@dataclass(frozen=True, kw_only=True)
class Generation:
    """The target's greedy response to one prompt."""

    prompt: Prompt
    prompt_ids: list[int]
    """The chat template rendering of prompt.messages with the generation prompt, tokenized."""
    response_ids: list[int]
    """The generated ids, ending with the stop token when stop_reason == 'eos'."""
    stop_reason: str
    """'eos' (a stop token was generated) or 'length' (max_new_tokens reached)."""
    text: str
    """response_ids decoded without the stop token (special tokens inside the response are kept)."""


def generate_greedy(model, tokenizer, prompts: Sequence[Prompt], *, cfg: GenerateConfig,
                    on_batch: Callable[[list[Generation]], None] | None = None) -> list[Generation]:
    """Greedy responses for `prompts` (returned in the given order). `on_batch` sees each finished batch."""
    stop_ids = stop_token_ids(tokenizer, getattr(model, "generation_config", None), cfg.template_kwargs)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    decoder = GreedyDecoder(model, stop_ids=stop_ids, pad_id=pad_id,
                            cfg=DecodeConfig(max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size,
                                             backend=cfg.backend))
    prompt_ids = [render_prompt_ids(tokenizer, p.messages, cfg.template_kwargs) for p in prompts]
    decoded = decoder.decode(prompt_ids)
    results = []
    for p, ids, d in zip(prompts, prompt_ids, decoded):
        body = d.response_ids[:-1] if d.stop_reason == "eos" else d.response_ids
        results.append(Generation(prompt=p, prompt_ids=ids, response_ids=d.response_ids, stop_reason=d.stop_reason,
                                  text=tokenizer.decode(body, skip_special_tokens=False)))
    if on_batch is not None:
        on_batch(results)
    return results


def generation_record(g: Generation, *, target: str, config_hash: str | None, cfg: GenerateConfig,
                      dtype: str | None = None) -> dict:
    """One output line (docs/generate.md, "Output records"): the conversation for people and
    chat-template readers, the exact ids as the pre-tokenized `input_ids`/`loss_mask` form that
    dflash.data prefers over `messages`, and the `dflash_generate` marker that makes the cache target_greedy."""
    rec: dict = {
        "messages": [dict(m) for m in g.prompt.messages] + [{"role": "assistant", "content": g.text}],
        "input_ids": g.prompt_ids + g.response_ids,
        "loss_mask": [0] * len(g.prompt_ids) + [1] * len(g.response_ids),
        GENERATE_FIELD: {
            "target": target,
            "target_config_hash": config_hash,
            "dtype": dtype,
            "greedy": True,
            "max_new_tokens": cfg.max_new_tokens,
            "template_kwargs": dict(cfg.template_kwargs),
            "stop_reason": g.stop_reason,
            "num_prompt_tokens": len(g.prompt_ids),
            "response_ids": g.response_ids,
            "source": g.prompt.location,
        },
    }
    if g.prompt.record_id is not None:
        rec["id"] = g.prompt.record_id
    return rec


@dataclass(frozen=True, kw_only=True)
class GenerateStats:
    """What one `dflash generate` run produced."""

    prompts: int
    stopped_at_eos: int
    hit_max_tokens: int
    response_tokens: int
    skipped: str
    """PromptSkips.summary() of the prompt file."""


def generate_file(*, model_path: str, prompts_path, output_path, cfg: GenerateConfig, device: str | None = None,
                  dtype: str | None = None, overwrite: bool = False, progress: bool = True) -> GenerateStats:
    """Greedy responses to the first turn of each prompt of a prompt file, through the resumable driver
    (dflash.generate.run): records in prompt-file order, the output written atomically at the end."""
    from dflash.generate.run import RegenerateConfig, regenerate

    st = regenerate(RegenerateConfig(model=model_path, output=str(output_path), prompts=str(prompts_path),
                                     turns="first", max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size,
                                     backend=cfg.backend, template_kwargs=dict(cfg.template_kwargs), limit=cfg.limit,
                                     device=device, dtype=dtype, overwrite=overwrite, max_length=cfg.max_length),
                    progress=progress)
    skipped = ", ".join(f"{n} {r}" for r, n in sorted(st.skipped.items()))
    return GenerateStats(prompts=st.records, stopped_at_eos=st.stopped_at_eos, hit_max_tokens=st.hit_max_tokens,
                         response_tokens=st.response_tokens,
                         skipped=f"skipped {skipped}" if skipped else "no prompts skipped")
