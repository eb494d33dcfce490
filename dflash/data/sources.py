"""Raw records -> normalised `Record`s: OpenAI `messages` (role/content), ShareGPT `conversations`
(from/value; human/gpt/system roles and a few aliases), or pre-tokenized `input_ids` with `loss_mask` or
`labels` (-100 = no loss). Anything else becomes a `Skip` with a reason; nothing here raises on data.

Normalisation keeps the conversation as written except for two cuts that cannot change any loss token:
leading assistant turns (they have no prompt; ~36% of ShareGPT V3 conversations start with "gpt" because
long chats were split) and trailing non-assistant turns (they come after the last loss token, so their
hidden states are never used as context: cutting them only saves extraction work).
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Iterator
from typing import Any

from dflash.data import skips
from dflash.data.readers import detect_format, iter_raw
from dflash.data.skips import Skip

# Role spellings seen in the wild -> the three roles chat templates know.
ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
}


@dataclasses.dataclass(frozen=True)
class Record:
    """One raw conversation or one pre-tokenized record."""

    source: str
    """The data path it came from, as given."""
    location: str
    """"file.jsonl:12" (line) or "file.parquet:row 7"."""
    messages: list[dict] | None = None
    """[{"role": "system"|"user"|"assistant", "content": str}] (plus "reasoning_content" when given)."""
    input_ids: list[int] | None = None
    """Pre-tokenized form: the token ids."""
    loss_mask: list[int] | None = None
    """Pre-tokenized form: 1 where the token is a loss (assistant) token, same length as input_ids."""


def check_paths(paths) -> list[pathlib.Path]:
    """Every path exists and has a known format, checked before any work (raises DataError)."""
    out = [pathlib.Path(p) for p in paths]
    for p in out:
        detect_format(p)
    return out


def iter_records(path: str | pathlib.Path) -> Iterator[Record | Skip]:
    """Every record of one data path, normalised, in file order (one item per record, skipped or not)."""
    source = str(path)
    for item in iter_raw(path):
        if isinstance(item, Skip):
            yield item
        else:
            location, obj = item
            yield normalise_record(obj, source=source, location=location)


def normalise_record(obj: Any, *, source: str, location: str) -> Record | Skip:
    """One parsed JSON object / table row -> Record, or Skip with the reason it cannot be used."""
    if not isinstance(obj, dict):
        return Skip(skips.WRONG_TYPE, location, f"record is a {type(obj).__name__}, expected an object")
    if obj.get("input_ids") is not None:
        return _pretokenized(obj, source=source, location=location)
    for key in ("messages", "conversations", "conversation"):
        if obj.get(key) is not None:
            turns = obj[key]
            break
    else:
        keys = ", ".join(sorted(map(str, obj))[:8])
        return Skip(skips.NO_CONVERSATION, location, f"no messages/conversations/input_ids field (keys: {keys})")
    if not isinstance(turns, list):
        return Skip(skips.WRONG_TYPE, location, f"{key} is a {type(turns).__name__}, expected a list")
    if not turns:
        return Skip(skips.EMPTY_CONVERSATION, location, f"{key} is empty")
    messages = []
    for i, turn in enumerate(turns):
        msg = _normalise_turn(turn)
        if isinstance(msg, str):
            reason, _, detail = msg.partition(":")
            return Skip(reason, location, f"turn {i}: {detail.strip()}")
        messages.append(msg)
    while messages and messages[0]["role"] == "system" and not messages[0]["content"]:
        messages.pop(0)  # an empty system turn is the same as none; templates then add their default
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages))
    system = [m for m in messages[:first_user] if m["role"] == "system"]
    messages = system + messages[first_user:]  # drop leading assistant turns, keep the system prompt
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()
    if not any(m["role"] == "assistant" for m in messages):
        return Skip(skips.NO_ASSISTANT_TURN, location, f"{len(turns)} turns, none an assistant reply after a user turn")
    return Record(source=source, location=location, messages=messages)


def _normalise_turn(turn: Any) -> dict | str:
    """A turn -> {"role", "content"}, or "reason: detail" when it cannot be used."""
    if not isinstance(turn, dict):
        return f"{skips.WRONG_TYPE}: turn is a {type(turn).__name__}, expected an object"
    role = turn.get("role", turn.get("from"))
    content = turn.get("content", turn.get("value"))
    if not isinstance(role, str):
        return f"{skips.WRONG_TYPE}: role is {type(role).__name__}, expected a string"
    if role.lower() not in ROLE_ALIASES:
        return f"{skips.UNKNOWN_ROLE}: role {role[:40]!r}"
    if isinstance(content, list):  # OpenAI content parts: keep text parts only if all parts are text
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            return f"{skips.WRONG_TYPE}: content parts other than text"
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        return f"{skips.WRONG_TYPE}: content is {type(content).__name__}, expected a string"
    msg = {"role": ROLE_ALIASES[role.lower()], "content": content}
    if isinstance(turn.get("reasoning_content"), str):
        msg["reasoning_content"] = turn["reasoning_content"]  # thinking templates (Qwen3) render it
    return msg


def _is_int_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in x)


def _pretokenized(obj: dict, *, source: str, location: str) -> Record | Skip:
    ids = obj["input_ids"]
    if not _is_int_list(ids):
        return Skip(skips.WRONG_TYPE, location, "input_ids must be a list of integers")
    if not ids:
        return Skip(skips.EMPTY_CONVERSATION, location, "input_ids is empty")
    if obj.get("loss_mask") is not None:
        mask = obj["loss_mask"]
        if not _is_int_list(mask) and not (isinstance(mask, list) and all(isinstance(v, bool) for v in mask)):
            return Skip(skips.WRONG_TYPE, location, "loss_mask must be a list of 0/1")
        if any(int(v) not in (0, 1) for v in mask):
            return Skip(skips.BAD_PRETOKENIZED, location, "loss_mask values must be 0 or 1")
        mask = [int(v) for v in mask]
        what = "loss_mask"
    elif obj.get("labels") is not None:
        labels = obj["labels"]
        if not _is_int_list(labels):
            return Skip(skips.WRONG_TYPE, location, "labels must be a list of integers")
        mask = [int(v != -100) for v in labels]
        what = "labels"
    else:
        return Skip(skips.BAD_PRETOKENIZED, location, "input_ids without loss_mask or labels")
    if len(mask) != len(ids):
        return Skip(skips.BAD_PRETOKENIZED, location, f"{what} has {len(mask)} entries, input_ids {len(ids)}")
    return Record(source=source, location=location, input_ids=ids, loss_mask=mask)
