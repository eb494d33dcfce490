"""Process-group setup for data-parallel training: under torchrun (env vars), or N local processes that
`spawn_local` starts (`dflash train --gpus N`). NCCL on CUDA, gloo on CPU.

Gradients are not synchronised by DistributedDataParallel but by one all-reduce per optimizer step over a
flat fp32 buffer that the parameters' .grad tensors are views of (see step.GradSync): the loss is the
decay-weighted mean over the whole global step, which needs the global weight sum, and ranks may hold empty
padding micro-batches, which DDP's per-backward hooks cannot express.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from dflash.procs import spawn


@dataclass(frozen=True, kw_only=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(*, device: str | None = None) -> DistInfo:
    """Read RANK/WORLD_SIZE/LOCAL_RANK (torchrun or spawn_local) and join the process group when world > 1.

    device: "cuda" / "cpu" / None (= CUDA when available). With CUDA each process takes GPU LOCAL_RANK.
    """
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    use_cuda = torch.cuda.is_available() if device is None else device == "cuda"
    if use_cuda:
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        kwargs: dict[str, Any] = {"backend": backend, "rank": rank, "world_size": world}
        if use_cuda:
            kwargs["device_id"] = dev
        dist.init_process_group(**kwargs)
    return DistInfo(rank=rank, world_size=world, local_rank=local, device=dev)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    if info.enabled:
        if info.device.type == "cuda":
            dist.barrier(device_ids=[info.local_rank])
        else:
            dist.barrier()


class AgreedFlag:
    """A flag any rank may raise (a SIGTERM reached it) that every rank sees at the same step: poll() once per step
    on every rank starts an all-reduce (max) of this rank's flag and answers from the one the previous poll
    started. So the answer lags one step, and the host never waits for the step in flight: on CUDA the previous
    answer was copied to pinned memory behind the previous step's work, which has ended by the next step's
    poll. A world of one answers with its own flag at once."""

    def __init__(self, info: DistInfo) -> None:
        self.info = info
        self._pending: Any = None   # the previous poll's answer on CUDA: an event to wait for before reading _host
        self._started = False
        self._host = torch.zeros(1, dtype=torch.int32, pin_memory=info.device.type == "cuda")

    def poll(self, raised: bool) -> bool:
        if not self.info.enabled:
            return raised
        if self._pending is not None:
            self._pending.synchronize()
        answer = self._started and bool(self._host.item())   # read before this poll's copy overwrites it
        self._started = True
        flag = torch.full((1,), int(raised), dtype=torch.int32, device=self.info.device)  # a fill: no host copy
        if self.info.device.type == "cuda":
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True).wait()  # the stream waits, not the host
            self._host.copy_(flag, non_blocking=True)
            self._pending = torch.cuda.Event()
            self._pending.record()
        else:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            self._host.copy_(flag)
        return answer


def _call(rank: int, emit, fn: Callable, args: tuple) -> Any:
    return fn(*args)


def spawn_local(fn: Callable, nprocs: int, args: tuple = ()) -> list[Any]:
    """Run fn(*args) in `nprocs` fresh processes with the torchrun environment set (dflash.procs.spawn: the
    first failing rank stops the others and is raised here); returns their results in rank order. fn must be
    importable (a module-level function) and its result must pickle."""
    return spawn(_call, nprocs, args=(fn, args), name="dflash-train")


def under_launcher() -> bool:
    """True when torchrun (or spawn_local) already set up the environment of this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ
