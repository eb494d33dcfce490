"""format.py: fingerprint json and mismatch naming, fp8 quantization error bound, chunk sizing."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash.cache import FP8_MAX, Fingerprint, dequantize_fp8, encode_hidden, quantize_fp8
from dflash.cache.commit import parse_commit_log, parse_shard_name, shard_name
from dflash.cache.format import bf16_all_finite, choose_chunk_tokens, non_finite_mask
from dflash.errors import CacheFormatError, CacheMismatchError, ConfigError


def make_fp(**kw):
    d = dict(target="m", target_config_hash="h", num_target_layers=8, hidden_size=16, target_dtype="bfloat16",
             tokenizer_hash="t", chat_template_hash="c", tap_layer_ids=(1, 3, 5), storage="bf16",
             sources=({"path": "a.jsonl", "sha256": "x"},), max_length=64, template_kwargs={"k": 1})
    d.update(kw)
    return Fingerprint(**d)


def test_fingerprint_json_round_trip():
    fp = make_fp()
    assert Fingerprint.from_json(fp.to_json()) == fp


@pytest.mark.parametrize("field,value", [("tap_layer_ids", (1, 3, 6)), ("storage", "fp8"), ("hidden_size", 32),
                                         ("template_kwargs", {"k": 2}), ("sources", ())])
def test_fingerprint_mismatch_names_field(field, value):
    with pytest.raises(CacheMismatchError) as e:
        make_fp().check_matches(make_fp(**{field: value}))
    assert e.value.field == field and field in str(e.value)


def test_fingerprint_rejects_bad_values():
    with pytest.raises(ConfigError, match="storage"):
        make_fp(storage="fp16")
    with pytest.raises(ConfigError, match="tap_layer_ids"):
        make_fp(tap_layer_ids=(3, 1))


@settings(max_examples=30, deadline=None)
@given(T=st.integers(1, 9), K=st.integers(1, 3), D=st.integers(1, 40), log_scale=st.floats(-20, 20),
       seed=st.integers(0, 2**31))
def test_fp8_error_within_e4m3_bound(T, K, D, log_scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, K, D, generator=g) * 2.0 ** log_scale).to(torch.bfloat16)
    x[0, 0] = 0  # an all-zero row: scale 0, no division by zero
    bits, scales = quantize_fp8(x)
    assert bits.dtype == torch.uint8 and scales.dtype == torch.float32 and scales.shape == (T, K)
    assert scales[0, 0] == 0
    y = dequantize_fp8(bits, scales, dtype=torch.float32)
    xf = x.float()
    s = scales.unsqueeze(-1)
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normals; subnormal spacing 2^-9 below 2^-6 (times scale)
    bound = xf.abs() * 2.0**-4 + s * 2.0**-9 + 1e-30
    assert torch.isfinite(y).all()
    assert ((y - xf).abs() <= bound).all()
    assert torch.allclose(scales, xf.abs().amax(-1) / FP8_MAX)


def test_encode_hidden_bf16_is_bit_view():
    x = torch.randn(3, 2, 4)
    bits, s = encode_hidden(x, "bf16")
    assert s is None and bits.dtype == torch.uint16
    assert torch.equal(bits.view(torch.bfloat16), x.to(torch.bfloat16))
    with pytest.raises(ConfigError):
        encode_hidden(x, "int4")


def test_chunk_tokens_power_of_two_under_budget():
    assert choose_chunk_tokens(hidden_size=5120, itemsize=2, chunk_bytes=1 << 19) == 32
    assert choose_chunk_tokens(hidden_size=5120, itemsize=1, chunk_bytes=1 << 19) == 64
    assert choose_chunk_tokens(hidden_size=1 << 20, itemsize=2, chunk_bytes=1 << 19) == 1
    # small hidden sizes hit the token cap: chunks stay well under typical sample lengths
    assert choose_chunk_tokens(hidden_size=576, itemsize=1, chunk_bytes=1 << 19) == 128
    assert choose_chunk_tokens(hidden_size=576, itemsize=2, chunk_bytes=1 << 19) == 128


def test_commit_log_torn_tail_is_ignored():
    good = '{"shard":"r0000-000000","rank":0,"seq":0,"num_samples":1,"num_tokens":3,' \
           '"num_loss_tokens":1,"nbytes":10,"sample_ids":[7]}\n'
    recs, torn = parse_commit_log(good + good[:20], source="x")
    assert len(recs) == 1 and recs[0].sample_ids == (7,) and torn == 20
    with pytest.raises(CacheFormatError, match="line 1"):
        parse_commit_log("{bad\n", source="x")
    assert parse_shard_name(shard_name(rank=3, seq=12)) == (3, 12)
    assert parse_shard_name("junk") is None


def test_bf16_all_finite_agrees_with_the_mask_on_every_bit_pattern():
    """The writer's fast bf16 check and cache verify's mask are one rule: each of the 65,536 patterns, alone
    beside a finite value, is refused exactly when the mask marks it."""
    patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    marked = non_finite_mask("bf16", "hidden", patterns)
    fast = np.array([not bf16_all_finite(np.array([0x3F80, p], dtype=np.uint16)) for p in patterns])
    assert np.array_equal(fast, marked)
    assert int(marked.sum()) == 2 * 128   # +-inf and the 254 nans: sign x 7 mantissa bits
    assert bf16_all_finite(np.empty(0, dtype=np.uint16))
