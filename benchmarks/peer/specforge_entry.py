"""Runs SpecForge's scripts/train_dflash.py unmodified in this process after putting the import stubs of
benchmarks/peer/env.py into sys.modules, and writes what the benchmark measures of it (wall time from here to
its exit, peak memory) to --report. torchrun starts this file in place of the script:

    torchrun --standalone --nproc_per_node 1 benchmarks/peer/specforge_entry.py --report R.json SCRIPT ARGS...
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import resource
import runpy
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from env import install_stubs  # noqa: E402  (this folder, not a package: torchrun runs the file)


# specforge.distributed.init_distributed hard-codes init_process_group("nccl"), torch.cuda.set_device and
# init_device_mesh("cuda"); on a machine without CUDA these torch calls are redirected to gloo / "cpu" so the rest
# of train_dflash.py (data, FSDP wrap, loop, save) can be run; CPU diagnosis only, never on the GPU.
CPU_DIST_PATCHES = ("torch.distributed.init_process_group: backend nccl -> gloo",
                    "torch.cuda.set_device: no-op", "torch.cuda.device_count: 1",
                    "torch.distributed.device_mesh.init_device_mesh and DeviceMesh.from_group: device_type cuda -> cpu",
                    "torch.distributed.fsdp.FullyShardedDataParallel: the module itself (FSDP1 refuses CPU: 'FSDP "
                    "needs a non-CPU accelerator device'); one rank, so no sharding is lost; params stay bf16")


class _NoShard:
    """FSDP stand-in for one CPU rank: returns the module; state_dict_type is a no-op context."""

    def __new__(cls, module, **kwargs):
        return module

    @staticmethod
    def state_dict_type(module, *args, **kwargs):
        import contextlib

        return contextlib.nullcontext()


def cpu_distributed(*, no_shard: bool) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.device_mesh as dm

    init_pg, init_mesh, from_group = dist.init_process_group, dm.init_device_mesh, dm.DeviceMesh.from_group
    dist.init_process_group = lambda backend=None, **kw: init_pg(backend="gloo", **kw)
    torch.cuda.set_device = lambda device: None
    torch.cuda.device_count = lambda: 1
    dm.init_device_mesh = lambda device_type, *a, **kw: init_mesh("cpu", *a, **kw)
    dist.device_mesh.init_device_mesh = dm.init_device_mesh
    dm.DeviceMesh.from_group = staticmethod(lambda group, device_type, *a, **kw: from_group(group, "cpu", *a, **kw))
    if no_shard:
        import torch.distributed.fsdp as fsdp

        fsdp.FullyShardedDataParallel = _NoShard


def main() -> None:
    args = sys.argv[1:]
    if len(args) < 3 or args[0] != "--report":
        raise SystemExit(__doc__)
    report, script, rest = pathlib.Path(args[1]), args[2], args[3:]
    t0 = time.perf_counter()
    cpu = os.environ.get("PEER_STUBS_CPU") == "1"
    install_stubs(cpu=cpu)
    level = os.environ.get("PEER_CPU_DIST", "none")
    if cpu and level in ("gloo", "full"):
        cpu_distributed(no_shard=level == "full")

    def write_report() -> None:
        import torch

        out = {"wall_s": time.perf_counter() - t0,
               "max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda_max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            out["cuda_max_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        if os.environ.get("RANK", "0") == "0":
            report.write_text(json.dumps(out, indent=2) + "\n")

    atexit.register(write_report)
    sys.argv = [script, *rest]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
