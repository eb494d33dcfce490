"""torch.compile'd norm and gate chains of Qwen3.5 target layers (extraction's forward), behind a flag.

Shapes: B = batch, S = sequence, D = hidden size, H = heads, d = head dim.

Why: transformers' Qwen3.5 layers run their RMSNorms (input, post-attention, q/k: 4 per attention layer, 2 per
GDN layer), the GDN output's gated RMSNorm and the MLP's SiLU-gating as eager chains of fp32 element-wise
kernels (cast, square, mean, rsqrt, multiply, scale, cast: ~7 launches and as many round trips through memory
each). On the 27B shape on an H200 about a quarter of the forward's GPU time is element-wise work and copies
(DESIGN.md "Performance method": an estimated 20-25 us of the ~98 us per token). compile_elementwise
replaces the forward of each such module instance by the same math written as one pure function, compiled
once per process with dynamic shapes (dflash.compiled.compiled_op), so each chain becomes one fused kernel.
The attention layers' rotary embedding (apply_rotary_pos_emb: two concatenations and four element-wise kernels per
layer, about 34 of the 27B forward's 2,468 ms a batch on an H100: results/extract_h200_profile.json) is a function of
the modeling module that the layers call by name, so that one is swapped in the module (FUSED_FUNCTIONS):
process-wide, as dflash.target.kernels' GDN ops are; extraction runs one target per process.

Faithful: the functions below are transformers' own forward bodies (transformers 5.x, modeling_qwen3_5),
same casts in the same order; eager they are bit-identical to the modules (test), compiled they differ by
float rounding only. Compare them per layer (per_layer_errors), never at the end of a deep random model
(DESIGN.md). Only the module classes named in FUSED and the functions named in FUSED_FUNCTIONS are touched;
other architectures are left as they are.
Tradeoff: the first batch of each new shape pays compile time (seconds; dynamic shapes make that once or
twice per process), and the swap is per model instance (the rotary function: per modeling module) and undone by
restore_elementwise.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dflash.compiled import compiled_op

__all__ = ["FUSED", "FUSED_FUNCTIONS", "compile_elementwise", "gated_rms_norm", "per_layer_errors",
           "restore_elementwise", "rotary", "silu_mul", "zero_centered_rms_norm"]


def zero_centered_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3_5RMSNorm.forward: normalise in fp32, scale by (1 + weight) in fp32, cast back."""
    x32 = x.float()
    out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).type_as(x)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3_5RMSNormGated.forward (activation silu): norm in fp32, weight in the input dtype, times silu(gate)
    in fp32, cast back."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    h = h * F.silu(gate.to(torch.float32))
    return h.to(dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The Qwen3.5 MLP's act_fn(gate_proj(x)) * up_proj(x) with act_fn = silu."""
    return F.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3.5's apply_rotary_pos_emb: q, k [B, H, S, d] (unsqueeze_dim 1) rotated in their first cos.shape[-1]
    dims (partial rotary), the rest passed through."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    r = cos.shape[-1]
    q_rot, q_pass = q[..., :r], q[..., r:]
    k_rot, k_pass = k[..., :r], k[..., r:]
    q_embed = (q_rot * cos) + (_rotate_half(q_rot) * sin)
    k_embed = (k_rot * cos) + (_rotate_half(k_rot) * sin)
    return torch.cat([q_embed, q_pass], dim=-1), torch.cat([k_embed, k_pass], dim=-1)


def _norm_forward(self, x):
    return compiled_op(zero_centered_rms_norm)(x, self.weight, self.eps)


def _gated_forward(self, hidden_states, gate):
    return compiled_op(gated_rms_norm)(hidden_states, gate, self.weight, self.variance_epsilon)


def _mlp_forward(self, x):
    return self.down_proj(compiled_op(silu_mul)(self.gate_proj(x), self.up_proj(x)))


def _mlp_is_silu(m: nn.Module) -> bool:
    return getattr(getattr(m, "config", None), "hidden_act", None) in ("silu", "swish")


def _gated_is_silu(m: nn.Module) -> bool:
    return getattr(m, "activation", None) in ("silu", "swish")


# module class name -> (replacement forward, whether an instance's configuration matches the replaced math)
FUSED: dict[str, tuple[Callable, Callable[[nn.Module], bool]]] = {
    "Qwen3_5RMSNorm": (_norm_forward, lambda m: True),
    "Qwen3_5RMSNormGated": (_gated_forward, _gated_is_silu),
    "Qwen3_5MLP": (_mlp_forward, _mlp_is_silu),
}


def _compiled_rotary(q, k, cos, sin, unsqueeze_dim=1):
    return compiled_op(rotary)(q, k, cos, sin, unsqueeze_dim)


# a module-level function of a modeling module -> (the class whose instances call it, the compiled stand-in)
FUSED_FUNCTIONS: dict[str, tuple[str, Callable]] = {"apply_rotary_pos_emb": ("Qwen3_5Attention", _compiled_rotary)}
# what compile_elementwise replaced: (modeling module name, function name) -> transformers' function
_SWAPPED: dict[tuple[str, str], Callable] = {}


def compile_elementwise(model: nn.Module) -> dict[str, int]:
    """Swap the forward of every FUSED module of `model` for its compiled version, and each FUSED_FUNCTIONS
    function in the modeling module of the classes that call it; returns the count per class (empty for a model
    with none of them, e.g. Llama). Idempotent."""
    counts: dict[str, int] = {}
    users = {cls: (name, fn) for name, (cls, fn) in FUSED_FUNCTIONS.items()}
    for m in model.modules():
        cls = type(m).__name__
        entry = FUSED.get(cls)
        if entry is not None and entry[1](m):
            m.forward = types.MethodType(entry[0], m)   # an instance attribute: hooks and __call__ still apply
            counts[cls] = counts.get(cls, 0) + 1
        elif cls in users:
            name, fn = users[cls]
            mod = sys.modules[type(m).__module__]
            if (mod.__name__, name) not in _SWAPPED:
                _SWAPPED[(mod.__name__, name)] = getattr(mod, name)
                setattr(mod, name, fn)
            counts[f"{cls}.{name}"] = counts.get(f"{cls}.{name}", 0) + 1
    return counts


def restore_elementwise(model: nn.Module) -> None:
    """Undo compile_elementwise: every module runs its class's forward again, every swapped function is
    transformers' own again."""
    for m in model.modules():
        if type(m).__name__ in FUSED and "forward" in m.__dict__:
            del m.forward
    for (mod_name, name), original in list(_SWAPPED.items()):
        if any(type(m).__module__ == mod_name for m in model.modules()):
            setattr(sys.modules[mod_name], name, original)
            del _SWAPPED[(mod_name, name)]


def per_layer_errors(model: nn.Module, layers: Sequence[nn.Module], run: Callable[[], object]) -> list[float]:
    """Per decoder layer: max |compiled - eager| / max |eager| of the layer's output on the inputs that layer
    received in one eager `run()` of the model (each layer gets its own real-shaped inputs, so the numbers do
    not compound through the stack). Leaves `model` eager."""
    restore_elementwise(model)
    inputs: list = [None] * len(layers)

    def keep(i):
        def hook(_module, args, kwargs):
            inputs[i] = (args, kwargs)
        return hook

    handles = [layer.register_forward_pre_hook(keep(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        with torch.inference_mode():
            run()
    finally:
        for h in handles:
            h.remove()

    def outputs() -> list[torch.Tensor]:
        with torch.inference_mode():
            outs = [layer(*a, **k) for layer, (a, k) in zip(layers, inputs)]
        return [o[0] if isinstance(o, tuple) else o for o in outs]

    eager = outputs()
    compile_elementwise(model)
    try:
        fused = outputs()
    finally:
        restore_elementwise(model)
    return [float((f.float() - e.float()).abs().max() / e.float().abs().max().clamp(min=1e-30))
            for f, e in zip(fused, eager)]
