"""A FLOPs-based time estimate printed before extraction starts (no model weights needed).

FLOPs = dflash.target.flops (the FLOP model the extraction benchmark's MFU uses) over the padded batches of the
plan, layers 0..deepest tap. Throughput = a
matmul timed on the run's device and dtype x an efficiency factor: on an H200 the 27B target forward reached
~437-481 TFLOP/s of a ~790 TFLOP/s matmul peak (DESIGN.md), so 0.55; on CPU the same factor is a guess.
The estimate ignores the disk; the progress bar's live ETA replaces it once batches run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

EFFICIENCY = 0.55


@dataclass(frozen=True, kw_only=True)
class EtaEstimate:
    flops: float
    """Total forward FLOPs of the planned batches (padding included)."""
    flops_per_s: float
    """Measured matmul rate x EFFICIENCY x ranks."""
    seconds: float
    how: str
    """One line saying how the number was made (printed next to it)."""


def forward_flops(*, config, deepest_tap: int, batch_shapes: list[tuple[int, int]]) -> float:
    """batch_shapes: (rows, padded length) per batch; counts layers 0..deepest_tap only."""
    from dflash.target.flops import target_flops

    model = target_flops(config, num_layers_run=deepest_tap + 1)
    return sum(rows * model.forward_flops([length]) for rows, length in batch_shapes)


def measure_matmul_flops(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a square matmul on `device` (median of a few runs after a warm-up)."""
    n = 4096 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    times = []
    for _ in range(4):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        (a @ b).sum().item()  # .item(): forces completion on CUDA
        times.append(time.perf_counter() - t0)
    return 2.0 * n**3 / float(np.median(times[1:]))


def estimate_eta(*, config, deepest_tap: int, batch_shapes: list[tuple[int, int]], world_size: int,
                 device: torch.device, dtype: torch.dtype) -> EtaEstimate:
    flops = forward_flops(config=config, deepest_tap=deepest_tap, batch_shapes=batch_shapes)
    peak = measure_matmul_flops(device, dtype)
    rate = peak * EFFICIENCY * world_size
    how = (f"FLOPs-based guess: {flops / 1e12:.3g} TFLOP at {EFFICIENCY} x measured {device.type} "
           f"{str(dtype).removeprefix('torch.')} matmul {peak / 1e12:.3g} TFLOP/s x {world_size} rank(s)")
    return EtaEstimate(flops=flops, flops_per_s=rate, seconds=flops / rate if rate else 0.0, how=how)


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Seconds per batch as a + b x FLOPs, fitted on real batches of the plan run through the real model."""

    seconds_per_batch: float
    """a: the per-batch cost that does not grow with FLOPs (packing, launch, Python)."""
    seconds_per_flop: float
    """b."""
    timed: tuple[tuple[float, float], ...]
    """(FLOPs, seconds) of the timed forwards."""

    def estimate(self, batch_flops: list[float]) -> float:
        return sum(self.seconds_per_batch + self.seconds_per_flop * f for f in batch_flops)


def calibrate(run_batch, *, batch_flops: list[float], timer=time.perf_counter) -> Calibration:
    """Time run_batch(i) (the real forward + pack + encode of planned batch i, result discarded) on the batch of
    median FLOPs and on the smallest one, each after an untimed warm-up call of the same shape (allocator, lazy
    init, and on CUDA FLA's compile per batch size), and fit a line through the two points.

    Why not the matmul guess: a square matmul on CPU says little about a model forward (bf16 matmuls without
    AMX are slow, a forward is also attention, norms and copies): the demo printed ETA ~10m29s for a 1m15s run.
    Costs 2 median and 2 small batches of work; the caller skips it for small plans."""
    order = np.argsort(batch_flops, kind="stable")
    mid, small = int(order[len(order) // 2]), int(order[0])
    for i in dict.fromkeys((mid, small)):  # warm-up
        run_batch(i)
    points = []
    for i in (mid, small):
        t0 = timer()
        run_batch(i)
        points.append((float(batch_flops[i]), timer() - t0))
    (f1, t1), (f0, t0_) = points
    if f1 > f0 and t1 > t0_:
        b = (t1 - t0_) / (f1 - f0)
        a = max(0.0, t1 - b * f1)
    else:  # same FLOPs (or timer noise): all of it scales with FLOPs
        a, b = 0.0, t1 / f1 if f1 else 0.0
    return Calibration(seconds_per_batch=a, seconds_per_flop=b, timed=tuple(points))
