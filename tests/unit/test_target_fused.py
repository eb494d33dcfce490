"""dflash.target.fused: the Qwen3.5 norm/gate functions are transformers' own math (bit-identical eagerly), the
swap touches exactly the Qwen3.5 modules and is undone by restore, and compiled (inductor on CPU) every layer
agrees with transformers' layer on its own real-shaped inputs to fp32 rounding."""

from __future__ import annotations

import pytest
import torch

from dflash.target import fused
from dflash.target.forward import TappedForward, text_decoder
from dflash.target.load import load_target
from dflash.target.testing import tiny_qwen35_dir


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    src = tiny_qwen35_dir(tmp_path_factory.mktemp("q") / "m", num_layers=2, seed=3)
    model, _ = load_target(src, device="cpu", dtype=torch.float32)
    # random-init norms are all ones/zeros: give the weights a spread so a wrong formula shows
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ in ("Qwen3_5RMSNorm", "Qwen3_5RMSNormGated"):
                m.weight.copy_(0.3 * torch.randn(m.weight.shape, generator=g) + (1.0 if
                               type(m).__name__ == "Qwen3_5RMSNormGated" else 0.0))
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_functions_are_transformers_forward_bit_for_bit(qwen, dtype):
    g = torch.Generator().manual_seed(1)
    seen = set()
    for m in qwen.modules():
        name = type(m).__name__
        if name not in fused.FUSED or name in seen:
            continue
        seen.add(name)
        m = m.to(dtype)
        try:
            if name == "Qwen3_5RMSNorm":
                x = torch.randn(3, 5, m.weight.shape[0], generator=g).to(dtype)
                got, want = fused.zero_centered_rms_norm(x, m.weight, m.eps), m(x)
            elif name == "Qwen3_5RMSNormGated":
                x, z = (torch.randn(7, m.weight.shape[0], generator=g).to(dtype) for _ in range(2))
                got, want = fused.gated_rms_norm(x, z, m.weight, m.variance_epsilon), m(x, z)
            else:
                x = torch.randn(2, 4, m.hidden_size, generator=g).to(dtype)
                got = m.down_proj(fused.silu_mul(m.gate_proj(x), m.up_proj(x)))
                want = m(x)
        finally:
            m.to(torch.float32)
        assert got.dtype == want.dtype == dtype
        assert torch.equal(got, want), name
    assert seen == set(fused.FUSED)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("partial", [0.25, 1.0])
def test_rotary_is_transformers_apply_rotary_pos_emb_bit_for_bit(dtype, partial):
    import transformers.models.qwen3_5.modeling_qwen3_5 as mq

    g = torch.Generator().manual_seed(4)
    B, H, Hk, S, d = 2, 6, 2, 9, 32
    q, k = torch.randn(B, H, S, d, generator=g).to(dtype), torch.randn(B, Hk, S, d, generator=g).to(dtype)
    angles = torch.randn(B, S, int(d * partial) // 2, generator=g)
    cos, sin = (f(torch.cat([angles, angles], dim=-1)).to(dtype) for f in (torch.cos, torch.sin))
    got, want = fused.rotary(q, k, cos, sin), mq.apply_rotary_pos_emb(q, k, cos, sin)
    assert all(torch.equal(a, b) and a.dtype == dtype for a, b in zip(got, want))


def test_swap_counts_the_qwen35_modules_and_restore_undoes_it(qwen):
    # 2 layers (GDN, attention): 2 + 2 layer norms, q/k norms of the attention layer, the final norm;
    # one gated norm (the GDN layer); 2 MLPs; the attention layer's rotary function, swapped in its module
    import transformers.models.qwen3_5.modeling_qwen3_5 as mq

    original = mq.apply_rotary_pos_emb
    counts = fused.compile_elementwise(qwen)
    try:
        assert counts == {"Qwen3_5RMSNorm": 7, "Qwen3_5RMSNormGated": 1, "Qwen3_5MLP": 2,
                          "Qwen3_5Attention.apply_rotary_pos_emb": 1}
        assert all("forward" in m.__dict__ for m in qwen.modules() if type(m).__name__ in fused.FUSED)
        assert mq.apply_rotary_pos_emb is fused.FUSED_FUNCTIONS["apply_rotary_pos_emb"][1]
        assert fused.compile_elementwise(qwen) == counts  # idempotent: transformers' function stays the one kept
    finally:
        fused.restore_elementwise(qwen)
    assert not any("forward" in m.__dict__ for m in qwen.modules())
    assert mq.apply_rotary_pos_emb is original


def test_compiled_layers_match_transformers_layers_per_layer(qwen):
    ids = torch.randint(0, 259, (2, 37), generator=torch.Generator().manual_seed(2))
    layers = list(text_decoder(qwen).layers)
    errs = fused.per_layer_errors(qwen, layers, lambda: qwen(input_ids=ids, use_cache=False))
    assert len(errs) == 2 and all(e < 1e-5 for e in errs), errs
    assert not any("forward" in m.__dict__ for m in qwen.modules())   # left eager
    # and through the tapped forward, behind its flag
    base = TappedForward(qwen, (0, 1))(ids)
    tapped = TappedForward(qwen, (0, 1), compile_elementwise=True)
    try:
        assert tapped.fused_modules["Qwen3_5MLP"] == 2
        got = tapped(ids)
    finally:
        fused.restore_elementwise(qwen)
    assert (got - base).abs().max() / base.abs().max() < 1e-5
