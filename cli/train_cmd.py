"""`dflash train`: parse options, resolve the TrainConfig (defaults < --config YAML < flags), call the trainer."""

from __future__ import annotations

import click

from dflash.errors import ConfigError


def _int_list(ctx, param, value):
    if not value:
        return None
    out = []
    for part in value:
        for item in str(part).replace(",", " ").split():
            try:
                out.append(int(item))
            except ValueError:
                raise click.BadParameter(f"{item!r} is not a layer id (integers, e.g. --taps 1,9,17)") from None
    return tuple(out)


@click.command("train")
@click.option("--cache", required=True, type=click.Path(), help="Hidden-state cache written by `dflash extract`.")
@click.option("--model", required=True, type=click.Path(),
              help="Target model folder: its embedding and LM head (frozen), tokenizer and config are read.")
@click.option("--output", required=True, type=click.Path(),
              help="Run folder (checkpoints/, metrics.jsonl, config.json, drafter/). Must be empty unless --resume.")
@click.option("--config", "config_path", type=click.Path(), help="YAML of TrainConfig fields (flags override it).")
@click.option("--steps", type=int, help="Total optimizer steps (may span epochs); overrides --epochs.")
@click.option("--epochs", type=int, help="Passes over the cache (default 6, the paper's).")
@click.option("--taps", multiple=True, callback=_int_list,
              help="Target layer ids to use, a subset of the cache's taps, e.g. --taps 1,9,17 (default: all).")
@click.option("--gpus", type=int, default=1, show_default=True,
              help="Local processes to spawn, one per GPU (on a CPU-only machine: gloo processes). Not needed "
                   "under torchrun, which sets the world itself.")
@click.option("--resume", is_flag=True, help="Continue the run in --output from its newest checkpoint (exactly).")
@click.option("--lr", type=float, help="Peak AdamW learning rate (default 6e-4).")
@click.option("--batch-tokens", type=int, help="Context-token budget of one micro-batch per process (default 16384).")
@click.option("--grad-accum", type=int, help="Micro-batches per process per optimizer step (default 1).")
@click.option("--seed", type=int, help="Seed of init, shuffle and anchors (default 0).")
@click.option("--num-anchors", type=int, help="Anchors (blocks) per sequence per epoch (default 512).")
@click.option("--layers", "num_layers", type=int, help="Drafter decoder layers (default 5).")
@click.option("--block-size", type=int, help="Block size B (default 16).")
@click.option("--mask-token-id", type=int,
              help="Mask token id; default: the tokenizer's mask token, else its pad token if distinct from eos.")
@click.option("--save-every", type=int, help="Steps between checkpoints (default 500; a final one is always written).")
@click.option("--log-every", type=int, help="Steps between metric logs (default 10).")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True,
              help="Compute device; auto = CUDA when available.")
@click.option("--online", is_flag=True, default=None,
              help="Baseline without the cache's features: load the target and compute the taps of every "
                   "micro-batch live (the cache still supplies the token stream: same samples, order, anchors). "
                   "Slower by the target forward; for comparisons.")
def command(cache, model, output, config_path, steps, epochs, taps, gpus, resume, lr, batch_tokens, grad_accum,
            seed, num_anchors, num_layers, block_size, mask_token_id, save_every, log_every, device,
            online) -> None:
    """Train a DFlash drafter on a hidden-state cache; a finished run exports it to OUTPUT/drafter/.

    Only the target's embedding and LM head are loaded (frozen). Each optimizer step covers
    gpus x grad-accum micro-batches of at most --batch-tokens context tokens. Checkpoints are atomic;
    `--resume` continues a killed run with the same per-step losses.
    """
    from dflash.train.config import load_train_config

    if gpus < 1:
        raise ConfigError(f"--gpus {gpus}: must be >= 1")
    overrides = dict(cache=cache, model=model, output=output, steps=steps, epochs=epochs, taps=taps, lr=lr,
                     batch_tokens=batch_tokens, grad_accum=grad_accum, seed=seed, num_anchors=num_anchors,
                     num_layers=num_layers, block_size=block_size, mask_token_id=mask_token_id,
                     save_every=save_every, log_every=log_every, online=online)
    cfg = load_train_config(config_path, overrides)
    dev = None if device == "auto" else device
    from dflash.train.launch import launch

    result = launch(cfg, resume=resume, device=dev, gpus=gpus)
    if result is None:
        click.echo(f"training finished; run folder {cfg.output}")
    elif result.finished:
        from dflash.train.metrics import describe_final_loss

        # A --resume of an already finished run runs no step, so there is no new loss to show.
        loss = f", {describe_final_loss(result.final_record)}" if result.final_record else " (already finished)"
        click.echo(f"trained {result.global_step} steps{loss}; drafter exported to {result.drafter_dir}")
    else:
        click.echo(f"stopped at step {result.global_step}/{result.total_steps}; continue with --resume")
