"""Where `dflash serve-check` leaves its result: serve_check.json beside the drafter's weights, and the drafter's
model card rendered again with a "Served acceptance" section (dflash.drafter.card).

serve_check.json is {"checks": [...]}, one entry per (engine, eval source, dtype): a later check of the same kind
replaces the earlier one, other kinds stay. Each entry is the check's result (served and offline counters, the
verdict, the tolerance, the eval source) plus the engine's version and the sha256 of the model.safetensors that
was checked. The file is replaced atomically (written beside, then renamed).

Only a folder the check may write to is recorded: one this user can write, and not a Hugging Face hub cache
snapshot (its files are links into a content-addressed store that other programs trust). A folder without a card
that dflash wrote (a drafter trained elsewhere) gets serve_check.json but keeps its README.md untouched.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from dflash.drafter.card import SERVE_CHECK_NAME, read_served_checks, refresh_model_card
from dflash.drafter.export import WEIGHTS_NAME
from dflash.durable import replace_text
from dflash.serve.check import ServeCheckResult

RECORD_KEYS = ("engine", "engine_version", "eval_source", "sources", "num_requests", "dtype", "tolerance", "ok",
               "differences", "served", "offline", "offline_tau")
"""The fields of a ServeCheckResult's JSON a record keeps (not the server URL or the timings)."""


@dataclass(frozen=True, kw_only=True)
class Recorded:
    record: Path | None
    """serve_check.json written, or None when the folder may not be written (see `why_not`)."""
    card: Path | None
    """The model card rendered again, or None (nothing recorded, or no dflash card in the folder)."""
    why_not: str | None = None


def unwritable_reason(drafter_dir: str | os.PathLike) -> str | None:
    """Why serve-check must not write into this drafter folder, or None when it may."""
    d = Path(drafter_dir).resolve()
    parts = d.parts
    if any(p.startswith("models--") for p in parts) and "snapshots" in parts:
        return f"{drafter_dir} is a Hugging Face hub cache snapshot"
    if (d / WEIGHTS_NAME).is_symlink():
        return f"{drafter_dir}/{WEIGHTS_NAME} is a link into another store"
    if not os.access(d, os.W_OK):
        return f"{drafter_dir} is not writable"
    return None


def record_entry(res: ServeCheckResult, *, weights_sha256: str | None) -> dict:
    """The serve_check.json entry of one check (pure)."""
    out = res.to_json()
    entry = {k: out[k] for k in RECORD_KEYS}
    entry["text_mismatches"] = len(res.text_mismatches)
    entry["weights_sha256"] = weights_sha256
    return entry


def _kind(check: dict) -> tuple:
    return check.get("engine"), check.get("eval_source"), tuple(check.get("sources") or ()), check.get("dtype")


def merge_checks(old: list[dict], entry: dict) -> list[dict]:
    """old with `entry` in place of any check of the same engine, eval source and dtype (pure)."""
    return [c for c in old if _kind(c) != _kind(entry)] + [entry]


def record_check(res: ServeCheckResult, drafter_dir: str | os.PathLike) -> Recorded:
    """Write the check into DRAFTER/serve_check.json and render the folder's card again; nothing when the
    folder may not be written (Recorded.why_not says why)."""
    from dflash.data.hashes import sha256_file

    why = unwritable_reason(drafter_dir)
    if why is not None:
        return Recorded(record=None, card=None, why_not=why)
    d = Path(drafter_dir)
    weights = d / WEIGHTS_NAME
    entry = record_entry(res, weights_sha256=sha256_file(weights) if weights.is_file() else None)
    checks = merge_checks(read_served_checks(d), entry)
    replace_text(d / SERVE_CHECK_NAME, json.dumps({"checks": checks}, indent=1) + "\n")
    return Recorded(record=d / SERVE_CHECK_NAME, card=refresh_model_card(d))
