"""DrafterConfig: the shape of a DFlash drafter and its published config.json schema.

The fields mirror the z-lab `DFlashDraftModel` config (a Qwen3 config plus `block_size`, `num_target_layers`
and `dflash_config`), so `to_hf_config()` writes a config.json that SGLang / vLLM / z-lab code load, and
`from_hf_config()` reads the published drafters (e.g. z-lab/Qwen3-8B-DFlash-b16, Qwen3.5-27B-DFlash, and
SpecForge's qwen3.6-27b-dflash: 4 sliding-window layers of 2,048 + 1 full).
Per-layer attention follows the engines: `layer_types` names each layer full_attention or sliding_attention
(window `sliding_window`, counting the query's own slot), and a sliding layer is causal inside the block, a full
one bidirectional (SGLang: sliding layers run as decoder attention, full ones as encoder-only; SpecForge's
training mask; vLLM's default), unless `causal` (config.json dflash_config.causal, which vLLM reads) sets every
layer's causality. Tradeoff: SGLang decides causality by layer type alone, so a drafter trained with `causal` set
against that rule serves as trained in vLLM only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dflash.errors import ConfigError

ARCHITECTURE = "DFlashDraftModel"
AUTO_MAP = {"AutoModel": "dflash.DFlashDraftModel"}
SUPPORTED_ACTS = ("silu",)
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
"""The values of DrafterConfig.layer_types (Hugging Face's names, as in config.json)."""


@dataclass(frozen=True)
class LayerAttention:
    """How one draft layer's block queries attend (DrafterConfig.layer_attention gives it per layer)."""

    window: int | None = None
    """Sliding window W (keys at positions > query position - W); None = no window (full_attention)."""
    causal: bool = False
    """Slot k sees only slots k' <= k of its own block; False = bidirectional within the block (the paper)."""

    def __post_init__(self) -> None:
        if self.window is not None and (not isinstance(self.window, int) or self.window < 1):
            raise ConfigError(f"sliding window {self.window!r}: must be a positive integer number of tokens")

    @property
    def is_full(self) -> bool:
        """The paper's attention: no window, bidirectional within the block."""
        return self.window is None and not self.causal


@dataclass(frozen=True, kw_only=True)
class DrafterConfig:
    hidden_size: int
    """Width of the residual stream; must equal the target's hidden size (the frozen embedding and LM head
    of the target are applied to the drafter's input and output)."""

    intermediate_size: int
    """SwiGLU MLP inner width (Qwen3-8B drafter 12288, Qwen3.5-27B drafter 17408)."""

    target_layer_ids: tuple[int, ...]
    """Target decoder layers whose outputs (HF hidden_states[id+1]) are concatenated, in this order, as the
    drafter's context input; z-lab picks 5 evenly spaced from 1 to L-3."""

    num_target_layers: int
    """Number of decoder layers of the target model (36 for Qwen3-8B, 64 for Qwen3.5-27B)."""

    mask_token_id: int
    """Token id whose frozen target embedding fills block slots 1..B-1 (151669 Qwen3, 248070 Qwen3.5)."""

    vocab_size: int
    """Target vocabulary size (rows of the frozen embedding and LM head)."""

    max_position_embeddings: int = 262144
    """Largest position the drafter is meant to see (informational for loaders; RoPE is computed on the fly)."""

    num_hidden_layers: int = 5
    """Number of draft decoder layers (5 in the paper; 8 for Qwen3-Coder-30B-A3B)."""

    num_attention_heads: int = 32
    """Query heads per draft layer."""

    num_key_value_heads: int = 8
    """Key/value heads per draft layer (GQA); must divide num_attention_heads."""

    head_dim: int = 128
    """Per-head width; RoPE rotates the full head_dim (not the target's partial RoPE)."""

    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm (hidden_norm, q/k norms, layer norms, final norm)."""

    rope_theta: float = 1e7
    """RoPE base of the drafter: 1e7 for Qwen3.5 drafters, 1e6 for Qwen3 drafters."""

    block_size: int = 16
    """Tokens per draft block B: the anchor plus B-1 mask slots predicted in one forward."""

    hidden_act: str = "silu"
    """MLP activation; only silu (SwiGLU) is implemented."""

    layer_types: tuple[str, ...] | None = None
    """Attention of each draft layer, full_attention or sliding_attention (SpecForge's qwen3.6-27b-dflash: 4
    sliding + 1 full); None = all full_attention (the paper). Normalised to a tuple of num_hidden_layers."""

    sliding_window: int | None = None
    """Window W of the sliding_attention layers, in tokens including the query's own slot: the query at position
    p sees keys at positions > p - W (2048 in qwen3.6-27b-dflash). Required when a layer slides, else None."""

    causal: bool | None = None
    """Causality inside the block for every layer (config.json dflash_config.causal): True = slot k sees slots
    <= k of its block. None = by layer type: sliding layers causal, full layers bidirectional."""

    def __post_init__(self) -> None:
        positive = ("hidden_size", "intermediate_size", "num_target_layers", "vocab_size",
                    "max_position_embeddings", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"DrafterConfig.{name}={value!r}: must be a positive integer")
        if self.head_dim % 2:
            raise ConfigError(f"DrafterConfig.head_dim={self.head_dim}: must be even (RoPE rotates pairs)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"DrafterConfig.num_key_value_heads={self.num_key_value_heads}: must divide "
                f"num_attention_heads={self.num_attention_heads} (GQA groups)")
        if not isinstance(self.block_size, int) or self.block_size < 2:
            raise ConfigError(f"DrafterConfig.block_size={self.block_size!r}: must be an integer >= 2 "
                              "(the anchor plus at least one predicted slot); the paper uses 16")
        if not (self.rms_norm_eps > 0):
            raise ConfigError(f"DrafterConfig.rms_norm_eps={self.rms_norm_eps!r}: must be > 0, e.g. 1e-6")
        if not (self.rope_theta > 0):
            raise ConfigError(f"DrafterConfig.rope_theta={self.rope_theta!r}: must be > 0 "
                              "(1e7 for Qwen3.5 drafters, 1e6 for Qwen3)")
        if self.hidden_act not in SUPPORTED_ACTS:
            raise ConfigError(f"DrafterConfig.hidden_act={self.hidden_act!r}: only {SUPPORTED_ACTS} is supported")
        ids = tuple(self.target_layer_ids)
        object.__setattr__(self, "target_layer_ids", ids)
        if not ids:
            raise ConfigError("DrafterConfig.target_layer_ids=(): give at least one target layer id, "
                              "e.g. the z-lab default of 5 evenly spaced layers")
        if len(set(ids)) != len(ids) or any(not isinstance(i, int) or i < 0 or i >= self.num_target_layers
                                            for i in ids):
            raise ConfigError(
                f"DrafterConfig.target_layer_ids={ids}: must be distinct integers in "
                f"[0, num_target_layers={self.num_target_layers})")
        if not isinstance(self.mask_token_id, int) or not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(
                f"DrafterConfig.mask_token_id={self.mask_token_id!r}: must be a token id in "
                f"[0, vocab_size={self.vocab_size}) so the target embedding has a row for it")
        types = check_layer_types(self.layer_types, num_layers=self.num_hidden_layers,
                                  sliding_window=self.sliding_window, where="DrafterConfig.")
        object.__setattr__(self, "layer_types", types)
        if self.causal is not None and not isinstance(self.causal, bool):
            raise ConfigError(f"DrafterConfig.causal={self.causal!r}: true, false, or unset (by layer type)")

    def layer_attention(self, i: int) -> LayerAttention:
        """How layer i's block queries attend: its window (sliding layers) and its in-block causality."""
        sliding = self.layer_types[i] == SLIDING_ATTENTION
        causal = self.causal if self.causal is not None else sliding
        return LayerAttention(window=self.sliding_window if sliding else None, causal=causal)

    @property
    def num_taps(self) -> int:
        """K: how many target layers are concatenated into the fc input."""
        return len(self.target_layer_ids)

    def to_json(self) -> dict[str, Any]:
        """Plain dict of the fields (for checkpoints and manifests)."""
        d = dataclasses.asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        d["layer_types"] = list(self.layer_types)
        return d

    def to_hf_config(self) -> dict[str, Any]:
        """The config.json of a published DFlash drafter (z-lab DFlashDraftModel, model_type qwen3)."""
        dflash = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
        if self.causal is not None:
            dflash["causal"] = self.causal
        sliding = SLIDING_ATTENTION in self.layer_types
        return {
            "architectures": [ARCHITECTURE],
            "auto_map": dict(AUTO_MAP),
            "model_type": "qwen3",
            "block_size": self.block_size,
            "dflash_config": dflash,
            "num_target_layers": self.num_target_layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "layer_types": list(self.layer_types),
            "max_window_layers": self.num_hidden_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": _json_number(self.rope_theta),
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "tie_word_embeddings": False,
            "use_cache": True,
            "use_sliding_window": sliding,
            "sliding_window": self.sliding_window,
            "vocab_size": self.vocab_size,
            "dtype": "bfloat16",
        }

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> "DrafterConfig":
        """Parse a drafter config.json dict; raises ConfigError naming the missing or unsupported field."""
        if not isinstance(hf, dict):
            raise ConfigError(f"drafter config must be a JSON object, got {type(hf).__name__}")
        archs = hf.get("architectures") or []
        if ARCHITECTURE not in archs:
            raise ConfigError(f"config.json architectures={archs!r}: not a DFlash drafter "
                              f"(expected {ARCHITECTURE!r})")
        dflash = hf.get("dflash_config")
        if not isinstance(dflash, dict):
            raise ConfigError("config.json has no 'dflash_config' object "
                              "(with mask_token_id and target_layer_ids): not a DFlash drafter")
        layer_types = hf.get("layer_types")
        if layer_types is None and (hf.get("use_sliding_window") or dflash.get("use_swa")):
            raise ConfigError("config.json enables sliding windows (use_sliding_window / dflash_config.use_swa) "
                              "without layer_types: engines disagree on which layers slide; give layer_types")
        if not isinstance(layer_types, (list, tuple, type(None))):
            raise ConfigError(f"config.json layer_types={layer_types!r}: must be a list of attention types")
        sliding = layer_types is not None and SLIDING_ATTENTION in layer_types
        window = dflash.get("swa_window_size", hf.get("sliding_window")) if sliding else None
        causal = dflash.get("causal")
        if causal is not None and not isinstance(causal, bool):
            raise ConfigError(f"config.json dflash_config.causal={causal!r}: must be true or false")
        if hf.get("attention_bias"):
            raise ConfigError("config.json attention_bias=true: not supported (published drafters have none)")
        if hf.get("rope_scaling"):
            raise ConfigError(f"config.json rope_scaling={hf['rope_scaling']!r}: only plain RoPE is supported")
        rope_theta = hf.get("rope_theta")
        if rope_theta is None and isinstance(hf.get("rope_parameters"), dict):
            rope_theta = hf["rope_parameters"].get("rope_theta")   # transformers 5 layout

        def need(d: dict, key: str, where: str = "") -> Any:
            if d.get(key) is None:
                raise ConfigError(f"config.json is missing {where}{key!r}, required for a DFlash drafter")
            return d[key]

        num_hidden_layers = need(hf, "num_hidden_layers")
        return cls(
            hidden_size=need(hf, "hidden_size"),
            intermediate_size=need(hf, "intermediate_size"),
            target_layer_ids=tuple(need(dflash, "target_layer_ids", "dflash_config.")),
            num_target_layers=need(hf, "num_target_layers"),
            mask_token_id=need(dflash, "mask_token_id", "dflash_config."),
            vocab_size=need(hf, "vocab_size"),
            max_position_embeddings=need(hf, "max_position_embeddings"),
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=need(hf, "num_attention_heads"),
            num_key_value_heads=need(hf, "num_key_value_heads"),
            head_dim=hf.get("head_dim") or need(hf, "hidden_size") // need(hf, "num_attention_heads"),
            rms_norm_eps=float(need(hf, "rms_norm_eps")),
            rope_theta=float(rope_theta if rope_theta is not None else need(hf, "rope_theta")),
            block_size=need(hf, "block_size"),
            hidden_act=hf.get("hidden_act", "silu"),
            layer_types=None if layer_types is None else tuple(layer_types),
            sliding_window=window,
            causal=causal,
        )


def check_layer_types(layer_types, *, num_layers: int, sliding_window, where: str = "") -> tuple[str, ...]:
    """The layer types as a tuple of num_layers (None = all full_attention), checked with the window; ConfigError
    naming `where` + the field otherwise. Shared by DrafterConfig and TrainConfig (checked before any work)."""
    types = (FULL_ATTENTION,) * num_layers if layer_types is None else tuple(layer_types)
    bad = sorted({t for t in types if t not in LAYER_TYPES}, key=str)
    if bad:
        raise ConfigError(f"{where}layer_types has {bad}: each layer is one of {', '.join(LAYER_TYPES)}")
    if len(types) != num_layers:
        raise ConfigError(f"{where}layer_types has {len(types)} entries for {num_layers} draft layers: give one "
                          "per layer")
    if SLIDING_ATTENTION in types:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            raise ConfigError(f"{where}sliding_window={sliding_window!r}: sliding_attention layers need a positive "
                              "window in tokens (qwen3.6-27b-dflash: 2048)")
    elif sliding_window is not None:
        raise ConfigError(f"{where}sliding_window={sliding_window!r} but no layer is sliding_attention: set "
                          "layer_types too, or drop the window")
    return types


def _json_number(x: float) -> float | int:
    # Published configs write rope_theta as an integer (1000000, 10000000); keep that form when exact.
    return int(x) if float(x).is_integer() else float(x)
