"""Bad-input accounting: every record that cannot become a training sample is skipped, counted by reason,
and the first few of each reason are kept with their source location, so a run never crashes on data and
the user still sees what was dropped and where (DESIGN.md "Extraction")."""

from __future__ import annotations

import dataclasses

# Reasons, one constant each so callers and tests do not spell strings by hand.
BAD_JSON = "bad_json"  # a line / record that is not valid JSON
TRUNCATED_FILE = "truncated_file"  # a .json list that ends mid-record (the ShareGPT V3 file does)
WRONG_TYPE = "wrong_type"  # a record or field of the wrong JSON type
NO_CONVERSATION = "no_conversation"  # none of messages / conversations / input_ids
UNKNOWN_ROLE = "unknown_role"
EMPTY_CONVERSATION = "empty_conversation"
NO_ASSISTANT_TURN = "no_assistant_turn"
BAD_PRETOKENIZED = "bad_pretokenized"  # input_ids without a usable loss_mask / labels
TEMPLATE_ERROR = "template_error"  # the chat template raised (e.g. roles must alternate)
TEMPLATE_PREFIX_MISMATCH = "template_prefix_mismatch"  # prefix renders are not prefixes of the full render
NO_LOSS_TOKENS = "no_loss_tokens"  # tokenized, but not one assistant token
OVER_LENGTH = "over_length"  # truncation to max_length left no assistant token

ALL_REASONS = (
    BAD_JSON, TRUNCATED_FILE, WRONG_TYPE, NO_CONVERSATION, UNKNOWN_ROLE, EMPTY_CONVERSATION,
    NO_ASSISTANT_TURN, BAD_PRETOKENIZED, TEMPLATE_ERROR, TEMPLATE_PREFIX_MISMATCH, NO_LOSS_TOKENS, OVER_LENGTH,
)


@dataclasses.dataclass(frozen=True)
class Skip:
    """One record that was dropped."""

    reason: str
    """One of the reason constants of this module."""
    location: str
    """Where it came from: "file.jsonl:12" (line) or "file.parquet:row 7"."""
    detail: str = ""
    """A short human-readable explanation (the JSON error, the offending role, ...)."""


class SkipCounter:
    """Counts skips by reason and keeps the first `max_examples` of each reason."""

    def __init__(self, *, max_examples: int = 3) -> None:
        self.max_examples = max_examples
        self.counts: dict[str, int] = {}
        self.examples: list[Skip] = []

    def add(self, skip: Skip) -> None:
        num_before = self.counts.get(skip.reason, 0)
        self.counts[skip.reason] = num_before + 1
        if num_before < self.max_examples:
            self.examples.append(skip)

    def merge(self, other: SkipCounter) -> None:
        """Fold another counter in (e.g. the counters of several ranks or sources)."""
        for reason, num in other.counts.items():
            kept = sum(1 for e in self.examples if e.reason == reason)
            self.counts[reason] = self.counts.get(reason, 0) + num
            self.examples.extend([e for e in other.examples if e.reason == reason][: max(0, self.max_examples - kept)])

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def to_dict(self) -> dict:
        """JSON-ready form for manifests and logs."""
        return {"counts": dict(sorted(self.counts.items())), "examples": [dataclasses.asdict(e) for e in self.examples]}

    def summary(self) -> str:
        """A few lines for the terminal: totals per reason, then the kept examples with their locations."""
        if not self.counts:
            return "skipped 0 records"
        lines = [f"skipped {self.total} records: " + ", ".join(f"{r}={n}" for r, n in sorted(self.counts.items()))]
        for e in self.examples:
            lines.append(f"  {e.reason} at {e.location}" + (f": {e.detail}" if e.detail else ""))
        return "\n".join(lines)
