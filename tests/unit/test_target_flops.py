"""FLOPs model of the truncated target forward, checked against hand counts."""

import pytest
from transformers import LlamaConfig, Qwen3_5TextConfig

from dflash.target.flops import GDN_CHUNK, target_flops
from dflash.target.testing import tiny_qwen35_text_kwargs

QWEN35_27B = dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
                  num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
                  linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248320)


def test_llama_by_hand():
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100)
    f = target_flops(cfg, num_layers_run=3)
    d, kv, i = 64, 2 * 16, 128
    per_layer = d * d + 2 * d * kv + d * d + 3 * d * i  # q, k, v, o, gate/up/down
    assert f.linear_per_token == 2 * 3 * per_layer
    assert f.attention_per_pair == 3 * 4 * 4 * 16 and f.gdn_per_token == 0
    s = 10
    assert f.forward_flops([s, s]) == 2 * (s * f.linear_per_token + f.attention_per_pair * s * (s + 1) / 2)
    assert f.per_token(s) == pytest.approx(f.linear_per_token + f.attention_per_pair * (s + 1) / 2)


def test_qwen35_hybrid_by_hand():
    kw = tiny_qwen35_text_kwargs(num_layers=6)
    cfg = Qwen3_5TextConfig(**kw)
    f = target_flops(cfg, num_layers_run=3)  # layers 0 (GDN), 1 (attention), 2 (GDN)
    d, i = 64, 128
    mlp = 3 * d * i
    # full attention with output gate: q_proj is twice as wide (query + gate)
    attn = d * (2 * 4 * 16) + 2 * d * (2 * 16) + 4 * 16 * d
    kdim, vdim = 2 * 16, 4 * 16
    gdn_proj = d * (2 * kdim + vdim) + d * vdim + 2 * d * 4 + vdim * d  # qkv, z, b, a, out
    assert f.linear_per_token == 2 * (2 * (gdn_proj + mlp) + attn + mlp)
    assert f.attention_per_pair == 4 * 4 * 16
    assert f.gdn_per_token == 2 * 4 * (6 * 16 * 16 + 2 * GDN_CHUNK * 32)
    assert f.forward_flops([8], include_gdn=False) < f.forward_flops([8])


def test_qwen35_27b_shape_is_plausible():
    f = target_flops(Qwen3_5TextConfig(**QWEN35_27B), num_layers_run=62)
    # 26.9B parameters minus embedding and head (2 x 1.27B), times 62/64 layers, 2 FLOPs each
    expected = 2 * (26.9e9 - 2 * 248320 * 5120) * 62 / 64
    assert f.linear_per_token == pytest.approx(expected, rel=0.02)
    assert 45e9 < f.per_token(4096) < 55e9


def test_rejects_bad_layer_count():
    with pytest.raises(ValueError, match="num_layers_run"):
        target_flops(LlamaConfig(num_hidden_layers=2), num_layers_run=3)
