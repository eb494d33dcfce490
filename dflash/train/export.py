"""Export a training checkpoint (or a run folder's newest one) as an HF-format drafter folder."""

from __future__ import annotations

import os
import pathlib

import torch

from dflash.train.checkpoint import load_checkpoint


def export_checkpoint(checkpoint: str | os.PathLike, output: str | os.PathLike, *,
                      dtype: str = "bfloat16") -> pathlib.Path:
    from dflash.drafter.config import DrafterConfig
    from dflash.drafter.export import export_drafter
    from dflash.drafter.model import DFlashDrafter

    state = load_checkpoint(checkpoint)
    d = dict(state["drafter_config"])
    d["target_layer_ids"] = tuple(d["target_layer_ids"])
    cfg = DrafterConfig(**d)
    model = DFlashDrafter(cfg)
    model.load_state_dict(state["model"])
    return export_drafter(model, cfg, output, dtype=getattr(torch, dtype))
