"""Start the ranks of `dflash extract`: under torchrun (RANK/WORLD_SIZE/LOCAL_RANK in the environment),
or N local processes spawned here, or the current process alone.

One process per GPU, never threads: each rank owns a target replica, and FLA's Triton autotuner is not
thread-safe. The process group is gloo in every case: ranks exchange only a few progress counters and
barriers (no tensors), so NCCL would add nothing but a GPU dependency, and gloo also runs the CPU tests.

Local spawning relays rank 0's report lines and every rank's DflashError to the parent; when one rank
fails, the parent terminates the others (which would otherwise wait in a collective until the timeout).
"""

from __future__ import annotations

import ctypes
import datetime
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import time

from dflash.errors import DflashError
from dflash.extract.driver import ExtractConfig, ExtractResult, run_rank, set_cpu_threads

# Long enough for a slow rank to finish tokenizing or loading a 27B target while the others wait.
PG_TIMEOUT = datetime.timedelta(minutes=60)


def default_num_procs() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def launch(cfg: ExtractConfig, *, num_procs: int | None = None, echo=print) -> ExtractResult:
    """Run extraction on all ranks; returns rank 0's result (equal on every rank)."""
    import torch.distributed as dist

    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    if "RANK" in os.environ and env_world > 1:  # torchrun: this process is one rank
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        if cfg.dry_run:
            return run_rank(cfg, rank=rank, world_size=env_world, local_rank=local_rank,
                            echo=echo if rank == 0 else _silent)
        set_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", env_world)))
        dist.init_process_group("gloo", timeout=PG_TIMEOUT)
        try:
            return run_rank(cfg, rank=rank, world_size=env_world, local_rank=local_rank,
                            echo=echo if rank == 0 else _silent)
        finally:
            dist.destroy_process_group()
    n = num_procs or default_num_procs()
    if n < 1:
        raise DflashError(f"--gpus/--procs must be >= 1, got {n}")
    if n == 1 or cfg.dry_run:  # a dry run only plans: no need for processes
        return run_rank(cfg, rank=0, world_size=n, echo=echo)
    return _spawn(cfg, n, echo)


def _silent(_msg: str) -> None:
    pass


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent(parent_pid: int) -> None:
    """Linux: have the kernel SIGKILL this rank when the launcher dies (e.g. it is SIGKILLed itself), so no
    orphan keeps writing into the cache while a rerun resumes it."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
        except OSError:
            pass
    if os.getppid() != parent_pid:  # the launcher died before prctl took effect
        raise SystemExit(1)


def _worker(rank: int, world_size: int, port: int, cfg: ExtractConfig, out: mp.Queue, parent_pid: int) -> None:
    import torch.distributed as dist

    _die_with_parent(parent_pid)
    set_cpu_threads(world_size)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=PG_TIMEOUT)
        try:
            echo = (lambda msg: out.put(("echo", rank, msg))) if rank == 0 else _silent
            result = run_rank(cfg, rank=rank, world_size=world_size, local_rank=rank, echo=echo)
        finally:
            dist.destroy_process_group()
    except DflashError as e:
        out.put(("error", rank, f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from None
    out.put(("done", rank, result))


def _spawn(cfg: ExtractConfig, n: int, echo) -> ExtractResult:
    ctx = mp.get_context("spawn")  # fork after torch/CUDA initialisation is unsafe
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, n, port, cfg, out, os.getpid()), name=f"dflash-extract-{r}")
             for r in range(n)]
    for p in procs:
        p.start()
    results: dict[int, ExtractResult] = {}
    error: str | None = None
    try:
        while len(results) < n and error is None:
            try:
                kind, rank, payload = out.get(timeout=0.5)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:  # crashed without a message (traceback already on its stderr)
                    time.sleep(0.5)  # a DflashError message may still be in the queue
                    while not out.empty():
                        kind, rank, payload = out.get()
                        if kind == "error":
                            error = f"rank {rank}: {payload}"
                    error = error or f"rank {procs.index(dead[0])} exited with code {dead[0].exitcode}"
                continue
            if kind == "echo":
                echo(payload)
            elif kind == "error":
                error = f"rank {rank}: {payload}"
            else:
                results[rank] = payload
    finally:
        if error is not None or len(results) < n:
            for p in procs:  # only the processes started above
                if p.is_alive():
                    p.terminate()
        for p in procs:
            p.join()
    if error is not None:
        raise DflashError(error)
    return results[0]
