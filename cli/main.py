"""The `dflash` console script: a click group whose subcommands live one per module in cli/.

Commands import torch and transformers inside their function bodies so `dflash --help` stays fast.
"""

from __future__ import annotations

import importlib
import sys

import click

from dflash.errors import DflashError

# Each module cli/<name>.py defines `command` (a click.Command or click.Group).
COMMAND_MODULES = (
    "cache_cmd",
    "extract_cmd",
    "generate_cmd",
    "eval_cmd",
    "serve_check_cmd",
    "train_cmd",
    "export_cmd",
    "sweep_cmd",
    "demo_cmd",
)


class DflashGroup(click.Group):
    """Turns DflashError into a one-line message and exit 1; other errors keep their traceback. A Ctrl-C outside a
    command's work (cli.interrupt handles the one inside it) exits 130 with one line, not click's "Aborted!" and 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as e:
            from cli.interrupt import interrupted_outside_work
            interrupted_outside_work(e)
        except DflashError as e:
            from cli.interrupt import close_progress_bars
            close_progress_bars()  # the error is the last line, not a bar redrawn after it
            raise click.ClickException(str(e)) from e


@click.group(cls=DflashGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dflash")
def cli() -> None:
    """Train DFlash speculative-decoding drafters from an offline cache of target hidden states.

    Typical flow: `dflash extract` (target -> cache), `dflash train` (cache -> drafter),
    `dflash eval` (drafter + eval cache -> acceptance length).
    """


for _name in COMMAND_MODULES:
    _mod = importlib.import_module(f"cli.{_name}")
    cli.add_command(_mod.command)


def main() -> None:
    cli(prog_name="dflash")


if __name__ == "__main__":
    sys.exit(main())
