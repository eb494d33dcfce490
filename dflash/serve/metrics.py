"""vLLM's speculative-decoding counters, read from its Prometheus text (/metrics), and the same counters derived
from `dflash eval`'s accept chains, so the two can be compared number for number.

vLLM counts, over all requests since it started:
    vllm:spec_decode_num_drafts_total                 target steps that verified a draft
    vllm:spec_decode_num_draft_tokens_total           drafted tokens (drafts x K)
    vllm:spec_decode_num_accepted_tokens_total        accepted draft tokens
    vllm:spec_decode_num_accepted_tokens_per_pos_total{position="i"}   steps whose drafts 0..i were all accepted
A `dflash eval` step that emitted k tokens accepted k-1 drafts, so with c[k] such steps (TauStats.step_counts):
drafts = sum c[k], accepted = sum (k-1) c[k], per position i = sum_{k >= i+2} c[k], and vLLM's mean acceptance
length 1 + accepted/drafts is dflash eval's token-weighted tau (its headline tau is a mean over prompts).
Counters are cumulative: a check reads them before and after its requests and takes the difference.
Pure functions; no network here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"

_SAMPLE = re.compile(r'^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$')
_LABEL = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """The samples of a Prometheus text exposition: (name, labels, value) per line, comments skipped.
    Label values are unescaped (\\\\, \\", \\n); values parse as float (NaN, +Inf included)."""
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise ValueError(f"not a Prometheus sample line: {raw!r}")
        labels: dict[str, str] = {}
        rest = m.group("labels") or ""
        pos = 0
        while pos < len(rest):
            lm = _LABEL.match(rest, pos)
            if lm is None:
                raise ValueError(f"bad labels in Prometheus line: {raw!r}")
            labels[lm.group(1)] = (lm.group(2).replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\"))
            pos = lm.end()
        out.append((m.group("name"), labels, float(m.group("value"))))
    return out


@dataclass(frozen=True, kw_only=True)
class SpecDecodeCounts:
    """Speculative-decoding counts of a set of requests (vLLM's counters, or derived from dflash eval)."""

    num_drafts: int
    """Target steps that verified a draft."""
    num_draft_tokens: int
    """Drafted tokens (num_drafts x K)."""
    num_accepted_tokens: int
    accepted_per_position: tuple[int, ...]
    """[i] = steps whose drafts 0..i were all accepted (length K)."""

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per target step (vLLM's figure): 1 + accepted / drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else math.nan

    @property
    def acceptance_by_position(self) -> tuple[float, ...]:
        return tuple(a / self.num_drafts if self.num_drafts else math.nan for a in self.accepted_per_position)

    def minus(self, before: SpecDecodeCounts) -> SpecDecodeCounts:
        """The counts between two readings of the same server (self is the later one)."""
        if len(before.accepted_per_position) != len(self.accepted_per_position):
            raise ValueError("the two readings have different numbers of positions")
        return SpecDecodeCounts(
            num_drafts=self.num_drafts - before.num_drafts,
            num_draft_tokens=self.num_draft_tokens - before.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens - before.num_accepted_tokens,
            accepted_per_position=tuple(a - b for a, b in zip(self.accepted_per_position,
                                                              before.accepted_per_position)))

    def to_json(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_position": list(self.accepted_per_position),
                "mean_acceptance_length": self.mean_acceptance_length,
                "acceptance_by_position": list(self.acceptance_by_position)}


def vllm_counts(text: str, *, num_speculative_tokens: int) -> SpecDecodeCounts:
    """vLLM's spec-decode counters in a /metrics text, summed over every label set but position (one server
    may label by model name or engine). A counter vLLM has not exported yet reads 0 (it appears on first use);
    positions missing from the text read 0. ValueError when the text has no spec-decode counter at all and
    no vLLM metric either (not a vLLM /metrics page)."""
    K = num_speculative_tokens
    totals = {DRAFTS: 0.0, DRAFT_TOKENS: 0.0, ACCEPTED: 0.0}
    per_pos = [0.0] * K
    seen_vllm = False
    for name, labels, value in parse_prometheus(text):
        seen_vllm |= name.startswith("vllm:")
        if name in totals:
            totals[name] += value
        elif name == ACCEPTED_PER_POS:
            i = int(labels.get("position", "-1"))
            if not 0 <= i < K:
                raise ValueError(f"{ACCEPTED_PER_POS} has position {i}, outside 0..{K - 1}: the server drafts a "
                                 f"different number of tokens than {K}")
            per_pos[i] += value
    if not seen_vllm:
        raise ValueError("no vllm: metric in the text: not a vLLM /metrics page")
    return SpecDecodeCounts(num_drafts=int(totals[DRAFTS]), num_draft_tokens=int(totals[DRAFT_TOKENS]),
                            num_accepted_tokens=int(totals[ACCEPTED]),
                            accepted_per_position=tuple(int(v) for v in per_pos))


def counts_from_steps(step_counts: Sequence[int], *, num_speculative_tokens: int) -> SpecDecodeCounts:
    """The counters vLLM would show for accept chains whose step_counts[k] steps emitted k tokens (index 0
    unused; TauStats.step_counts of dflash eval), drafting K = num_speculative_tokens tokens per step."""
    K = num_speculative_tokens
    if len(step_counts) > K + 2 and any(step_counts[K + 2:]):
        raise ValueError(f"a step emitted more than K+1 = {K + 1} tokens: K is smaller than the chains' block")
    c = list(step_counts) + [0] * max(0, K + 2 - len(step_counts))
    drafts = sum(c[1:])
    return SpecDecodeCounts(num_drafts=drafts, num_draft_tokens=drafts * K,
                            num_accepted_tokens=sum((k - 1) * n for k, n in enumerate(c) if k >= 1),
                            accepted_per_position=tuple(sum(c[i + 2:]) for i in range(K)))
