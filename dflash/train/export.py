"""Export a training checkpoint (or a run folder's newest one) as an HF-format drafter folder with its model card.

The card (dflash.drafter.card) is made from what the run recorded: the held-out tau of the exported step (or the
last evaluation before it) from RUN_DIR/metrics.jsonl, the training cache's fingerprint and totals and the
resolved config from the checkpoint; the same card `dflash train` writes at the end of a run."""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass

import torch

from dflash.train.checkpoint import latest_checkpoint, load_checkpoint
from dflash.train.metrics import read_metrics


@dataclass(frozen=True, kw_only=True)
class ExportResult:
    path: pathlib.Path
    """The drafter folder written."""
    checkpoint: pathlib.Path
    """The checkpoint file exported (a run folder's newest)."""
    step: int
    """Global step of that checkpoint."""


def export_checkpoint(checkpoint: str | os.PathLike, output: str | os.PathLike, *,
                      dtype: str = "bfloat16", overwrite: bool = False, drafter_name: str | None = None
                      ) -> ExportResult:
    """drafter_name: how the card's serving commands name the drafter (its Hub id); None = the output folder."""
    from dflash.drafter.card import heldout_from_metrics, write_model_card
    from dflash.drafter.export import export_drafter
    from dflash.drafter.registry import build_drafter, config_from_json
    from dflash.train.prefix import DEFAULT_PREFIX_WEIGHT_BASE, objective_config_fields

    src = pathlib.Path(checkpoint)
    if src.is_dir():
        src = latest_checkpoint(src) or src  # load_checkpoint names the missing checkpoint
    state = load_checkpoint(src)
    cfg = config_from_json(state["drafter_config"])
    model = build_drafter(cfg)
    model.load_state_dict(state["model"])
    recipe = dict(state.get("train_config") or {})
    extra = objective_config_fields(recipe.get("objective", "dflash"),
                                    recipe.get("prefix_weight_base", DEFAULT_PREFIX_WEIGHT_BASE))
    out = export_drafter(model, cfg, output, dtype=getattr(torch, dtype), overwrite=overwrite, dflash_extra=extra)
    step = int(state["position"]["global_step"])
    eval_cache = recipe.get("eval_cache")
    run_dir = src.parent.parent   # RUN_DIR/checkpoints/step-N.pt
    heldout = heldout_from_metrics(read_metrics(run_dir), step=step,
                                   name=pathlib.Path(str(eval_cache).rstrip("/")).name if eval_cache else "heldout")
    write_model_card(out, heldout=heldout, data=(state.get("extra") or {}).get("cache") or {}, recipe=recipe,
                     target=recipe.get("model"), drafter_name=drafter_name)
    return ExportResult(path=out, checkpoint=src, step=step)
