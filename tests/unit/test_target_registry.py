"""dflash.target.registry: one entry per target family (decoder location, layer kinds, live decoding, kernels)."""

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from dflash.target import registry
from dflash.target.kernels import GDN_OPS


def tiny_qwen35_config():
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=128)


def test_families_resolve_and_unknown_is_generic():
    assert registry.architecture(LlamaConfig()).name == "llama"
    assert registry.architecture(Qwen3Config()).name == "qwen3"
    assert registry.architecture(tiny_qwen35_config()).name == "qwen3.5"

    class Other:
        model_type = "someone_else"
        num_hidden_layers = 2

    assert registry.architecture(Other()) is registry.GENERIC


def test_layer_kinds_and_live_decoding():
    q = tiny_qwen35_config()
    kinds = [k.name for k in registry.layer_kinds(q)]
    assert kinds == list(q.layer_types) and "linear_attention" in kinds
    assert registry.live_decoding_supported(q) == (False, sorted(set(kinds)))
    assert registry.live_decoding_supported(LlamaConfig(num_hidden_layers=3)) == (True, ["full_attention"])

    class Unlisted:
        model_type = "x"
        num_hidden_layers = 2
        layer_types = ["full_attention", "mamba"]

    assert registry.live_decoding_supported(Unlisted()) == (False, ["full_attention", "mamba"])


def test_kernel_ops_come_from_the_registry():
    assert GDN_OPS == registry.LAYER_KINDS["linear_attention"].kernel_ops
    assert set(registry.kernel_ops()) == set(GDN_OPS)


def test_find_decoder_on_real_modules():
    with torch.device("meta"):
        llama = AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                             num_attention_heads=4, num_key_value_heads=2,
                                                             vocab_size=64))
        qwen = AutoModelForCausalLM.from_config(tiny_qwen35_config())
    assert registry.find_decoder(llama) is llama.model
    assert registry.find_decoder(qwen) is qwen.model
    assert registry.find_decoder(torch.nn.Linear(2, 2)) is None
