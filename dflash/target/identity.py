"""Hashes that identify a target for cache fingerprints: its config, tokenizer and chat template.

One definition used by extraction (writes them into the manifest), training and evaluation (check that
--model is the target a cache was made with) and generation (marks target-greedy records). Each hash is
over canonical JSON, so key order, whitespace and file layout do not change it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def target_config_hash(model_dir: str | os.PathLike) -> str:
    """sha256 of config.json as canonical JSON."""
    with open(Path(model_dir) / "config.json") as f:
        return sha256_json(json.load(f))


def tokenizer_hash(tokenizer: Any) -> str:
    """sha256 over the vocabulary, the special-token map and the tokenizer class."""
    vocab = sorted(tokenizer.get_vocab().items())
    specials = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    return sha256_json({"vocab": vocab, "special": specials, "class": type(tokenizer).__name__})


def chat_template_hash(tokenizer: Any) -> str:
    return sha256_json(tokenizer.chat_template)
