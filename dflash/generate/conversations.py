"""What `dflash generate` regenerates: conversations from data files (`--data`, the formats dflash.data reads:
ShareGPT `conversations`, OpenAI `messages`, jsonl/json/parquet/arrow) or from prompt files (`--prompts`:
MT-Bench `turns`, HumanEval `prompt`, chats), as a system prompt plus user turns with their original replies.

A turn is the run of non-assistant messages before an assistant reply (usually one user message) and that
reply. Which replies are regenerated is the turn mode: "all" (each turn in order, conditioned on the
regenerated earlier replies), "first" (the first reply only) or "last" (the last reply, after the original
history). Pre-tokenized records cannot be regenerated (no text) and are skipped, counted like every other
unusable record; nothing here raises on data.
"""

from __future__ import annotations

import gzip
import json
import pathlib
from dataclasses import dataclass
from typing import Iterator, Sequence

from dflash.data.skips import Skip, SkipCounter
from dflash.errors import ConfigError, DataError

TURN_MODES = ("all", "first", "last")
_ID_FIELDS = ("id", "question_id", "task_id")
_ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                 "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant",
                 "system": "system"}


@dataclass(frozen=True, kw_only=True)
class Turn:
    """One exchange of the source conversation."""

    prompt: tuple[dict, ...]
    """Messages before the reply ({"role": "user"|"system", "content"}); at least one user message."""
    reply: str | None
    """The source's assistant reply (None: the source has none, e.g. MT-Bench's second turn)."""


@dataclass(frozen=True, kw_only=True)
class Conversation:
    """One source conversation, in input order."""

    index: int
    """Running index over all records of all inputs (skipped ones included): the order of the output."""
    location: str
    """`file:line` or `file:row N` of the source record."""
    record_id: str | None
    """The record's own id (`id`, `question_id` or `task_id`), kept in the output for joins."""
    system: tuple[dict, ...]
    """Leading system messages."""
    turns: tuple[Turn, ...]

    def num_generated(self, mode: str) -> int:
        """Responses regenerated in this mode (before any truncation)."""
        return len(self.turns) if mode == "all" else 1


def conversation_of(messages: Sequence[dict], *, index: int, location: str, record_id: str | None
                    ) -> Conversation | Skip:
    """Normalised messages (role/content) -> Conversation, or Skip when no turn has a user message. An
    assistant message with content None ends a turn that has no source reply (MT-Bench's turns)."""
    msgs = [{"role": m["role"], "content": m["content"]} for m in messages]  # an assistant content None: no reply
    system: list[dict] = []
    while msgs and msgs[0]["role"] == "system":
        system.append(msgs.pop(0))
    turns: list[Turn] = []
    pending: list[dict] = []
    for m in msgs:
        if m["role"] != "assistant":
            pending.append(m)
        elif any(p["role"] == "user" for p in pending):
            turns.append(Turn(prompt=tuple(pending), reply=m["content"]))
            pending = []
        # an assistant message without a user message before it has no prompt: dropped
    if any(p["role"] == "user" for p in pending):
        turns.append(Turn(prompt=tuple(pending), reply=None))
    turns = [t for t in turns if any(p["role"] == "user" and p["content"].strip() for p in t.prompt)]
    if not turns:
        return Skip("empty_prompt", location, "no user turn with text")
    return Conversation(index=index, location=location, record_id=record_id, system=tuple(system),
                        turns=tuple(turns))


def _record_id(obj: dict) -> str | None:
    return next((str(obj[k]) for k in _ID_FIELDS if k in obj), None)


def iter_data_conversations(paths: Sequence[str], *, start_index: int = 0) -> Iterator[Conversation | Skip]:
    """Conversations of data files (dflash.data.sources), one item per record, in order."""
    from dflash.data.readers import iter_raw
    from dflash.data.sources import normalise_record

    index = start_index
    for path in paths:
        for item in iter_raw(path):
            if isinstance(item, Skip):
                yield item
                continue
            location, obj = item
            rec = normalise_record(obj, source=str(path), location=location)
            if isinstance(rec, Skip):
                yield rec
            elif rec.messages is None:
                yield Skip("pretokenized_record", location, "input_ids without text cannot be regenerated")
            else:
                yield conversation_of(rec.messages, index=index, location=location,
                                      record_id=_record_id(obj) if isinstance(obj, dict) else None)
            index += 1


