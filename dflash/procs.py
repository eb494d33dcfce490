"""One local process launcher and one free-port helper for every command that runs N ranks on one machine
(`dflash extract --procs N`, `dflash train --gpus N`, sweeps, benchmarks).

`spawn(fn, n, args=...)` starts n fresh ("spawn") processes with the torchrun environment set (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a free port), calls
fn(rank, emit, *args) in each and returns every rank's return value, rank order. The first failure wins:
the other ranks are terminated (SIGTERM, then SIGKILL after a grace period) and the failure is raised in the
parent: a DflashError as the same class with "rank R: " before its message (the CLI prints one line), any
other exception as RankFailedError carrying the child's formatted traceback, a rank that died without a
word (signal, os._exit) as RankFailedError naming its exit code. Each child asks the kernel to kill it when
the parent dies (Linux PR_SET_PDEATHSIG), so no orphan keeps writing into a cache or run folder.
A SIGTERM to the parent (a scheduler's limit, `kill`) is passed on to every rank, and the parent goes on
waiting: a rank that stops cleanly on it (dflash.train.terminate) reports as usual; one that dies of it is raised
as a DflashError saying so (one line from the CLI, not a crash report).
`emit(obj)` sends a message to the parent's on_message(rank, obj) (extraction relays rank 0's report lines).
Tradeoff: results and messages travel through one multiprocessing queue, so they must pickle and should be
small; tensors go through the process group, not through here.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable

from dflash.errors import DflashError

TERMINATE_GRACE_S = 10.0   # a rank given SIGTERM gets this long to exit before SIGKILL


class RankFailedError(RuntimeError):
    """A spawned rank raised an unexpected exception or died; the message holds its traceback or exit code.
    Not a DflashError: it is a bug or a crash, and the CLI keeps showing it in full."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the rendezvous of the local process group)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_env(*, rank: int, world_size: int, port: int) -> dict[str, str]:
    """The environment torchrun gives rank `rank` of a one-machine job."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
        except OSError:
            pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        raise SystemExit(1)


def _child(rank: int, world_size: int, port: int | None, parent_pid: int, fn: Callable, args: tuple,
           out: Any) -> None:
    _die_with_parent(parent_pid)
    env = torchrun_env(rank=rank, world_size=world_size, port=port or 0)
    if port is None:  # independent one-process jobs: no process group to join, whatever the parent's environment
        for key in env:
            os.environ.pop(key, None)
    else:
        os.environ.update(env)
    try:
        result = fn(rank, lambda msg: out.put(("message", rank, msg, None)), *args)
    except DflashError as e:
        try:
            out.put(("dflash_error", rank, e, traceback.format_exc()))
        except Exception:  # noqa: BLE001 - an exception that does not pickle still reports its text
            out.put(("dflash_error", rank, DflashError(str(e)), traceback.format_exc()))
        raise SystemExit(1) from None
    except BaseException:  # noqa: BLE001 - every failure must reach the parent, with its traceback
        out.put(("crash", rank, None, traceback.format_exc()))
        raise SystemExit(1) from None
    out.put(("done", rank, result, None))


def _stop(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def _failure(kind: str, rank: int, err: Any, tb: str | None) -> BaseException:
    if kind == "dflash_error":
        again = type(err).__new__(type(err))   # the same class, so the CLI prints its one line
        again.__dict__.update(err.__dict__)
        again.args = (f"rank {rank}: {err}",)
        return again
    return RankFailedError(f"rank {rank} failed:\n{tb}")


def spawn(fn: Callable, nprocs: int, *, args: tuple = (), on_message: Callable[[int, Any], None] | None = None,
          name: str = "dflash", process_group: bool = True) -> list[Any]:
    """Run fn(rank, emit, *args) in `nprocs` spawned processes; returns their results in rank order or raises
    the first failure (see the module docstring). fn must be importable (a module-level function).
    process_group=False: the processes are independent one-process jobs (e.g. trainings sharing one GPU): no
    torchrun environment, so each trains as a world of one."""
    if nprocs < 1:
        raise DflashError(f"cannot start {nprocs} processes: need at least 1")
    ctx = mp.get_context("spawn")   # fork after torch/CUDA initialisation is unsafe
    out = ctx.Queue()
    port = free_port() if process_group else None
    procs = [ctx.Process(target=_child, args=(r, nprocs, port, os.getpid(), fn, args, out), name=f"{name}-{r}")
             for r in range(nprocs)]
    for p in procs:
        p.start()
    before = signal.getsignal(signal.SIGTERM)
    forward = threading.current_thread() is threading.main_thread() and before is not signal.SIG_IGN
    termed: list[bool] = []

    def pass_on(signum, frame) -> None:
        termed.append(True)
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)
        if callable(before):   # a handler of the caller's (not the default action: the parent waits)
            before(signum, frame)
    if forward:
        signal.signal(signal.SIGTERM, pass_on)
    results: dict[int, Any] = {}
    failure: BaseException | None = None
    try:
        while len(results) < nprocs and failure is None:
            try:
                kind, rank, payload, tb = out.get(timeout=0.5)
            except queue.Empty:
                # exited without a report: killed, os._exit, or a result that did not pickle (exit code 0)
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in results]
                if dead:
                    time.sleep(0.5)   # its report may still be on the way
                    try:
                        kind, rank, payload, tb = out.get(timeout=0.5)
                    except queue.Empty:
                        code = procs[dead[0]].exitcode
                        if code == 0:
                            failure = RankFailedError(f"rank {dead[0]} exited without sending its result "
                                                      "(a result must pickle; see its stderr)")
                        elif code == -signal.SIGTERM and termed:
                            failure = DflashError(f"stopped by SIGTERM: rank {dead[0]} ended with it")
                        else:
                            why = f"signal {-code}" if code < 0 else f"exit code {code}"
                            failure = RankFailedError(f"rank {dead[0]} died with {why} before reporting")
                        continue
                else:
                    continue
            if kind == "message":
                if on_message is not None:
                    on_message(rank, payload)
            elif kind == "done":
                results[rank] = payload
            else:
                failure = _failure(kind, rank, payload, tb)
    finally:
        if failure is not None or len(results) < nprocs:
            _stop(procs)
        for p in procs:
            p.join()
        if forward:
            signal.signal(signal.SIGTERM, before)
    if failure is not None:
        raise failure
    return [results[r] for r in range(nprocs)]
