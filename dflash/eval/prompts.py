"""Prompt files for `dflash generate`: jsonl (or .jsonl.gz) with one prompt per line.

Accepted record shapes, checked in this order (the first that fits wins):
- `messages`: a chat; the prompt is every message before the first assistant message.
- `conversations`: ShareGPT style (`from`/`value`, human/gpt); same rule as `messages`.
- `turns`: MT-Bench (`question.jsonl`); the prompt is turn 1 as a user message.
- `prompt`: a string (HumanEval or any plain prompt) as one user message.
A line that fits none, or has an empty prompt, is skipped and counted; a file that cannot be read raises.
"""

from __future__ import annotations

import gzip
import json
import pathlib
from dataclasses import dataclass, field
from typing import Iterator

from dflash.errors import DataError

_ID_FIELDS = ("id", "question_id", "task_id")


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


def _open_text(path: pathlib.Path):
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open("r", encoding="utf-8")


def iter_prompts(path, *, skips: PromptSkips, limit: int | None = None) -> Iterator[Prompt]:
    """Yields the usable prompts of a jsonl(.gz) file in file order, at most `limit` of them."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise DataError(f"prompt file {path} does not exist")
    if not (path.name.endswith(".jsonl") or path.name.endswith(".jsonl.gz")):
        raise DataError(f"prompt file {path}: expected .jsonl or .jsonl.gz")
    n = 0
    with _open_text(path) as f:
        for lineno, line in enumerate(f, start=1):
            if limit is not None and n >= limit:
                return
            if not line.strip():
                continue
            loc = f"{path.name}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                skips.add("bad_json", loc)
                continue
            if not isinstance(record, dict):
                skips.add("not_an_object", loc)
                continue
            msgs = prompt_messages(record)
            if isinstance(msgs, str):
                skips.add(msgs, loc)
                continue
            rid = next((str(record[k]) for k in _ID_FIELDS if k in record), None)
            yield Prompt(messages=tuple(msgs), location=loc, record_id=rid)
            n += 1
