"""Run the target only up to its deepest tap and return the tapped residual streams.

Shapes: B = batch, S = sequence (padded), K = taps, D = hidden size.

We call the text model's own forward (so each layer type gets exactly the masks, rotary embeddings and
position ids transformers builds for it: Llama, Qwen3.5 hybrid GDN/attention, ...) with its `layers`
temporarily cut to layers 0..max(tap) and its final norm replaced by Identity, and we never call the LM
head. Forward hooks on the tapped layers capture their outputs. Later layers therefore cost nothing:
on the 27B shape with taps (1, 16, 31, 46, 61) this skips 2 of 64 layers plus the 248K-vocab head.

Right padding needs no attention mask: every layer (attention and Gated-DeltaNet) is causal, so real
tokens never see the pads that follow them (tests check this per architecture). Passing a mask is allowed
but makes transformers build a dense 4D mask and, for GDN layers, zero the padded inputs.

Without a mask, an SDPA model's attention layers run under CAUSAL_SDPA: transformers' own SDPA function, but a
name with no mask function, so transformers builds no mask and SDPA runs is_causal, as it would after building
one. Under the name "sdpa" the mask builder first checks the position ids for packed sequences, a
`.all()` the host waits on for the GPU: a sync per forward that kept the host from queueing the next
work while the GPU ran (online training: 2 per step). Models with sliding-window or chunked layers keep their
masks (their window is in the mask).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from dflash.errors import ConfigError
from dflash.target import fused
from dflash.target.registry import find_decoder
from dflash.target.taps import validate_tap_layer_ids


CAUSAL_SDPA = "dflash_causal_sdpa"
_FULL_CAUSAL_LAYERS = {"full_attention", "linear_attention"}


def causal_sdpa_name() -> str:
    """CAUSAL_SDPA, registered with transformers' AttentionInterface (idempotent)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if CAUSAL_SDPA not in AttentionInterface._global_mapping:
        AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    return CAUSAL_SDPA


def mask_free_causal(config) -> bool:
    """Whether an unmasked forward of this (text) config is plain causal attention that SDPA's is_causal
    computes: SDPA attention, every layer full attention or linear attention, no sliding window."""
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    return (getattr(config, "_attn_implementation", None) == "sdpa" and layer_types <= _FULL_CAUSAL_LAYERS
            and not getattr(config, "sliding_window", None) and not getattr(config, "use_sliding_window", False))


def text_decoder(model: nn.Module) -> nn.Module:
    """The decoder stack (has embed_tokens, layers, norm) inside a causal LM or a multimodal model, where the
    target's registry entry (dflash.target.registry) says it sits."""
    dec = find_decoder(model)
    if dec is None:
        raise ConfigError(f"cannot find the decoder layers of {type(model).__name__} (expected .model.layers)")
    return dec


def compile_decoder_layers(layers: Sequence[nn.Module]) -> None:
    """Swap each layer's forward for its class's forward under torch.compile (dflash.compiled.compiled_op:
    dynamic shapes, one compiled object per class): the layers of a class share one graph, their weights are its
    inputs, so a 30-layer target compiles once (tests count the graphs). Why: an eager layer is ~40 kernel
    launches and as many Python dispatches, and a target run in the training loop (online) is host-bound on
    them (results/smollm2_step_online_host_h200.json: 2,867 launches a step, the GPU busy 172 ms of a profiled
    step's 552); compiled, each norm, RoPE and gating chain is one kernel. Same math up to float rounding.
    Hooks and __call__ still apply (an instance attribute, as fused.compile_elementwise)."""
    import types

    from dflash.compiled import compiled_op

    for layer in layers:
        layer.forward = types.MethodType(compiled_op(type(layer).forward), layer)


def restore_decoder_layers(layers: Sequence[nn.Module]) -> None:
    """Undo compile_decoder_layers: each layer runs its class's forward eagerly again."""
    for layer in layers:
        layer.__dict__.pop("forward", None)


class TappedForward:
    """Callable: input ids [B, S] -> tapped hidden states [B, S, K, D] in the model's dtype.

    Returns an inference-mode tensor: pack or copy it (as extraction does), do not modify it in place.
    Tap k is the output of decoder layer k, i.e. HF `output_hidden_states[k + 1]` (for the last layer that
    tensor is final-normed, so a tap on the last layer gets the norm applied, as in HF). Not thread-safe (it
    swaps modules of the shared model for the duration of a call); use one per process.
    compile_elementwise: run the Qwen3.5 norm, gate and rotary chains torch.compile'd (dflash.target.fused; off by
    default, and meant for CUDA: on CPU inductor's compile costs more than it saves). compile_layers: run each
    decoder layer it runs whole under torch.compile (compile_decoder_layers). Both change `model`'s modules for
    every user of that model instance.
    """

    def __init__(self, model: nn.Module, tap_layer_ids: Sequence[int], *, compile_elementwise: bool = False,
                 compile_layers: bool = False) -> None:
        self.model = model
        self.fused_modules = fused.compile_elementwise(model) if compile_elementwise else {}
        self.decoder = text_decoder(model)
        self.num_layers = len(self.decoder.layers)
        self.tap_layer_ids = validate_tap_layer_ids(tap_layer_ids, num_layers=self.num_layers)
        self.num_layers_run = max(self.tap_layer_ids) + 1
        # Built once; swapped in per call. Holds the same layer objects, so no weights are copied.
        self._kept_layers = nn.ModuleList(list(self.decoder.layers)[: self.num_layers_run])
        if compile_layers:
            compile_decoder_layers(self._kept_layers)

    @contextmanager
    def _truncated(self, *, unmasked: bool) -> Iterator[None]:
        dec = self.decoder
        full_layers, norm = dec.layers, dec.norm
        attn = dec.config._attn_implementation
        dec.layers, dec.norm = self._kept_layers, nn.Identity()
        if unmasked and mask_free_causal(dec.config):
            dec.config._attn_implementation = causal_sdpa_name()
        try:
            yield
        finally:
            dec.layers, dec.norm = full_layers, norm
            dec.config._attn_implementation = attn

    def __call__(self, input_ids_BS: torch.Tensor, attention_mask_BS: torch.Tensor | None = None) -> torch.Tensor:
        if input_ids_BS.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids_BS.shape)}")
        captured: dict[int, torch.Tensor] = {}

        def make_hook(k: int):
            def hook(_module, _args, output):
                captured[k] = output[0] if isinstance(output, tuple) else output

            return hook

        handles = [self._kept_layers[k].register_forward_hook(make_hook(k)) for k in self.tap_layer_ids]
        with torch.inference_mode():
            try:
                with self._truncated(unmasked=attention_mask_BS is None):
                    self.decoder(input_ids=input_ids_BS, attention_mask=attention_mask_BS, use_cache=False)
            finally:
                for h in handles:
                    h.remove()
            if self.num_layers_run == self.num_layers:
                # HF's hidden_states[L] is the *final-normed* output of the last layer (transformers 5
                # replaces the last entry by the norm output), and z-lab/SpecForge train on that tensor.
                last = self.num_layers - 1
                captured[last] = self.decoder.norm(captured[last])
        return torch.stack([captured[k] for k in self.tap_layer_ids], dim=2)
