"""dflash.target on a tiny random Qwen3.5 hybrid model (GDN + attention), saved and loaded for real."""

import inspect
import json
import logging

import pytest
import torch
from torch import nn

from dflash.errors import ConfigError, ModelNotFoundError
from dflash.target.forward import TappedForward, text_decoder
from dflash.target.head import embedding_and_head
from dflash.target.load import load_target
from dflash.target.testing import tiny_qwen35_dir

NUM_LAYERS = 6


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return tiny_qwen35_dir(tmp_path_factory.mktemp("qwen35"), num_layers=NUM_LAYERS)


@pytest.fixture(scope="module")
def qwen_vl_tied_dir(tmp_path_factory):
    return tiny_qwen35_dir(tmp_path_factory.mktemp("qwen35vl"), num_layers=NUM_LAYERS, vl=True, tie=True)


@pytest.fixture(scope="module")
def model_fp32(qwen_dir):
    model, _ = load_target(qwen_dir, device="cpu", dtype=torch.float32)
    return model


def _right_padded_batch(lengths, vocab, *, pad_id, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    batch = torch.full((len(lengths), max(lengths)), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        batch[i, : len(s)] = s
    return seqs, batch


def _reference_taps(model, seq, taps):
    """Unbatched full-model forward: HF output_hidden_states[k + 1] for each tap, [S, K, D]."""
    with torch.no_grad():
        hs = model(seq[None], output_hidden_states=True).hidden_states
    return torch.stack([hs[k + 1][0] for k in taps], dim=1)


def test_load_target_text_model(qwen_dir, caplog):
    with caplog.at_level(logging.INFO, logger="dflash"):
        model, tok = load_target(qwen_dir, device="cpu")
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.config._attn_implementation == "sdpa"
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert tok.chat_template and len(tok) <= model.config.vocab_size
    assert model.dflash_kernels.gated_deltanet == "torch"
    assert "not CUDA" in caplog.text and "torch reference kernels" in caplog.text


def test_load_vl_checkpoint_text_only(qwen_vl_tied_dir):
    cfg = json.loads((qwen_vl_tied_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"] and "text_config" in cfg
    model, _ = load_target(qwen_vl_tied_dir, device="cpu", dtype=torch.float32)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert not any("visual" in n for n, _ in model.named_parameters())
    embed, head, info = embedding_and_head(qwen_vl_tied_dir)
    assert info.embed_key == "model.language_model.embed_tokens.weight" and info.tied
    assert torch.equal(model.model.embed_tokens.weight, embed)
    assert torch.equal(model.lm_head.weight, head)


def test_missing_path_raises_before_work(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not found"):
        load_target(tmp_path / "nope", device="cpu")
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_target(tmp_path, device="cpu")  # exists, but is not a model folder
    with pytest.raises(ModelNotFoundError):
        embedding_and_head(tmp_path / "nope")
    assert issubclass(ModelNotFoundError, FileNotFoundError)


def test_cpu_forces_torch_kernels_even_if_fla_was_bound(qwen_dir, monkeypatch):
    """With fla + triton installed, transformers binds FLA at import and crashes on CPU: we must rebind."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as mq

    from dflash.target import kernels

    reference = inspect.unwrap(mq.torch_chunk_gated_delta_rule)

    def fake_fla(*args, **kwargs):
        raise RuntimeError("FLA Triton kernel called on CPU")

    fake_fla.__wrapped__ = reference  # what functools.wraps in transformers' wrapper leaves behind
    monkeypatch.setattr(mq, "torch_chunk_gated_delta_rule", fake_fla)
    monkeypatch.setitem(kernels._ORIGINALS, (mq.__name__, "torch_chunk_gated_delta_rule"), fake_fla)
    model, _ = load_target(qwen_dir, device="cpu", dtype=torch.float32)
    assert mq.torch_chunk_gated_delta_rule is reference
    out = TappedForward(model, (0, 2))(torch.arange(20)[None])
    assert torch.isfinite(out).all()


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_tapped_equals_unbatched_full_model_with_right_padding(qwen_dir, dtype, atol):
    model, tok = load_target(qwen_dir, device="cpu", dtype=dtype)
    taps = (1, 3, 4)
    lengths = [37, 5, 70, 64]  # crosses the GDN chunk size (64) and puts pads in later chunks
    seqs, batch = _right_padded_batch(lengths, len(tok), pad_id=tok.pad_token_id)
    out_BSKD = TappedForward(model, taps)(batch)
    assert out_BSKD.shape == (4, 70, 3, model.config.hidden_size) and out_BSKD.dtype == dtype
    for i, seq in enumerate(seqs):
        ref = _reference_taps(model, seq, taps)
        got = out_BSKD[i, : len(seq)]
        scale = ref.abs().amax()
        assert (got.float() - ref.float()).abs().max() <= atol * scale, f"sample {i}"


def test_attention_mask_gives_same_real_tokens(model_fp32):
    lengths = [9, 30]
    _, batch = _right_padded_batch(lengths, 259, pad_id=256, seed=1)
    mask = (torch.arange(30)[None] < torch.tensor(lengths)[:, None]).long()
    fwd = TappedForward(model_fp32, (2, 5))
    a, b = fwd(batch), fwd(batch, mask)
    for i, n in enumerate(lengths):
        torch.testing.assert_close(a[i, :n], b[i, :n], rtol=1e-5, atol=1e-5)


def test_last_layer_tap_matches_hf_including_final_norm(model_fp32):
    seq = torch.randint(0, 259, (25,))
    got = TappedForward(model_fp32, (0, NUM_LAYERS - 1))(seq[None])[0]
    torch.testing.assert_close(got, _reference_taps(model_fp32, seq, (0, NUM_LAYERS - 1)), rtol=1e-5, atol=1e-5)


class _Boom(nn.Module):
    def forward(self, *args, **kwargs):
        raise AssertionError("a module after the deepest tap ran")


def test_stops_after_deepest_tap(qwen_dir):
    model, _ = load_target(qwen_dir, device="cpu", dtype=torch.float32)
    dec = text_decoder(model)
    fwd = TappedForward(model, (0, 2))
    expected = fwd(torch.arange(12)[None])
    fired: list[str] = []
    dec.embed_tokens.register_forward_hook(lambda *a: fired.append("embed"))
    for i in range(3, NUM_LAYERS):
        dec.layers[i].register_forward_pre_hook(lambda *a, i=i: fired.append(f"layer{i}"))
    dec.norm.register_forward_pre_hook(lambda *a: fired.append("norm"))
    model.lm_head.register_forward_pre_hook(lambda *a: fired.append("lm_head"))
    got = fwd(torch.arange(12)[None])
    assert fired == ["embed"]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # Stronger: replace everything after layer 2 by modules that raise; the forward still works.
    dec.layers[3] = _Boom()
    dec.norm, model.lm_head = _Boom(), _Boom()
    torch.testing.assert_close(TappedForward(model, (0, 2))(torch.arange(12)[None]), expected, rtol=0, atol=0)
    # And the model is left intact after a call (layers and norm restored).
    assert isinstance(dec.norm, _Boom) and len(dec.layers) == NUM_LAYERS


def test_tapped_forward_rejects_bad_taps(model_fp32):
    with pytest.raises(ConfigError, match="out of range"):
        TappedForward(model_fp32, (1, NUM_LAYERS))
    with pytest.raises(ConfigError, match="ascending"):
        TappedForward(model_fp32, (3, 1))


def test_embedding_and_head_untied(qwen_dir, model_fp32):
    embed, head, info = embedding_and_head(qwen_dir)
    assert not info.tied and info.lm_head_key == "lm_head.weight"
    assert (info.vocab_size, info.hidden_size) == tuple(model_fp32.model.embed_tokens.weight.shape)
    assert torch.equal(embed, model_fp32.model.embed_tokens.weight)
    assert torch.equal(head, model_fp32.lm_head.weight)
    assert not torch.equal(embed, head)


def test_embedding_and_head_reads_only_needed_shards(tmp_path):
    from transformers import AutoModelForCausalLM

    src = tiny_qwen35_dir(tmp_path / "src", num_layers=NUM_LAYERS)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="60KB")
    weight_map = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    needed = {weight_map["model.embed_tokens.weight"], weight_map["lm_head.weight"]}
    others = set(weight_map.values()) - needed
    assert others, "the test needs shards that hold neither tensor"
    for name in others:  # corrupt every other shard: reading any of them would fail
        (sharded / name).write_bytes(b"not a safetensors file")
    embed, head, info = embedding_and_head(sharded, dtype=torch.bfloat16)
    assert set(info.shards) == needed
    assert embed.dtype == torch.bfloat16
    assert torch.equal(embed, model.model.embed_tokens.weight.bfloat16())
    assert torch.equal(head, model.lm_head.weight.bfloat16())


def test_unmasked_forward_builds_no_mask(model_fp32, monkeypatch):
    from target_checks import check_unmasked_forward_skips_the_mask_builder

    _, batch = _right_padded_batch([9, 30, 17], 259, pad_id=256, seed=2)
    check_unmasked_forward_skips_the_mask_builder(model_fp32, batch, (1, 4), monkeypatch)


def test_sliding_window_configs_keep_their_masks():
    from types import SimpleNamespace

    from dflash.target.forward import mask_free_causal

    base = dict(_attn_implementation="sdpa", layer_types=["linear_attention", "full_attention"])
    assert mask_free_causal(SimpleNamespace(**base))
    assert mask_free_causal(SimpleNamespace(_attn_implementation="sdpa"))  # Llama: no layer_types
    assert not mask_free_causal(SimpleNamespace(**base | {"sliding_window": 4096}))
    assert not mask_free_causal(SimpleNamespace(**base | {"layer_types": ["sliding_attention", "full_attention"]}))
    assert not mask_free_causal(SimpleNamespace(**base | {"_attn_implementation": "eager"}))
