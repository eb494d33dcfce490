"""Supported target architectures: one registry (torchtitan TrainSpec-style) of what dflash needs to know about
a target model family, so a new family is one entry here instead of edits in forward, kernels, flops and live.

Two tables:
- LAYER_KINDS, by HF `layer_types` name: the sequence-length FLOP terms of that layer (flops.py), whether it
  keeps a recurrent state (then live speculative decoding cannot roll its cache back: eval/live.py), and the
  modeling-module ops that kernels.py rebinds per device (Gated-DeltaNet's Triton kernels crash off CUDA).
- ARCHITECTURES, by HF `model_type` of the text config: where the decoder stack (embed_tokens, layers, norm)
  sits inside the loaded model (forward.py taps it; flops.py counts its Linear weights), and the layer kind of
  configs without `layer_types`.
A model_type not listed gets GENERIC (the decoder found by the same attribute search, every layer full
attention unless `layer_types` says otherwise), which is how every target behaved before the registry.
Tradeoff: the entries describe transformers' module layout, so a transformers release that moves the
decoder needs an edit here (and only here).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

GDN_CHUNK = 64  # transformers' and FLA's chunk size for chunk_gated_delta_rule

# The Gated-DeltaNet ops transformers binds at import of qwen3_5, qwen3_5_moe and qwen3_next modeling modules.
GDN_OPS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
           "causal_conv1d_update")


def _attention_per_pair(cfg: Any) -> float:
    # QK^T and PV: 4 * heads * head_dim FLOPs per visible (query, key) pair
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 4.0 * cfg.num_attention_heads * head_dim


def _gdn_per_token(cfg: Any) -> float:
    # chunked gated delta rule per value head and token: state read/write/update 6*dk*dv plus intra-chunk
    # attention 2*C*(dk+dv) (an estimate of the kernel's matmul work)
    dk, dv, hv = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_num_value_heads
    return float(hv * (6 * dk * dv + 2 * GDN_CHUNK * (dk + dv)))


def _zero(_cfg: Any) -> float:
    return 0.0


@dataclass(frozen=True, kw_only=True)
class LayerKind:
    """One HF layer type."""

    name: str
    """The `layer_types` entry ("full_attention", "linear_attention", ...)."""
    flops_per_pair: Callable[[Any], float]
    """FLOPs per causal (query, key) pair of this layer, from the text config (attention layers)."""
    flops_per_token: Callable[[Any], float]
    """Sequence-length-independent core FLOPs per token outside Linear weights (GDN recurrence)."""
    stateful: bool
    """Keeps a recurrent state across tokens: a KV-cache crop cannot roll it back (no live decoding)."""
    kernel_ops: tuple[str, ...] = ()
    """Modeling-module ops kernels.py rebinds per device (empty: nothing to choose)."""


LAYER_KINDS: dict[str, LayerKind] = {k.name: k for k in (
    LayerKind(name="full_attention", flops_per_pair=_attention_per_pair, flops_per_token=_zero, stateful=False),
    # sliding windows would need the window in the FLOP count: none of the supported targets use one
    LayerKind(name="sliding_attention", flops_per_pair=_attention_per_pair, flops_per_token=_zero,
              stateful=False),
    LayerKind(name="linear_attention", flops_per_pair=_zero, flops_per_token=_gdn_per_token, stateful=True,
              kernel_ops=GDN_OPS),
)}


_UNLISTED = LayerKind(name="?", flops_per_pair=_attention_per_pair, flops_per_token=_zero, stateful=True)


@dataclass(frozen=True, kw_only=True)
class TargetArch:
    """One target model family."""

    name: str
    """Short name for logs and docs."""
    model_types: tuple[str, ...]
    """HF `model_type` values of the text config (or of the outer config) this entry covers."""
    decoder_paths: tuple[tuple[str, ...], ...]
    """Attribute paths from the loaded model to its decoder stack, tried in order."""
    default_layer_kind: str = "full_attention"
    """Layer kind of every layer when the config has no `layer_types`."""


_PLAIN = ((), ("model",))
_MULTIMODAL = ((), ("model",), ("language_model",), ("model", "language_model"))

ARCHITECTURES: tuple[TargetArch, ...] = (
    TargetArch(name="llama", model_types=("llama",), decoder_paths=_PLAIN),
    TargetArch(name="qwen3", model_types=("qwen3",), decoder_paths=_PLAIN),
    TargetArch(name="qwen3.5", model_types=("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text",
                                             "qwen3_next"), decoder_paths=_MULTIMODAL),
)

GENERIC = TargetArch(name="generic", model_types=(), decoder_paths=_MULTIMODAL)


def text_config(config: Any) -> Any:
    """The text decoder's config (the config itself for plain causal LMs)."""
    sub = getattr(config, "text_config", None)
    return sub if sub is not None else config


def architecture(config: Any) -> TargetArch:
    """The registry entry of a transformers config (text or multimodal); GENERIC for an unlisted model_type."""
    types = {getattr(text_config(config), "model_type", None), getattr(config, "model_type", None)}
    for arch in ARCHITECTURES:
        if types & set(arch.model_types):
            return arch
    return GENERIC


def layer_kinds(config: Any) -> list[LayerKind]:
    """The LayerKind of every decoder layer of `config`, in order. A layer type not in LAYER_KINDS is counted
    as attention for FLOPs and as stateful (no live decoding): the conservative reading until it is added."""
    cfg = text_config(config)
    types = getattr(cfg, "layer_types", None) or [architecture(config).default_layer_kind] * cfg.num_hidden_layers
    return [LAYER_KINDS.get(t) or dataclasses.replace(_UNLISTED, name=t) for t in types]


def live_decoding_supported(config: Any) -> tuple[bool, list[str]]:
    """Whether live speculative decoding can run this target (no stateful layer), and its layer type names."""
    kinds = layer_kinds(config)
    return not any(k.stateful for k in kinds), sorted({k.name for k in kinds})


def kernel_ops() -> tuple[str, ...]:
    """Every op some layer kind rebinds per device (kernels.py)."""
    return tuple(dict.fromkeys(op for k in LAYER_KINDS.values() for op in k.kernel_ops))


def find_decoder(model: Any) -> Any | None:
    """The decoder stack (has embed_tokens, layers, norm) of a loaded model, by its registry entry's paths."""
    config = getattr(model, "config", None)
    arch = architecture(config) if config is not None else GENERIC
    for path in arch.decoder_paths:
        c = model
        for attr in path:
            c = getattr(c, attr, None)
            if c is None:
                break
        if c is not None and all(hasattr(c, a) for a in ("embed_tokens", "layers", "norm")):
            return c
    return None
