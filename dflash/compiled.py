"""One torch.compile cache for the pure element-wise functions that the drafter, the training loss and the target
forward run compiled (norms, RoPE, SiLU-gating, the fused CE epilogue).

Why one place: each function is compiled once per process with dynamic shapes (packed batches change shape every
step; torch.compile's automatic dynamic shapes would recompile once first), and every caller gets the same
compiled object, so a function used by two components is compiled once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["compiled_op"]

_compiled_ops: dict[Callable, Callable] = {}


def compiled_op(fn: Callable) -> Callable:
    """fn under torch.compile (dynamic shapes), built once per process. Why: in eager mode these functions are
    chains of memory-bound kernels with fp32 temporaries (forward and backward); compiled, each is one fused
    kernel per direction."""
    if fn not in _compiled_ops:
        _compiled_ops[fn] = torch.compile(fn, dynamic=True)
    return _compiled_ops[fn]
