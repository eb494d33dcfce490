"""`dflash export CHECKPOINT --output DIR`: write a training checkpoint as an HF-format drafter folder."""

from __future__ import annotations

import click


@click.command("export")
@click.argument("checkpoint", type=click.Path())
@click.option("--output", required=True, type=click.Path(),
              help="Destination folder for config.json, model.safetensors, dflash.py and README.md (must be empty or "
                   "absent).")
@click.option("--overwrite", is_flag=True,
              help="Replace a non-empty --output folder (the old one is removed only once the new one is complete).")
@click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16", show_default=True,
              help="Dtype of the exported weights.")
@click.option("--hub-id", metavar="ORG/NAME",
              help="The drafter's Hugging Face Hub id, for the model card's serving commands (default: the --output "
                   "folder's path).")
def command(checkpoint, output, dtype, overwrite, hub_id) -> None:
    """Export CHECKPOINT (a step-*.pt file, or a run folder: its newest checkpoint) as a DFlash drafter
    that SGLang / vLLM / z-lab code and `dflash eval` load, with dflash.py (loads with transformers'
    trust_remote_code, no dflash needed) and a model card (README.md: held-out tau from the run's metrics,
    data, recipe, the vLLM and SGLang commands)."""
    from dflash.train.export import export_checkpoint

    res = export_checkpoint(checkpoint, output, dtype=dtype, overwrite=overwrite, drafter_name=hub_id)
    click.echo(f"exported step {res.step} ({res.checkpoint}) to {res.path}")
