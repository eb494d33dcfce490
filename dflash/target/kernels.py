"""Kernel selection for hybrid (Gated-DeltaNet) targets such as Qwen3.5.

transformers binds each GDN op (`torch_chunk_gated_delta_rule`, `causal_conv1d_fn`, ...) once, at import
of the modeling module: FLA's Triton kernel when `fla` imports, else its torch reference. That choice
ignores the device, so with fla + triton installed on a machine without a GPU the FLA kernels run and
crash (DESIGN.md "Test assets"). We therefore rebind the module globals per device:

- not CUDA: always the torch reference kernels (`inspect.unwrap` of transformers' wrapper is exactly the
  reference function it would fall back to).
- CUDA: whatever transformers bound (FLA when importable); optionally (`fla_conv=True`) FLA's Triton
  `causal_conv1d` in place of the torch conv fallback: measured ~13% faster end to end on the 27B shape
  on an H200 and faithful per op (5e-8 relative in fp32, DESIGN.md "Performance method").
- Grouped key heads: when a target has fewer GDN key heads than value heads (Qwen3.5-27B: 16 and 48),
  transformers before GROUPED_KEY_HEADS_SINCE copies q and k to the value heads' count before every GDN
  kernel; later versions hand FLA the key heads as they are, and FLA's grouped value attention reads key head
  j // (HV / H) for value head j, the same values without the copy (bit-identical and 1.33x faster per layer
  on the 27B shape, given transformers' split views: benchmarks/results/gdn_heads_h200.json). The choice's
  reason says which one runs.

The rebinding is process-global (the module is shared by every model of that class); extraction runs one
process per device, so one process never needs two choices at once. Every choice is logged with its reason.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import transformers
from packaging.version import Version

from dflash.target.registry import LAYER_KINDS, text_config

log = logging.getLogger(__name__)

# The GDN ops transformers binds at import time: the registry's linear_attention layer kind names them.
GDN_OPS = LAYER_KINDS["linear_attention"].kernel_ops

# (module name, op name) -> what transformers bound originally, so a later choice can restore it.
_ORIGINALS: dict[tuple[str, str], Callable] = {}


@dataclass(frozen=True, kw_only=True)
class KernelChoice:
    """What runs the target's Gated-DeltaNet layers, and why."""

    gated_deltanet: str
    """"fla" (Triton), "torch" (transformers' reference) or "none" (the model has no GDN layers)."""
    conv1d: str
    """"fla-triton", "causal-conv1d" (Dao's CUDA package), "torch" or "none"."""
    reason: str
    """One line saying why, for the log and the manifest."""


GROUPED_KEY_HEADS_SINCE = "5.23"
"""The first transformers version whose Qwen3.5 GDN layers pass FLA the key heads as they are (no repeat copy)."""


def key_heads_grouped(transformers_version: str) -> bool:
    """Whether this transformers version hands the GDN kernel the key heads without copying them per value head."""
    return Version(transformers_version) >= Version(GROUPED_KEY_HEADS_SINCE)


def _key_heads_note(model: torch.nn.Module) -> str | None:
    """The reason's word on grouped key heads, for a target with fewer GDN key heads than value heads."""
    cfg = text_config(model.config)
    hk, hv = getattr(cfg, "linear_num_key_heads", None), getattr(cfg, "linear_num_value_heads", None)
    if not hk or not hv or hv <= hk:
        return None
    if key_heads_grouped(transformers.__version__):
        return f"{hk} GDN key heads passed grouped to {hv} value heads"
    return (f"transformers {transformers.__version__} copies the {hk} GDN key heads to {hv} before each kernel: "
            f">= {GROUPED_KEY_HEADS_SINCE} passes them grouped, the same values ~1.3x faster (pip install "
            f"'transformers>={GROUPED_KEY_HEADS_SINCE}')")


def gdn_modules(model: torch.nn.Module) -> list[ModuleType]:
    """The modeling modules of `model`'s layers that define GDN ops (usually exactly one)."""
    names = {type(m).__module__ for m in model.modules()}
    mods = [sys.modules[n] for n in sorted(names) if n in sys.modules]
    return [m for m in mods if hasattr(m, "torch_chunk_gated_delta_rule")]


def _bound_implementation(fn: Callable) -> Callable:
    """The implementation transformers' `use_kernel_func_from_hub_with_fallback` wrapper calls."""
    f: Callable | None = fn
    while f is not None:  # other decorators (the `kernels` hub wrapper) may sit on top of it
        try:
            impl = inspect.getclosurevars(f).nonlocals.get("implementation")
        except TypeError:  # a builtin or a non-function callable
            impl = None
        if callable(impl):
            return impl
        f = getattr(f, "__wrapped__", None)
    return fn


