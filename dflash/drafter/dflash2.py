"""The DFlash 2 drafter: the DFlash backbone with a two-tap dynamic convolution around every draft sublayer, and
a pairwise path selector over each drafted slot's top-k candidates.

Shapes: Q = block (query) rows, J = blocks, B = block size, W = B-1 drafted slots, D = hidden size,
T = context rows, G = channel groups (D / conv_group_size), g = conv_group_size, P = conv taps, V = vocabulary,
r = selector rank, k = selector top-k, n = rows of a chunk.

Semantics (the serving code this export must load in: SGLang `python/sglang/srt/models/dflash.py`
DFlashGroupedConv / CandidateSelector / DFlash2DraftModel, vLLM `qwen3_dflash2.py`; the method:
https://inco.ai/blog/dflash2/):
  per layer:  h = input_layernorm(x)
              c = attention_conv.kernel_projection(h) -> [Q, 2, P, G]    one projection for both sides
              h = conv(h, base_kernel[0] + c[:, 0])                      before the sublayer
              a = conv(self_attn(h, ctx), base_kernel[1] + c[:, 1])      after it
              x = x + a, then the same with mlp_conv around the MLP
  conv(y, k)[t] = sum_{p < P} k[t, p] * y[t - p], where y[t - p] is taken only inside t's own block:
  block position 0 (the anchor) reads nothing before it, position 1 reads the anchor. The attention K/V of
  the context are those of DFlash (context rows are not convolved).
  selector:   cand, U = top-k of the frozen LM head's logits at each drafted slot (U scaled by
              output_multiplier, soft-capped by final_logit_softcapping when set)
              S_t(a, b) = U_t(b) + < A[a] * hidden_projection(h_t), Bc[b] >   (A / Bc: predecessor / successor
              codebooks, h_t the final-normed drafter output of slot t)
              the draft walks from the anchor: d_1 = cand_1[argmax S_1(anchor, .)], d_t = cand_t[argmax
              S_t(d_{t-1}, .)]. Greedy decoding verifies these drafts, so exact tau follows this path.
Tradeoff: the convolution is written with plain tensor ops over the packed [Q, D] rows (blocks are B consecutive
rows, so a row's block position is its index mod B): no custom kernel, one extra elementwise pass per side.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash.drafter.config import DrafterConfig
from dflash.drafter.model import DFlashDecoderLayer, DFlashDrafter
from dflash.errors import ConfigError

ARCHITECTURE2 = "DFlash2DraftModel"


@dataclass(frozen=True, kw_only=True)
class DFlash2Config(DrafterConfig):
    """A DFlash drafter's shape plus the DFlash 2 modules' sizes (config.json `dflash_config` keys of the same
    names, as SGLang's parse_dflash_draft_config and vLLM's qwen3_dflash2 read them)."""

    conv_kernel_size: int = 2
    """Taps P of the in-block convolution (2: a slot and its predecessor)."""

    conv_group_size: int = 16
    """Channels sharing one dynamic coefficient; must divide hidden_size."""

    selector_rank: int = 256
    """Rank r of the selector's codebooks and hidden projection (published drafters: 256)."""

    selector_top_k: int = 16
    """Candidates k per drafted slot that the selector chooses among (published drafters: 16)."""

    output_multiplier: float = 1.0
    """Scale of the unary (LM head) logits of the candidates."""

    final_logit_softcapping: float | None = None
    """Soft cap cap * tanh(U / cap) of the unary logits; None = none."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"DFlash2Config.{name}={value!r}: must be a positive integer")
        if self.hidden_size % self.conv_group_size:
            raise ConfigError(f"DFlash2Config.conv_group_size={self.conv_group_size}: must divide hidden_size="
                              f"{self.hidden_size} (channels share a coefficient per group)")
        if self.conv_kernel_size > self.block_size:
            raise ConfigError(f"DFlash2Config.conv_kernel_size={self.conv_kernel_size}: at most block_size="
                              f"{self.block_size} (taps never leave the block)")
        if self.selector_top_k > self.vocab_size:
            raise ConfigError(f"DFlash2Config.selector_top_k={self.selector_top_k}: at most vocab_size="
                              f"{self.vocab_size}")
        if not self.output_multiplier > 0:
            raise ConfigError(f"DFlash2Config.output_multiplier={self.output_multiplier!r}: must be > 0")
        if self.final_logit_softcapping is not None and not self.final_logit_softcapping > 0:
            raise ConfigError(f"DFlash2Config.final_logit_softcapping={self.final_logit_softcapping!r}: must be > 0 "
                              "or None")

    @property
    def conv_groups(self) -> int:
        return self.hidden_size // self.conv_group_size

    @classmethod
    def from_base(cls, base: DrafterConfig, **dflash2: Any) -> "DFlash2Config":
        """The DFlash 2 drafter of `base`'s shape (every DrafterConfig field copied) with these module sizes."""
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(DrafterConfig)}
        return cls(**fields, **dflash2)

    def to_json(self) -> dict[str, Any]:
        d = super().to_json()
        d["arch"] = "dflash2"   # registry.config_from_json picks the class by it
        return d

    def to_hf_config(self) -> dict[str, Any]:
        """config.json of a DFlash 2 drafter: DFlash's, with architecture DFlash2DraftModel and the module sizes
        (and block_size, which SGLang reads there first) in dflash_config."""
        hf = super().to_hf_config()
        hf["architectures"] = [ARCHITECTURE2]
        hf.pop("auto_map", None)  # z-lab's remote code class is DFlash 1's
        extra = {"block_size": self.block_size, "conv_kernel_size": self.conv_kernel_size,
                 "conv_group_size": self.conv_group_size, "selector_rank": self.selector_rank,
                 "selector_top_k": self.selector_top_k}
        if self.output_multiplier != 1.0:
            extra["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping is not None:
            extra["final_logit_softcapping"] = self.final_logit_softcapping
        hf["dflash_config"] = {**hf["dflash_config"], **extra}
        return hf

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> "DFlash2Config":
        if not isinstance(hf, dict) or ARCHITECTURE2 not in (hf.get("architectures") or []):
            archs = hf.get("architectures") if isinstance(hf, dict) else None
            raise ConfigError(f"config.json architectures={archs!r}: not a DFlash 2 drafter "
                              f"(expected {ARCHITECTURE2!r})")
        dflash = hf.get("dflash_config") if isinstance(hf.get("dflash_config"), dict) else {}
        missing = [k for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
                   if not dflash.get(k)]
        if missing:
            raise ConfigError(f"config.json dflash_config lacks {missing}: a DFlash2DraftModel needs its "
                              "convolution and selector sizes")
        as_dflash = {**hf, "architectures": ["DFlashDraftModel"]}
        if as_dflash.get("block_size") is None and dflash.get("block_size") is not None:
            as_dflash["block_size"] = dflash["block_size"]
        elif dflash.get("block_size") is not None and dflash["block_size"] != as_dflash["block_size"]:
            raise ConfigError(f"config.json block_size={as_dflash['block_size']} but dflash_config.block_size="
                              f"{dflash['block_size']}: they must agree")
        base = DrafterConfig.from_hf_config(as_dflash)
        softcap = dflash.get("final_logit_softcapping")
        return cls.from_base(base, conv_kernel_size=int(dflash["conv_kernel_size"]),
                             conv_group_size=int(dflash["conv_group_size"]),
                             selector_rank=int(dflash["selector_rank"]), selector_top_k=int(dflash["selector_top_k"]),
                             output_multiplier=float(dflash.get("output_multiplier", 1.0)),
                             final_logit_softcapping=float(softcap) if softcap else None)


# ------------------------------------------------------------------------------------------------ convolution

def block_positions(num_rows: int, block_size: int, device: torch.device) -> torch.Tensor:
    """int64 [Q]: each row's slot in its block (rows are whole blocks of block_size consecutive rows)."""
    assert num_rows % block_size == 0, f"{num_rows} rows are not whole blocks of {block_size}"
    return torch.arange(num_rows, device=device) % block_size


def grouped_block_conv(y_QD: torch.Tensor, delta_QPG: torch.Tensor, base_PD: torch.Tensor, *,
                       block_size: int) -> torch.Tensor:
    """out[t, c] = sum_p (base[p, c] + delta[t, p, group(c)]) * y[t - p, c], the y[t - p] term present only when
    t - p lies in t's own block (slot(t) >= p). Pure: no state, any float dtype (the result is y's)."""
    Q, D = y_QD.shape
    P, G = delta_QPG.shape[1], delta_QPG.shape[2]
    y_QGg = y_QD.view(Q, G, D // G)
    coef_QPGg = base_PD.view(1, P, G, D // G).to(y_QD.dtype) + delta_QPG.to(y_QD.dtype)[..., None]
    out = coef_QPGg[:, 0] * y_QGg
    slot_Q = block_positions(Q, block_size, y_QD.device)
    for p in range(1, P):
        shifted = F.pad(y_QGg[:-p], (0, 0, 0, 0, p, 0))       # row t holds y[t - p]
        out = out + coef_QPGg[:, p] * shifted * (slot_Q >= p).to(y_QD.dtype).view(Q, 1, 1)
    return out.reshape(Q, D)


class GroupedDynamicConv(nn.Module):
    """The convolution wrapped around one sublayer: `prepare` convolves the sublayer's input and returns the
    coefficients `finish` uses on its output; both sides come from one projection of the input."""

    def __init__(self, cfg: DFlash2Config) -> None:
        super().__init__()
        self.block_size, self.taps, self.groups = cfg.block_size, cfg.conv_kernel_size, cfg.conv_groups
        self.base_kernel = nn.Parameter(torch.zeros(2, self.taps, cfg.hidden_size))   # [side, tap, channel]
        self.kernel_projection = nn.Linear(cfg.hidden_size, 2 * self.taps * self.groups, bias=False)
        self.reset_identity()

    @torch.no_grad()
    def reset_identity(self) -> None:
        """The identity convolution: base tap 0 = 1, the rest and the dynamic part 0 (a fresh DFlash 2 layer
        computes what the DFlash layer it wraps computes; training moves it from there)."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def prepare(self, h_QD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        coef = self.kernel_projection(h_QD).view(h_QD.shape[0], 2, self.taps, self.groups)
        return grouped_block_conv(h_QD, coef[:, 0], self.base_kernel[0], block_size=self.block_size), coef[:, 1]

    def finish(self, y_QD: torch.Tensor, coef_QPG: torch.Tensor) -> torch.Tensor:
        return grouped_block_conv(y_QD, coef_QPG, self.base_kernel[1], block_size=self.block_size)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    def __init__(self, cfg: DFlash2Config, *args, **kwargs) -> None:
        super().__init__(cfg, *args, **kwargs)
        self.attention_conv = GroupedDynamicConv(cfg)
        self.mlp_conv = GroupedDynamicConv(cfg)

    def forward(self, x_QD, ctx_TD, *, rope_q, rope_k, attend):
        h_QD, coef = self.attention_conv.prepare(self.input_layernorm(x_QD))
        a_QD = self.self_attn(h_QD, ctx_TD, rope_q=rope_q, rope_k=rope_k, attend=attend)
        x_QD = x_QD + self.attention_conv.finish(a_QD, coef)
        h_QD, coef = self.mlp_conv.prepare(self.post_attention_layernorm(x_QD))
        return x_QD + self.mlp_conv.finish(self.mlp(h_QD), coef)


# ----------------------------------------------------------------------------------------------- selector

class CandidateSelector(nn.Module):
    def __init__(self, cfg: DFlash2Config) -> None:
        super().__init__()
        self.top_k = cfg.selector_top_k
        self.output_multiplier = cfg.output_multiplier
        self.softcap = cfg.final_logit_softcapping
        self.predecessor_codebook = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.selector_rank))
        self.successor_codebook = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.selector_rank))
        self.hidden_projection = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)

    def unary(self, logits: torch.Tensor) -> torch.Tensor:
        """The candidates' unary scores from their LM-head logits (float32)."""
        u = logits.float() * self.output_multiplier
        if self.softcap is not None:
            u = torch.tanh(u / self.softcap) * self.softcap
        return u

    def edge_scores(self, *, unary_nk: torch.Tensor, cand_nk: torch.Tensor, pred_n: torch.Tensor,
                    proj_nr: torch.Tensor) -> torch.Tensor:
        """S(pred, cand) = unary + <A[pred] * proj, Bc[cand]> per row (float32 [n, k]); proj_nr is
        hidden_projection of the row's drafter output."""
        gated_nr = self.predecessor_codebook[pred_n].float() * proj_nr.float()
        return unary_nk.float() + torch.einsum("nr,nkr->nk", gated_nr, self.successor_codebook[cand_nk].float())


def top_candidates(out_ND: torch.Tensor, lm_head_VD: torch.Tensor, k: int, *,
                   rows_per_chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int64 [N, k], logits [N, k]) of the LM head's top k per row, sorted by logit; chunked over rows so at
    most rows_per_chunk x V logits exist at once. The head matmul runs in out_ND's dtype."""
    head = lm_head_VD.to(device=out_ND.device, dtype=out_ND.dtype)
    ids, vals = [], []
    for i in range(0, out_ND.shape[0], rows_per_chunk):
        v, c = torch.topk(out_ND[i:i + rows_per_chunk] @ head.T, k, dim=-1)
        ids.append(c)
        vals.append(v)
    if not ids:
        return out_ND.new_zeros((0, k), dtype=torch.long), out_ND.new_zeros((0, k))
    return torch.cat(ids), torch.cat(vals)


def walk_path(scores_fn, *, cand_JWk: torch.Tensor, anchor_J: torch.Tensor) -> torch.Tensor:
    """The greedy walk: d_0 = the anchor, d_t = cand_t[argmax_b S_t(d_{t-1}, b)] (argmax: the first maximum).
    scores_fn(t, pred_J) -> float [J, k] gives S_t(pred, .) for slot t. Returns int64 [J, W]."""
    pred_J, path = anchor_J.long(), []
    for t in range(cand_JWk.shape[1]):
        idx_J = scores_fn(t, pred_J).argmax(dim=-1)
        pred_J = cand_JWk[:, t].gather(1, idx_J[:, None]).squeeze(1)
        path.append(pred_J)
    if not path:
        return cand_JWk.new_zeros((cand_JWk.shape[0], 0))
    return torch.stack(path, dim=1)


class DFlash2Drafter(DFlashDrafter):
    """Trainable part of a DFlash 2 drafter; parameter names are those SGLang and vLLM load."""

    decoder_layer_cls = DFlash2DecoderLayer

    def __init__(self, cfg: DFlash2Config) -> None:
        super().__init__(cfg)
        self.candidate_selector = CandidateSelector(cfg)
        self.reset_parameters()  # again, now with the selector: the whole init is one seeded pass

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """DFlash's init for the backbone, the identity convolution, normal(0, std) codebooks: the bilinear term
        starts near 0, so a fresh selector walks (almost) the per-slot argmax."""
        super().reset_parameters(std)
        for m in self.modules():
            if isinstance(m, GroupedDynamicConv):
                m.reset_identity()
        selector = getattr(self, "candidate_selector", None)  # None inside DFlashDrafter.__init__
        if selector is not None:
            selector.predecessor_codebook.normal_(0.0, std)
            selector.successor_codebook.normal_(0.0, std)

    @torch.no_grad()
    def draft_tokens(self, out_JBD: torch.Tensor, *, anchor_ids_J: torch.Tensor, lm_head_VD: torch.Tensor,
                     rows_per_chunk: int = 1024) -> torch.Tensor:
        """The selector's path through each block's drafted slots (int64 [J, B-1]): what greedy speculative
        decoding with this drafter proposes, the drafts exact tau checks (eval.batched, eval.live)."""
        J, B, D = out_JBD.shape
        out_ND = out_JBD[:, 1:].reshape(J * (B - 1), D)
        sel = self.candidate_selector
        cand_Nk, logits_Nk = top_candidates(out_ND, lm_head_VD, sel.top_k, rows_per_chunk=rows_per_chunk)
        unary_JWk = sel.unary(logits_Nk).view(J, B - 1, -1)
        cand_JWk = cand_Nk.view(J, B - 1, -1)
        proj_JWr = sel.hidden_projection(out_ND.to(sel.hidden_projection.weight.dtype)).view(J, B - 1, -1)
        return walk_path(lambda t, pred: sel.edge_scores(unary_nk=unary_JWk[:, t], cand_nk=cand_JWk[:, t],
                                                         pred_n=pred, proj_nr=proj_JWr[:, t]),
                         cand_JWk=cand_JWk, anchor_J=anchor_ids_J)
