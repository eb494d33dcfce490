"""A DFlash drafter for `AutoModel.from_pretrained(folder, trust_remote_code=True)`: torch and transformers only.

`dflash export` copies this file verbatim into every drafter folder as dflash.py, the module that config.json's
auto_map names ({"AutoModel": "dflash.DFlashDraftModel"}, the z-lab layout), so the drafter loads and drafts
where the dflash package is not installed. It must therefore never import dflash.

Shapes: b = batch, T = context tokens, Q = block (query) tokens, K = target taps, D = hidden size,
h = heads, d = head_dim, V = vocabulary, B = block size.

The drafter (DFlash, z-lab DFlashDraftModel):
  ctx = hidden_norm(fc(cat taps))                        the target's hidden states at the context positions
  per layer: x' = input_layernorm(x)
             q = q_norm(q_proj(x')), k = k_norm(k_proj([ctx; x'])), v = v_proj([ctx; x'])
             RoPE (full head_dim) on q at the block positions, on k at [context; block] positions
             x = x + o_proj(attention(q, k, v))          non-causal: every block token sees all keys
             x = x + down_proj(silu(gate_proj(y)) * up_proj(y)),  y = post_attention_layernorm(x)
  out = norm(x)
It has no embedding and no LM head: the block [x_a, MASK x (B-1)] is embedded with the target's embedding and
the outputs 1..B-1 go through the target's LM head. `spec_generate` runs greedy speculative decoding with a
transformers target (attention-only models such as Llama or Qwen3); it recomputes the drafter's context K/V
every step (no drafter KV cache): simple and exact, not fast.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32, scale in the input dtype (Qwen3RMSNorm with the weight cast to the input dtype)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(dtype) * x32.to(dtype)


class DFlashRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_cos_sin(pos: torch.Tensor, *, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin [..., d] for integer positions [...] (default rope type, fp32 math, half-split layout)."""
    exponent = torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponent)
    freqs = pos.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rope_theta_of(config) -> float:
    """RoPE base: transformers 5 keeps it in rope_parameters, 4.x as rope_theta."""
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else getattr(config, "rope_theta"))


class DFlashAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        D, nh, nkv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        d = getattr(config, "head_dim", None) or D // nh
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, d
        self.q_proj = nn.Linear(D, nh * d, bias=False)
        self.k_proj = nn.Linear(D, nkv * d, bias=False)
        self.v_proj = nn.Linear(D, nkv * d, bias=False)
        self.o_proj = nn.Linear(nh * d, D, bias=False)
        self.q_norm = DFlashRMSNorm(d, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(d, config.rms_norm_eps)

    def forward(self, x_bQD, ctx_bTD, rope_q, rope_k, attn_mask=None):
        b, Q, T, d = x_bQD.shape[0], x_bQD.shape[1], ctx_bTD.shape[1], self.head_dim
        q = self.q_norm(self.q_proj(x_bQD).view(b, Q, self.num_heads, d)).transpose(1, 2)
        k = torch.cat([self.k_proj(ctx_bTD), self.k_proj(x_bQD)], dim=1)
        v = torch.cat([self.v_proj(ctx_bTD), self.v_proj(x_bQD)], dim=1)
        k = self.k_norm(k.view(b, T + Q, self.num_kv_heads, d)).transpose(1, 2)
        v = v.view(b, T + Q, self.num_kv_heads, d).transpose(1, 2)
        q = apply_rope(q, *rope_q).to(v.dtype)
        k = apply_rope(k, *rope_k).to(v.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, Q, self.num_heads * d))


class DFlashMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r}: this DFlash drafter implements silu only")
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, ctx, rope_q, rope_k, attn_mask=None):
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_k, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(PreTrainedModel):
    """The DFlash drafter; parameter names are those of config.json's safetensors (layers.N.*, fc, hidden_norm,
    norm). Reads config.dflash_config (target_layer_ids, mask_token_id) and config.block_size."""

    config_class = Qwen3Config
    base_model_prefix = "dflash"
    _no_split_modules = ["DFlashDecoderLayer"]
    _supports_sdpa = True

    def __init__(self, config) -> None:
        super().__init__(config)
        dflash_config = dict(getattr(config, "dflash_config", None) or {})
        if "target_layer_ids" not in dflash_config or "mask_token_id" not in dflash_config:
            raise ValueError("config.dflash_config needs target_layer_ids and mask_token_id: not a DFlash drafter")
        # this file implements full-attention, bidirectional layers only: a windowed or causal drafter would
        # load and draft wrongly here, so it is refused (vLLM and SGLang serve those layouts)
        layer_types = list(getattr(config, "layer_types", None) or [])
        if any(t != "full_attention" for t in layer_types) or dflash_config.get("causal"):
            raise ValueError(f"layer_types={layer_types}, causal={dflash_config.get('causal')}: this stand-alone "
                             "file implements full-attention, bidirectional drafters only; serve this drafter "
                             "with vLLM or SGLang")
        self.target_layer_ids = [int(i) for i in dflash_config["target_layer_ids"]]
        self.mask_token_id = int(dflash_config["mask_token_id"])
        self.block_size = int(getattr(config, "block_size", 16))
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rope_theta = rope_theta_of(config)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module) -> None:
        std = getattr(self.config, "initializer_range", 0.02)
        if isinstance(module, nn.Linear):
            module.weight.normal_(0.0, std)
        elif isinstance(module, DFlashRMSNorm):
            module.weight.fill_(1.0)

    def forward(self, noise_embedding: torch.Tensor, target_hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed outputs [b, Q, D] of the block tokens.

        noise_embedding: [b, Q, D] target embeddings of the block ([x_a, MASK...]).
        target_hidden: [b, T, K*D] the target's hidden states at the context positions, taps concatenated in
            target_layer_ids order (HF hidden_states[id + 1]).
        position_ids: [b, T+Q] positions of [context; block].
        attention_mask: optional boolean [b, 1, Q, T+Q] (True = attend); None = every block token sees every key.
        """
        T = target_hidden.shape[1]
        dtype = noise_embedding.dtype
        rope_q = rope_cos_sin(position_ids[:, T:], head_dim=self.head_dim, theta=self.rope_theta, dtype=dtype)
        rope_k = rope_cos_sin(position_ids, head_dim=self.head_dim, theta=self.rope_theta, dtype=dtype)
        rope_q = tuple(t[:, None] for t in rope_q)   # broadcast over heads
        rope_k = tuple(t[:, None] for t in rope_k)
        ctx = self.context(target_hidden).to(dtype)
        x = noise_embedding
        for layer in self.layers:
            x = layer(x, ctx, rope_q, rope_k, attention_mask)
        return self.norm(x)

    def context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """hidden_norm(fc(taps)): [..., K*D] -> [..., D]."""
        return self.hidden_norm(self.fc(target_hidden))

    @torch.no_grad()
    def spec_generate(self, target, input_ids, *, max_new_tokens: int, stop_token_ids=()) -> tuple[list, list]:
        """Greedy speculative decoding of one prompt with a transformers target on the drafter's device.

        Returns (tokens, steps): the generated ids (the target's own greedy output, a stop token included) and
        the tokens emitted per target forward (accepted drafts + 1; tau = mean(steps)). A step cut by a stop
        token or max_new_tokens counts min(accepted drafts, tokens kept) + 1, as dflash eval's accept chain
        does. Attention-only targets only: the target's KV cache
        is cropped after a rejection, which cannot roll back a recurrent state.
        """
        from transformers import DynamicCache

        device = next(self.parameters()).device
        dtype = next(self.parameters()).dtype
        embed = target.get_input_embeddings().weight.to(device=device, dtype=dtype)
        head = target.get_output_embeddings().weight.to(device=device, dtype=dtype)
        stops = {int(s) for s in stop_token_ids}
        B = self.block_size
        cache = DynamicCache(config=target.config)
        cache_kw = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"

        def taps(hidden_states):
            return torch.cat([hidden_states[i + 1] for i in self.target_layer_ids], dim=-1).to(dtype)

        prompt = torch.as_tensor(input_ids, dtype=torch.long, device=device).reshape(1, -1)
        out = target(input_ids=prompt, use_cache=True, output_hidden_states=True, **{cache_kw: cache})
        hidden = taps(out.hidden_states)                     # [1, pos, K*D]: features of the verified positions
        bonus = int(out.logits[0, -1].float().argmax())
        pos = prompt.shape[1]
        tokens, steps = [bonus], []
        while bonus not in stops and len(tokens) < max_new_tokens:
            block = torch.full((1, B), self.mask_token_id, dtype=torch.long, device=device)
            block[0, 0] = bonus
            position_ids = torch.arange(pos + B, device=device)[None]
            draft_out = self(embed[block], hidden, position_ids)[0, 1:]
            drafts = (draft_out @ head.T).argmax(dim=-1)                      # [B-1]
            verify = torch.cat([block[0, :1], drafts])[None]
            out = target(input_ids=verify, use_cache=True, output_hidden_states=True, **{cache_kw: cache})
            post = out.logits[0].float().argmax(dim=-1)                       # [B]
            accepted = int((drafts == post[:-1]).long().cumprod(0).sum())
            new = drafts[:accepted].tolist() + [int(post[accepted])]
            kept = []
            for t in new[: max_new_tokens - len(tokens)]:
                kept.append(t)
                if t in stops:
                    break
            steps.append(min(accepted, len(kept)) + 1)
            tokens.extend(kept)
            if len(kept) < len(new) or kept[-1] in stops:
                break
            hidden = torch.cat([hidden, taps(out.hidden_states)[:, : accepted + 1]], dim=1)
            extra = cache.get_seq_length() - (pos + accepted + 1)     # drop the rejected drafts' K/V
            if extra > 0:
                if "tokens_to_remove" in inspect.signature(cache.crop).parameters:
                    cache.crop(-extra)
                else:
                    cache.crop(pos + accepted + 1)
            pos += accepted + 1
            bonus = new[-1]
        return tokens, steps