def prompt_record_messages(record: dict) -> list[dict] | str:
    """The whole chat of one prompt-file record (MT-Bench turns become consecutive user turns), or a skip
    reason: `messages`, `conversations` (ShareGPT), `turns` (MT-Bench) or `prompt` (one user message)."""
    if isinstance(record.get("messages"), list):
        turns, role_key, content_key = record["messages"], "role", "content"
    elif isinstance(record.get("conversations"), list):
        turns, role_key, content_key = record["conversations"], "from", "value"
    elif isinstance(record.get("turns"), list) and record["turns"]:
        if not all(isinstance(t, str) for t in record["turns"]):
            return "malformed_messages"
        # each MT-Bench turn is its own exchange: a placeholder reply (None) separates them
        return [m for t in record["turns"] for m in ({"role": "user", "content": t},
                                                     {"role": "assistant", "content": None})]
    elif isinstance(record.get("prompt"), str):
        return [{"role": "user", "content": record["prompt"]}]
    else:
        return "no_prompt_field"
    out = []
    for t in turns:
        role = _ROLE_ALIASES.get(str(t.get(role_key, "")).lower()) if isinstance(t, dict) else None
        content = t.get(content_key) if isinstance(t, dict) else None
        if role is None or not isinstance(content, str):
            return "malformed_messages"
        out.append({"role": role, "content": content})
    return out


@dataclass(frozen=True, kw_only=True)
class PromptLine:
    """One JSON object of a prompt file."""

    record: dict
    location: str
    """`file:line` (1-based), for messages about this record."""
    record_id: str | None
    """The record's own id (`id`, `question_id` or `task_id`), kept in the output for joins."""


def iter_prompt_lines(path) -> Iterator[PromptLine | Skip]:
    """The records of a prompt file (jsonl or jsonl.gz), one item per non-empty line, in order: a line that is
    not JSON or not an object is a Skip (bad_json, not_an_object); a missing or misnamed file raises DataError.
    The one reader of prompt files (generation from prompts and dflash.eval.prompts)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise DataError(f"prompt file {path} does not exist")
    if not (path.name.endswith(".jsonl") or path.name.endswith(".jsonl.gz")):
        raise DataError(f"prompt file {path}: expected .jsonl or .jsonl.gz")
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            loc = f"{path.name}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                yield Skip("bad_json", loc)
                continue
            if not isinstance(record, dict):
                yield Skip("not_an_object", loc)
                continue
            yield PromptLine(record=record, location=loc, record_id=_record_id(record))


def iter_prompt_conversations(path, *, start_index: int = 0) -> Iterator[Conversation | Skip]:
    """Conversations of a prompt file (jsonl or jsonl.gz), one item per non-empty line, in order."""
    index = start_index
    for item in iter_prompt_lines(path):
        if isinstance(item, Skip):
            yield item
        else:
            msgs = prompt_record_messages(item.record)
            yield (Skip(msgs, item.location) if isinstance(msgs, str)
                   else conversation_of(msgs, index=index, location=item.location, record_id=item.record_id))
        index += 1


def load_conversations(*, data: Sequence[str] = (), prompts: str | None = None, limit: int | None = None,
                       skips: SkipCounter) -> list[Conversation]:
    """Every usable conversation of the inputs in order (at most `limit`), the unusable ones counted."""
    if bool(data) == (prompts is not None):
        raise ConfigError("give either data files (--data) or a prompt file (--prompts), not both or neither")
    if data:
        from dflash.data.sources import check_paths

        check_paths(data)  # DataError before any work
    items = iter_data_conversations(data) if data else iter_prompt_conversations(prompts)
    out: list[Conversation] = []
    for item in items:
        if limit is not None and len(out) >= limit:
            break
        if isinstance(item, Skip):
            skips.add(item)
        else:
            out.append(item)
    return out
