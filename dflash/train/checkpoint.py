"""Atomic training checkpoints: everything an exact resume needs, in one file per save.

A checkpoint is RUN_DIR/checkpoints/step-NNNNNNNN.pt holding the model, optimizer and scheduler state, the RNG
states, the data position (epoch, step within the epoch, global step), the world size, and the resolved train and
drafter configs as JSON. It is written to a tmp file in the same folder, fsynced, then os.replace'd into place and
the folder fsynced, so a crash at any instant leaves either the previous checkpoint set or the new one, never a
torn file; resume picks the newest complete file and ignores tmp leftovers.

Tradeoff: one rank (0) writes the full state; fine for a drafter of ~2B parameters (about 24 GB with fp32 Adam
states), not for sharded optimizers.
"""

from __future__ import annotations

import errno
import os
import pathlib
import random
import re
import shutil
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dflash.durable import fsync_dir
from dflash.errors import ModelNotFoundError, OutOfSpaceError, in_chain, interrupt_in_chain

CHECKPOINT_FORMAT = "dflash-train-checkpoint"
CHECKPOINT_VERSION = 1
# How epoch plans cut micro-batches into steps: 1 = packing order, 2 = cost-balanced steps (loader.balance_steps).
# A run keeps the plan it started with through every resume, or its epoch would repeat and skip samples.
PLAN_VERSION = 2
_NAME = re.compile(r"^step-(\d{8})\.pt$")


@dataclass(frozen=True, kw_only=True)
class DataPosition:
    """Where training stands: the next step to run is `step_in_epoch` of `epoch`."""

    epoch: int
    step_in_epoch: int
    global_step: int


def checkpoint_dir(run_dir: str | os.PathLike) -> pathlib.Path:
    return pathlib.Path(run_dir) / "checkpoints"


def checkpoint_path(run_dir: str | os.PathLike, global_step: int) -> pathlib.Path:
    return checkpoint_dir(run_dir) / f"step-{global_step:08d}.pt"


def checkpoint_step(path: str | os.PathLike) -> int:
    """The global step of a checkpoint file named by checkpoint_path."""
    m = _NAME.match(pathlib.Path(path).name)
    assert m is not None, f"{path} is not a checkpoint_path name"
    return int(m.group(1))


def list_checkpoints(run_dir: str | os.PathLike) -> list[pathlib.Path]:
    """Complete checkpoints, oldest first (tmp files of an interrupted save are not listed)."""
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if _NAME.match(p.name))


def latest_checkpoint(run_dir: str | os.PathLike) -> pathlib.Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def atomic_torch_save(obj: Any, path: pathlib.Path) -> None:
    """torch.save to `path` atomically: tmp file in the same folder, fsync, os.replace, fsync the folder.
    A full disk is an OutOfSpaceError naming the path and the free space; the tmp file is removed, so the
    previous checkpoints stay and a rerun with --resume continues once space is freed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        interrupt = interrupt_in_chain(e)
        if interrupt is not None:   # Ctrl-C inside torch.save: the interrupt, not the zip writer's complaint
            raise interrupt from None
        # torch.save reports a failed write as a RuntimeError whose context is the OSError (errno ENOSPC)
        if not _is_enospc(e):
            raise
        if tmp.exists():
            tmp.unlink()
        free = shutil.disk_usage(path.parent).free
        raise OutOfSpaceError(f"no space left on the device of {str(path.parent)!r} while saving checkpoint "
                              f"{path.name} ({free / 2**20:.1f} MiB free); free some space and rerun the same "
                              "command with --resume (it continues from the last complete checkpoint)") from e
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)


def _is_enospc(e: BaseException) -> bool:
    return in_chain(e, lambda x: isinstance(x, OSError) and x.errno == errno.ENOSPC) is not None


def save_checkpoint(run_dir: str | os.PathLike, *, model_state: dict, optimizer_state: dict, scheduler_state: dict,
                    position: DataPosition, world_size: int, train_config: dict, drafter_config: dict,
                    keep: int = 2, extra: dict | None = None, plan_version: int = PLAN_VERSION) -> pathlib.Path:
    """Write one checkpoint atomically and delete all but the newest `keep`. Call on rank 0 only."""
    path = checkpoint_path(run_dir, position.global_step)
    state = {
        "format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION,
        "model": model_state, "optimizer": optimizer_state, "scheduler": scheduler_state,
        "rng": rng_state(),
        "position": {"epoch": position.epoch, "step_in_epoch": position.step_in_epoch,
                     "global_step": position.global_step},
        "world_size": world_size, "train_config": train_config, "drafter_config": drafter_config,
        "plan_version": plan_version, "extra": extra or {},
    }
    atomic_torch_save(state, path)
    for old in list_checkpoints(run_dir)[:-keep]:
        old.unlink()
    return path


def plan_version_of(state: dict | None) -> int:
    """The epoch plan a run uses: PLAN_VERSION when it starts fresh (state None), else the one its checkpoint
    recorded (1 for checkpoints written before plan versions existed)."""
    return PLAN_VERSION if state is None else int(state.get("plan_version", 1))


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint file onto the CPU, checking its format."""
    p = pathlib.Path(path)
    if p.is_dir():  # a run folder: its newest checkpoint
        latest = latest_checkpoint(p)
        if latest is None:
            raise ModelNotFoundError(f"no checkpoint under {str(checkpoint_dir(p))!r}")
        p = latest
    if not p.is_file():
        raise ModelNotFoundError(f"checkpoint {str(p)!r} does not exist")
    # weights_only=False: the RNG states hold numpy objects; only load checkpoints you wrote.
    state = torch.load(p, map_location="cpu", weights_only=False)
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ModelNotFoundError(f"{str(p)!r} is not a dflash training checkpoint")
    if state.get("version") != CHECKPOINT_VERSION:
        raise ModelNotFoundError(f"{str(p)!r} has checkpoint version {state.get('version')}, "
                                 f"this dflash reads {CHECKPOINT_VERSION}")
    return state


def position_of(state: dict[str, Any]) -> DataPosition:
    return DataPosition(**state["position"])
