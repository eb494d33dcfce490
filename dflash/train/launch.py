"""Start training in this process, or in N local processes (`dflash train --gpus N`).

Under torchrun (RANK/WORLD_SIZE set) every process simply trains. Otherwise --gpus N > 1 spawns N processes
with the torchrun environment (distributed.spawn_local over dflash.procs.spawn: the first failing rank stops the
others and is raised here); on a machine without CUDA they are gloo processes on
the CPU, which is how the DDP tests run.
"""

from __future__ import annotations

import logging

import torch

from dflash.errors import ConfigError
from dflash.train.config import TrainConfig, config_from_dict
from dflash.train.distributed import spawn_local, under_launcher
from dflash.train.trainer import TrainResult, train

log = logging.getLogger(__name__)


def _setup_logging() -> None:
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")


def _worker(cfg_json: dict, resume: bool, device: str | None) -> TrainResult:
    _setup_logging()
    if torch.distributed.is_available():
        import os

        if os.environ.get("RANK", "0") != "0":
            logging.getLogger().setLevel(logging.WARNING)  # one rank speaks
    from dflash.train.terminate import stop_on_sigterm

    with stop_on_sigterm():   # a rank process of `dflash train --gpus N` (dflash.train.terminate)
        return train(config_from_dict(cfg_json), resume=resume, device=device)


def launch(cfg: TrainConfig, *, resume: bool, device: str | None, gpus: int) -> TrainResult:
    """Train, in this process or in spawned workers; returns (rank 0's) result."""
    _setup_logging()
    if gpus == 1 or under_launcher():
        if gpus > 1:
            log.info("--gpus %d ignored: running under torchrun, which sets the world size", gpus)
        return train(cfg, resume=resume, device=device)
    use_cuda = torch.cuda.is_available() if device is None else device == "cuda"
    if use_cuda and torch.cuda.device_count() < gpus:
        raise ConfigError(f"--gpus {gpus}: only {torch.cuda.device_count()} CUDA devices are visible")
    if not use_cuda:
        log.info("--gpus %d without CUDA: spawning %d CPU processes with the gloo backend", gpus, gpus)
    return spawn_local(_worker, gpus, (cfg.to_json(), resume, device))[0]
