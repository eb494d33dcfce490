"""Where training metrics go besides RUN_DIR/metrics.jsonl: TensorBoard and Weights & Biases (`--report-to`).

Each reporter gets every metrics.jsonl record (loss, per-position acceptance, held-out tau per source, tokens/s,
stall, MFU, ...) as flat scalars: numbers as `train/<key>`, lists as `train/<key>/<k>` (k from 1: the block
position for `acc`), and the run's resolved config once at the start. Both packages are optional extras
(`pip install 'dflash[tensorboard]'`, `'dflash[wandb]'`) imported only when asked for.
Tradeoff: a W&B run is one invocation: a `--resume` starts a new W&B run (named after the run folder) whose
steps continue from the checkpoint, rather than appending to the first one.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from dflash.errors import ConfigError

log = logging.getLogger(__name__)

REPORTERS = ("tensorboard", "wandb")
"""The names --report-to accepts."""
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""The package each reporter imports (and the pyproject extra that installs it)."""
WANDB_DEFAULT_PROJECT = "dflash"
"""The W&B project when $WANDB_PROJECT is unset."""


def parse_report_to(value: str | Sequence[str] | None) -> tuple[str, ...] | None:
    """'tensorboard,wandb' (or a list) -> ('tensorboard', 'wandb'); 'none' or '' -> (); None stays None (the
    default: TensorBoard when installed). ConfigError naming an unknown reporter."""
    if value is None:
        return None
    items = value.replace(",", " ").split() if isinstance(value, str) else [str(v) for v in value]
    items = [i.strip().lower() for i in items if i.strip()]
    if items == ["none"]:
        return ()
    unknown = [i for i in items if i not in REPORTERS]
    if unknown:
        raise ConfigError(f"report_to={value!r}: unknown {unknown}; choose from {', '.join(REPORTERS)} "
                          "(comma-separated), or none")
    return tuple(dict.fromkeys(items))


def flat_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics record under train/ names (lists one scalar per entry, numbered from 1)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)) and math.isfinite(value):
            out[f"train/{key}"] = float(value)
        elif isinstance(value, list):
            for i, x in enumerate(value):
                if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x):
                    out[f"train/{key}/{i + 1}"] = float(x)
    return out


class Reporter(Protocol):
    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoardReporter:
    """Event files under RUN_DIR/tensorboard; the config as a text summary at step 0."""

    def __init__(self, run_dir: pathlib.Path, config: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.writer.add_text("config", "```json\n" + json.dumps(config, indent=1, default=str) + "\n```", 0)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbReporter:
    """One W&B run per invocation, files under RUN_DIR/wandb (WANDB_MODE=offline: no network; `wandb sync`
    uploads it later); project $WANDB_PROJECT or dflash, named after the run folder, the config attached."""

    def __init__(self, run_dir: pathlib.Path, config: Mapping[str, Any]) -> None:
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", WANDB_DEFAULT_PROJECT), name=run_dir.name,
                              dir=str(run_dir), config=json.loads(json.dumps(config, default=str)),
                              reinit="create_new")   # a sweep's units are runs of one process

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def open_reporters(report_to: tuple[str, ...] | None, run_dir: str | os.PathLike,
                   config: Mapping[str, Any]) -> list[Reporter]:
    """The reporters of a run. None: TensorBoard if the package is installed (a log line says when it is
    not); a tuple: exactly those, ConfigError when one's package is missing."""
    run = pathlib.Path(run_dir)
    if report_to is None:
        try:
            return [TensorBoardReporter(run, config)]
        except ImportError:
            log.info("TensorBoard logging off: the tensorboard package is not installed "
                     "(metrics still go to metrics.jsonl)")
            return []
    out: list[Reporter] = []
    for name in report_to:
        cls = TensorBoardReporter if name == "tensorboard" else WandbReporter
        try:
            out.append(cls(run, config))
        except ImportError as e:
            for r in out:
                r.close()
            raise ConfigError(f"--report-to {name}: the {PACKAGES[name]} package is not installed ({e}); "
                              f"pip install 'dflash[{name}]' or drop {name} from --report-to") from None
    return out
