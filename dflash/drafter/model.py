"""The DFlash drafter (z-lab `DFlashDraftModel`, method doc 1.1): fc + hidden_norm over the concatenated
target taps, then N Qwen3-style layers with KV injection, then a final norm.

Shapes: T = context tokens (C in attention.py), K = taps, D = hidden size, Q = block (query) tokens,
h = heads, d = head_dim.

Semantics (z-lab dflash/model.py):
  ctx = hidden_norm(fc(cat taps))                              computed once, shared by every layer
  per layer: x' = input_layernorm(x)
             q = q_norm(q_proj(x'))                            queries: block tokens only
             k = k_norm(cat(k_proj(ctx), k_proj(x')))          keys/values: [context; block]
             v = cat(v_proj(ctx), v_proj(x'))
             RoPE(full head_dim, rope_theta) on q at block positions, on k at [context; block] positions
             x = x + o_proj(attention(q, k, v, mask))          non-causal
             x = x + down_proj(silu(gate_proj(y)) * up_proj(y)),  y = post_attention_layernorm(x)
  out = norm(x)
The context is neither re-normed per layer nor updated layer to layer. There is no embedding and no LM head:
the caller embeds the block with the frozen target embedding and applies the frozen target head.
Tradeoff: everything is unbatched ("packed"): several sequences share one token axis and the mask keeps
them apart, so no padding is spent on ragged sequences.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from dflash.compiled import compiled_op
from dflash.drafter.attention import (CONTEXT_BLOCK, BlockLayout, LayerAttention, block_attention_mask,
                                      choose_backend, dense_block_attention, flex_block_attention, flex_block_mask)
from dflash.drafter.config import DrafterConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3RMSNorm: normalise in float32, scale in the input dtype. The weight is cast to the input dtype
    (fp32 master weights under bf16 autocast): the output stays bf16, as it is when the exported drafter
    runs in bf16, instead of an fp32 tensor that every following matmul casts back."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(dtype) * x32.to(dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.norm_fn = rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm_fn(x, self.weight, self.eps)


def rope_cos_sin(pos_N: torch.Tensor, *, head_dim: int, theta: float, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [N, d] for absolute positions (Qwen3RotaryEmbedding, default rope type, fp32 math)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=pos_N.device, dtype=torch.int64)
                                .float() / head_dim))
    freqs_Nf = pos_N.float()[:, None] * inv_freq[None]
    emb_Nd = torch.cat([freqs_Nf, freqs_Nf], dim=-1)
    return emb_Nd.cos().to(dtype), emb_Nd.sin().to(dtype)


def apply_rope(x_hNd: torch.Tensor, cos_Nd: torch.Tensor, sin_Nd: torch.Tensor) -> torch.Tensor:
    half = x_hNd.shape[-1] // 2
    rotated = torch.cat([-x_hNd[..., half:], x_hNd[..., :half]], dim=-1)
    return x_hNd * cos_Nd + rotated * sin_Nd


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        H, nh, nkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, d
        self.q_proj = nn.Linear(H, nh * d, bias=False)
        self.k_proj = nn.Linear(H, nkv * d, bias=False)
        self.v_proj = nn.Linear(H, nkv * d, bias=False)
        self.o_proj = nn.Linear(nh * d, H, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.rope_fn = apply_rope

    def forward(self, x_QD: torch.Tensor, ctx_TD: torch.Tensor, *, rope_q, rope_k, attend) -> torch.Tensor:
        Q, T, d = x_QD.shape[0], ctx_TD.shape[0], self.head_dim
        q_hQd = self.q_norm(self.q_proj(x_QD).view(Q, self.num_heads, d)).transpose(0, 1)
        k_KD = torch.cat([self.k_proj(ctx_TD), self.k_proj(x_QD)], dim=0)
        v_KD = torch.cat([self.v_proj(ctx_TD), self.v_proj(x_QD)], dim=0)
        k_hKd = self.k_norm(k_KD.view(T + Q, self.num_kv_heads, d)).transpose(0, 1)
        v_hKd = v_KD.view(T + Q, self.num_kv_heads, d).transpose(0, 1)
        # Under autocast the projections return the compute dtype; outside it (fp32 CPU runs) everything is
        # the input dtype. The attention kernels want one dtype: v's.
        q_hQd = self.rope_fn(q_hQd, *rope_q).to(v_hKd.dtype)
        k_hKd = self.rope_fn(k_hKd, *rope_k).to(v_hKd.dtype)
        out_hQd = attend(q_hQd, k_hKd, v_hKd)
        return self.o_proj(out_hQd.transpose(0, 1).reshape(Q, self.num_heads * d))


class DFlashMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act_fn = silu_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x), self.up_proj(x)))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(cfg)
        self.mlp = DFlashMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x_QD, ctx_TD, *, rope_q, rope_k, attend):
        x_QD = x_QD + self.self_attn(self.input_layernorm(x_QD), ctx_TD, rope_q=rope_q, rope_k=rope_k,
                                     attend=attend)
        return x_QD + self.mlp(self.post_attention_layernorm(x_QD))


class DFlashDrafter(nn.Module):
    """Trainable part of a DFlash drafter; parameter names match the published checkpoints."""

    decoder_layer_cls = DFlashDecoderLayer
    """The draft layer (DFlash 2's subclass wraps its sublayers in convolutions: drafter/dflash2.py)."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.elementwise_compiled = False
        """compile_elementwise() was called: training compiles its LM-head CE epilogue too (train.fused_ce)."""
        self.layers = nn.ModuleList(self.decoder_layer_cls(cfg) for _ in range(cfg.num_hidden_layers))
        self.fc = nn.Linear(cfg.num_taps * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_backend = "auto"       # 'auto' (flex on CUDA, dense elsewhere), 'dense' or 'flex'
        self.dense_chunk_tokens = 2048   # query tokens per dense-path chunk (bounds mask and score memory)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Qwen3PreTrainedModel init (what SpecForge trains from): normal(0, 0.02) linears, unit norms."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, std)
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)

    def compile_elementwise(self) -> None:
        """Run the norms, RoPE and SiLU-gating as torch.compile'd fused kernels (training on CUDA). Same math;
        results differ from eager by float rounding only. Weights, names and exports are unchanged."""
        self.elementwise_compiled = True
        self._bind_elementwise(compiled_op)

    @contextlib.contextmanager
    def eager_elementwise(self) -> Iterator[None]:
        """The eager element-wise ops for the duration (evaluation: the floats of an exported, uncompiled
        drafter, and no recompiles for new shapes); compiled ones are bound again after."""
        if not self.elementwise_compiled:
            yield
            return
        self._bind_elementwise(lambda fn: fn)
        try:
            yield
        finally:
            self._bind_elementwise(compiled_op)

    def _bind_elementwise(self, wrap) -> None:
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.norm_fn = wrap(rms_norm)
            elif isinstance(m, DFlashAttention):
                m.rope_fn = wrap(apply_rope)
            elif isinstance(m, DFlashMLP):
                m.act_fn = wrap(silu_mul)

    def context(self, target_hidden_TKD: torch.Tensor) -> torch.Tensor:
        """hidden_norm(fc(concat taps)) -> [T, D]. Taps are concatenated in target_layer_ids order."""
        return self.hidden_norm(self.fc(target_hidden_TKD.flatten(1)))

    def forward(self, block_embeds_QD: torch.Tensor, ctx_TD: torch.Tensor, *, q_pos: torch.Tensor,
                kv_pos: torch.Tensor, mask: BlockLayout | None = None) -> torch.Tensor:
        """Final-normed drafter outputs for the block tokens, [Q, D].

        block_embeds_QD: frozen target embeddings of the block tokens ([x_a, MASK...] per block).
        ctx_TD: output of `context()`; q_pos [Q] and kv_pos [T+Q] absolute positions.
        mask: None = one block over its visible context (z-lab decode step): every query sees every key in
        full-attention layers, the window / in-block causality of the others; a BlockLayout = the
        packed-training mask (block_attention_mask per layer), run with flex on CUDA or chunked dense SDPA
        elsewhere.
        """
        assert kv_pos.shape[0] == ctx_TD.shape[0] + block_embeds_QD.shape[0], "kv_pos must cover [ctx; block]"
        dtype, cfg = block_embeds_QD.dtype, self.cfg
        rope_q = rope_cos_sin(q_pos, head_dim=cfg.head_dim, theta=cfg.rope_theta, dtype=dtype)
        rope_k = rope_cos_sin(kv_pos, head_dim=cfg.head_dim, theta=cfg.rope_theta, dtype=dtype)
        layer_attn = [cfg.layer_attention(i) for i in range(cfg.num_hidden_layers)]
        # one kernel (and flex BlockMask) per distinct layer attention, built once per forward, shared by its layers
        attends = {a: self._attention_fn(mask, block_embeds_QD.device, a, q_pos=q_pos, kv_pos=kv_pos,
                                         num_ctx=ctx_TD.shape[0])
                   for a in dict.fromkeys(layer_attn)}
        ctx_TD = ctx_TD.to(dtype)
        x_QD = block_embeds_QD
        for layer, a in zip(self.layers, layer_attn):
            x_QD = layer(x_QD, ctx_TD, rope_q=rope_q, rope_k=rope_k, attend=attends[a])
        return self.norm(x_QD)

    def _attention_fn(self, mask: BlockLayout | None, device: torch.device, attn: LayerAttention, *,
                      q_pos: torch.Tensor, kv_pos: torch.Tensor, num_ctx: int):
        if mask is None:
            if attn.is_full:
                return lambda q, k, v: F.scaled_dot_product_attention(q[None], k[None], v[None],
                                                                      enable_gqa=True)[0]
            # one block over its context (all of it below the anchor): the predicate on positions alone
            zero = torch.zeros((), dtype=torch.int64, device=device)
            kv_block = torch.zeros_like(kv_pos)
            kv_block[:num_ctx] = CONTEXT_BLOCK
            allowed_QK = block_attention_mask(q_seq=zero, q_anchor=q_pos[0], q_block=zero, q_pos=q_pos[:, None],
                                              kv_seq=zero, kv_pos=kv_pos[None], kv_block=kv_block[None], attn=attn)
            return lambda q, k, v: F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=allowed_QK,
                                                                  enable_gqa=True)[0]
        backend = choose_backend(device, self.attn_backend)
        if backend == "flex":
            block_mask = flex_block_mask(mask, attn=attn)
            compiled = device.type == "cuda"
            return lambda q, k, v: flex_block_attention(q, k, v, block_mask, compiled=compiled)
        chunk = self.dense_chunk_tokens
        return lambda q, k, v: dense_block_attention(q, k, v, mask, chunk_tokens=chunk, attn=attn)
