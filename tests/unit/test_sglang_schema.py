"""The export held against SGLang's DFlash loader, by its code: every config key and weight name that SGLang 0.5.23
reads for a plain DFlash drafter, written down here as data, and what it resolves them to for our export.

Source (read, not imported): the PyPI wheel sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl (files dated
2026-10-30 in the wheel; `pip download sglang==0.5.23 --no-deps`), files and their RECORD sha256:
  sglang/srt/models/dflash.py                     HIMHun9j_UH1NDX72r2tjJ6aBIR770lZ8fj8FuptsK4  DFlashDraftModel,
      DFlashAttention, DFlashMLP, DFlashDecoderLayer, load_weights
  sglang/srt/speculative/dflash_utils.py          cicLfU4BAS5LDQSyg9sPVxIL436gyUyCAFatmlqaDVo  parse_dflash_draft_config
  sglang/srt/speculative/dflash_worker_v2.py      h6f1gI6hK-wPtKu4_8DSCCljp5td6atDUGPg36jOhDE  block size, mask token
  sglang/srt/utils/hf_transformers/common.py      fOaKicVLlCZ7uVpLm22qMjakMz6w-FAJWEL0r5mg5Gw  get_rope_config
  sglang/srt/arg_groups/speculative_hook.py       _handle_dflash: num draft tokens <- block_size when not given

What SGLang drops or lets pass silently (docs/export.md repeats it):
  - a checkpoint tensor whose name matches no parameter is skipped ("Ignore unexpected weights"): a misnamed
    tensor loads nothing and leaves its parameter uninitialised, with no error;
  - a parameter the checkpoint lacks is not reported either (only Domino projector weights are checked);
  - --speculative-num-draft-tokens different from config.block_size only logs a warning;
  - rope_theta absent means 10000 (get_rope_config), not the drafter's base; rope_is_neox_style absent means True;
  - dflash_config.mask_token absent means "<|MASK|>": mask_token_id is then checked against that string's id only
    when the target tokenizer has it.
"""

import pytest
import torch
from safetensors import safe_open

from dflash.drafter.config import DrafterConfig
from dflash.drafter.export import WEIGHTS_NAME, export_drafter
from dflash.drafter.model import DFlashDrafter

SGLANG_RELEASE = "0.5.23"
REQUIRED = object()

CONFIG_READS = {
    # key: (where SGLang looks, its default when absent (REQUIRED: no default), what reads it)
    "architectures": ("top", REQUIRED, "model registry: EntryClass DFlashDraftModel"),
    "hidden_size": ("top", REQUIRED, "DFlashAttention, DFlashMLP, DFlashDraftModel"),
    "num_hidden_layers": ("top", REQUIRED, "DFlashDraftModel.layers, parse_dflash_draft_config"),
    "num_attention_heads": ("top", REQUIRED, "DFlashAttention"),
    "intermediate_size": ("top", 0, "DFlashMLP (0 raises)"),
    "num_key_value_heads": ("top", "num_attention_heads", "DFlashAttention"),
    "head_dim": ("top", "hidden_size // num_attention_heads", "DFlashAttention"),
    "attention_bias": ("top", False, "DFlashAttention qkv_proj / o_proj bias"),
    "rms_norm_eps": ("top", 1e-6, "every RMSNorm"),
    "use_gemma_norm": ("top", False, "GemmaRMSNorm (1 + weight) instead of RMSNorm"),
    "partial_rotary_factor": ("top", 1.0, "get_rope rotary width"),
    "rope_theta": ("top", 10000, "get_rope_config (transformers 5: rope_parameters.rope_theta)"),
    "rope_scaling": ("top", None, "get_rope_config (transformers 5: rope_parameters)"),
    "rope_is_neox_style": ("top", True, "get_rope (then is_neox_style)"),
    "max_position_embeddings": ("top", 32768, "get_rope cache length"),
    "hidden_act": ("top", "silu", "DFlashMLP: silu or swigluoai"),
    "layer_types": ("top", None, "None or full_attention: non-causal (ENCODER_ONLY); sliding_attention"),
    "is_causal": ("top", None, "text config: overrides the causality of layer_types"),
    "sliding_window": ("top", None, "only with sliding_attention layers"),
    "num_target_layers": ("dflash_config, then top", None, "range check of target_layer_ids"),
    "block_size": ("dflash_config, then top", None, "default of --speculative-num-draft-tokens; 16 if absent"),
    "target_layer_ids": ("dflash_config, then top", None, "fc width K; None = build_target_layer_ids"),
    "mask_token": ("dflash_config, then top", "<|MASK|>", "mask token string (tokenizer lookup)"),
    "mask_token_id": ("dflash_config, then top", None, "mask token id; None = look mask_token up"),
    "conv_kernel_size": ("dflash_config", 0, "DFlash 2 grouped convolution (0 = off)"),
    "conv_group_size": ("dflash_config", 0, "DFlash 2 grouped convolution (0 = off)"),
    "selector_rank": ("dflash_config", 0, "DFlash 2 path selector (0 = off)"),
    "selector_top_k": ("dflash_config", 0, "DFlash 2 path selector (0 = off)"),
    "output_multiplier": ("dflash_config", 1.0, "logit scale"),
    "final_logit_softcapping": ("dflash_config", None, "logit soft cap"),
    "attention_sink_bias": ("dflash_config", False, "per-head sink bias parameter"),
    "attention_value_scale": ("dflash_config", None, "V scale"),
    "projector_type": ("dflash_config, then top", None, "'domino' adds a GRU projector"),
    "has_embed_tokens": ("top", False, "Nemotron 3.5 layout (own embedding) when also quantized W4A16_NVFP4"),
}

