"""What a cache is: format name and version, storage dtypes, the fingerprint, and the hidden-state encodings.

Shapes: T = packed tokens, K = taps, D = hidden size.

Storage dtypes. `bf16` stores the bf16 bits as uint16 so plain zarr (which has no bfloat16) reads them.
`fp8` stores float8_e4m3fn bits as uint8 plus one float32 scale per token and tap (amax/448): 4 bytes per
D-vector (0.08% at D=5120) buys a per-row range, so outlier tokens do not crush the precision of the rest.
4-bit formats (dflash.cache.quant4, docs/CACHE_FORMAT_4BIT.md) store two codes per byte in `hidden`
[T, K, D/2], per-group scales in `group_scales` [T, K, G] and, for e4m3 group scales, a float32 row scale per
token and tap in `scales` [T, K]. `--storage int4` names DEFAULT_QUANT4, the format the 4-bit probe chose
(13,625 B/token on the 27B shape, 0.266x bf16); the manifest and fingerprint record the full format name.
StoredLayout is the one description of a storage dtype's arrays that writer, reader, verify and space use.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dflash.cache import quant4
from dflash.errors import CacheMismatchError, ConfigError, DataError

FORMAT_NAME = "dflash-hidden-cache"
FORMAT_VERSION = 1
STORAGE_DTYPES = ("bf16", "fp8", "int4")
"""The names `--storage` lists; "int4" is DEFAULT_QUANT4, and every quant4 format name is accepted too."""
DEFAULT_QUANT4 = "int4-g32-e4m3-h32"
"""The 4-bit layout of `--storage int4`: int4 codes, groups of 32 channels, e4m3 group scales x a float32 row
scale, block Hadamard over 32 channels (benchmarks/results/quant_probe_cpu.json: median relative L2 0.082 vs
fp8's 0.022)."""
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# numpy dtype of the stored hidden bits per storage dtype (4-bit: StoredLayout)
STORED_NUMPY_DTYPE = {"bf16": "uint16", "fp8": "uint8"}
STORED_TORCH_DTYPE = {"bf16": torch.uint16, "fp8": torch.uint8}
STORED_ITEMSIZE = {"bf16": 2, "fp8": 1}
"""Bytes per stored hidden element (4-bit: StoredLayout)."""
SCALE_ITEMSIZE = 4
"""fp8 scales are float32, one per token and tap."""
TOKEN_BYTES = 4 + 1
"""Per token outside hidden/scales: input_ids int32 + loss_mask uint8."""
SAMPLE_ROW_BYTES = 4 * 8
"""One row of a shard's `samples` array: (sample id, offset, length, loss tokens) as int64."""
DEFAULT_CHUNK_BYTES = 1 << 19
"""CacheWriter's target bytes of one (tokens, 1 tap, D) hidden chunk (512 KB: benchmarks/results/cache_*.json)."""
DEFAULT_BLOCK_BYTES = 1 << 25
"""CacheWriter's per-tap bytes of one streamed block: the longest contiguous run of one tap in a shard file, so
a sample's tap is 1 + length/block_tokens reads. 32 MB (6,528 tokens at the 27B's fp8 5120 B/token): a
ShareGPT-length sample's tap is then ~1.2 ranged GETs of ~5.6 MB on an object store, against ~2 of ~3.2 MB
at 8 MB; on the SeaweedFS of the tests a request costs ~1 MB of payload time (a 70K-token profile at load ~6:
direct reads 0.81x a plain 8 MB-part GET, against 0.53-0.65x with 8 MB blocks; bench_store's JSON has the
benchmark's own figure). Writer memory: two blocks, 2 x taps x 32 MB (320 MB at 5 fp8 taps)."""

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
    """Storage dtype: "bf16", "fp8" or a 4-bit format name ("int4" is stored as DEFAULT_QUANT4's full name)."""
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
        object.__setattr__(self, "storage", resolve_storage(self.storage))
        taps = tuple(int(t) for t in self.tap_layer_ids)
        if not taps or list(taps) != sorted(set(taps)):
            raise ConfigError(f"tap_layer_ids={taps!r} must be non-empty, ascending and unique")
        object.__setattr__(self, "tap_layer_ids", taps)
        object.__setattr__(self, "sources", tuple(dict(s) for s in self.sources))
        if self.hidden_size <= 0:
            raise ConfigError(f"hidden_size={self.hidden_size} must be positive")
        stored_layout(self.storage, self.hidden_size)  # 4-bit: ConfigError unless D fits the format

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


def resolve_storage(storage: str) -> str:
    """A `--storage` value -> the name the manifest records: "bf16", "fp8", or a 4-bit format's full name
    ("int4" -> DEFAULT_QUANT4). ConfigError listing the choices otherwise."""
    if storage in ("bf16", "fp8"):
        return storage
    if storage == "int4":
        return DEFAULT_QUANT4
    if isinstance(storage, str) and quant4.is_quant4(storage):
        return quant4.parse_quant4(storage).name
    raise ConfigError(f"storage={storage!r} is not one of {STORAGE_DTYPES} (int4 = {DEFAULT_QUANT4}) nor a 4-bit "
                      "format name ELEMENT-gGROUP-SCALE[-hR] such as int4-g64-bf16-h64 (dflash.cache.quant4)")


@dataclass(frozen=True, kw_only=True)
class StoredLayout:
    """The arrays one storage dtype keeps per shard besides input_ids/loss_mask/samples."""

    storage: str
    """Resolved storage name."""
    hidden_size: int
    """D of the features (not of the stored array)."""
    hidden_dtype: str
    """numpy dtype of `hidden`: uint16 (bf16 bits) or uint8 (fp8 bits, 4-bit code pairs)."""
    hidden_width: int
    """Last dim of `hidden` [T, K, W]: D, or D/2 for two 4-bit codes per byte."""
    group_dtype: str | None
    """numpy dtype of `group_scales` [T, K, G] (4-bit only), else None."""
    group_width: int
    """G, the groups per (token, tap); 0 = no group_scales array."""
    has_scales: bool
    """A float32 `scales` [T, K] array exists (fp8, and 4-bit with e4m3 group scales)."""

    @property
    def quant4(self) -> quant4.Quant4Format | None:
        return quant4.parse_quant4(self.storage) if self.group_width else None

    @property
    def hidden_torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.hidden_dtype)

    @property
    def group_torch_dtype(self) -> torch.dtype | None:
        return getattr(torch, self.group_dtype) if self.group_dtype else None

    @property
    def array_names(self) -> list[str]:
        return (["hidden", "input_ids", "loss_mask", "samples"] + (["scales"] if self.has_scales else [])
                + (["group_scales"] if self.group_width else []))

    def hidden_bytes_per_token(self, num_taps: int) -> int:
        """Bytes of hidden + scales + group_scales per token (the storage cost; TOKEN_BYTES come on top)."""
        per_tap = (self.hidden_width * np.dtype(self.hidden_dtype).itemsize + (SCALE_ITEMSIZE if self.has_scales else 0)
                   + (self.group_width * np.dtype(self.group_dtype).itemsize if self.group_width else 0))
        return num_taps * per_tap


