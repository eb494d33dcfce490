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


def test_select_kernels_on_cuda_and_layer_equivalence(tmp_path):
    from dflash.target.forward import TappedForward
    from dflash.target.load import load_target
    from dflash.target.testing import tiny_qwen35_dir

    src = tiny_qwen35_dir(tmp_path / "q", num_layers=4)
    model, _ = load_target(src, device="cuda", dtype=torch.float32)
    assert model.dflash_kernels.gated_deltanet == "fla", model.dflash_kernels.reason
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
