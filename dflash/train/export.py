"""Export a training checkpoint (or a run folder's newest one) as an HF-format drafter folder."""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass

import torch

from dflash.train.checkpoint import latest_checkpoint, load_checkpoint


@dataclass(frozen=True, kw_only=True)
class ExportResult:
    path: pathlib.Path
    """The drafter folder written."""
    checkpoint: pathlib.Path
    """The checkpoint file exported (a run folder's newest)."""
    step: int
    """Global step of that checkpoint."""


def export_checkpoint(checkpoint: str | os.PathLike, output: str | os.PathLike, *,
                      dtype: str = "bfloat16", overwrite: bool = False) -> ExportResult:
    from dflash.drafter.export import export_drafter
    from dflash.drafter.registry import build_drafter, config_from_json

    src = pathlib.Path(checkpoint)
    if src.is_dir():
        src = latest_checkpoint(src) or src  # load_checkpoint names the missing checkpoint
    state = load_checkpoint(src)
    cfg = config_from_json(state["drafter_config"])
    model = build_drafter(cfg)
    model.load_state_dict(state["model"])
    out = export_drafter(model, cfg, output, dtype=getattr(torch, dtype), overwrite=overwrite)
    return ExportResult(path=out, checkpoint=src, step=int(state["position"]["global_step"]))
