"""`dflash cache ...`: inspect and verify a hidden-state cache (filled in by the cache work)."""

import click


@click.group("cache")
def command() -> None:
    """Inspect and verify a hidden-state cache."""
