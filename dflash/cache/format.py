"""What a cache is: format name and version, storage dtypes, the fingerprint, and the hidden-state encodings.

Shapes: T = packed tokens, K = taps, D = hidden size.

Two storage dtypes. `bf16` stores the bf16 bits as uint16 so plain zarr (which has no bfloat16) reads them.
`fp8` stores float8_e4m3fn bits as uint8 plus one float32 scale per token and tap (amax/448): 4 bytes per
D-vector (0.08% at D=5120) buys a per-row range, so outlier tokens do not crush the precision of the rest.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import torch

from dflash.errors import CacheMismatchError, ConfigError

FORMAT_NAME = "dflash-hidden-cache"
FORMAT_VERSION = 1
STORAGE_DTYPES = ("bf16", "fp8")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# numpy dtype of the stored hidden bits per storage dtype
STORED_NUMPY_DTYPE = {"bf16": "uint16", "fp8": "uint8"}
STORED_TORCH_DTYPE = {"bf16": torch.uint16, "fp8": torch.uint8}
STORED_ITEMSIZE = {"bf16": 2, "fp8": 1}
"""Bytes per stored hidden element."""
SCALE_ITEMSIZE = 4
"""fp8 scales are float32, one per token and tap."""
TOKEN_BYTES = 4 + 1
"""Per token outside hidden/scales: input_ids int32 + loss_mask uint8."""
SAMPLE_ROW_BYTES = 4 * 8
"""One row of a shard's `samples` array: (sample id, offset, length, loss tokens) as int64."""
DEFAULT_CHUNK_BYTES = 1 << 19
"""CacheWriter's target bytes of one (tokens, 1 tap, D) hidden chunk (512 KB: benchmarks/results/cache_*.json)."""
DEFAULT_BLOCK_BYTES = 1 << 23
"""CacheWriter's per-tap bytes of one streamed block."""

# Quantize in row blocks so a large CPU batch does not need a full float32 copy at once.
_QUANT_BLOCK_TOKENS = 4096


@dataclass(frozen=True, kw_only=True)
class Fingerprint:
    """Everything that decides whether a resume or an append to an existing cache is allowed."""

    target: str
    """Model path or hub name as given."""
    target_config_hash: str
    """sha256 of the target config.json (canonical json)."""
    num_target_layers: int
    """Decoder layers of the target."""
    hidden_size: int
    """Hidden size D of the target."""
    target_dtype: str
    """Dtype the target ran in, e.g. "bfloat16"."""
    tokenizer_hash: str
    """Hash of the tokenizer files."""
    chat_template_hash: str
    """Hash of the chat template."""
    tap_layer_ids: tuple[int, ...]
    """Ascending decoder-layer ids whose outputs are cached (HF hidden_states[id+1])."""
    storage: str
    """Storage dtype: "bf16" or "fp8"."""
    sources: tuple[dict, ...] = ()
    """Data sources in order: [{"path": ..., "sha256": ...}, ...]."""
    max_length: int = 0
    """Longest sample in tokens."""
    template_kwargs: dict = dataclasses.field(default_factory=dict)
    """Chat-template kwargs, e.g. {"enable_thinking": False}."""
    target_greedy: bool = False
    """Responses are the target's greedy outputs (dflash generate)."""
    target_weights_hash: str = ""
    """sha256 over the target's weight files (dflash.target.identity.target_weights_hash): weights replaced in
    place under the same config.json are another target. "" = unknown: caches written before this field (format
    version 1 all the same: readers ignore it), or a target without local weight files."""

    def __post_init__(self) -> None:
        if self.storage not in STORAGE_DTYPES:
            raise ConfigError(f"storage={self.storage!r} is not one of {STORAGE_DTYPES}")
        taps = tuple(int(t) for t in self.tap_layer_ids)
        if not taps or list(taps) != sorted(set(taps)):
            raise ConfigError(f"tap_layer_ids={taps!r} must be non-empty, ascending and unique")
        object.__setattr__(self, "tap_layer_ids", taps)
        object.__setattr__(self, "sources", tuple(dict(s) for s in self.sources))
        if self.hidden_size <= 0:
            raise ConfigError(f"hidden_size={self.hidden_size} must be positive")

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["tap_layer_ids"] = list(self.tap_layer_ids)
        d["sources"] = [dict(s) for s in self.sources]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Fingerprint:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"unknown fingerprint fields {sorted(unknown)}: written by a newer dflash?")
        d = dict(d)
        d["tap_layer_ids"] = tuple(d.get("tap_layer_ids", ()))
        d["sources"] = tuple(d.get("sources", ()))
        return cls(**d)

    def check_matches(self, other: Fingerprint) -> None:
        """Raise CacheMismatchError naming the first field where `other` (this run) differs from self (cache)."""
        mine, theirs = self.to_json(), other.to_json()
        for f in dataclasses.fields(self):
            a, b = _canonical(mine[f.name]), _canonical(theirs[f.name])
            if a != b:
                raise CacheMismatchError(
                    f.name, theirs[f.name], mine[f.name],
                    hint="write to a new cache directory, or rerun with the settings the cache was made with")


