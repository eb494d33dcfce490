"""The one training set of both trainers: the same conversations written twice (dflash's {"messages": ...} and
SpecForge's {"conversations": ...}), tokenized both ways, and kept only where the token ids and loss masks agree.

Tradeoff: dflash tokenizes with the target's chat template and masks assistant content + <|im_end|>
(dflash.data.chat); SpecForge renders with the same template and finds assistant spans by regex over the text
(specforge/data/parse.py). Each conversation carries an explicit system turn, so neither the template's default
system prompt (SmolLM2's) nor SpecForge's default ("You are a helpful assistant.") is inserted by one side only.
A sample is kept only if both sides give identical ids and masks that agree (SmolLM2: they differ in one way,
SpecForge also trains the newline after each <|im_end|>, its 'qwen' end-of-turn string being '<|im_end|>\n';
such samples are kept and counted), it fits max_length (SpecForge would truncate, dflash would skip) and it has at
least 2 x block_size loss tokens (SpecForge drops the rest). dflash then extracts SpecForge's ids and masks as
pre-tokenized records, so both trainers see exactly the same samples, tokens and loss positions.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import numpy as np

SYSTEM_PROMPT = "You are a helpful assistant."   # SpecForge's 'qwen' template default, written into the data


@dataclasses.dataclass(frozen=True, kw_only=True)
class Agreement:
    """How the two tokenizations of the candidate conversations compare."""

    num_candidates: int
    """conversations tokenized by both"""
    ids_equal: int
    """samples whose token ids are identical"""
    masks_equal: int
    """samples whose ids and loss masks are both identical"""
    masks_eot_newline_only: int
    """samples whose masks differ only at tokens right after an end-of-turn token, where SpecForge has loss and
    dflash not (its 'qwen' template's end_of_turn_token is '<|im_end|>\\n': the newline is in its assistant span)"""
    kept: tuple[int, ...]
    """candidate indices both trainers train on (with SpecForge's ids and masks)"""
    dropped: dict
    """reason -> count: dflash_skipped, ids_differ, mask_differs, over_length, few_loss_tokens"""
    mismatches: tuple[dict, ...]
    """the first few differing samples: index, what differs, first differing position, the two values there"""

    def to_json(self) -> dict:
        return {"num_candidates": self.num_candidates, "ids_equal": self.ids_equal, "masks_equal": self.masks_equal,
                "masks_eot_newline_only": self.masks_eot_newline_only, "kept": len(self.kept),
                "dropped": dict(self.dropped), "mismatches": list(self.mismatches),
                "ids_all_agree": self.ids_equal == self.num_candidates,
                "masks_all_agree": self.masks_equal == self.num_candidates}


def _first_diff(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def _only_after_eot(ids: np.ndarray, ours: np.ndarray, theirs: np.ndarray, eot_ids: frozenset[int]) -> bool:
    """Every differing position p has SpecForge loss, no dflash loss, and an end-of-turn token at p - 1."""
    diff = np.flatnonzero(ours != theirs)
    return bool(len(diff)) and all(p > 0 and theirs[p] == 1 and ours[p] == 0 and int(ids[p - 1]) in eot_ids
                                   for p in diff)


def compare_tokenizations(*, ours: dict[int, tuple[np.ndarray, np.ndarray]],
                          theirs: dict[int, tuple[np.ndarray, np.ndarray]], max_length: int, min_loss_tokens: int,
                          eot_ids: frozenset[int] = frozenset(), max_examples: int = 5) -> Agreement:
    """Compare dflash's (`ours`, index -> (ids, mask); a missing index = dflash skipped it) with SpecForge's
    (`theirs`, every candidate) tokenization. Kept: identical ids, and masks identical or differing only by the
    newline after an end-of-turn token (`eot_ids`); both trainers then use SpecForge's masks. The length and
    loss-token filters apply to SpecForge's mask, as its trainer's filter does."""
    dropped = {"dflash_skipped": 0, "ids_differ": 0, "mask_differs": 0, "over_length": 0, "few_loss_tokens": 0}
    kept, examples = [], []
    ids_equal = masks_equal = eot_only = 0
    for i in sorted(theirs):
        t_ids, t_mask = np.asarray(theirs[i][0]), np.asarray(theirs[i][1]).astype(np.uint8)
        if i not in ours:
            dropped["dflash_skipped"] += 1
            continue
        o_ids, o_mask = np.asarray(ours[i][0]), np.asarray(ours[i][1]).astype(np.uint8)
        if len(o_ids) != len(t_ids) or not np.array_equal(o_ids, t_ids):
            dropped["ids_differ"] += 1
            pos = _first_diff(o_ids, t_ids)
            examples.append({"index": i, "differs": "ids", "position": pos, "len_dflash": len(o_ids),
                             "len_specforge": len(t_ids),
                             "dflash": int(o_ids[pos]) if pos < len(o_ids) else None,
                             "specforge": int(t_ids[pos]) if pos < len(t_ids) else None})
            continue
        ids_equal += 1
        if np.array_equal(o_mask, t_mask):
            masks_equal += 1
        elif _only_after_eot(o_ids, o_mask, t_mask, eot_ids):
            eot_only += 1
        else:
            dropped["mask_differs"] += 1
            pos = _first_diff(o_mask, t_mask)
            examples.append({"index": i, "differs": "loss_mask", "position": pos, "token": int(o_ids[pos]),
                             "dflash": int(o_mask[pos]), "specforge": int(t_mask[pos]),
                             "loss_tokens_dflash": int(o_mask.sum()), "loss_tokens_specforge": int(t_mask.sum())})
            continue
        if len(t_ids) > max_length:
            dropped["over_length"] += 1
        elif int(t_mask.sum()) < min_loss_tokens:
            dropped["few_loss_tokens"] += 1
        else:
            kept.append(i)
    return Agreement(num_candidates=len(theirs), ids_equal=ids_equal, masks_equal=masks_equal,
                     masks_eot_newline_only=eot_only, kept=tuple(kept), dropped=dropped,
                     mismatches=tuple(examples[:max_examples]))


def conversation(user: str, assistant: str, *, system: str = SYSTEM_PROMPT) -> list[dict]:
    """One training conversation with the explicit system turn."""
    return [{"role": "system", "content": system}, {"role": "user", "content": user},
            {"role": "assistant", "content": assistant}]


def from_greedy_records(path: pathlib.Path) -> list[list[dict]]:
    """Conversations of a `dflash generate` output: its messages text (the target's greedy responses without the
    stop token), first user turn and response, with the system turn. The text is re-tokenized by both trainers;
    its ids need not equal the generated ids, which only dflash could use."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            msgs = [m for m in json.loads(line)["messages"] if m["role"] != "system"]
            if len(msgs) >= 2 and msgs[0]["role"] == "user" and msgs[1]["role"] == "assistant" and msgs[1]["content"]:
                out.append(conversation(msgs[0]["content"], msgs[1]["content"]))
    return out


def from_regenerated_conversations(paths: list[str], count: int) -> list[list[dict]]:
    """The first `count` whole conversations of `dflash generate --turns all` outputs (the committed quality data,
    bench_reference's training set): every user turn and regenerated assistant turn, with the system turn.
    Conversations that do not alternate user/assistant from a user turn, or hold an empty turn, are passed over."""
    from dflash.data import iter_records

    out = []
    for path in paths:
        for rec in iter_records(path):
            msgs = [m for m in (getattr(rec, "messages", None) or []) if m["role"] != "system"]
            roles_ok = all(m["role"] == ("user", "assistant")[i % 2] for i, m in enumerate(msgs))
            if len(msgs) >= 2 and roles_ok and all(m["content"] for m in msgs):
                out.append([{"role": "system", "content": SYSTEM_PROMPT}]
                           + [{"role": m["role"], "content": m["content"]} for m in msgs])
                if len(out) == count:
                    return out
    return out


def from_sharegpt(count: int, *, max_chars: int) -> list[list[dict]]:
    """First user turn and its answer of the first `count` ShareGPT records where both are 1..max_chars long
    (the CPU --tiny data: no generation needed)."""
    from dflash.data import iter_records
    from dflash.data.assets import sharegpt_path

    out = []
    for rec in iter_records(sharegpt_path()):
        msgs = getattr(rec, "messages", None)
        if not msgs or len(msgs) < 2 or msgs[0]["role"] != "user" or msgs[1]["role"] != "assistant":
            continue
        user, answer = msgs[0]["content"].strip(), msgs[1]["content"].strip()
        if 0 < len(user) <= max_chars and 0 < len(answer) <= max_chars:
            out.append(conversation(user, answer))
            if len(out) == count:
                break
    return out


def write_both(convs: list[list[dict]], *, dflash_path: pathlib.Path, specforge_path: pathlib.Path) -> None:
    """The same conversations in dflash's and SpecForge's record shapes, same order (index = line)."""
    for path, key in ((dflash_path, "messages"), (specforge_path, "conversations")):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps({"id": str(i), key: c}, ensure_ascii=False) + "\n"
                               for i, c in enumerate(convs)), encoding="utf-8")
        os.replace(tmp, path)


def write_pretokenized(samples: list[tuple[np.ndarray, np.ndarray]], path: pathlib.Path) -> None:
    """dflash's pre-tokenized records ({"input_ids", "loss_mask"}): the training file of `dflash extract`, so the
    cache holds exactly the ids and masks SpecForge's trainer builds from its own file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps({"id": str(i), "input_ids": [int(x) for x in ids],
                                       "loss_mask": [int(x) for x in mask]}) + "\n"
                           for i, (ids, mask) in enumerate(samples)), encoding="utf-8")
    os.replace(tmp, path)


def dflash_tokenization(path: pathlib.Path, tokenizer) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """index -> (ids, mask) as `dflash extract` tokenizes the file (dflash.data.load_samples: no length limit
    here, compare_tokenizations applies it); skipped records are absent."""
    from dflash.data import load_samples

    samples, _ = load_samples([path], tokenizer)
    return {s.sample_id: (s.input_ids, s.loss_mask) for s in samples}


def read_probe(npz: pathlib.Path) -> tuple[dict[int, tuple[np.ndarray, np.ndarray]], np.ndarray]:
    """specforge_probe.py's output: index -> (ids, mask), and SpecForge's lr per optimizer step."""
    with np.load(npz) as z:  # each z[key] reads the whole array again: once each, and the records are views of it
        ids, masks, off, lr = z["ids"], z["masks"], z["offsets"], z["lr"]
    toks = {i: (ids[off[i]:off[i + 1]], masks[off[i]:off[i + 1]]) for i in range(len(off) - 1)}
    return toks, lr