# (checkpoint name part, SGLang parameter it is stacked into, shard): load_weights' stacked_params_mapping
STACKED = (("q_proj", "qkv_proj", "q"), ("k_proj", "qkv_proj", "k"), ("v_proj", "qkv_proj", "v"),
           ("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1))
LAYER_PARAMS = ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
                "self_attn.k_norm.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight",
                "input_layernorm.weight", "post_attention_layernorm.weight")
TOP_PARAMS = ("norm.weight", "fc.weight", "hidden_norm.weight")


def sglang_params(num_layers: int) -> set[str]:
    """named_parameters() of SGLang's DFlashDraftModel for a plain drafter (no conv, selector, sink, Domino)."""
    return {f"layers.{i}.{p}" for i in range(num_layers) for p in LAYER_PARAMS} | set(TOP_PARAMS)


def sglang_load(names, params: set[str]) -> tuple[dict[str, set], list[str]]:
    """load_weights' name resolution: {parameter: shards loaded} and the checkpoint names it skips silently."""
    def resolve(name):
        if name in params:
            return name
        if name.startswith("model.") and name[len("model."):] in params:
            return name[len("model."):]
        return f"model.{name}" if f"model.{name}" in params else None

    loaded: dict[str, set] = {}
    dropped = []
    for name in names:
        for part, param, shard in STACKED:
            if f".{part}." not in name:
                continue
            target = resolve(name.replace(part, param))
            if target is not None:
                loaded.setdefault(target, set()).add(shard)
                break
        else:
            target = resolve(name)
            if target is None:
                dropped.append(name)
            else:
                loaded.setdefault(target, set()).add(None)
    return loaded, dropped


def sglang_value(hf: dict, key: str):
    """What SGLang resolves `key` to for this config.json (REQUIRED when absent and required)."""
    where, default, _ = CONFIG_READS[key]
    dflash = hf.get("dflash_config") or {}
    if where.startswith("dflash_config") and key in dflash:
        return dflash[key]
    if where != "dflash_config" and key in hf:
        return hf[key]
    if default == "num_attention_heads":
        return hf["num_attention_heads"]
    if default == "hidden_size // num_attention_heads":
        return hf["hidden_size"] // hf["num_attention_heads"]
    return default


def cfg_of(**kw) -> DrafterConfig:
    base = dict(hidden_size=64, intermediate_size=96, target_layer_ids=(1, 4, 6), num_target_layers=8,
                mask_token_id=7, vocab_size=100, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=24, block_size=16, rope_theta=1e7)
    return DrafterConfig(**{**base, **kw})


@pytest.mark.parametrize("kw", [{}, dict(block_size=4, rope_theta=1e6, num_hidden_layers=3)])
def test_sglang_reads_our_config_as_our_drafter(kw):
    cfg = cfg_of(**kw)
    hf = cfg.to_hf_config()
    v = {key: sglang_value(hf, key) for key in CONFIG_READS}
    missing = sorted(k for k, x in v.items() if x is REQUIRED)
    assert not missing, f"SGLang {SGLANG_RELEASE} requires {missing}"
    assert "DFlashDraftModel" in v["architectures"]
    assert (v["hidden_size"], v["num_hidden_layers"], v["num_attention_heads"], v["num_key_value_heads"],
            v["head_dim"], v["intermediate_size"]) == (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
                                                       cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size)
    # head_dim is written: SGLang's default (hidden // heads = 16 here) would be wrong for this drafter
    assert hf["head_dim"] == 24 != cfg.hidden_size // cfg.num_attention_heads
    assert v["rms_norm_eps"] == cfg.rms_norm_eps and v["hidden_act"] == "silu"
    assert v["attention_bias"] is False and v["use_gemma_norm"] is False and v["partial_rotary_factor"] == 1.0
    # RoPE: our base, rotate-half (neox) over the full head_dim, no scaling; SGLang's absent-key default is 10000
    assert float(v["rope_theta"]) == cfg.rope_theta and v["rope_scaling"] is None and v["rope_is_neox_style"] is True
    # non-causal within the block: every layer full_attention and no is_causal
    assert v["layer_types"] == ["full_attention"] * cfg.num_hidden_layers and v["is_causal"] is None
    assert v["sliding_window"] is None
    assert v["block_size"] == cfg.block_size and v["num_target_layers"] == cfg.num_target_layers
    assert list(v["target_layer_ids"]) == list(cfg.target_layer_ids)
    assert all(0 <= i < v["num_target_layers"] for i in v["target_layer_ids"])
    assert v["mask_token_id"] == cfg.mask_token_id and v["mask_token"] == "<|MASK|>"
    for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        assert v[key] == 0, key   # a plain DFlash drafter: no DFlash 2 parts
    assert v["output_multiplier"] == 1.0 and v["final_logit_softcapping"] is None
    assert v["attention_sink_bias"] is False and v["attention_value_scale"] is None
    assert v["projector_type"] is None and v["has_embed_tokens"] is False


@pytest.mark.parametrize("num_layers", [1, 3])
def test_sglang_loads_every_exported_tensor(tmp_path, num_layers):
    cfg = cfg_of(num_hidden_layers=num_layers)
    out = export_drafter(DFlashDrafter(cfg), cfg, tmp_path / "d", dtype=torch.float32)
    with safe_open(str(out / WEIGHTS_NAME), framework="pt") as f:
        names = list(f.keys())
        fc_shape = tuple(f.get_slice("fc.weight").get_shape())
    params = sglang_params(num_layers)
    loaded, dropped = sglang_load(names, params)
    assert dropped == [], f"SGLang {SGLANG_RELEASE} would skip {dropped} silently"
    assert set(loaded) == params, f"left uninitialised: {sorted(params - set(loaded))}"
    for name, shards in loaded.items():
        want = {"q", "k", "v"} if name.endswith("qkv_proj.weight") else {0, 1} if name.endswith("gate_up_proj.weight") \
            else {None}
        assert shards == want, name
    # fc.weight shape check of load_weights: [hidden, K * hidden], K = len(target_layer_ids)
    assert fc_shape == (cfg.hidden_size, len(cfg.target_layer_ids) * cfg.hidden_size)


def test_the_simulated_loader_catches_what_sglang_drops():
    params = sglang_params(1)
    ok = ["layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
          "model.fc.weight"]
    loaded, dropped = sglang_load(ok + ["layers.0.self_attn.qkv.weight", "embed_tokens.weight"], params)
    assert dropped == ["layers.0.self_attn.qkv.weight", "embed_tokens.weight"]
    assert loaded["layers.0.self_attn.qkv_proj.weight"] == {"q", "k", "v"} and "fc.weight" in loaded
