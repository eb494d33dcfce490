"""One dtype-name map and one default-dtype rule for every command (issue 19: extract defaulted to bfloat16 on
CPU while generate and eval defaulted to float32)."""

import pytest
import torch

from dflash.dtypes import DTYPES, default_dtype, dtype_name, dtype_of
from dflash.errors import ConfigError


def test_names_round_trip():
    for name in DTYPES:
        assert dtype_name(dtype_of(name)) == name
    with pytest.raises(ConfigError, match="'bf16': use one of bfloat16, float16, float32"):
        dtype_of("bf16")
    with pytest.raises(ConfigError):
        dtype_name(torch.int8)


def test_default_dtype_rule():
    assert default_dtype("cuda") == default_dtype(torch.device("cuda", 1)) == "bfloat16"
    assert default_dtype("cpu") == default_dtype(torch.device("cpu")) == default_dtype("mps") == "float32"


def test_eval_uses_the_rule():
    from dflash.eval.evaluate import EvalConfig

    with pytest.raises(ConfigError, match="use one of"):
        EvalConfig(dtype="bf16")
