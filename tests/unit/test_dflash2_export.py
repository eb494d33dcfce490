"""The DFlash 2 export against what SGLang's and vLLM's DFlash 2 loaders read: config.json keys and values, and
every tensor name (after the loader's own renaming) with its shape, both ways: nothing the loader needs is
missing, nothing we write is something it would skip (SGLang's load_weights silently ignores unknown names).

The lists below were read from the engines' source:
- SGLang 0.5.23, the PyPI wheel sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl (`pip download sglang==0.5.23
  --no-deps`): sglang/srt/speculative/dflash_utils.py (RECORD sha256=cicLfU4BAS5LDQSyg9sPVxIL436gyUyCAFatmlqaDVo),
  parse_dflash_draft_config (the config keys; output_multiplier and final_logit_softcapping are optional, 1.0 and
  none when absent), and sglang/srt/models/dflash.py (RECORD sha256=HIMHun9j_UH1NDX72r2tjJ6aBIR770lZ8fj8FuptsK4):
  DFlash2DraftModel in EntryClass, DFlashDecoderLayer's attention_conv / mlp_conv (DFlashGroupedConv: base_kernel
  [2, taps, hidden] with tap 0 at 1.0, kernel_projection laid out [side, tap, group]), CandidateSelector and
  load_weights' stacked mapping; unknown names are skipped without a word. The DFlash 2 classes came with
  sgl-project/sglang PR #35371.
- vLLM: vllm/model_executor/models/qwen3_dflash2.py at vllm-project/vllm commit
  030da624231c394ea975df15248edd9adc9315da (PR #52816): DFlashGroupedConv, CandidateSelector and the
  dflash_config keys it indexes.
"""

import json

import pytest
import torch
from safetensors import safe_open

from dflash.drafter.dflash2 import DFlash2Config, DFlash2Drafter
from dflash.drafter.export import export_drafter, load_drafter

SGLANG_SOURCE = ("sglang", "0.5.23", "sglang/srt/models/dflash.py sha256=HIMHun9j_UH1NDX72r2tjJ6aBIR770lZ8fj8FuptsK4")
VLLM_SOURCE = ("vllm-project/vllm", "030da624231c394ea975df15248edd9adc9315da", "PR #52816")

# SGLang DFlashDraftModel.load_weights: (param_name, weight_name) of its stacked_params_mapping
SGLANG_STACKED = (("qkv_proj", "q_proj"), ("qkv_proj", "k_proj"), ("qkv_proj", "v_proj"),
                  ("gate_up_proj", "gate_proj"), ("gate_up_proj", "up_proj"))
# SGLang DFlash2DraftModel's parameters (non-Nemotron layout): per layer, then the model's own
SGLANG_LAYER_PARAMS = ("input_layernorm.weight", "post_attention_layernorm.weight",
                       "self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
                       "self_attn.k_norm.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight",
                       "attention_conv.base_kernel", "attention_conv.kernel_projection.weight",
                       "mlp_conv.base_kernel", "mlp_conv.kernel_projection.weight")
SGLANG_MODEL_PARAMS = ("norm.weight", "fc.weight", "hidden_norm.weight", "candidate_selector.predecessor_codebook",
                       "candidate_selector.successor_codebook", "candidate_selector.hidden_projection.weight")
# parse_dflash_draft_config: keys read from dflash_config (block_size also from the top level)
SGLANG_DFLASH_CONFIG_KEYS = ("block_size", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
                             "target_layer_ids", "mask_token_id")
