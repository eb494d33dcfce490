"""Default tap layers (z-lab build_target_layer_ids) and validation of user taps."""

import pytest

from dflash.errors import ConfigError
from dflash.target.taps import default_tap_layer_ids, validate_tap_layer_ids


@pytest.mark.parametrize(
    ("num_layers", "expected"),
    [
        (64, (1, 16, 31, 46, 61)),  # Qwen3.5-27B, published drafter
        (36, (1, 9, 17, 25, 33)),  # Qwen3-8B, published drafter
        (32, (1, 8, 15, 22, 29)),  # Qwen3.5-4B / 9B
        (40, (1, 10, 19, 28, 37)),  # Qwen3.5-35B-A3B
        (30, (1, 8, 14, 20, 27)),  # SmolLM2-135M: 7.5 -> 8 and 20.5 -> 20 (Python round, as z-lab)
    ],
)
def test_default_taps_match_zlab(num_layers, expected):
    assert default_tap_layer_ids(num_layers) == expected


def test_single_tap_is_middle_layer():
    assert default_tap_layer_ids(64, 1) == (32,)
    assert default_tap_layer_ids(7, 1) == (3,)


def test_default_taps_on_tiny_model():
    assert default_tap_layer_ids(6, 2) == (1, 3)
    with pytest.raises(ConfigError, match="too shallow"):
        default_tap_layer_ids(4, 5)
    with pytest.raises(ConfigError, match="collide"):
        default_tap_layer_ids(6, 5)


@pytest.mark.parametrize(
    ("taps", "match"),
    [
        ((), "empty"),
        ((1, 64), "out of range"),
        ((-1, 3), "out of range"),
        ((3, 3), "duplicates"),
        ((5, 2), "ascending"),
        ((1.0, 2), "integers"),
        ((True, 2), "integers"),
    ],
)
def test_validate_rejects(taps, match):
    with pytest.raises(ConfigError, match=match):
        validate_tap_layer_ids(taps, num_layers=64)


def test_validate_accepts_and_returns_tuple():
    assert validate_tap_layer_ids([1, 16, 31, 46, 61], num_layers=64) == (1, 16, 31, 46, 61)
    assert validate_tap_layer_ids([63], num_layers=64) == (63,)


def test_identity_hashes_ignore_layout_and_see_content(tmp_path):
    import json

    from dflash.target.identity import chat_template_hash, target_config_hash, tokenizer_hash
    from dflash.target.testing import tiny_tokenizer

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "config.json").write_text(json.dumps({"x": 1, "y": [1, 2]}))
    (tmp_path / "b" / "config.json").write_text(json.dumps({"y": [1, 2], "x": 1}, indent=2))
    assert target_config_hash(tmp_path / "a") == target_config_hash(tmp_path / "b")
    (tmp_path / "b" / "config.json").write_text(json.dumps({"y": [1, 3], "x": 1}))
    assert target_config_hash(tmp_path / "a") != target_config_hash(tmp_path / "b")
    t1, t2 = tiny_tokenizer(), tiny_tokenizer()
    assert tokenizer_hash(t1) == tokenizer_hash(t2)
    t2.add_tokens(["<new>"])
    assert tokenizer_hash(t1) != tokenizer_hash(t2)
    t2.chat_template = "{{ messages }}"
    assert chat_template_hash(t1) != chat_template_hash(t2)