def _canonical(v: Any) -> str:
    return json.dumps(v, sort_keys=True)


def quantize_fp8(hidden_TKD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Any float dtype, any device -> (uint8 bits of float8_e4m3fn [T,K,D], float32 scales [T,K] = amax/448).

    A row of zeros gets scale 0 and zero bits (we divide by 1 there, never by 0)."""
    if not hidden_TKD.is_floating_point():
        raise ConfigError(f"quantize_fp8 needs a float tensor, got {hidden_TKD.dtype}")
    T = hidden_TKD.shape[0]
    bits = torch.empty(hidden_TKD.shape, dtype=torch.uint8, device=hidden_TKD.device)
    scales = torch.empty(hidden_TKD.shape[:-1], dtype=torch.float32, device=hidden_TKD.device)
    for t0 in range(0, T, _QUANT_BLOCK_TOKENS):
        x = hidden_TKD[t0:t0 + _QUANT_BLOCK_TOKENS].float()
        s = x.abs().amax(dim=-1) / FP8_MAX
        safe = torch.where(s > 0, s, torch.ones_like(s))
        # clamp: x/s can round to a hair above 448, and e4m3fn has no inf to saturate to
        q = (x / safe.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        bits[t0:t0 + _QUANT_BLOCK_TOKENS] = q.view(torch.uint8)
        scales[t0:t0 + _QUANT_BLOCK_TOKENS] = s
    return bits, scales


def dequantize_fp8(bits_TKD: torch.Tensor, scales_TK: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """uint8 e4m3 bits [T,K,D] and float32 scales [T,K] -> `dtype` values [T,K,D]."""
    x = bits_TKD.view(torch.float8_e4m3fn).to(torch.float32)
    return (x * scales_TK.to(torch.float32).unsqueeze(-1)).to(dtype)


def encode_hidden(hidden_TKD: torch.Tensor, storage: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """bf16: (uint16 view of the bf16 bits, None); fp8: quantize_fp8. Works on any device."""
    if storage == "bf16":
        return hidden_TKD.to(torch.bfloat16).contiguous().view(torch.uint16), None
    if storage == "fp8":
        return quantize_fp8(hidden_TKD)
    raise ConfigError(f"storage={storage!r} is not one of {STORAGE_DTYPES}")


def decode_bf16(bits_TKD: torch.Tensor) -> torch.Tensor:
    """uint16 bits -> bfloat16 view (no copy)."""
    return bits_TKD.view(torch.bfloat16)


def choose_chunk_tokens(*, hidden_size: int, itemsize: int, chunk_bytes: int, max_tokens: int = 128) -> int:
    """Tokens per (token, 1 tap, D) chunk: the largest power of two whose chunk is <= chunk_bytes, at most
    max_tokens.

    A chunk is the read and checksum unit: bigger means fewer syscalls and crc calls, smaller means less
    read amplification at sample edges (a sample wastes about one chunk per tap). The token cap matters for
    small hidden sizes only (27B's 5120: 32 tokens bf16, 64 fp8 by bytes): SmolLM2's 576 got 256/512-token
    chunks, and ~300-token ShareGPT samples read 1.85x (bf16) / 2.72x (fp8) the bytes they hold; at 128
    tokens 1.43x / 1.45x, with no slower warm reads (64 tokens: 1.21x, but fp8 warm reads 45% slower)."""
    per_token = hidden_size * itemsize
    t = 1
    while t * 2 * per_token <= chunk_bytes and t * 2 <= max_tokens:
        t *= 2
    return t


def hidden_chunk_tokens(*, hidden_size: int, storage: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Tokens per hidden chunk as CacheWriter chooses them for this hidden size and storage dtype."""
    return choose_chunk_tokens(hidden_size=hidden_size, itemsize=STORED_ITEMSIZE[storage], chunk_bytes=chunk_bytes)
