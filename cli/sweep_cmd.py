"""`dflash sweep`: many drafters trained off one cache, from one loader stream per device."""

from __future__ import annotations

import click

from cli.cache_cmd import store_mirror_option
from dflash.errors import ConfigError


@click.command("sweep")
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--cache", "caches", required=True, multiple=True, type=click.Path(),
              help="Hidden-state cache written by `dflash extract`; repeat it to mix caches (the spec may vary "
                   "cache_weights: those runs train side by side off one read of each cache).")
@click.option("--model", required=True, type=click.Path(), help="Target model folder (frozen embedding and LM head).")
@click.option("--output", required=True, type=click.Path(),
              help="Sweep folder: runs/NAME/{checkpoints,metrics.jsonl,drafter}, results.md/.csv, plots.")
@click.option("--gpus", type=int, default=1, show_default=True,
              help="GPUs to spread the groups of runs over (one process each); ignored on CPU.")
@click.option("--eval-cache", type=click.Path(), help="Eval cache: each finished drafter gets its exact greedy tau.")
@click.option("--approximate", is_flag=True, help="Allow an eval cache not marked target_greedy (approximate tau).")
@click.option("--eval-limit", type=int, help="Evaluate only the first N sequences of the eval cache.")
@click.option("--resume", is_flag=True, help="Continue the sweep in --output: every run from its newest checkpoint.")
@store_mirror_option
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True,
              help="Compute device; auto = CUDA when available.")
def command(spec, caches, model, output, gpus, eval_cache, approximate, eval_limit, resume, store_mirror,
            device) -> None:
    """Train every run of the sweep SPEC (YAML: base, grid, runs) from one read of the cache per device.

    Runs that share the data stream (batch_tokens, grad_accum, shuffle seed, ...) train side by side:
    each micro-batch is read and copied to the device once and used by every drafter, each with its own
    optimizer, schedule, anchors and checkpoints. See configs/sweep_example.yaml.
    """
    from dflash.sweep.runner import run_sweep
    from dflash.sweep.spec import load_sweep_spec

    if gpus < 1:
        raise ConfigError(f"--gpus {gpus}: must be >= 1")
    from dflash.store.resolve import reader_path

    cache, *extra = [reader_path(c, mirror=store_mirror) for c in caches]  # a URL: read directly unless mirrored
    eval_cache = None if eval_cache is None else reader_path(eval_cache, mirror=store_mirror)
    s = load_sweep_spec(spec, cache=cache, model=model, output=output, extra_caches=extra)
    import logging

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    from cli.interrupt import command_line, exits_on_interrupt

    def describe(_interrupt) -> str:
        from dflash.train.interrupted import sweep_interrupted_text
        return sweep_interrupted_text(output, command=command_line("--resume"))

    from dflash.train.terminate import EXIT_TERMINATED, SweepTerminated, stop_on_sigterm

    try:
        with exits_on_interrupt(describe), stop_on_sigterm():
            res = run_sweep(s, output=output, gpus=gpus, eval_cache=eval_cache, approximate=approximate,
                            resume=resume, device=None if device == "auto" else device, eval_limit=eval_limit)
    except SweepTerminated:
        from cli.interrupt import close_progress_bars
        from dflash.train.interrupted import sweep_interrupted_text

        close_progress_bars()
        click.echo(sweep_interrupted_text(output, command=command_line("--resume"), why="stopped by SIGTERM"),
                   err=True)
        raise SystemExit(EXIT_TERMINATED) from None
    from dflash.train.metrics import describe_final_loss

    for row in res.rows:
        tau = "" if row["tau"] is None else f", tau {row['tau']:.3f}"
        if row["heldout_tau"] is not None:
            tau += f", held-out tau {row['heldout_tau']:.3f} (step {row['heldout_step']})"
        click.echo(f"{row['name']}: {row['steps']} steps, {describe_final_loss(row['final_record'])}{tau}")
    from dflash.sweep.report import rank_runs

    # a tie names every leader instead of one "best run" (rank_runs)
    click.echo(f"{rank_runs(res.rows).describe()} Cache bytes read {res.bytes_read}; results in "
               f"{res.output / 'results.md'}")
