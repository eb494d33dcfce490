"""`dflash train`: parse options, resolve the TrainConfig (defaults < --config YAML < flags), call the trainer.

The TrainConfig options are generated from the dataclass: name, type, default and help text (the field's
docstring) have one source, dflash/train/config.py.
"""

from __future__ import annotations

import dataclasses

import click

from cli.cache_cmd import store_mirror_option
from dflash.errors import ConfigError
from dflash.train.config import ANCHOR_POSITIONS, ARCHS, LOSS_NORMALIZATIONS, OBJECTIVES, TrainConfig, field_docs

FLAGS = {"steps": "--steps", "epochs": "--epochs", "taps": "--taps", "lr": "--lr", "batch_tokens": "--batch-tokens",
         "grad_accum": "--grad-accum", "seed": "--seed", "num_anchors": "--num-anchors", "num_layers": "--layers",
         "block_size": "--block-size", "mask_token_id": "--mask-token-id", "save_every": "--save-every",
         "log_every": "--log-every", "online": "--online", "online_storage": "--online-storage",
         "eval_cache": "--eval-cache",
         "eval_every": "--eval-every", "eval_limit": "--eval-limit", "loss_normalization": "--loss-normalization",
         "anchor_positions": "--anchor-positions", "step_samples": "--step-samples", "objective": "--objective",
         "prefix_weight_base": "--prefix-weight-base", "layer_types": "--layer-types",
         "sliding_window": "--sliding-window", "causal": "--causal", "report_to": "--report-to", "arch": "--arch",
         "selector_weight": "--selector-weight", "shuffle_block": "--shuffle-block"}
"""TrainConfig fields offered as flags (the rest: --config YAML), and their flag names."""
CHOICES = {"loss_normalization": LOSS_NORMALIZATIONS, "anchor_positions": ANCHOR_POSITIONS, "objective": OBJECTIVES,
           "arch": ARCHS}
"""String fields whose flag takes one of a fixed set of values."""
NAMES = {"online_storage": "STORAGE", "report_to": "tensorboard,wandb"}
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


LAYER_TYPE_NAMES = {"full": "full_attention", "sliding": "sliding_attention"}
"""Short forms --layer-types accepts beside the config.json names."""


def _layer_types(ctx, param, value):
    if not value:
        return None
    parts = [item for part in value for item in str(part).replace(",", " ").split()]
    return tuple(LAYER_TYPE_NAMES.get(p, p) for p in parts)  # the config names unknown ones


def _cache_fields(caches: tuple[str, ...]) -> dict:
    """--cache given once or more: cache and extra_caches (nothing when not given: the YAML's)."""
    return {} if not caches else {"cache": caches[0], "extra_caches": tuple(caches[1:])}


def _weights(value: str | None) -> tuple[float, ...] | None:
    if value is None:
        return None
    try:
        return tuple(float(w) for w in value.replace(",", " ").split())
    except ValueError:
        raise ConfigError(f"--cache-weights {value!r}: give numbers, one per --cache, e.g. 3,1") from None


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
        if name in NAMES:
            opt = click.option(flag, name, type=str, metavar=NAMES[name], default=None, help=help_text)
        elif name == "layer_types":
            opt = click.option(flag, name, multiple=True, callback=_layer_types,
                               help=help_text + " E.g. sliding,sliding,sliding,sliding,full.")
        elif name == "causal":
            opt = click.option("--causal/--bidirectional", name, default=None, help=help_text)
        elif kind.startswith("tuple"):
            opt = click.option(flag, name, multiple=True, callback=_int_list, help=help_text + " E.g. 1,9,17.")
        elif kind.startswith("bool"):
            opt = click.option(flag, name, is_flag=True, default=None, help=help_text)
        elif name in CHOICES:
            opt = click.option(flag, name, type=click.Choice(CHOICES[name]), default=None, help=help_text)
        else:
            typ = int if kind.startswith("int") else float if kind.startswith("float") else click.Path()
            opt = click.option(flag, name, type=typ, default=None, help=help_text)
        fn = opt(fn)
    return fn


