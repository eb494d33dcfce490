"""bench_train's profile summary: the GPU time of a step by kernel kind counts kernels once. torch.profiler also
puts its own ranges (the optimizer's step) on the GPU timeline, spanning kernels that are listed themselves."""

import pathlib
import sys
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "benchmarks"))
import bench_train  # noqa: E402


def ev(key, ms, count=2, device=DeviceType.CUDA, annotation=False, cpu_ms=0.0):
    return SimpleNamespace(key=key, self_device_time_total=ms * 1e3, count=count, device_type=device,
                           is_user_annotation=annotation, self_cpu_time_total=cpu_ms * 1e3)


def test_the_optimizer_range_is_not_counted_beside_its_kernels():
    events = [
        ev("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT", 300.0),
        ev("void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata>", 40.0),
        ev("Optimizer.step#AdamW.step", 42.0, annotation=True),        # the range over the kernel above
        ev("ProfilerStep#3", 380.0),                                    # a range, by its name alone
        ev("void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda(...)::{lambda()#3}>", 10.0),
        ev("cudaLaunchKernel", 0.0, device=DeviceType.CPU, cpu_ms=8.0),
    ]
    s = bench_train.summarize_events(events, steps=2, wall_s=0.4)
    assert s["step_ms"] == pytest.approx(200.0)
    assert s["gpu_busy_ms"] == pytest.approx(175.0)                    # (300 + 40 + 10) / 2 steps
    assert s["ms_per_step_by_kind"] == pytest.approx({"matmul": 150.0, "optimizer": 20.0, "copy/fill": 5.0})
    assert s["gpu_idle_fraction"] == pytest.approx(0.125)
    assert [r["kernel"][:6] for r in s["top_kernels"]] == ["nvjet_", "void a", "void a"]
    assert s["host_cuda_calls"] == [{"call": "cudaLaunchKernel", "ms_per_step": 4.0, "calls_per_step": 1.0}]
