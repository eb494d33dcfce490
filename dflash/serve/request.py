"""One greedy response to replay on a server: what serve-check's two sources (an eval cache, generate's response
files) both produce and its check consumes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class CheckRequest:
    """One cached greedy response to replay on the server."""

    sample_id: int
    prompt_ids: list[int]
    response_ids: list[int]