@click.command("train")
@click.option("--cache", "caches", multiple=True, type=click.Path(),
              help="Hidden-state cache written by `dflash extract` (a folder or URL). Repeat it to mix several "
                   "caches of one target, taps and storage (--cache-weights; YAML: caches: [{path, weight}]).")
@click.option("--cache-weights", "cache_weights", type=str, default=None,
              help="One weight per --cache, e.g. 3,1: each step's samples come from the caches in proportion. "
                   "Default: every sample of every cache once per epoch.")
@click.option("--init-from", "init_from", type=click.Path(), default=None,
              help="Start from trained weights: a dflash run folder or checkpoint, or a drafter folder "
                   "(config.json with dflash_config + model.safetensors). New schedule, optimizer and data.")
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
def command(caches, cache_weights, init_from, model, output, config_path, gpus, resume, store_mirror, device,
            **flags) -> None:
    """Train a DFlash drafter on a hidden-state cache; a finished run exports it to OUTPUT/drafter/.

    Only the target's embedding and LM head are loaded (frozen). Each optimizer step covers
    gpus x grad-accum micro-batches of at most --batch-tokens context tokens. Checkpoints are atomic;
    `--resume` continues a killed run with the same per-step losses. With --eval-cache, the exact held-out
    tau is logged every --eval-every steps and at the end.
    """
    from dflash.train.config import load_train_config

    if gpus < 1:
        raise ConfigError(f"--gpus {gpus}: must be >= 1")
    cfg = load_train_config(config_path, dict(model=model, output=output, init_from=init_from,
                                              cache_weights=_weights(cache_weights), **_cache_fields(caches),
                                              **flags))
    from dflash.store.resolve import reader_paths

    cfg = reader_paths(cfg, mirror=store_mirror)  # URLs read directly, or via local mirrors (--store-mirror)
    from dflash.store.resolve import train_store_line

    line = train_store_line(cfg, gpus=gpus)  # None for a folder (or a mirror)
    if line:
        click.echo(line)
    dev = None if device == "auto" else device
    from cli.interrupt import command_line, exits_on_interrupt
    from dflash.train.launch import launch

    def describe(interrupt: KeyboardInterrupt) -> str:
        from dflash.train.interrupted import can_resume, train_interrupted_text
        return train_interrupted_text(cfg.output, reached=getattr(interrupt, "global_step", None),
                                      command=command_line(*(["--resume"] if can_resume(cfg.output) else [])))

    from dflash.train.terminate import stop_on_sigterm

    with exits_on_interrupt(describe), stop_on_sigterm():
        result = launch(cfg, resume=resume, device=dev, gpus=gpus)
    if result.terminated:
        from dflash.train import checkpoint as ckpt
        from dflash.train.terminate import EXIT_TERMINATED

        click.echo(f"stopped by SIGTERM at step {result.global_step}/{result.total_steps}; checkpoint "
                   f"{ckpt.latest_checkpoint(cfg.output)}; continue with: {command_line('--resume')}", err=True)
        raise SystemExit(EXIT_TERMINATED)
    if result.finished:
        from dflash.train.metrics import describe_final_loss

        # A --resume of an already finished run runs no step, so there is no new loss to show.
        loss = f", {describe_final_loss(result.final_record)}" if result.final_record else " (already finished)"
        heldout = result.final_record.get("heldout_tau") if result.final_record else None
        tau = f", held-out tau {heldout:.3f}" if heldout is not None else ""
        click.echo(f"trained {result.global_step} steps{loss}{tau}; drafter exported to {result.drafter_dir}")
        seen = (result.final_record or {}).get("cache_samples")
        if seen:  # a mixture: what each cache contributed
            tokens = result.final_record.get("cache_tokens", {})
            total = max(1, sum(seen.values()))
            click.echo("samples per cache: " + ", ".join(f"{path} {n} ({n / total:.1%}, {tokens.get(path, 0)} tokens)"
                                                          for path, n in seen.items()))
    else:
        click.echo(f"stopped at step {result.global_step}/{result.total_steps}; continue with --resume")