@functools.lru_cache(maxsize=64)
def stored_layout(storage: str, hidden_size: int) -> StoredLayout:
    """The layout of `storage` for features of size D; ConfigError for an unknown storage or a D the 4-bit
    format cannot pack (odd, or not divisible by its rotation block)."""
    storage = resolve_storage(storage)
    if storage in STORED_NUMPY_DTYPE:
        return StoredLayout(storage=storage, hidden_size=hidden_size, hidden_dtype=STORED_NUMPY_DTYPE[storage],
                            hidden_width=hidden_size, group_dtype=None, group_width=0, has_scales=storage == "fp8")
    arrays = quant4.stored_arrays(quant4.parse_quant4(storage), num_taps=1, hidden_size=hidden_size)
    (hdt, (_, width)), (gdt, (_, groups)) = arrays["hidden"], arrays["group_scales"]
    return StoredLayout(storage=storage, hidden_size=hidden_size, hidden_dtype=hdt, hidden_width=width,
                        group_dtype=gdt, group_width=groups, has_scales="scales" in arrays)


def non_finite_mask(storage: str, array: str, stored: np.ndarray) -> np.ndarray | None:
    """Which of a shard array's stored elements decode to nan or inf (bool, stored's shape): bf16 bits with an
    all-ones exponent, e4m3 NaN bytes (S.1111.111), float32 scales, and the 4-bit formats' group-scale NaN marks
    (their codes have no non-finite value); None for the arrays that hold no features (ids, masks, samples)."""
    def bf16_bits(v: np.ndarray) -> np.ndarray:
        return (v.view(np.uint16) & 0x7F80) == 0x7F80

    def e4m3_bytes(v: np.ndarray) -> np.ndarray:
        return (v.view(np.uint8) & 0x7F) == quant4.E4M3_NAN

    if array == "scales":   # fp8's per-row scales, and the row scales of a 4-bit e4m3 format: float32
        return ~np.isfinite(stored.view(np.float32))
    storage = resolve_storage(storage)
    if storage == "bf16":
        return bf16_bits(stored) if array == "hidden" else None
    if storage == "fp8":
        return e4m3_bytes(stored) if array == "hidden" else None
    if array != "group_scales":
        return None
    scale = quant4.parse_quant4(storage).scale
    if scale == "bf16":
        return bf16_bits(stored)
    if scale == "e8m0":
        return stored.view(np.uint8) == quant4.E8M0_NAN
    return e4m3_bytes(stored)


