"""`dflash demo`: the whole pipeline end to end on SmolLM2-135M + ShareGPT, trained vs untrained tau."""

from __future__ import annotations

import click


@click.command("demo")
@click.option("--output", default="demo_out", show_default=True, type=click.Path(file_okay=False),
              help="Folder for every artefact; a rerun with the same settings reuses its finished steps.")
@click.option("--conversations", type=click.IntRange(min=1),
              help="ShareGPT conversations in the training cache (default: 48 on CPU, 2000 on GPU).")
@click.option("--steps", type=click.IntRange(min=1), help="Drafter training steps (default: 300 on CPU, 2000 on GPU).")
@click.option("--eval-prompts", type=click.IntRange(min=1, max=80),
              help="MT-Bench prompts (turn 1) to measure tau on (default: 8 on CPU, 80 on GPU).")
@click.option("--fresh", is_flag=True, help="Wipe --output first and start over.")
def command(output, conversations, steps, eval_prompts, fresh) -> None:
    """Convert SmolLM2-135M, extract a cache of ShareGPT conversations, train a drafter, generate the target's
    greedy answers to MT-Bench prompts, and print the exact greedy tau of the trained drafter next to an
    untrained one. CPU preset: a few minutes on 2 cores; with CUDA a larger GPU preset is used."""
    import logging

    from dflash.demo import default_config, run_demo

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    cfg = default_config(output=output, conversations=conversations, steps=steps, eval_prompts=eval_prompts)
    from cli.interrupt import command_line, exits_on_interrupt

    def describe(_interrupt) -> str:  # each finished step is reused; a rerun without --fresh picks up the rest
        return (f"interrupted: the finished steps in {output} are kept and reused; resume with: "
                + command_line().replace(" --fresh", ""))

    with exits_on_interrupt(describe):
        run_demo(cfg, echo=click.echo, fresh=fresh)
