"""GPU only: FLA kernels for Qwen3.5 GDN layers, and the optional FLA Triton causal_conv1d swap.

Compared per op and per layer (in fp32 where possible), never only at the end of a deep random model,
which amplifies any bf16 rounding difference (DESIGN.md "Performance method")."""

import importlib.util
import inspect

import pytest
import torch

needs_fla_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("fla") is None,
    reason="needs a CUDA GPU and flash-linear-attention",
)
pytestmark = [pytest.mark.gpu, needs_fla_gpu]


def _torch_conv():
    import transformers.models.qwen3_5.modeling_qwen3_5 as mq

    from dflash.target import kernels

    return inspect.unwrap(kernels._ORIGINALS.get((mq.__name__, "causal_conv1d_fn"), mq.causal_conv1d_fn))


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_fla_conv_matches_torch_conv_per_op(dtype, tol):
    from dflash.target.kernels import _fla_causal_conv1d, _make_fla_conv

    fla = _fla_causal_conv1d()
    assert fla is not None, "FLA is installed but its causal_conv1d was not found"
    g = torch.Generator(device="cuda").manual_seed(0)
    B, T, D, W = 2, 777, 384, 4
    x_BDT = torch.randn(B, T, D, device="cuda", dtype=dtype, generator=g).transpose(1, 2)  # as transformers passes it
    w_DW = torch.randn(D, W, device="cuda", dtype=dtype, generator=g) * 0.5
    ref = _torch_conv()(x_BDT, w_DW, None, activation="silu")
    got = _make_fla_conv(fla)(x_BDT, w_DW, None, activation="silu")
    assert got.shape == ref.shape
    rel = (got.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert rel < tol, f"relative error {rel:.2e}"


def test_fla_reads_key_head_j_over_group_for_value_head_j():
    """What transformers >= 5.23 relies on (dflash.target.kernels.GROUPED_KEY_HEADS_SINCE): FLA given 16 key heads
    for 48 value heads computes exactly what it computes on the key heads copied by repeat_interleave."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    g = torch.Generator(device="cuda").manual_seed(0)
    B, T, H, HV, K = 2, 300, 4, 12, 64

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=g)

    q, k, v = rand(B, T, H, K), rand(B, T, H, K), rand(B, T, HV, K)
    decay, beta = -0.1 * rand(B, T, HV, dtype=torch.float32).abs(), rand(B, T, HV).sigmoid()
    copied = chunk_gated_delta_rule(q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2), v,
                                    g=decay, beta=beta, use_qk_l2norm_in_kernel=True)[0]
    grouped = chunk_gated_delta_rule(q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True)[0]
    assert torch.equal(grouped, copied)
    tiled = chunk_gated_delta_rule(q.repeat(1, 1, HV // H, 1), k.repeat(1, 1, HV // H, 1), v,
                                   g=decay, beta=beta, use_qk_l2norm_in_kernel=True)[0]
    assert not torch.equal(grouped, tiled)  # the mapping is j // group, not j % H


def test_select_kernels_on_cuda_and_layer_equivalence(tmp_path):
    from dflash.target.forward import TappedForward
    from dflash.target.load import load_target
    from dflash.target.testing import tiny_qwen35_dir

    src = tiny_qwen35_dir(tmp_path / "q", num_layers=4)
    model, _ = load_target(src, device="cuda", dtype=torch.float32)
    assert model.dflash_kernels.gated_deltanet == "fla", model.dflash_kernels.reason
    import transformers

    from dflash.target.kernels import key_heads_grouped  # the tiny target has 2 key heads for 4 value heads

    assert ("key heads passed grouped" in model.dflash_kernels.reason) == key_heads_grouped(transformers.__version__)
    ids = torch.randint(0, 259, (2, 300), device="cuda")
    base = TappedForward(model, (0,))(ids)
    model_fc, _ = load_target(src, device="cuda", dtype=torch.float32, fla_conv=True)
    assert model_fc.dflash_kernels.conv1d == "fla-triton", model_fc.dflash_kernels.reason
    swapped = TappedForward(model_fc, (0,))(ids)  # layer 0 is a GDN layer: one layer, fp32
    rel = (swapped - base).abs().max() / base.abs().max()
    assert rel < 1e-4, f"relative error {rel:.2e}"
    # and the CPU path still forces the torch reference afterwards
    model_cpu, _ = load_target(src, device="cpu", dtype=torch.float32)
    assert model_cpu.dflash_kernels.conv1d == "torch"
