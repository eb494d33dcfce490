"""Where a GPU step's time goes, from a torch.profiler trace: GPU time by kernel kind, the top kernels, the host's
CUDA runtime calls and the eager ops behind the kernels that are not matmuls. Shared by bench_train (a training
step), bench_smollm2_step and bench_extract (a target forward over one planned batch)."""

from __future__ import annotations

KERNEL_KINDS = (  # (kind, name fragments), first match wins; names of CUDA kernels on the H200 (torch 2.11)
    # SDPA's attention kernels first: the memory-efficient ones are CUTLASS kernels ("fmha_cutlassF_...")
    ("attention (SDPA)", ("flash_fwd", "fmha", "flashattn", "pytorch_flash", "efficient_attention")),
    ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "sm90_")),
    ("flex attention", ("triton_tem", "flex")),
    ("compiled elementwise", ("triton_",)),
    # a Qwen3.5 target's linear-attention layers: FLA's Triton kernels, named after their functions (after
    # inductor's, whose fused names may hold an op called chunk)
    ("linear attention (FLA)", ("chunk_", "solve_tril", "recompute_w_u", "l2norm", "causal_conv1d",
                                "fused_recurrent")),
    ("optimizer", ("adam", "multi_tensor")),
    ("copy/fill", ("memcpy", "memset", "copy_kernel", "fill")),
    ("softmax/CE", ("softmax", "nll", "log_softmax", "cross_entropy", "ce_rows")),  # ce_rows: train.ce_kernel
    ("reduce", ("reduce",)),
    ("eager elementwise", ("elementwise", "vectorized", "unrolled", "cat", "index")),
)


# torch.profiler's own ranges on the GPU timeline (the optimizer's step, the profiler's steps): each spans kernels
# that are counted themselves, so counting the range too would count its time twice
ANNOTATION_PREFIXES = ("Optimizer.", "ProfilerStep#")


def is_annotation(event) -> bool:
    return bool(getattr(event, "is_user_annotation", False)) or event.key.startswith(ANNOTATION_PREFIXES)


def kernel_summary(prof, *, steps: int, wall_s: float) -> dict:
    """GPU time per step (an optimizer step; bench_extract's: a forward batch) by kernel kind and the top kernels,
    from a torch.profiler run of `steps` steps that took `wall_s`: where a step's time goes, and how much of it
    the GPU sits idle; with the eager ops behind the kernels that are not matmuls (eager_ops), by input shape."""
    out = summarize_events(prof.key_averages(), steps=steps, wall_s=wall_s)  # aggregates the whole trace: once
    out["eager_ops"] = eager_ops(prof.key_averages(group_by_input_shape=True), steps=steps)
    return out


MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::_scaled_mm")


def eager_ops(events, *, steps: int, top: int = 25) -> list[dict]:
    """The aten ops whose own kernels take GPU time, matmuls left out, by input shape (a profile recorded with
    record_shapes): which tensors the copy, fill and elementwise kernels of a step work on (a kernel's name
    gives its dtype, not what it was called on)."""
    from torch.autograd import DeviceType

    rows = [{"op": e.key, "input_shapes": [list(x) for x in e.input_shapes if x],
             "ms_per_step": e.self_device_time_total / 1e3 / steps, "calls_per_step": e.count / steps}
            for e in events
            if e.device_type == DeviceType.CPU and e.key.startswith("aten::") and e.key not in MATMUL_OPS
            and e.self_device_time_total > 0]
    return sorted(rows, key=lambda r: -r["ms_per_step"])[:top]


def summarize_events(events, *, steps: int, wall_s: float) -> dict:
    """kernel_summary from the profiler's averaged events (FunctionEventAvg): kernels only, ranges left out."""
    from torch.autograd import DeviceType

    rows = []
    for e in events:
        if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0 and not is_annotation(e):
            rows.append({"kernel": e.key[:160], "ms_per_step": e.self_device_time_total / 1e3 / steps,
                         "calls_per_step": e.count / steps})
    rows.sort(key=lambda r: -r["ms_per_step"])
    kinds: dict[str, float] = {}
    for r in rows:
        name = r["kernel"].lower()
        kind = next((k for k, frags in KERNEL_KINDS if any(f in name for f in frags)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + r["ms_per_step"]
    busy = sum(r["ms_per_step"] for r in rows)
    step_ms = wall_s * 1e3 / steps
    # the host's side: CUDA runtime calls (launches, copies, and the synchronising calls where the host waits
    # for the GPU) by time spent in them, so an idle GPU says whether the host queued too slowly or waited
    runtime = sorted(({"call": e.key, "ms_per_step": e.self_cpu_time_total / 1e3 / steps,
                       "calls_per_step": e.count / steps}
                      for e in events
                      if e.device_type == DeviceType.CPU and e.key.startswith("cuda") and e.count),
                     key=lambda r: -r["ms_per_step"])
    return {"step_ms": step_ms, "gpu_busy_ms": busy, "gpu_idle_fraction": max(0.0, 1 - busy / step_ms),
            "ms_per_step_by_kind": dict(sorted(kinds.items(), key=lambda kv: -kv[1])), "top_kernels": rows[:30],
            "host_cuda_calls": runtime[:12],
            # every copy by kind: a Pageable one makes the host wait for the copy (and what is queued before it)
            "copies": [r for r in rows if r["kernel"].startswith(("Memcpy", "Memset"))]}
