"""4-bit hidden-state storage: two 4-bit codes per byte plus one scale per group of channels.

Shapes: T = packed tokens, K = taps, D = hidden size (even), C = D/2 code bytes, G = groups = ceil(D/group_size),
R = rotation block (channels).

Why: fp8 is 25,625 B/token on the 27B shape (5 taps x 5120); 4 bits plus a scale per 32-128 channels is
12,800 + 200..1,600 B/token, under the bound of 14,340 B/token (0.28x bf16) a 4-bit format has to meet to be
worth its error. A per-group scale (not fp8's per-row one) keeps one massive-activation channel from crushing
the precision of the whole 5120-vector; the optional block Hadamard rotation spreads such an outlier over its
block before the grouping sees it.

A format is `Quant4Format(element, group_size, scale, rotate)`, named e.g. "e2m1-g32-e8m0" or
"int4-g64-bf16-h64" (parse_quant4 / Quant4Format.name), so a storage dtype string can carry it:
- element "int4": symmetric integers -7..7, scale = absmax/7, round to nearest (ties to even);
  element "e2m1": FP4 (OCP MXFP4 / NVFP4 element) values +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}, scale = absmax/6,
  round to the nearest grid value (a tie goes to the smaller magnitude).
- scale "bf16": the group scale itself in bf16; "e8m0": a power of two 2^(b-127) (MX style, one byte);
  "e4m3": an e4m3 byte times a float32 scale per token and tap (NVFP4 style two-level: e4m3 alone spans only
  2^-9..448, hidden states do not fit it, so the row scale row_absmax/(qmax*448) carries the range).
  Every scale is rounded UP to its encoding, so |x| <= qmax * scale: nothing is clipped and each element's
  error is at most half the grid step around it (times the scale). All-zero groups store scale 0 (e8m0: byte 0)
  and code 0, and decode to exact zeros.
- rotate R > 0: before grouping, each run of R channels is multiplied by the normalised Sylvester Hadamard
  matrix H_R (entries +-1/sqrt(R), H = H^T = H^-1); decode multiplies by H_R again. Cost per token and tap,
  as the dense [R x R] matmul the GPU runs: 2*R FLOPs per channel, i.e. 2*K*D*R per token (27B shape, R=128:
  6.6 MFLOP/token, about 1e-4 of the target forward's ~54 GFLOP/token); a fast Walsh-Hadamard transform
  would need K*D*log2(R) additions. R must be a power of two that divides D (5120 = 40 x 128).

NaN/Inf are refused at write (DataError). encode() also marks a non-finite group with a NaN scale (bf16 NaN,
e8m0 0xFF, e4m3 0x7F), so with check_finite=False (the writer checking the small host copy of the scales
later, with no device sync) a bad group can never decode to finite numbers.

How a plain zarr-python reader decodes the 4-bit arrays of a shard group (docs/CACHE_FORMAT_4BIT.md; tested by
tests/unit/test_quant4.py and test_quant4_cache.py with numpy only):
    hidden        uint8   [T, K, D/2]  byte c of a (token, tap) row holds channel 2c in its LOW nibble
                                       (b & 0x0F) and channel 2c+1 in its HIGH nibble (b >> 4)
    group_scales  uint16  [T, K, G]    scale "bf16": bf16 bits (float32 bits = b << 16)
                  uint8   [T, K, G]    scale "e8m0": value 2^(b - 127); 255 = NaN
                  uint8   [T, K, G]    scale "e4m3": float8 e4m3fn bits (sign, 4 exponent bits with bias 7,
                                       3 mantissa bits; exponent 0 is subnormal m/8 * 2^-6; 0x7F/0xFF NaN)
    scales        float32 [T, K]       scale "e4m3" only (the row scale): group scale = e4m3 value * scales[t, k]
    value(nibble n)  int4: n if n < 8 else n - 16;  e2m1: (-1 if n & 8 else 1) * [0,.5,1,1.5,2,3,4,6][n & 7]
    channel d of group g = d // group_size (the last group may be shorter when group_size does not divide D)
    y[t, k, d] = value(nibble) * group_scale[t, k, d // group_size]
    rotate R > 0: x[t, k, j*R:(j+1)*R] = y[t, k, j*R:(j+1)*R] @ H_R, with H_1 = [[1]],
                  H_2n = [[H_n, H_n], [H_n, -H_n]] / sqrt(2) (so H_R entries are +-1/sqrt(R)); else x = y.
The format name (storage dtype) in the manifest gives element, group_size, scale and R; stored_arrays() lists
the arrays with dtypes and per-token shapes. Chunk them like `hidden` (tokens x 1 tap x rest), crc32c on each.

Measured (benchmarks/results/quant_probe_cpu.json: real SmolLM2 taps over 100 ShareGPT
conversations, error against the bf16 features): the median per-token relative L2 of fp8 is 0.022; the best
4-bit format within 14,340 B/token is int4-g32-e4m3-h32 (13,625 B/token on the 27B shape, 0.266x bf16; 0.082,
mean cosine 0.9967). The rotation halves int4's error (0.169 without) and helps e2m1 less (0.120 -> 0.106), so
rotated int4 beats e2m1; power-of-two (e8m0) scales cost ~40% more error than e4m3/bf16 at equal bytes.
A format is accepted only by its held-out tau against bf16 on the GPU (docs/storage.md).
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from dflash.errors import ConfigError, DataError

ELEMENTS = ("int4", "e2m1")
SCALES = ("bf16", "e4m3", "e8m0")
QMAX = {"int4": 7.0, "e2m1": 6.0}  # largest magnitude of each element grid
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # OCP FP4 (E2M1): index = the low 3 bits
E4M3_MAX = 448.0
E8M0_BIAS = 127
E8M0_NAN = 255
E4M3_NAN = 0x7F
# input_ids int32 + loss_mask uint8, stored per token beside the hidden states by every storage dtype
TOKEN_ARRAY_BYTES = np.dtype(np.int32).itemsize + np.dtype(np.uint8).itemsize
_NAME_RE = re.compile(r"^(int4|e2m1)-g(\d+)-(bf16|e4m3|e8m0)(?:-h(\d+))?$")
# Rows per fp32 working block: a 16K-token batch of 5 x 5120 would need 1.7 GB per fp32 temporary at once.
_BLOCK_TOKENS = 4096


@dataclass(frozen=True, kw_only=True)
class Quant4Format:
    """One 4-bit storage format; `name` is its storage-dtype string."""

    element: str = "e2m1"
    """Element grid: "int4" (-7..7) or "e2m1" (FP4: +-0, 0.5, 1, 1.5, 2, 3, 4, 6)."""
    group_size: int = 32
    """Channels that share one scale; the last group is shorter when it does not divide D."""
    scale: str = "e8m0"
    """Group-scale encoding: "bf16", "e8m0" (power of two, 1 byte) or "e4m3" (1 byte + float32 per row)."""
    rotate: int = 0
    """Block size R of the fixed Hadamard rotation over channels (a power of two dividing D); 0 = none."""

    def __post_init__(self) -> None:
        if self.element not in ELEMENTS:
            raise ConfigError(f"element={self.element!r} is not one of {ELEMENTS}")
        if self.scale not in SCALES:
            raise ConfigError(f"scale={self.scale!r} is not one of {SCALES}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise ConfigError(f"group_size={self.group_size!r} must be a positive integer, e.g. 32, 64 or 128")
        r = self.rotate
        if isinstance(r, bool) or not isinstance(r, int) or r < 0 or (r and r & (r - 1)) or r == 1:
            raise ConfigError(f"rotate={r!r} must be 0 (no rotation) or a power of two >= 2, e.g. 64 or 128")

    @property
    def name(self) -> str:
        base = f"{self.element}-g{self.group_size}-{self.scale}"
        return base + (f"-h{self.rotate}" if self.rotate else "")

    @property
    def qmax(self) -> float:
        return QMAX[self.element]

    def num_groups(self, hidden_size: int) -> int:
        return -(-hidden_size // self.group_size)

    def check_hidden_size(self, hidden_size: int) -> None:
        """ConfigError unless D is even (two codes per byte) and divisible by the rotation block."""
        if hidden_size < 2 or hidden_size % 2:
            raise ConfigError(f"4-bit storage packs two channels per byte: hidden size {hidden_size} must be even")
        if self.rotate and hidden_size % self.rotate:
            raise ConfigError(f"storage {self.name}: rotation block {self.rotate} does not divide hidden size "
                              f"{hidden_size}; use a power of two that does (largest: {hidden_size & -hidden_size})")


def is_quant4(storage: str) -> bool:
    """Whether a storage-dtype string names a 4-bit format."""
    return _NAME_RE.match(storage) is not None


def parse_quant4(storage: str) -> Quant4Format:
    """"e2m1-g32-e8m0" / "int4-g64-bf16-h64" -> Quant4Format; ConfigError with the grammar otherwise."""
    m = _NAME_RE.match(storage)
    if m is None:
        raise ConfigError(f"storage={storage!r} is not a 4-bit format: expected ELEMENT-gGROUP-SCALE[-hR] with "
                          f"ELEMENT in {ELEMENTS}, SCALE in {SCALES}, e.g. 'e2m1-g32-e8m0' or 'int4-g64-bf16-h64'")
    return Quant4Format(element=m[1], group_size=int(m[2]), scale=m[3], rotate=int(m[4] or 0))


@dataclass(frozen=True, kw_only=True)
class Quant4Tensors:
    """What encode() returns: the arrays a shard stores (on the device of the input)."""

    codes: torch.Tensor
    """uint8 [T, K, D/2]: channel 2c in the low nibble of byte c, channel 2c+1 in the high nibble."""
    group_scales: torch.Tensor
    """[T, K, G]: uint16 bf16 bits (scale bf16) or uint8 (e8m0 exponent byte / e4m3 bits)."""
    row_scales: torch.Tensor | None
    """float32 [T, K] for scale "e4m3" (group scale = e4m3 value x row scale), else None."""


@dataclass(frozen=True, kw_only=True)
class TokenBytes:
    """Stored bytes per token of one format (without the per-sample index and chunk rounding)."""

    codes: int
    """K x D/2."""
    group_scales: int
    """K x G x (2 for bf16, 1 for e8m0/e4m3)."""
    row_scales: int
    """K x 4 for e4m3, else 0."""
    token_arrays: int
    """input_ids int32 + loss_mask uint8."""

    @property
    def hidden(self) -> int:
        """Bytes of the hidden states (codes + scales)."""
        return self.codes + self.group_scales + self.row_scales

    @property
    def total(self) -> int:
        return self.hidden + self.token_arrays


def bytes_per_token(fmt: Quant4Format, *, num_taps: int, hidden_size: int) -> TokenBytes:
    """Pure: bytes per token of `fmt` for K taps of size D (27B shape: 5 x 5120, bf16 = 51,200 hidden bytes)."""
    fmt.check_hidden_size(hidden_size)
    G = fmt.num_groups(hidden_size)
    return TokenBytes(codes=num_taps * hidden_size // 2,
                      group_scales=num_taps * G * (2 if fmt.scale == "bf16" else 1),
                      row_scales=num_taps * 4 if fmt.scale == "e4m3" else 0,
                      token_arrays=TOKEN_ARRAY_BYTES)


def stored_arrays(fmt: Quant4Format, *, num_taps: int, hidden_size: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Pure: the arrays a shard of this format holds besides input_ids/loss_mask/samples, as
    {name: (numpy dtype, shape per token)}, in encode()'s order (codes, group scales, row scales): what a writer
    creates and a reader opens, so neither spells the layout out again."""
    fmt.check_hidden_size(hidden_size)
    K, G = num_taps, fmt.num_groups(hidden_size)
    arrays = {"hidden": ("uint8", (K, hidden_size // 2)),
              "group_scales": ("uint16" if fmt.scale == "bf16" else "uint8", (K, G))}
    if fmt.scale == "e4m3":
        arrays["scales"] = ("float32", (K,))  # the row scales, named like fp8's per-row scales
    return arrays


def rotation_flops_per_token(fmt: Quant4Format, *, num_taps: int, hidden_size: int) -> int:
    """FLOPs to undo (or apply) the rotation for one token as the dense block matmul: 2 x K x D x R."""
    return 2 * num_taps * hidden_size * fmt.rotate


@functools.lru_cache(maxsize=16)
def _hadamard_cached(n: int, device: str) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(device=device, dtype=torch.float32)


def hadamard(n: int, *, device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 [n, n] normalised Sylvester Hadamard matrix (symmetric, orthogonal: H @ H = I)."""
    if n < 1 or n & (n - 1):
        raise ConfigError(f"Hadamard size {n} must be a power of two")
    return _hadamard_cached(n, str(torch.device(device)))


def _rotate(x_TKD: torch.Tensor, r: int) -> torch.Tensor:
    T, K, D = x_TKD.shape
    return (x_TKD.reshape(T, K, D // r, r) @ hadamard(r, device=x_TKD.device)).reshape(T, K, D)


def _div(num: torch.Tensor, den: float) -> torch.Tensor:
    """num / den rounded once (IEEE) on every device. CUDA replaces a division by a host scalar with a multiply
    by the scalar's rounded reciprocal (ATen BinaryDivTrueKernel.cu, "may lose one bit of precision"); the CPU
    divides. One ulp moves a rounded-up scale to the next step: that was 9 of the 22 CUDA-vs-CPU byte tests on
    the H200 (int4 bf16, every e4m3). A 0-dim tensor on num's device (a fill kernel, no copy) is divided."""
    return torch.div(num, num.new_full((), den))


def _bf16_round_up(s: torch.Tensor) -> torch.Tensor:
    """float32 >= 0 -> the smallest bf16 >= s (as bf16). NaN stays NaN, inf stays inf."""
    bits = s.contiguous().view(torch.int32)
    # Adding 0xFFFF then dropping the low 16 bits rounds a positive float up to the bf16 grid (exact ones stay).
    up = torch.bitwise_and(bits + 0xFFFF, -65536)
    up = torch.where(torch.isnan(s), bits, up)  # NaN bits + 0xFFFF could carry into the sign bit
    return up.view(torch.float32).to(torch.bfloat16)


def _e8m0_round_up(v: torch.Tensor) -> torch.Tensor:
    """float32 >= 0 -> int32 exponent e = ceil(log2 v), exact (frexp, no log2 rounding), clamped to the byte."""
    m, e = torch.frexp(v)  # v = m * 2^e, m in [0.5, 1)
    e = torch.where(m == 0.5, e - 1, e)  # exact power of two: 2^(e-1)
    return e.clamp(-E8M0_BIAS, 254 - E8M0_BIAS)


def _e4m3_round_up(g: torch.Tensor) -> torch.Tensor:
    """float32 in [0, 448] -> uint8 bits of the smallest e4m3fn value >= g (NaN -> a NaN encoding)."""
    bits = g.to(torch.float8_e4m3fn).view(torch.uint8)
    below = bits.view(torch.float8_e4m3fn).to(torch.float32) < g
    # For positive e4m3 values the next bit pattern is the next larger value; g <= 448 never needs 0x7E + 1.
    return torch.where(below, bits + 1, bits)


def _encode_scales(amax_TKG: torch.Tensor, fmt: Quant4Format):
    """Group absmax (float32) -> (stored group scales, row scales or None, decoded float32 group scales)."""
    qmax = fmt.qmax
    if fmt.scale == "bf16":
        s = _bf16_round_up(_div(amax_TKG, qmax))
        # absmax/qmax of a float32-subnormal group can underflow to 0: the smallest bf16 step covers it
        s = torch.where((amax_TKG > 0) & (s == 0), torch.tensor(1, dtype=torch.int16, device=s.device)
                        .view(torch.bfloat16), s)
        return s.view(torch.uint16), None, s.to(torch.float32)
    if fmt.scale == "e8m0":
        e = _e8m0_round_up(_div(amax_TKG, qmax))
        e = torch.where(amax_TKG > 0, e, torch.full_like(e, -E8M0_BIAS))  # zero groups: byte 0
        stored = (e + E8M0_BIAS).to(torch.uint8)
        stored = torch.where(torch.isfinite(amax_TKG), stored, torch.full_like(stored, E8M0_NAN))
        return stored, None, _decode_e8m0(stored)
    row_TK = _div(amax_TKG.amax(dim=-1), qmax * E4M3_MAX)
    safe_row = torch.where(row_TK > 0, row_TK, torch.ones_like(row_TK))
    g = (amax_TKG / (qmax * safe_row.unsqueeze(-1))).clamp(max=E4M3_MAX)
    # a group 1e-45 times smaller than its row's largest makes g underflow to 0 in float32: give it the
    # smallest e4m3 step instead, which still covers it (its codes round to 0)
    stored = torch.where((amax_TKG > 0) & (g == 0), 1, _e4m3_round_up(g)).to(torch.uint8)
    stored = torch.where(torch.isfinite(amax_TKG), stored, torch.full_like(stored, E4M3_NAN))
    return stored, row_TK, stored.view(torch.float8_e4m3fn).to(torch.float32) * row_TK.unsqueeze(-1)


def _decode_e8m0(stored: torch.Tensor) -> torch.Tensor:
    """Exponent bytes -> float32 2^(b-127), built from its bits (exact on every device, unlike a pow):
    byte b in 1..254 is the float32 exponent field itself; byte 0 is the subnormal 2^-127 = 0x00400000."""
    b = stored.to(torch.int32)
    bits = torch.where(b > 0, torch.bitwise_left_shift(b, 23), 1 << 22)
    return torch.where(b == E8M0_NAN, float("nan"), bits.view(torch.float32))


def _element_lut(element: str, device: torch.device) -> torch.Tensor:
    """float32 [16]: the value of each nibble (built once per device: the loader decodes every micro-batch)."""
    return _element_lut_cached(element, str(torch.device(device)))


@functools.lru_cache(maxsize=16)
def _element_lut_cached(element: str, device: str) -> torch.Tensor:
    if element == "int4":
        vals = [float(n if n < 8 else n - 16) for n in range(16)]
    else:
        vals = [(-1.0 if n & 8 else 1.0) * E2M1_MAGNITUDES[n & 7] for n in range(16)]
    return torch.tensor(vals, dtype=torch.float32, device=device)


def _quantize_elements(y: torch.Tensor, element: str) -> torch.Tensor:
    """Scaled values (|y| <= qmax up to rounding; NaN/Inf already zeroed) -> int32 nibbles 0..15."""
    if element == "int4":
        q = torch.round(y).clamp_(-7, 7).to(torch.int32)
        return torch.bitwise_and(q, 15)  # two's complement nibble
    a = y.abs().clamp_(max=6.0)
    # w maps the e2m1 grid 0,.5,1,1.5,2,3,4,6 linearly per piece onto 0..7 ([0,2] x2, [2,4] +2, [4,6] /2+4),
    # so nearest-grid rounding is rounding w; ceil(w - 0.5) sends a tie to the smaller value. Elementwise only:
    # torch.bucketize was 30% of encode on CPU.
    w = 2.0 * a - (a - 2.0).clamp_(min=0.0) - 0.5 * (a - 4.0).clamp_(min=0.0)
    idx = torch.ceil(w.sub_(0.5)).clamp_(min=0.0).to(torch.int32)
    # sign bit only on a nonzero magnitude: no -0 codes, so zero inputs are code 0 whatever their sign
    return torch.where((y < 0) & (idx > 0), idx + 8, idx)


def encode(hidden_TKD: torch.Tensor, *, fmt: Quant4Format, check_finite: bool = True) -> Quant4Tensors:
    """Any float dtype [T, K, D], any device -> the stored arrays (module docstring), vectorised over tokens.

    check_finite: raise DataError on NaN/Inf (one device sync at the end); False leaves the check to the
    caller (raise_if_nonfinite on the host copy of the scales), the bad groups carrying NaN scales."""
    if not hidden_TKD.is_floating_point():
        raise ConfigError(f"4-bit encode needs a float tensor, got {hidden_TKD.dtype}")
    if hidden_TKD.ndim != 3:
        raise ConfigError(f"4-bit encode needs hidden states [tokens, taps, hidden], got {tuple(hidden_TKD.shape)}")
    T, K, D = hidden_TKD.shape
    fmt.check_hidden_size(D)
    Gs, G = fmt.group_size, fmt.num_groups(D)
    dev = hidden_TKD.device
    codes = torch.empty(T, K, D // 2, dtype=torch.uint8, device=dev)
    group_scales = torch.empty(T, K, G, dtype=torch.uint16 if fmt.scale == "bf16" else torch.uint8, device=dev)
    row_scales = torch.empty(T, K, dtype=torch.float32, device=dev) if fmt.scale == "e4m3" else None
    bad = []
    for t0 in range(0, T, _BLOCK_TOKENS):
        x = hidden_TKD[t0:t0 + _BLOCK_TOKENS].to(torch.float32)
        t = x.shape[0]
        if fmt.rotate:
            x = _rotate(x, fmt.rotate)
        xg = (F.pad(x, (0, G * Gs - D)) if G * Gs > D else x).view(t, K, G, Gs)  # zero pads keep an absmax
        amax = xg.abs().amax(dim=-1)  # NaN propagates, so a NaN group gets a NaN scale
        finite = torch.isfinite(amax)
        stored, row, scale_f = _encode_scales(amax, fmt)
        safe = torch.where(finite & (scale_f > 0), scale_f, 1.0)
        # a non-finite group keeps its NaN/Inf here (divided by 1): zero it, its scale already marks it
        y = torch.nan_to_num_(xg / safe.unsqueeze(-1), nan=0.0, posinf=0.0, neginf=0.0)
        nib = _quantize_elements(y, fmt.element).view(t, K, G * Gs)[..., :D]
        codes[t0:t0 + t] = torch.bitwise_or(nib[..., 0::2], torch.bitwise_left_shift(nib[..., 1::2], 4)).to(torch.uint8)
        group_scales[t0:t0 + t] = stored
        if row_scales is not None:
            row_scales[t0:t0 + t] = row
        if check_finite:
            bad.append((~finite).any())
    if check_finite and bad and bool(torch.stack(bad).any()):
        raise_if_nonfinite(group_scales=group_scales, row_scales=row_scales, fmt=fmt)
    return Quant4Tensors(codes=codes, group_scales=group_scales, row_scales=row_scales)


def nonfinite_groups(*, group_scales: torch.Tensor, row_scales: torch.Tensor | None, fmt: Quant4Format) -> torch.Tensor:
    """bool [T, K, G]: groups whose stored scale marks NaN/Inf input (works on the host copy)."""
    if fmt.scale == "bf16":
        return ~torch.isfinite(group_scales.view(torch.bfloat16))
    if fmt.scale == "e8m0":
        return group_scales == E8M0_NAN
    bad = torch.bitwise_and(group_scales, 0x7F) == E4M3_NAN
    # encode() marks the bad group itself (its row scale is NaN too): name that group, not the row's first;
    # a NaN row scale without a marked group (bytes not from encode) still counts, as all of its groups
    row_only = ~torch.isfinite(row_scales).unsqueeze(-1) & ~bad.any(dim=-1, keepdim=True)
    return bad | row_only


NON_FINITE_HINT = "The target overflowed or is broken: check it in float32, or the input tokens of that batch"


def raise_if_nonfinite(*, group_scales: torch.Tensor, row_scales: torch.Tensor | None, fmt: Quant4Format) -> None:
    """DataError naming how many groups held NaN/Inf and where the first one is; nothing if none."""
    bad = nonfinite_groups(group_scales=group_scales, row_scales=row_scales, fmt=fmt)
    n = int(bad.sum())
    if n:
        t, k, g = (int(i) for i in bad.nonzero()[0])
        lo = g * fmt.group_size
        where = (f"rotation block of channels {lo - lo % fmt.rotate}..{lo - lo % fmt.rotate + fmt.rotate - 1}"
                 if fmt.rotate else f"channels {lo}..{lo + fmt.group_size - 1}")
        raise DataError(
            f"hidden states hold NaN/Inf in {n} group(s) of {fmt.group_size} channels (first: packed token {t}, "
            f"tap index {k}, {where}); 4-bit storage {fmt.name} refuses non-finite features. {NON_FINITE_HINT}")


def decode(codes_TKC: torch.Tensor, group_scales_TKG: torch.Tensor, row_scales_TK: torch.Tensor | None = None, *,
           fmt: Quant4Format, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Stored arrays (any device; the loader calls it on the GPU) -> `dtype` hidden states [T, K, D]."""
    T, K, C = codes_TKC.shape
    D = 2 * C
    fmt.check_hidden_size(D)
    Gs, G = fmt.group_size, fmt.num_groups(D)
    if tuple(group_scales_TKG.shape) != (T, K, G):
        raise ConfigError(f"group scales have shape {tuple(group_scales_TKG.shape)}, {fmt.name} with D={D} "
                          f"needs {(T, K, G)}")
    if (row_scales_TK is None) != (fmt.scale != "e4m3"):
        raise ConfigError(f"storage {fmt.name}: row scales are {'required' if fmt.scale == 'e4m3' else 'unused'}")
    lut = _element_lut(fmt.element, codes_TKC.device)
    out = torch.empty(T, K, D, dtype=dtype, device=codes_TKC.device)
    for t0 in range(0, T, _BLOCK_TOKENS):
        c = codes_TKC[t0:t0 + _BLOCK_TOKENS].to(torch.int32)
        t = c.shape[0]
        nib = torch.stack([torch.bitwise_and(c, 15), torch.bitwise_right_shift(c, 4)], dim=-1).view(t, K, D)
        s = group_scales_TKG[t0:t0 + t]
        if fmt.scale == "bf16":
            scale_f = s.view(torch.bfloat16).to(torch.float32)
        elif fmt.scale == "e8m0":
            scale_f = _decode_e8m0(s)
        else:
            row = row_scales_TK[t0:t0 + t].to(torch.float32).unsqueeze(-1)
            scale_f = s.view(torch.float8_e4m3fn).to(torch.float32) * row
        v = lut[nib]  # int32 indices: half the temporary of int64 (decode runs in the loader, on the GPU)
        y = (F.pad(v, (0, G * Gs - D)) if G * Gs > D else v).view(t, K, G, Gs) * scale_f.unsqueeze(-1)
        y = y.view(t, K, G * Gs)[..., :D]
        if fmt.rotate:
            y = _rotate(y.contiguous(), fmt.rotate)
        out[t0:t0 + t] = y.to(dtype)
    return out
