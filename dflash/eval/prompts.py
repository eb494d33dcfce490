"""Prompt files for `dflash generate`: jsonl (or .jsonl.gz) with one prompt per line.

Accepted record shapes, checked in this order (the first that fits wins):
- `messages`: a chat; the prompt is every message before the first assistant message.
- `conversations`: ShareGPT style (`from`/`value`, human/gpt); same rule as `messages`.
- `turns`: MT-Bench (`question.jsonl`); the prompt is turn 1 as a user message.
- `prompt`: a string (HumanEval or any plain prompt) as one user message.
A line that fits none, or has an empty prompt, is skipped and counted; a file that cannot be read raises.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator


@dataclass(frozen=True, kw_only=True)
class Prompt:
    """One prompt to generate a response for."""

    messages: tuple[dict, ...]
    """The chat before the response: [{"role": "system"|"user"|"assistant", "content": str}, ...], ends with user."""
    location: str
    """`file:line` (1-based), for messages about this prompt."""
    record_id: str | None = None
    """The record's own id (`id`, `question_id` or `task_id`), kept in the output for joins."""


@dataclass(kw_only=True)
class PromptSkips:
    """Lines that were not usable, counted by reason, with the first few locations."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)

    def add(self, reason: str, location: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        if len(self.examples) < 5:
            self.examples.append(f"{location}: {reason}")

    def summary(self) -> str:
        if not self.counts:
            return "no prompts skipped"
        parts = ", ".join(f"{n} {r}" for r, n in sorted(self.counts.items()))
        return f"skipped {sum(self.counts.values())} prompts ({parts}); first: {'; '.join(self.examples)}"


def prompt_messages(record: dict) -> list[dict] | str:
    """The prompt chat of one record (system turns + the first turn's messages), or a skip reason (str). The
    record shapes are dflash.generate.conversations' (which regenerates whole conversations from them)."""
    from dflash.data.skips import Skip
    from dflash.generate.conversations import conversation_of, prompt_record_messages

    msgs = prompt_record_messages(record)
    if isinstance(msgs, str):
        return msgs
    conv = conversation_of(msgs, index=0, location="", record_id=None)
    if isinstance(conv, Skip):
        return conv.reason
    return [dict(m) for m in conv.system] + [dict(m) for m in conv.turns[0].prompt]


def iter_prompts(path, *, skips: PromptSkips, limit: int | None = None) -> Iterator[Prompt]:
    """Yields the usable prompts of a jsonl(.gz) file in file order, at most `limit` of them."""
    from dflash.data.skips import Skip
    from dflash.generate.conversations import iter_prompt_lines

    n = 0
    for item in iter_prompt_lines(path):   # DataError here for a missing or misnamed file, as before
        if limit is not None and n >= limit:
            return
        if isinstance(item, Skip):
            skips.add(item.reason, item.location)
            continue
        msgs = prompt_messages(item.record)
        if isinstance(msgs, str):
            skips.add(msgs, item.location)
            continue
        yield Prompt(messages=tuple(msgs), location=item.location, record_id=item.record_id)
        n += 1
