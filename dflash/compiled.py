"""One torch.compile cache for the pure element-wise functions that the drafter, the training loss and the target
forward run compiled (norms, RoPE, SiLU-gating, the fused CE epilogue).

Why one place: each function is compiled once per process with dynamic shapes (packed batches change shape every
step; torch.compile's automatic dynamic shapes would recompile once first), and every caller gets the same
compiled object, so a function used by two components is compiled once. compile_wanted is the one rule for
the compile_elementwise settings of extraction and training; target_compiles the one for a target's two.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["COMPILE_SETTINGS", "compiled_op", "compile_wanted", "target_compiles"]

COMPILE_SETTINGS = ("auto", "on", "off")

_compiled_ops: dict[Callable, Callable] = {}


def compiled_op(fn: Callable) -> Callable:
    """fn under torch.compile (dynamic shapes), built once per process. Why: in eager mode these functions are
    chains of memory-bound kernels with fp32 temporaries (forward and backward); compiled, each is one fused
    kernel per direction."""
    if fn not in _compiled_ops:
        import torch

        _compiled_ops[fn] = torch.compile(fn, dynamic=True)
    return _compiled_ops[fn]


def compile_wanted(setting: str, device: torch.device | str) -> bool:
    """Whether a compile_elementwise setting ("auto", "on", "off") compiles on `device`: auto means on CUDA only
    (on CPU inductor's compile costs more than the fused kernels save). No torch import: configs use it."""
    if setting not in COMPILE_SETTINGS:
        raise ValueError(f"compile_elementwise={setting!r}: choose auto, on or off")
    return setting == "on" or (setting == "auto" and str(device).split(":")[0] == "cuda")


def target_compiles(elementwise: str, layers: str, device: torch.device | str) -> tuple[bool, bool]:
    """(norm/gate chains compiled, decoder layers compiled whole) for a target's compile_elementwise and
    compile_layers settings on `device`: layers compiled whole hold those chains, so the chains are not compiled
    on their own as well."""
    whole = compile_wanted(layers, device)
    return compile_wanted(elementwise, device) and not whole, whole
