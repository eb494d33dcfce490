"""FLOPs of the truncated target forward (layers 0..deepest tap), for the extraction floor and MFU.

Counted, not estimated from a parameter total: the Linear weights of the layers that actually run are
summed from a meta-device instance of the model (so attention output gates, GDN projections, MoE-free
MLPs, ... are exactly right), 2 FLOPs per weight per token. Embedding lookup, final norm and LM head are
not run, so not counted. Sequence-length terms are added per sequence:
- causal softmax attention (full_attention layers): QK^T and PV over the S(S+1)/2 visible pairs,
  4 * heads * head_dim FLOPs per pair (no credit for the masked half, as FlashAttention does not compute it);
- gated delta rule (linear_attention layers), chunked form with chunk C=64 per value head and token:
  state read/write/update 6*dk*dv plus intra-chunk attention 2*C*(dk+dv) (an estimate of the kernel's
  matmul work; reported separately so MFU can be computed with or without it).
Element-wise work (norms, activations, conv1d, rotary) is ignored: the usual MFU convention.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from dflash.target.registry import GDN_CHUNK, find_decoder, layer_kinds, text_config  # noqa: F401 (GDN_CHUNK)


@dataclass(frozen=True, kw_only=True)
class TargetFlops:
    """FLOPs model of running decoder layers 0..num_layers_run-1 of a target."""

    num_layers_run: int
    """Decoder layers executed (deepest tap + 1)."""
    linear_per_token: float
    """2 x the Linear weights of those layers: FLOPs per token independent of sequence length."""
    attention_per_pair: float
    """FLOPs per causal (query, key) pair, summed over the full-attention layers run."""
    gdn_per_token: float
    """Gated-delta-rule core FLOPs per token, summed over the linear-attention layers run (estimate)."""

    def forward_flops(self, seq_lengths: Sequence[int], *, include_gdn: bool = True) -> float:
        """Total FLOPs of one forward over sequences of these (unpadded) lengths."""
        total = 0.0
        per_token = self.linear_per_token + (self.gdn_per_token if include_gdn else 0.0)
        for s in seq_lengths:
            total += s * per_token + self.attention_per_pair * s * (s + 1) / 2
        return total

    def per_token(self, seq_len: int, *, include_gdn: bool = True) -> float:
        """Average FLOPs per token for sequences of length `seq_len`."""
        return self.forward_flops([seq_len], include_gdn=include_gdn) / seq_len


def target_flops(config, *, num_layers_run: int) -> TargetFlops:
    """FLOPs model for a transformers config (text or multimodal) running its first `num_layers_run` layers."""
    from transformers import AutoModelForCausalLM

    cfg = text_config(config)
    num_layers = cfg.num_hidden_layers
    if not 1 <= num_layers_run <= num_layers:
        raise ValueError(f"num_layers_run must be in 1..{num_layers}, got {num_layers_run}")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    layers = find_decoder(model).layers[:num_layers_run]
    linear_weights = sum(m.weight.numel() for layer in layers for m in layer.modules() if isinstance(m, nn.Linear))
    # per-layer sequence terms from the target registry's layer kinds (attention pairs, GDN recurrence)
    kinds = layer_kinds(cfg)[:num_layers_run]
    attention = sum(k.flops_per_pair(cfg) for k in kinds)
    gdn = sum(k.flops_per_token(cfg) for k in kinds)
    return TargetFlops(num_layers_run=num_layers_run, linear_per_token=2.0 * linear_weights,
                       attention_per_pair=attention, gdn_per_token=gdn)
