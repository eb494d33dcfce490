"""The exported drafter's remote-code module (dflash/drafter/modeling_dflash.py, copied as DRAFTER/dflash.py):
it imports nothing of dflash, is copied verbatim, loads through AutoModel(trust_remote_code=True), and its forward
equals dflash's drafter forward."""

import ast
import json

import pytest
import torch

from dflash.drafter import modeling_dflash
from dflash.drafter.config import AUTO_MAP, DrafterConfig
from dflash.drafter.export import MODELING_NAME, MODELING_TEMPLATE, export_drafter
from dflash.drafter.model import DFlashDrafter


def tiny_config(**kw) -> DrafterConfig:
    base = dict(hidden_size=64, intermediate_size=96, target_layer_ids=(1, 3, 5), num_target_layers=8,
                mask_token_id=7, vocab_size=100, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, block_size=4, rope_theta=1e6)
    return DrafterConfig(**{**base, **kw})


def test_template_imports_only_torch_and_transformers():
    tree = ast.parse(MODELING_TEMPLATE.read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add(node.module.split(".")[0])
    assert roots <= {"__future__", "inspect", "torch", "transformers"}, roots


def test_export_copies_the_template_verbatim_under_the_auto_map_name(tmp_path):
    cfg = tiny_config()
    out = export_drafter(DFlashDrafter(cfg), cfg, tmp_path / "d", dtype=torch.float32)
    assert MODELING_NAME == "dflash.py" and AUTO_MAP["AutoModel"] == "dflash.DFlashDraftModel"
    assert (out / MODELING_NAME).read_bytes() == MODELING_TEMPLATE.read_bytes()
    assert json.loads((out / "config.json").read_text())["auto_map"] == AUTO_MAP


@pytest.mark.parametrize("kw", [{}, dict(num_key_value_heads=4, block_size=6, rope_theta=1e7)])
def test_forward_equals_dflash_drafter(kw):
    from transformers import Qwen3Config

    cfg = tiny_config(**kw)
    torch.manual_seed(0)
    ours = DFlashDrafter(cfg).eval()
    with torch.no_grad():   # non-trivial norm weights, so a swapped or missing norm shows
        for name, p in ours.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    hf = cfg.to_hf_config()
    remote = modeling_dflash.DFlashDraftModel(Qwen3Config(**{k: v for k, v in hf.items() if k != "model_type"}))
    missing, unexpected = remote.load_state_dict(ours.state_dict(), strict=True)
    assert not missing and not unexpected
    remote.eval()
    T, B = 11, cfg.block_size
    g = torch.Generator().manual_seed(1)
    taps_TKD = torch.randn(T, cfg.num_taps, cfg.hidden_size, generator=g)
    block_QD = torch.randn(B, cfg.hidden_size, generator=g)
    q_pos = torch.arange(T, T + B)
    kv_pos = torch.arange(T + B)
    with torch.no_grad():
        want = ours(block_QD, ours.context(taps_TKD), q_pos=q_pos, kv_pos=kv_pos, mask=None)
        got = remote(block_QD[None], taps_TKD.flatten(1)[None], kv_pos[None])[0]
        # a batch of two different rows gives each row's own result
        taps2 = torch.randn(T, cfg.num_taps, cfg.hidden_size, generator=g)
        got2 = remote(torch.stack([block_QD, block_QD]), torch.stack([taps_TKD.flatten(1), taps2.flatten(1)]),
                      torch.stack([kv_pos, kv_pos]))
        want2 = ours(block_QD, ours.context(taps2), q_pos=q_pos, kv_pos=kv_pos, mask=None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got2[0], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got2[1], want2, rtol=1e-5, atol=1e-5)
    assert (want - want2).abs().max() > 1e-2   # the context matters


def test_automodel_loads_the_export(tmp_path):
    from transformers import AutoModel

    cfg = tiny_config()
    torch.manual_seed(0)
    ours = DFlashDrafter(cfg)
    out = export_drafter(ours, cfg, tmp_path / "d", dtype=torch.float32)
    model = AutoModel.from_pretrained(out, trust_remote_code=True)
    assert type(model).__name__ == "DFlashDraftModel" and type(model).__module__.endswith(".dflash")
    assert (model.target_layer_ids, model.mask_token_id, model.block_size) == ([1, 3, 5], 7, 4)
    assert model.rope_theta == 1e6
    state = model.state_dict()
    assert set(state) == set(ours.state_dict())
    for name, t in ours.state_dict().items():
        assert torch.equal(state[name], t), name


def test_a_sliding_window_export_is_refused_by_the_stand_alone_file(tmp_path):
    """The stand-alone file implements full-attention, bidirectional layers: a windowed drafter loaded through it
    would draft wrongly, so it refuses with the engines to use instead."""
    from transformers import AutoModel

    cfg = tiny_config(layer_types=("sliding_attention", "full_attention"), sliding_window=3)
    out = export_drafter(DFlashDrafter(cfg), cfg, tmp_path / "d", dtype=torch.float32)
    with pytest.raises(ValueError, match="full-attention, bidirectional drafters only; serve this drafter with vLLM"):
        AutoModel.from_pretrained(out, trust_remote_code=True)
