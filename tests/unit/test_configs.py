"""Every shipped config loads and validates, so a config typo fails CI, not a user's 8-GPU job."""

import pathlib

import pytest

from dflash.train.config import load_train_config

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("train_*.yaml")), ids=lambda p: p.name)
def test_train_configs_load(path):
    cfg = load_train_config(path, {"cache": "c", "model": "m", "output": "o"})
    assert cfg.mask_token_id is not None and cfg.block_size >= 2


def test_qwen35_27b_config_is_the_paper_recipe():
    cfg = load_train_config(CONFIGS / "train_qwen3.5-27b.yaml", {"cache": "c", "model": "m", "output": "o"})
    assert (cfg.num_layers, cfg.block_size, cfg.num_anchors, cfg.gamma) == (5, 16, 512, 7)
    assert (cfg.lr, cfg.warmup_ratio, cfg.grad_clip, cfg.epochs) == (6e-4, 0.04, 1.0, 6)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size) == (32, 8, 128, 17408)
    assert cfg.mask_token_id == 248070 and cfg.rope_theta == 1e7

