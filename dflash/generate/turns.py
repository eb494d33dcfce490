"""Exact token ids of a conversation regenerated turn by turn, and the record written for it.

Turn r's prompt is the previous context (the previous prompt and the generated response ids, not a
re-tokenization of their text) plus the template's transition to the next user turn and its generation
prompt. The transition is found by rendering the history twice with the regenerated texts: up to the
assistant turn (no generation prompt) and with the next user turn (with it). The second must extend the first
(else the template rewrites history, e.g. drops earlier reasoning: the conversation ends there, counted as
template_prefix_mismatch). What follows the end-of-turn token in the first rendering (ChatML's "\n") plus the
new text is tokenized on its own: it starts after a special token, where a tokenizer splits anyway, so the
ids equal those of tokenizing the whole rendering.

A response cut by its token budget has no end-of-turn token; the template's end-of-turn id is appended to the
context (loss 0: the target did not generate it) so the next turn sees a closed turn, as in the template.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

GENERATE_FIELD = "dflash_generate"
"""Per-record field that marks a conversation as produced by `dflash generate` (docs/generate.md, "Output records")."""


def render_prompt_ids(tokenizer, messages: Sequence[dict], template_kwargs: dict) -> list[int]:
    """Chat template with the generation prompt, tokenized without extra special tokens (the template has them)."""
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False,
                                         **template_kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def transition_ids(tokenizer, *, history: Sequence[dict], next_messages: Sequence[dict], end_token: str,
                   template_kwargs: dict) -> list[int] | None:
    """Ids between an assistant turn's end-of-turn token and the next response: the template's trailer after
    the end token, the next turn's messages and the generation prompt. history ends with the assistant message.
    None when the template does not render the longer conversation as an extension of the shorter one."""
    done = tokenizer.apply_chat_template(list(history), add_generation_prompt=False, tokenize=False,
                                         **template_kwargs)
    more = tokenizer.apply_chat_template(list(history) + list(next_messages), add_generation_prompt=True,
                                         tokenize=False, **template_kwargs)
    cut = done.rfind(end_token)
    if cut < 0 or not more.startswith(done):
        return None
    text = done[cut + len(end_token):] + more[len(done):]
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass(kw_only=True)
class TurnState:
    """One conversation being regenerated: the context so far and its loss spans."""

    messages: list[dict]
    """The conversation as written to the record: system, user turns and regenerated assistant turns."""
    ids: list[int] = field(default_factory=list)
    """Context ids so far (the prompt of the next turn once a user turn is appended)."""
    mask: list[int] = field(default_factory=list)
    """1 on generated ids, 0 elsewhere; same length as ids."""
    turns: list[dict] = field(default_factory=list)
    """Per regenerated turn: {"start", "end" (span of its ids in ids), "stop_reason", "num_prompt_tokens"}."""

    def add_prompt(self, prompt_ids: Sequence[int]) -> None:
        self.ids.extend(prompt_ids)
        self.mask.extend([0] * len(prompt_ids))

    def add_response(self, response_ids: Sequence[int], *, stop_reason: str, text: str) -> None:
        start = len(self.ids)
        self.turns.append({"start": start, "end": start + len(response_ids), "stop_reason": stop_reason,
                           "num_prompt_tokens": start})
        self.ids.extend(response_ids)
        self.mask.extend([1] * len(response_ids))
        self.messages.append({"role": "assistant", "content": text})

    def close_turn(self, end_id: int) -> None:
        """After a response cut by its budget: the template's end-of-turn token, not a loss token."""
        if not self.ids or self.ids[-1] != end_id:
            self.ids.append(end_id)
            self.mask.append(0)


def conversation_record(state: TurnState, *, meta: dict, location: str, record_id: str | None) -> dict:
    """One output line (docs/generate.md, "Output records"): messages for people and chat-template
    readers, the exact ids as the pre-tokenized input_ids/loss_mask form that dflash.data prefers, and the
    dflash_generate marker. The first turn's num_prompt_tokens / response_ids / stop_reason stay top-level in
    the marker (single-turn readers); `turns` has every turn's span."""
    assert state.turns, "a record needs at least one regenerated turn"
    first = state.turns[0]
    rec: dict = {
        "messages": [dict(m) for m in state.messages],
        "input_ids": list(state.ids[: state.turns[-1]["end"]]),
        "loss_mask": list(state.mask[: state.turns[-1]["end"]]),
        GENERATE_FIELD: {
            **meta,
            "stop_reason": first["stop_reason"],
            "num_prompt_tokens": first["start"],
            "response_ids": list(state.ids[first["start"]: first["end"]]),
            "turns": [dict(t) for t in state.turns],
            "source": location,
        },
    }
    if record_id is not None:
        rec["id"] = record_id
    return rec
