"""`dflash eval`: exact greedy acceptance length (tau) of a drafter on a target-greedy cache."""

import click


@click.command("eval")
def command() -> None:
    """Exact greedy acceptance length of a drafter on an eval cache."""
