"""`dflash train`: parse options, resolve the TrainConfig (defaults < --config YAML < flags), call the trainer.

The TrainConfig options are generated from the dataclass: name, type, default and help text (the field's
docstring) have one source, dflash/train/config.py.
"""

from __future__ import annotations

import dataclasses

import click

from cli.cache_cmd import store_mirror_option
from dflash.errors import ConfigError
from dflash.train.config import ANCHOR_POSITIONS, ARCHS, LOSS_NORMALIZATIONS, TrainConfig, field_docs

FLAGS = {"steps": "--steps", "epochs": "--epochs", "taps": "--taps", "lr": "--lr", "batch_tokens": "--batch-tokens",
         "grad_accum": "--grad-accum", "seed": "--seed", "num_anchors": "--num-anchors", "num_layers": "--layers",
         "block_size": "--block-size", "mask_token_id": "--mask-token-id", "save_every": "--save-every",
         "log_every": "--log-every", "online": "--online", "online_storage": "--online-storage",
         "eval_cache": "--eval-cache",
         "eval_every": "--eval-every", "eval_limit": "--eval-limit", "loss_normalization": "--loss-normalization",
         "anchor_positions": "--anchor-positions", "step_samples": "--step-samples", "arch": "--arch",
         "selector_weight": "--selector-weight"}
"""TrainConfig fields offered as flags (the rest: --config YAML), and their flag names."""
CHOICES = {"loss_normalization": LOSS_NORMALIZATIONS, "anchor_positions": ANCHOR_POSITIONS, "arch": ARCHS}
"""String fields whose flag takes one of a fixed set of values."""
NAMES = {"online_storage": "STORAGE"}
"""String fields that are names, not paths (the config checks them), and their metavar."""


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


def config_options(fn):
    """One click option per FLAGS field. Every default is None, so only the flags the user gave override the
    YAML; the help shows the dataclass default."""
    docs = field_docs()
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for name, flag in reversed(FLAGS.items()):
        f = fields[name]
        help_text = docs[name]
        if f.default is not dataclasses.MISSING and f.default is not None and not isinstance(f.default, bool):
            help_text += f" [default: {f.default}]"
        kind = str(f.type)
        if kind.startswith("tuple"):
            opt = click.option(flag, name, multiple=True, callback=_int_list, help=help_text + " E.g. 1,9,17.")
        elif kind.startswith("bool"):
            opt = click.option(flag, name, is_flag=True, default=None, help=help_text)
        elif name in CHOICES:
            opt = click.option(flag, name, type=click.Choice(CHOICES[name]), default=None, help=help_text)
        elif name in NAMES:
            opt = click.option(flag, name, type=str, metavar=NAMES[name], default=None, help=help_text)
        else:
            typ = int if kind.startswith("int") else float if kind.startswith("float") else click.Path()
            opt = click.option(flag, name, type=typ, default=None, help=help_text)
        fn = opt(fn)
    return fn


@click.command("train")
@click.option("--cache", required=True, type=click.Path(), help="Hidden-state cache written by `dflash extract`.")
@click.option("--model", required=True, type=click.Path(),
              help="Target model folder: its embedding and LM head (frozen), tokenizer and config are read.")
@click.option("--output", required=True, type=click.Path(),
              help="Run folder (checkpoints/, metrics.jsonl, config.json, drafter/). Must be empty unless --resume.")
@click.option("--config", "config_path", type=click.Path(), help="YAML of TrainConfig fields (flags override it).")
@click.option("--gpus", type=int, default=1, show_default=True,
              help="Local processes to spawn, one per GPU (on a CPU-only machine: gloo processes). Not needed "
                   "under torchrun, which sets the world itself.")
@click.option("--resume", is_flag=True, help="Continue the run in --output from its newest checkpoint (exactly).")
@store_mirror_option
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True,
              help="Compute device; auto = CUDA when available.")
@config_options
def command(cache, model, output, config_path, gpus, resume, store_mirror, device, **flags) -> None:
    """Train a DFlash drafter on a hidden-state cache; a finished run exports it to OUTPUT/drafter/.

    Only the target's embedding and LM head are loaded (frozen). Each optimizer step covers
    gpus x grad-accum micro-batches of at most --batch-tokens context tokens. Checkpoints are atomic;
    `--resume` continues a killed run with the same per-step losses. With --eval-cache, the exact held-out
    tau is logged every --eval-every steps and at the end.
    """
    from dflash.train.config import load_train_config

    if gpus < 1:
        raise ConfigError(f"--gpus {gpus}: must be >= 1")
    cfg = load_train_config(config_path, dict(cache=cache, model=model, output=output, **flags))
    from dflash.store.resolve import reader_paths

    cfg = reader_paths(cfg, mirror=store_mirror)  # URLs read directly, or via local mirrors (--store-mirror)
    from dflash.store.resolve import train_store_line

    line = train_store_line(cfg, gpus=gpus)  # None for a folder (or a mirror)
    if line:
        click.echo(line)
    dev = None if device == "auto" else device
    from dflash.train.launch import launch

    result = launch(cfg, resume=resume, device=dev, gpus=gpus)
    if result is None:
        click.echo(f"training finished; run folder {cfg.output}")
    elif result.finished:
        from dflash.train.metrics import describe_final_loss

        # A --resume of an already finished run runs no step, so there is no new loss to show.
        loss = f", {describe_final_loss(result.final_record)}" if result.final_record else " (already finished)"
        heldout = result.final_record.get("heldout_tau") if result.final_record else None
        tau = f", held-out tau {heldout:.3f}" if heldout is not None else ""
        click.echo(f"trained {result.global_step} steps{loss}{tau}; drafter exported to {result.drafter_dir}")
    else:
        click.echo(f"stopped at step {result.global_step}/{result.total_steps}; continue with --resume")
