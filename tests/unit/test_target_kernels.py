"""dflash.target.kernels' rule on grouped GDN key heads: which transformers versions pass FLA the key heads without
copying them per value head, and what the kernel choice's reason says about it."""

import types

import pytest
from transformers import LlamaConfig
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

from dflash.target import kernels
from dflash.target.testing import tiny_qwen35_text_kwargs


@pytest.mark.parametrize(("version", "grouped"), [("5.17.0", False), ("5.22.2", False), ("5.23.0", True),
                                                  ("5.25.0", True), ("6.0.0", True)])
def test_key_heads_grouped_from_5_23(version, grouped):
    assert kernels.key_heads_grouped(version) is grouped


def _model(config):
    return types.SimpleNamespace(config=config)


def test_note_says_which_path_runs(monkeypatch):
    qwen = _model(Qwen3_5TextConfig(**tiny_qwen35_text_kwargs()))  # 2 key heads, 4 value heads
    monkeypatch.setattr(kernels.transformers, "__version__", "5.17.0")
    old = kernels._key_heads_note(qwen)
    assert "copies the 2 GDN key heads to 4" in old and "'transformers>=5.23'" in old
    monkeypatch.setattr(kernels.transformers, "__version__", "5.25.0")
    assert kernels._key_heads_note(qwen) == "2 GDN key heads passed grouped to 4 value heads"


def test_no_note_without_grouped_heads():
    kw = tiny_qwen35_text_kwargs() | {"linear_num_key_heads": 4}
    assert kernels._key_heads_note(_model(Qwen3_5TextConfig(**kw))) is None  # as many key heads as value heads
    assert kernels._key_heads_note(_model(LlamaConfig(hidden_size=64, num_attention_heads=4))) is None