def _is_package(fn: Callable, package: str) -> bool:
    return (getattr(fn, "__module__", "") or "").split(".")[0] == package


def _fla_causal_conv1d() -> Callable | None:
    """FLA's Triton causal_conv1d, wherever this FLA version keeps it; None when FLA is absent."""
    for mod_name in ("fla.modules.convolution", "fla.modules.conv", "fla.modules"):
        try:
            fn = getattr(importlib.import_module(mod_name), "causal_conv1d", None)
        except Exception:  # noqa: BLE001 - any import failure means "not usable here"
            fn = None
        if callable(fn):
            return fn
    return None


def _make_fla_conv(fla_conv1d: Callable) -> Callable:
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        # transformers passes [B, D, T] (a transposed view of a contiguous [B, T, D]); FLA wants [B, T, D],
        # so the transposes below are free views, not copies.
        out = fla_conv1d(x=hidden_states.transpose(1, 2), weight=weight, bias=bias, activation=activation)
        out_BTD = out[0] if isinstance(out, tuple) else out  # (y, final_state) in FLA >= 0.3
        return out_BTD.transpose(1, 2)

    causal_conv1d_fn.dflash_kernel = "fla-triton"  # type: ignore[attr-defined]
    return causal_conv1d_fn


def select_kernels(model: torch.nn.Module, device: torch.device | str, *, fla_conv: bool = False) -> KernelChoice:
    """Bind the GDN ops of `model`'s modeling module for `device`; log and return the choice."""
    device = torch.device(device)
    mods = gdn_modules(model)
    if not mods:
        choice = KernelChoice(gated_deltanet="none", conv1d="none", reason="no Gated-DeltaNet layers")
        log.info("target kernels: %s", choice.reason)
        return choice
    for mod in mods:
        for op in GDN_OPS:
            if hasattr(mod, op):
                _ORIGINALS.setdefault((mod.__name__, op), getattr(mod, op))

    if device.type != "cuda":
        for mod in mods:
            for op in GDN_OPS:
                if hasattr(mod, op):
                    setattr(mod, op, inspect.unwrap(_ORIGINALS[(mod.__name__, op)]))
        choice = KernelChoice(
            gated_deltanet="torch", conv1d="torch",
            reason=f"device {device} is not CUDA: FLA's Triton kernels need a GPU, using transformers' "
                   "torch reference kernels",
        )
        log.info("target kernels: %s", choice.reason)
        return choice

    # CUDA: restore what transformers bound, then report what that is.
    for mod in mods:
        for op in GDN_OPS:
            if hasattr(mod, op):
                setattr(mod, op, _ORIGINALS[(mod.__name__, op)])
    mod = mods[0]
    chunk_impl = _bound_implementation(_ORIGINALS[(mod.__name__, "torch_chunk_gated_delta_rule")])
    gdn = "fla" if _is_package(chunk_impl, "fla") else "torch"
    conv_impl = _bound_implementation(_ORIGINALS[(mod.__name__, "causal_conv1d_fn")])
    conv = "causal-conv1d" if _is_package(conv_impl, "causal_conv1d") else "torch"
    reasons = [
        "FLA Triton kernels (flash-linear-attention importable)" if gdn == "fla"
        else "torch reference GDN kernels: flash-linear-attention is not importable (pip install dflash[gpu])"
    ]
    if gdn == "fla" and (note := _key_heads_note(model)):
        reasons.append(note)
    if fla_conv:
        fla_conv1d = _fla_causal_conv1d()
        if fla_conv1d is None:
            reasons.append("fla_conv requested but FLA's causal_conv1d is not importable: keeping " + conv)
        else:
            for m in mods:
                m.causal_conv1d_fn = _make_fla_conv(fla_conv1d)
            conv = "fla-triton"
            reasons.append("FLA Triton causal_conv1d in place of the conv fallback (fla_conv=True)")
    else:
        reasons.append(f"conv1d: {conv}")
    choice = KernelChoice(gated_deltanet=gdn, conv1d=conv, reason="; ".join(reasons))
    log.info("target kernels on %s: %s", device, choice.reason)
    return choice


def fla_available() -> bool:
    """Whether flash-linear-attention and triton are installed (says nothing about a usable GPU)."""
    return importlib.util.find_spec("fla") is not None and importlib.util.find_spec("triton") is not None
