"""One conversation regenerated turn by turn, as a state machine over token ids.

`ConversationRun.next_request()` gives the next turn's prompt (the whole context so far) and token budget, or
None once the conversation is over; `take()` appends the target's response. Every scheduler calls the same
two methods, so a round-by-round batch loop and a continuous-batching engine write the same records and count
the same stats for the same responses.

The conversation ends early, keeping the turns done, when the next prompt leaves no room under max_length
(over_length) or the template rewrites the history (template_prefix_mismatch, template_error); when that
happens at the first turn the conversation is skipped (prompt_over_length, template_error).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from dflash.generate.conversations import Conversation
from dflash.generate.turns import TurnState, conversation_record, render_prompt_ids, transition_ids

log = logging.getLogger(__name__)


def new_chunk_stats() -> dict:
    """The per-chunk stats every scheduler fills (dflash.generate.output commits them)."""
    return {"records": 0, "turns": 0, "eos": 0, "length": 0, "response_tokens": 0, "skipped": {}, "truncated": {}}


def count(acc: dict, key: str, n: int = 1) -> None:
    acc[key] = acc.get(key, 0) + n


def first_messages(conv: Conversation, mode: str) -> list[dict]:
    """The chat before the first regenerated reply: the first turn's prompt, or (last) the source history."""
    msgs = [dict(m) for m in conv.system]
    if mode == "last":
        for t in conv.turns[:-1]:
            msgs.extend(dict(m) for m in t.prompt)
            if t.reply is not None:
                msgs.append({"role": "assistant", "content": t.reply})
        msgs.extend(dict(m) for m in conv.turns[-1].prompt)
    else:
        msgs.extend(dict(m) for m in conv.turns[0].prompt)
    return msgs


@dataclass(frozen=True, kw_only=True)
class DialogRules:
    """What every conversation of a job shares: the tokenizer and the limits."""

    tokenizer: object
    mode: str
    """Turn mode: "all", "first" or "last"."""
    max_new_tokens: int
    max_length: int
    template_kwargs: dict
    end_id: int | None
    """The template's end-of-turn id (closes a turn cut by its budget); None: single-turn modes only."""

    @property
    def end_token(self) -> str | None:
        return self.tokenizer.convert_ids_to_tokens(self.end_id) if self.end_id is not None else None


class ConversationRun:
    """The regeneration of one conversation; stats go into the chunk's `stats` dict (new_chunk_stats)."""

    def __init__(self, conv: Conversation, *, rules: DialogRules, stats: dict) -> None:
        self.conv = conv
        self.rules = rules
        self.stats = stats
        self.state: TurnState | None = None
        self.turn = 0
        """Index of the next turn to regenerate."""
        self.done = False
        self._pending: tuple[list[int], list[dict]] | None = None

    def next_request(self) -> tuple[list[int], int] | None:
        """(prompt ids = context + the next turn's ids, token budget), or None: the conversation is over."""
        assert self._pending is None, "take() the previous response first"
        r, conv, rules = self.turn, self.conv, self.rules
        if self.done or r >= conv.num_generated(rules.mode):
            self.done = True
            return None
        if r == 0:
            msgs = first_messages(conv, rules.mode)
            try:
                new_ids = render_prompt_ids(rules.tokenizer, msgs, rules.template_kwargs)
            except Exception as e:  # a template that rejects this chat (roles, missing system turn)
                log.debug("%s: template error %s", conv.location, e)
                return self._end("skipped", "template_error")
            self.state = TurnState(messages=[])
        else:
            msgs = [dict(m) for m in conv.turns[r].prompt]
            try:
                new_ids = transition_ids(rules.tokenizer, history=self.state.messages, next_messages=msgs,
                                         end_token=rules.end_token, template_kwargs=rules.template_kwargs)
            except Exception as e:  # the template rejects the longer chat: keep the turns done
                log.debug("%s: template error at turn %d: %s", conv.location, r, e)
                return self._end("truncated", "template_error")
            if new_ids is None:
                return self._end("truncated", "template_prefix_mismatch")
        budget = min(rules.max_new_tokens, rules.max_length - len(self.state.ids) - len(new_ids))
        if budget < 1:
            return self._end("skipped", "prompt_over_length") if r == 0 else self._end("truncated", "over_length")
        self._pending = (new_ids, msgs)
        return self.state.ids + new_ids, budget

    def _end(self, kind: str, reason: str) -> None:
        count(self.stats[kind], reason)
        self.done = True
        return None

    def take(self, response_ids: list[int], *, stop_reason: str) -> None:
        """The target's response to the last request (ids incl. the stop token when stop_reason == 'eos')."""
        assert self._pending is not None, "no request in flight"
        new_ids, msgs = self._pending
        self._pending = None
        st, rules = self.state, self.rules
        st.add_prompt(new_ids)
        st.messages.extend(msgs)
        body = response_ids[:-1] if stop_reason == "eos" else response_ids
        st.add_response(response_ids, stop_reason=stop_reason,
                        text=rules.tokenizer.decode(body, skip_special_tokens=False))
        count(self.stats, stop_reason)
        self.stats["turns"] += 1
        self.stats["response_tokens"] += len(response_ids)
        self.turn += 1
        if self.turn < self.conv.num_generated(rules.mode):
            st.close_turn(rules.end_id)

    def record(self, meta: dict) -> dict | None:
        """The output record once the conversation is over; None when no turn was regenerated."""
        assert self.done
        if self.state is None or not self.state.turns:
            return None
        return conversation_record(self.state, meta=meta, location=self.conv.location,
                                   record_id=self.conv.record_id)


def chunk_records(runs: list[ConversationRun], *, meta: dict, stats: dict) -> tuple[list[dict], dict]:
    """Records of a finished chunk in input order, and its stats with the record count."""
    records = [rec for rec in (run.record(meta) for run in runs) if rec is not None]
    stats["records"] = len(records)
    return records, stats
