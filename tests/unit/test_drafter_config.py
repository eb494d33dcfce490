"""DrafterConfig validation and the published config.json schema (method doc 1.4)."""

import dataclasses

import pytest
from transformers import Qwen3Config

from dflash.drafter.config import DrafterConfig
from dflash.errors import ConfigError

# The published Qwen3-8B-DFlash-b16 config.json (SpecForge configs/qwen3-8b-dflash.json, synced upstream),
# with the dflash_config of the method doc 1.4.
PUBLISHED_QWEN3_8B = {
    "architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": 16, "bos_token_id": 151643,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "dtype": "bfloat16", "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 12288, "layer_types": ["full_attention"] * 5,
    "max_position_embeddings": 40960, "max_window_layers": 5, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 5, "num_key_value_heads": 8, "num_target_layers": 36,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": False, "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}

SCHEMA_FIELDS = {"architectures", "auto_map", "model_type", "block_size", "dflash_config", "num_target_layers",
                 "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "hidden_act", "layer_types", "rms_norm_eps", "rope_theta",
                 "rope_scaling", "max_position_embeddings", "attention_bias", "tie_word_embeddings",
                 "vocab_size", "dtype", "use_sliding_window", "sliding_window"}


def qwen35_27b():
    return DrafterConfig(hidden_size=5120, intermediate_size=17408, target_layer_ids=(1, 16, 31, 46, 61),
                         num_target_layers=64, mask_token_id=248070, vocab_size=248320,
                         max_position_embeddings=262144)


def test_defaults_are_the_paper_drafter():
    c = qwen35_27b()
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (5, 32, 8, 128)
    assert (c.block_size, c.rms_norm_eps, c.rope_theta, c.hidden_act) == (16, 1e-6, 1e7, "silu")
    assert c.num_taps == 5


def test_every_field_has_a_docstring():
    import ast
    import inspect

    import dflash.drafter.config as mod
    tree = ast.parse(inspect.getsource(mod.DrafterConfig))
    body = tree.body[0].body
    documented = {stmt.target.id for stmt, nxt in zip(body, body[1:])
                  if isinstance(stmt, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                  and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)}
    assert documented == {f.name for f in dataclasses.fields(DrafterConfig)}


def test_hf_config_has_the_published_schema_and_values():
    hf = qwen35_27b().to_hf_config()
    assert SCHEMA_FIELDS <= set(hf)
    assert hf["architectures"] == ["DFlashDraftModel"]
    assert hf["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert hf["model_type"] == "qwen3" and hf["dtype"] == "bfloat16"
    assert hf["dflash_config"] == {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]}
    assert hf["layer_types"] == ["full_attention"] * 5
    assert hf["rope_theta"] == 10000000 and isinstance(hf["rope_theta"], int)
    assert hf["rope_scaling"] is None and hf["sliding_window"] is None
    assert hf["tie_word_embeddings"] is False and hf["attention_bias"] is False
    assert hf["use_sliding_window"] is False
    # same keys (and values where they apply) as the published Qwen3-8B drafter
    pub_keys = set(PUBLISHED_QWEN3_8B) - {"bos_token_id", "eos_token_id"}
    assert pub_keys <= set(hf)


def test_published_config_round_trips():
    c = DrafterConfig.from_hf_config(PUBLISHED_QWEN3_8B)
    assert c.target_layer_ids == (1, 9, 17, 25, 33) and c.mask_token_id == 151669
    assert c.rope_theta == 1e6 and c.hidden_size == 4096 and c.num_target_layers == 36
    hf = c.to_hf_config()
    for k in SCHEMA_FIELDS:
        assert hf[k] == PUBLISHED_QWEN3_8B[k], k
    assert DrafterConfig.from_hf_config(hf) == c


def test_transformers_reads_the_exported_config_as_qwen3():
    hf = qwen35_27b().to_hf_config()
    q = Qwen3Config(**{k: v for k, v in hf.items() if k not in ("architectures", "auto_map", "model_type")})
    assert q.head_dim == 128 and q.num_key_value_heads == 8 and q.hidden_size == 5120
    assert q.rope_parameters["rope_theta"] == 1e7


def test_transformers5_rope_parameters_layout_is_accepted():
    hf = dict(PUBLISHED_QWEN3_8B)
    del hf["rope_theta"]
    hf["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000000.0}
    assert DrafterConfig.from_hf_config(hf).rope_theta == 1e7


@pytest.mark.parametrize("change, match", [
    (dict(num_key_value_heads=5), "num_key_value_heads"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(block_size=1), "block_size"),
    (dict(target_layer_ids=(1, 64)), "target_layer_ids"),
    (dict(target_layer_ids=(3, 3)), "target_layer_ids"),
    (dict(target_layer_ids=()), "target_layer_ids"),
    (dict(mask_token_id=248320), "mask_token_id"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_theta=0.0), "rope_theta"),
    (dict(head_dim=7), "head_dim"),
])
def test_validation_names_field_and_value(change, match):
    with pytest.raises(ConfigError, match=match):
        dataclasses.replace(qwen35_27b(), **change)


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.update(architectures=["Qwen3ForCausalLM"]), "not a DFlash drafter"),
    (lambda d: d.pop("dflash_config"), "dflash_config"),
    (lambda d: d["dflash_config"].update(mask_token_id=None), "mask_token_id"),
    (lambda d: d.pop("num_target_layers"), "num_target_layers"),
    (lambda d: d.update(layer_types=["sliding_attention"] * 4 + ["full_attention"]), "sliding"),
    (lambda d: d.update(rope_scaling={"type": "yarn", "factor": 4.0}), "rope_scaling"),
])
def test_from_hf_config_rejects_non_drafters_clearly(edit, match):
    d = {**PUBLISHED_QWEN3_8B, "dflash_config": dict(PUBLISHED_QWEN3_8B["dflash_config"])}
    edit(d)
    with pytest.raises(ConfigError, match=match):
        DrafterConfig.from_hf_config(d)