def non_finite_values(storage: str, array: str, stored: np.ndarray) -> int:
    """How many of a shard array's stored elements decode to nan or inf (`dflash cache verify`; non_finite_mask)."""
    bad = non_finite_mask(storage, array, stored)
    return 0 if bad is None else int(np.count_nonzero(bad))


def storage_description(storage: str) -> str:
    """One line for `dflash cache info`: what the stored bytes are."""
    storage = resolve_storage(storage)
    if storage == "bf16":
        return "bfloat16 bits (exact)"
    if storage == "fp8":
        return "float8 e4m3 + a float32 scale per token and tap"
    f = quant4.parse_quant4(storage)
    element = {"int4": "int4 codes (-7..7)", "e2m1": "e2m1 (FP4) codes"}[f.element]
    scale = {"bf16": "bf16 group scales", "e8m0": "e8m0 (power of two) group scales",
             "e4m3": "e4m3 group scales x a float32 row scale"}[f.scale]
    rot = f", Hadamard rotation over {f.rotate} channels" if f.rotate else ""
    return f"4-bit {element}, groups of {f.group_size} channels, {scale}{rot}"


@dataclass(frozen=True, kw_only=True)
class EncodedHidden:
    """The stored arrays of a batch (on the device of the input), as StoredLayout names them."""

    hidden: torch.Tensor
    """[T, K, W] uint16 bf16 bits, uint8 fp8 bits, or uint8 4-bit code pairs."""
    scales: torch.Tensor | None = None
    """float32 [T, K]: fp8 amax/448, or the 4-bit e4m3 row scale; else None."""
    group_scales: torch.Tensor | None = None
    """[T, K, G] 4-bit group scales; else None."""


def encode_stored(hidden_TKD: torch.Tensor, storage: str, *, check_finite: bool = True) -> EncodedHidden:
    """Float features [T, K, D], any device -> the arrays `storage` stores. check_finite (4-bit): raise
    DataError on NaN/Inf here (a device sync); False leaves it to check_stored_finite on the host copy."""
    storage = resolve_storage(storage)
    if storage == "bf16":
        return EncodedHidden(hidden=hidden_TKD.to(torch.bfloat16).contiguous().view(torch.uint16))
    if storage == "fp8":
        bits, scales = quantize_fp8(hidden_TKD)
        return EncodedHidden(hidden=bits, scales=scales)
    q = quant4.encode(hidden_TKD, fmt=quant4.parse_quant4(storage), check_finite=check_finite)
    return EncodedHidden(hidden=q.codes, scales=q.row_scales, group_scales=q.group_scales)


