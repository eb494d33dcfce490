"""The benchmarks' profile summary (benchmarks/kernel_profile.py): the GPU time of a step by kernel kind counts kernels once. torch.profiler also
puts its own ranges (the optimizer's step) on the GPU timeline, spanning kernels that are listed themselves."""

import pathlib
import sys
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "benchmarks"))
import kernel_profile  # noqa: E402


def ev(key, ms, count=2, device=DeviceType.CUDA, annotation=False, cpu_ms=0.0, shapes=()):
    return SimpleNamespace(key=key, self_device_time_total=ms * 1e3, count=count, device_type=device,
                           is_user_annotation=annotation, self_cpu_time_total=cpu_ms * 1e3, input_shapes=shapes)


def test_the_optimizer_range_is_not_counted_beside_its_kernels():
    events = [
        ev("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT", 300.0),
        ev("void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata>", 40.0),
        ev("Optimizer.step#AdamW.step", 42.0, annotation=True),        # the range over the kernel above
        ev("ProfilerStep#3", 380.0),                                    # a range, by its name alone
        ev("void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda(...)::{lambda()#3}>", 10.0),
        ev("cudaLaunchKernel", 0.0, device=DeviceType.CPU, cpu_ms=8.0),
    ]
    s = kernel_profile.summarize_events(events, steps=2, wall_s=0.4)
    assert s["step_ms"] == pytest.approx(200.0)
    assert s["gpu_busy_ms"] == pytest.approx(175.0)                    # (300 + 40 + 10) / 2 steps
    assert s["ms_per_step_by_kind"] == pytest.approx({"matmul": 150.0, "optimizer": 20.0, "copy/fill": 5.0})
    assert s["gpu_idle_fraction"] == pytest.approx(0.125)
    assert [r["kernel"][:6] for r in s["top_kernels"]] == ["nvjet_", "void a", "void a"]
    assert s["host_cuda_calls"] == [{"call": "cudaLaunchKernel", "ms_per_step": 4.0, "calls_per_step": 1.0}]


def test_eager_ops_name_the_tensors_of_the_kernels_that_are_not_matmuls():
    """eager_ops: the aten ops that launched kernels of their own, by input shape, slowest first; matmuls,
    kernels themselves and ops that launched nothing are left out."""
    cpu = DeviceType.CPU
    events = [
        ev("aten::mm", 300.0, device=cpu, shapes=([8192, 5120], [5120, 17408])),
        ev("aten::add", 6.0, count=4, device=cpu, shapes=([8192, 5120], [8192, 5120], [])),
        ev("aten::copy_", 9.0, count=6, device=cpu, shapes=([5120, 17408], [5120, 17408], [])),
        ev("aten::view", 0.0, device=cpu, shapes=([8192, 5120], [])),
        ev("void at::native::vectorized_elementwise_kernel<CUDAFunctor_add<float>>", 6.0),
    ]
    assert kernel_profile.eager_ops(events, steps=2) == [
        {"op": "aten::copy_", "input_shapes": [[5120, 17408], [5120, 17408]], "ms_per_step": 4.5,
         "calls_per_step": 3.0},
        {"op": "aten::add", "input_shapes": [[8192, 5120], [8192, 5120]], "ms_per_step": 3.0, "calls_per_step": 2.0}]


def test_a_target_forwards_kernels_by_kind():
    """bench_extract's profile: FLA's linear-attention kernels and SDPA's attention kernels have kinds of their own;
    an inductor kernel whose fused name holds `chunk` stays compiled elementwise, a CUTLASS attention kernel is
    attention, not a matmul."""
    events = [
        ev("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", 30.0),
        ev("solve_tril_64x64_kernel", 4.0),
        ev("causal_conv1d_fwd_kernel", 2.0),
        ev("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", 10.0),
        ev("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(AttentionKernel<...>::Params)", 6.0),
        ev("triton_poi_fused_add_chunk_mul_0", 8.0),
        ev("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT", 100.0),
    ]
    kinds = kernel_profile.summarize_events(events, steps=2, wall_s=0.2)["ms_per_step_by_kind"]
    assert kinds == pytest.approx({"matmul": 50.0, "linear attention (FLA)": 18.0, "attention (SDPA)": 8.0,
                                   "compiled elementwise": 4.0})


def test_the_triton_ce_epilogue_is_softmax_ce_not_other():
    """train.ce_kernel's kernel (`ce_rows`, a hand-written Triton kernel without inductor's triton_ prefix)."""
    kinds = kernel_profile.summarize_events([ev("ce_rows", 8.0), ev("triton_red_fused_sum_0", 2.0)], steps=2,
                                            wall_s=0.2)["ms_per_step_by_kind"]
    assert kinds == pytest.approx({"softmax/CE": 4.0, "compiled elementwise": 1.0})
