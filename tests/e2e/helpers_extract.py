"""The inputs of the extraction e2e tests (test_extract_faults, test_extract_resume): a tiny random Qwen3.5
target and a JSONL of random two-turn conversations, written once here instead of once per test file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def write_conversations(path: Path, *, num: int, seed: int, broken_after: tuple[int, ...] = ()) -> Path:
    """`num` conversations (user 3-19 words, assistant 5-29) as JSONL lines; a line that is not JSON follows
    conversation i for each i in `broken_after` (the extractor must skip it and count it)."""
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(num):
        q = " ".join(rng.choice(WORDS, size=int(rng.integers(3, 20))))
        a = " ".join(rng.choice(WORDS, size=int(rng.integers(5, 30))))
        lines.append(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}))
        if i in broken_after:
            lines.append("{broken")
    path.write_text("\n".join(lines) + "\n")
    return path


def tiny_target_and_data(base: Path, *, num: int, seed: int, broken_after: tuple[int, ...] = ()) -> tuple[str, str]:
    """(model folder, data file) under `base`: tiny_qwen35_dir's default target and write_conversations' data."""
    from dflash.target.testing import tiny_qwen35_dir

    model = tiny_qwen35_dir(base / "qwen")
    data = write_conversations(base / "data.jsonl", num=num, seed=seed, broken_after=broken_after)
    return str(model), str(data)