def bf16_all_finite(bits: np.ndarray) -> bool:
    """No element of these bf16 bits has an all-ones exponent (non_finite_mask's rule), in two max reductions
    and no temporary: as int16, +nan/+inf are 0x7F80-0x7FFF, above every positive finite value; as uint16,
    -nan/-inf are 0xFF80-0xFFFF, above every negative one."""
    return (int(bits.view(np.int16).max(initial=-32768)) < 0x7F80
            and int(bits.view(np.uint16).max(initial=0)) < 0xFF80)


def check_stored_finite(layout: StoredLayout, hidden: np.ndarray, scales: np.ndarray | None,
                        group_scales: np.ndarray | None) -> None:
    """DataError (one line, naming the first bad place) when a batch's stored arrays (host copies) hold NaN/Inf
    features, so none is ever written: 4-bit, the encoder's NaN marks in the group scales; fp8, the row scales
    (amax/448 is nan or inf exactly when its row holds one); bf16, the bits themselves (bf16_all_finite: ~70 ms
    per GB on one core, which is why the cache writer's thread runs it)."""
    fmt = layout.quant4
    if fmt is not None:
        quant4.raise_if_nonfinite(group_scales=torch.from_numpy(group_scales),
                                  row_scales=None if scales is None else torch.from_numpy(scales), fmt=fmt)
        return
    if layout.storage == "fp8":
        bad, what = non_finite_mask("fp8", "scales", scales), "token-tap row(s)"
    else:
        if bf16_all_finite(hidden):
            return
        bad, what = non_finite_mask("bf16", "hidden", hidden), "value(s)"
    n = int(np.count_nonzero(bad))
    if n:
        first = np.unravel_index(int(np.argmax(bad)), bad.shape)
        channel = f", channel {int(first[2])}" if len(first) == 3 else ""
        raise DataError(f"hidden states hold NaN/Inf in {n} {what} (first: packed token {int(first[0])}, tap index "
                        f"{int(first[1])}{channel}); storage {layout.storage} refuses non-finite features. "
                        f"{quant4.NON_FINITE_HINT}")


def encode_hidden(hidden_TKD: torch.Tensor, storage: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """bf16: (uint16 view of the bf16 bits, None); fp8: quantize_fp8. Works on any device. A 4-bit format has
    three arrays: use encode_stored."""
    if resolve_storage(storage) not in ("bf16", "fp8"):
        raise ConfigError(f"encode_hidden returns (bits, scales): storage {storage!r} has group scales too; "
                          "use encode_stored")
    enc = encode_stored(hidden_TKD, storage)
    return enc.hidden, enc.scales


def decode_stored(hidden: torch.Tensor, scales: torch.Tensor | None = None, group_scales: torch.Tensor | None = None,
                  *, storage: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Stored arrays (any device: the loader calls it on the GPU) -> `dtype` features [T, K, D]."""
    storage = resolve_storage(storage)
    if storage == "bf16":
        return hidden.view(torch.bfloat16).to(dtype)
    if storage == "fp8":
        if scales is None:
            raise ConfigError("fp8 bits need their float32 scales")
        return dequantize_fp8(hidden, scales, dtype=dtype)
    if group_scales is None:
        raise ConfigError(f"storage {storage}: 4-bit codes need their group scales")
    return quant4.decode(hidden, group_scales, scales, fmt=quant4.parse_quant4(storage), dtype=dtype)


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
    layout = stored_layout(storage, hidden_size)
    return choose_chunk_tokens(hidden_size=layout.hidden_width, itemsize=np.dtype(layout.hidden_dtype).itemsize,
                               chunk_bytes=chunk_bytes)
