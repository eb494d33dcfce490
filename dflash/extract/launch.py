"""Start the ranks of `dflash extract`: under torchrun (RANK/WORLD_SIZE/LOCAL_RANK in the environment),
or N local processes spawned here, or the current process alone.

One process per GPU, never threads: each rank owns a target replica, and FLA's Triton autotuner is not
thread-safe. The process group is gloo in every case: ranks exchange only a few progress counters and
barriers (no tensors), so NCCL would add nothing but a GPU dependency, and gloo also runs the CPU tests.

Local spawning (dflash.procs.spawn) relays rank 0's report lines and every rank's DflashError to the parent;
when one rank fails, the parent terminates the others (which would otherwise wait in a collective until the
timeout).
"""

from __future__ import annotations

import contextlib
import datetime
import os

from dflash.errors import DflashError
from dflash.procs import spawn
from dflash.extract.driver import ExtractConfig, ExtractResult, run_rank, set_cpu_threads

# Long enough for a slow rank to finish tokenizing or loading a 27B target while the others wait.
PG_TIMEOUT = datetime.timedelta(minutes=60)


def default_num_procs() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


@contextlib.contextmanager
def torchrun_group():
    """This torchrun rank in the job's gloo process group for the block: joined here unless the caller joined
    already (then left to the caller, who may need it after, e.g. extract_to_store's last barrier)."""
    import torch.distributed as dist

    joined = not dist.is_initialized()
    if joined:
        dist.init_process_group("gloo", timeout=PG_TIMEOUT)
    try:
        yield
    finally:
        if joined:
            dist.destroy_process_group()


def launch(cfg: ExtractConfig, *, num_procs: int | None = None, echo=print) -> ExtractResult:
    """Run extraction on all ranks; returns rank 0's result (equal on every rank)."""
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    if "RANK" in os.environ and env_world > 1:  # torchrun: this process is one rank
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        if cfg.dry_run:
            return run_rank(cfg, rank=rank, world_size=env_world, local_rank=local_rank,
                            echo=echo if rank == 0 else _silent)
        set_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", env_world)))
        with torchrun_group():
            return run_rank(cfg, rank=rank, world_size=env_world, local_rank=local_rank,
                            echo=echo if rank == 0 else _silent)
    n = num_procs or default_num_procs()
    if n < 1:
        raise DflashError(f"--gpus/--procs must be >= 1, got {n}")
    if n == 1 or cfg.dry_run:  # a dry run only plans: no need for processes
        return run_rank(cfg, rank=0, world_size=n, echo=echo)
    return _spawn(cfg, n, echo)


def _silent(_msg: str) -> None:
    pass


def _worker(rank: int, emit, world_size: int, cfg: ExtractConfig) -> ExtractResult:
    import torch.distributed as dist

    set_cpu_threads(world_size)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=PG_TIMEOUT)  # env:// from spawn
    try:
        return run_rank(cfg, rank=rank, world_size=world_size, local_rank=rank,
                        echo=emit if rank == 0 else _silent)
    finally:
        dist.destroy_process_group()


def _spawn(cfg: ExtractConfig, n: int, echo) -> ExtractResult:
    results = spawn(_worker, n, args=(n, cfg), on_message=lambda _rank, msg: echo(msg), name="dflash-extract")
    return results[0]
