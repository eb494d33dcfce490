"""LM-head cross-entropy alone: fused (train.fused_ce), fused with its compiled epilogue (fused_compiled:
fused_ce_loss(epilogue="compiled")), fused with the hand-written Triton epilogue (fused_triton, CUDA only:
train.ce_kernel) and chunk-checkpointed (objective.chunked_ce_loss).

    python benchmarks/bench_fused_ce.py            # CUDA: the Qwen3.5-27B drafter head (H 5120, V 248320),
                                                   # 2 x 512 blocks of 16 rows, bf16 autocast
    python benchmarks/bench_fused_ce.py --small    # CPU: H 512, V 16384, 128 blocks of 16, fp32

Per implementation: median wall time of forward + backward (weighted_ce_sum.backward(), as the train step),
peak memory above the inputs (CUDA: max_memory_allocated; CPU: each implementation runs in its own child
process and reports ru_maxrss growth), and the loss and hidden-gradient differences between them
(fused vs checkpoint; fused_compiled vs fused). The compiled epilogue's compile happens in the warm-up step.
Weights as the trainer's: slot 0 zero, decay exp(-(k-1)/7), ~10% of the other slots masked out.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
import pathlib

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
IMPLS = ("checkpoint", "fused", "fused_compiled", "fused_triton")
EPILOGUE = {"fused": "eager", "fused_compiled": "compiled", "fused_triton": "triton"}


def make_case(*, H: int, V: int, J: int, B: int, device: torch.device, dtype: torch.dtype):
    from dflash.train.objective import decay_weights

    g = torch.Generator(device="cpu").manual_seed(0)
    N = J * B
    head = (0.02 * torch.randn(V, H, generator=g)).to(device=device, dtype=dtype)
    hidden = torch.randn(N, H, generator=g).to(device)
    labels = torch.randint(0, V, (N,), generator=g).to(device)
    keep = (torch.rand(N, generator=g) > 0.1).float()
    weights = (decay_weights(block_size=B, gamma=7.0).repeat(J) * keep).to(device)
    return hidden, head, labels, weights


def run_one(impl: str, *, H, V, J, B, reps, chunk_blocks, device, dtype) -> dict:
    from dflash.train.fused_ce import fused_ce_loss
    from dflash.train.objective import chunked_ce_loss

    hidden, head, labels, weights = make_case(H=H, V=V, J=J, B=B, device=device, dtype=dtype)
    count = int((weights > 0).sum())
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step():
        h = hidden.detach().requires_grad_(True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            if impl != "checkpoint":
                res = fused_ce_loss(h, head, labels, weights, chunk=chunk_blocks * B, block_size=B,
                                    num_supervised=count, epilogue=EPILOGUE[impl])
            else:
                res = chunked_ce_loss(h, head, labels, weights, chunk=chunk_blocks * B, block_size=B)
        res.weighted_ce_sum.backward()
        return res, h.grad

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # CPU: the inputs exist, no step has run yet
    res, grad = step()  # warm-up
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    times = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        res, grad = step()
        sync()
        times.append(time.perf_counter() - t)
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**30 if device.type == "cuda" else \
        (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 2**20
    fused = impl != "checkpoint"
    head_flops = (4 if fused else 6) * H * V * (count if fused else J * B)
    return {"time_s": statistics.median(times), "peak_extra_gib": peak, "loss": res.loss.item(),
            "supervised_rows": count, "rows": J * B, "head_matmul_flops": head_flops,
            "grad": grad.float().cpu()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="CPU-sized shape (default on a machine without CUDA)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--chunk-blocks", type=int, default=128, help="TrainConfig.loss_chunk_blocks")
    p.add_argument("--only", choices=IMPLS, help=argparse.SUPPRESS)  # CPU child process
    p.add_argument("--grad-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    small = args.small or device.type == "cpu"
    shape = dict(H=512, V=16384, J=128, B=16) if small else dict(H=5120, V=248320, J=1024, B=16)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    kw = dict(**shape, reps=args.reps, chunk_blocks=args.chunk_blocks, device=device, dtype=dtype)
    if args.only:
        r = run_one(args.only, **kw)
        torch.save(r.pop("grad"), args.grad_out)
        print(json.dumps(r))
        return
    out = {}
    for impl in IMPLS if device.type == "cuda" else IMPLS[:-1]:
        if device.type == "cpu":  # ru_maxrss is per process: one child per implementation
            gpath = f"/tmp/bench_fused_ce_{impl}.pt"
            cmd = [sys.executable, __file__, "--only", impl, "--grad-out", gpath, "--reps", str(args.reps),
                   "--chunk-blocks", str(args.chunk_blocks)] + (["--small"] if args.small else [])
            r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            r["grad"] = torch.load(gpath)
        else:
            r = run_one(impl, **kw)
            torch.cuda.empty_cache()
        out[impl] = r
    g_f, g_c, g_fc = (out[k].pop("grad") for k in ("fused", "checkpoint", "fused_compiled"))
    summary = {"benchmark": "fused_ce", "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "shape": shape, "dtype": str(dtype), "chunk_blocks": args.chunk_blocks,
               **out, "speedup": out["checkpoint"]["time_s"] / out["fused"]["time_s"],
               "loss_rel_diff": abs(out["fused"]["loss"] - out["checkpoint"]["loss"]) / abs(out["checkpoint"]["loss"]),
               "grad_rel_diff": float((g_f - g_c).norm() / g_c.norm()),
               "compiled_speedup": out["fused"]["time_s"] / out["fused_compiled"]["time_s"],
               "compiled_loss_rel_diff": abs(out["fused_compiled"]["loss"] - out["fused"]["loss"])
               / abs(out["fused"]["loss"]),
               "compiled_grad_rel_diff": float((g_fc - g_f).norm() / g_f.norm())}
    if "fused_triton" in out:
        g_t = out["fused_triton"].pop("grad")
        summary.update(triton_speedup_vs_compiled=out["fused_compiled"]["time_s"] / out["fused_triton"]["time_s"],
                       triton_loss_rel_diff=abs(out["fused_triton"]["loss"] - out["fused"]["loss"])
                       / abs(out["fused"]["loss"]),
                       triton_grad_rel_diff=float((g_t - g_f).norm() / g_f.norm()))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
