"""One map between dtype names and torch dtypes, and one rule for the default compute dtype of every command
(extract, generate, eval, train): bfloat16 on CUDA, float32 elsewhere.

Why float32 off CUDA: CPU bf16 matmuls are emulated on most CPUs (slower than fp32) and a CPU run is a test
or a small job where exactness matters more than memory. The cache's storage names ("bf16", "fp8") are a
different vocabulary and live in dflash.cache.format.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dflash.errors import ConfigError

if TYPE_CHECKING:
    import torch

# names of the compute dtypes a command accepts (torch attribute names); torch is imported only on use, so
# configs and CLI modules can validate a name without importing it
DTYPES = ("bfloat16", "float16", "float32")


def dtype_of(name: str) -> "torch.dtype":
    """The torch dtype called `name`; ConfigError naming the choices otherwise."""
    import torch

    check_dtype_name(name)
    return getattr(torch, name)


def check_dtype_name(name: str) -> str:
    if name not in DTYPES:
        raise ConfigError(f"dtype {name!r}: use one of {', '.join(DTYPES)}")
    return name


def dtype_name(dtype: "torch.dtype") -> str:
    """The name DTYPES knows `dtype` by ("bfloat16", ...)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ConfigError(f"dtype {dtype}: use one of {', '.join(DTYPES)}")
    return name


def default_dtype(device: "str | torch.device") -> str:
    """bfloat16 on CUDA, float32 on any other device (see the module docstring)."""
    return "bfloat16" if str(device).split(":")[0] == "cuda" else "float32"