SGLANG_ARCHITECTURE = "DFlash2DraftModel"   # EntryClass of models/dflash.py
# vLLM qwen3_dflash2: draft_config[...] lookups that raise when absent
VLLM_REQUIRED_DFLASH_CONFIG_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def dflash2_shapes(*, hidden: int, taps: int, groups: int, vocab: int, rank: int) -> dict[str, tuple[int, ...]]:
    """The DFlash 2 tensors' shapes as both engines allocate them (SGLang DFlashGroupedConv: base_kernel
    zeros(2, taps, hidden), kernel_projection Linear(hidden, 2 * taps * num_groups); CandidateSelector:
    codebooks (vocab, state_rank), hidden_projection Linear(hidden, state_rank); vLLM the same)."""
    return {"attention_conv.base_kernel": (2, taps, hidden),
            "attention_conv.kernel_projection.weight": (2 * taps * groups, hidden),
            "mlp_conv.base_kernel": (2, taps, hidden),
            "mlp_conv.kernel_projection.weight": (2 * taps * groups, hidden),
            "candidate_selector.predecessor_codebook": (vocab, rank),
            "candidate_selector.successor_codebook": (vocab, rank),
            "candidate_selector.hidden_projection.weight": (rank, hidden)}


def sglang_param_name(name: str) -> str:
    """load_weights' renaming of a checkpoint tensor name."""
    for param, weight in SGLANG_STACKED:
        if f".{weight}." in name:
            return name.replace(weight, param)
    return name


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    cfg = DFlash2Config(hidden_size=64, intermediate_size=96, target_layer_ids=(1, 3, 5), num_target_layers=8,
                        mask_token_id=99, vocab_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, block_size=8, selector_rank=12, selector_top_k=6)
    torch.manual_seed(0)
    model = DFlash2Drafter(cfg)
    out = export_drafter(model, cfg, tmp_path_factory.mktemp("exp") / "drafter", dtype=torch.float32)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    return cfg, model, out, json.loads((out / "config.json").read_text()), shapes


def test_config_has_what_sglang_and_vllm_read(exported):
    cfg, _, _, hf, _ = exported
    assert hf["architectures"] == [SGLANG_ARCHITECTURE]
    dc = hf["dflash_config"]
    assert set(SGLANG_DFLASH_CONFIG_KEYS) <= set(dc) and set(VLLM_REQUIRED_DFLASH_CONFIG_KEYS) <= set(dc)
    assert (dc["block_size"], dc["conv_kernel_size"], dc["conv_group_size"], dc["selector_rank"],
            dc["selector_top_k"]) == (8, 2, 16, 12, 6)
    assert dc["block_size"] == hf["block_size"]  # SGLang reads dflash_config first, z-lab code the top level
    assert dc["target_layer_ids"] == [1, 3, 5] and dc["mask_token_id"] == 99 and hf["num_target_layers"] == 8
    assert hf["hidden_size"] % dc["conv_group_size"] == 0  # SGLang and vLLM refuse otherwise
    # absent = the engines' defaults (output_multiplier 1.0, no soft cap, vLLM input_embedding_scale 1.0)
    assert not {"output_multiplier", "final_logit_softcapping", "input_embedding_scale"} & set(dc)
    assert hf["layer_types"] == ["full_attention"] * cfg.num_hidden_layers


def test_tensor_names_and_shapes_match_the_loaders(exported):
    cfg, _, _, _, shapes = exported
    L = cfg.num_hidden_layers
    wanted = {f"layers.{i}.{p}" for i in range(L) for p in SGLANG_LAYER_PARAMS} | set(SGLANG_MODEL_PARAMS)
    mapped = {sglang_param_name(k) for k in shapes}
    assert mapped == wanted, (sorted(wanted - mapped), sorted(mapped - wanted))
    H = cfg.hidden_size
    new = dflash2_shapes(hidden=H, taps=cfg.conv_kernel_size, groups=H // cfg.conv_group_size,
                         vocab=cfg.vocab_size, rank=cfg.selector_rank)
    for name, shape in new.items():
        where = [k for k in shapes if k.endswith(name) and (k.startswith("layers.") or k.startswith("candidate_"))]
        assert where, name
        assert all(shapes[k] == shape for k in where), (name, {k: shapes[k] for k in where}, shape)
    assert shapes["fc.weight"] == (H, len(cfg.target_layer_ids) * H)


def test_export_loads_back_as_dflash2(exported):
    cfg, model, out, _, _ = exported
    back, back_cfg = load_drafter(out, dtype=torch.float32)
    assert type(back) is DFlash2Drafter and back_cfg == cfg
    sd = model.state_dict()
    assert all(torch.equal(t, sd[k]) for k, t in back.state_dict().items())
