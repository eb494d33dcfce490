"""quant4.py: the 4-bit storage format pinned: per-element error bounds, scale edge cases, nibble order, NaN/Inf
refusal, determinism, bytes per token, and a numpy-only decode (from the module docstring) of arrays read back
by plain zarr-python from shard files written the way the cache writes them (crc32c on every chunk)."""

import json
import math

import numpy as np
import pytest
import torch
import zarr

from dflash.cache import quant4
from dflash.cache.quant4 import (Quant4Format, bytes_per_token, decode, encode, is_quant4, parse_quant4,
                                 raise_if_nonfinite, rotation_flops_per_token, stored_arrays)
from dflash.cache.shardfile import ArrayWriter
from dflash.errors import ConfigError, DataError

ALL = [f"{e}-g{g}-{s}" for e in quant4.ELEMENTS for s in quant4.SCALES for g in (32, 64, 128)]
ROTATED = ["int4-g64-bf16-h64", "e2m1-g32-e8m0-h32", "e2m1-g128-e4m3-h64", "e2m1-g64-e8m0-h128"]
D = 384  # 3 groups of 128
D_RAGGED = 320  # = 2.5 x 128: g128 has a 64-channel last group


def features(T=48, K=2, D=D, seed=0):
    """Gaussian features with the structure of real hidden states: a few massive channels, varied row norms."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, D, generator=g) * torch.exp(torch.randn(T, K, 1, generator=g))
    x[:, :, 5] *= 40.0
    x[:, :, D // 2 + 3] *= -25.0
    return x.to(torch.bfloat16)


# ---- numpy-only reader, written from the module docstring -----------------------------------------------------

def np_scales(group_scales, row_scales, fmt):
    """Stored group scales -> float32 values, per the docstring."""
    b = np.asarray(group_scales)
    if fmt.scale == "bf16":
        return (b.astype(np.uint32) << 16).view(np.float32)
    if fmt.scale == "e8m0":
        v = np.ldexp(np.float32(1.0), np.minimum(b, 254).astype(np.int32) - 127).astype(np.float32)
        return np.where(b == 255, np.float32(np.nan), v)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 0xF, (b & 7).astype(np.float64)
    v = sign * np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e.astype(np.float64) - 7))
    v = np.where((b & 0x7F) == 0x7F, np.nan, v).astype(np.float32)
    return v * np.asarray(row_scales, dtype=np.float32)[..., None]


def np_hadamard(r):
    h = np.ones((1, 1))
    while h.shape[0] < r:
        h = np.block([[h, h], [h, -h]])
    return (h / math.sqrt(r)).astype(np.float32)


def np_decode(codes, group_scales, row_scales, fmt):
    c = np.asarray(codes)
    T, K, C = c.shape
    nib = np.stack([c & 0x0F, c >> 4], axis=-1).reshape(T, K, 2 * C)
    if fmt.element == "int4":
        vals = np.where(nib < 8, nib.astype(np.int32), nib.astype(np.int32) - 16).astype(np.float32)
    else:
        mag = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
        vals = np.where(nib & 8, -1.0, 1.0).astype(np.float32) * mag[nib & 7]
    scale = np_scales(group_scales, row_scales, fmt)
    group_of = np.arange(2 * C) // fmt.group_size
    y = vals * scale[:, :, group_of]
    if fmt.rotate:
        r = fmt.rotate
        y = (y.reshape(T, K, -1, r) @ np_hadamard(r)).reshape(T, K, 2 * C)
    return y


# ---- bounds -----------------------------------------------------------------------------------------------------

def half_step(a_over_s, element):
    """Half the grid gap around each scaled magnitude: int4 0.5; e2m1 0.25 / 0.5 / 1 on [0,2] / (2,4] / (4,6]."""
    if element == "int4":
        return np.full_like(a_over_s, 0.5)
    return np.where(a_over_s <= 2, 0.25, np.where(a_over_s <= 4, 0.5, 1.0))


def rotated(x_TKD, r):
    T, K, Dx = x_TKD.shape
    return (x_TKD.reshape(T, K, -1, r) @ np_hadamard(r).astype(np.float64)).reshape(T, K, Dx)


@pytest.mark.parametrize("name,dim", [(n, d) for n in ALL + ROTATED for d in (D, D_RAGGED)
                                      if d % max(parse_quant4(n).rotate, 1) == 0])
def test_error_of_each_element_within_half_a_step_of_its_group(name, dim):
    fmt = parse_quant4(name)
    x = features(D=dim).double().numpy()
    q = encode(torch.from_numpy(x).to(torch.bfloat16), fmt=fmt)
    out = decode(q.codes, q.group_scales, q.row_scales, fmt=fmt, dtype=torch.float32).double().numpy()
    scale = np_scales(q.group_scales.numpy(), None if q.row_scales is None else q.row_scales.numpy(), fmt)
    scale = scale.astype(np.float64)[:, :, np.arange(dim) // fmt.group_size]
    # in the rotated domain the grid bound holds per element; H H = I, so H(decoded) is the dequantized grid value
    y = rotated(x, fmt.rotate) if fmt.rotate else x
    y_hat = rotated(out, fmt.rotate) if fmt.rotate else out
    tol = 1e-6 * np.abs(y).max(axis=-1, keepdims=True) + 1e-30  # fp32 rounding of the scaling itself
    assert (np.abs(y) <= fmt.qmax * scale * (1 + 1e-6) + tol).all(), "scale rounded down: an element was clipped"
    h = half_step(np.abs(y) / scale, fmt.element) * scale
    assert (np.abs(y - y_hat) <= h + tol).all()
    if fmt.rotate:  # back in channel space: |e_i| <= sum_j |H_ij| h_j = (1/sqrt(R)) sum of the block's half steps
        r = fmt.rotate
        bound = np.repeat(h.reshape(*h.shape[:2], -1, r).sum(-1) / math.sqrt(r), r, axis=-1)
        assert (np.abs(x - out) <= bound + 4 * tol).all()
        # and per block in L2 the rotation changes nothing: ||e||_2 <= ||h||_2
        e2 = np.linalg.norm((x - out).reshape(*x.shape[:2], -1, r), axis=-1)
        assert (e2 <= np.linalg.norm(h.reshape(*h.shape[:2], -1, r), axis=-1) + 4 * tol[..., :1]).all()
    # bf16 output = the float32 decode rounded once
    bf = decode(q.codes, q.group_scales, q.row_scales, fmt=fmt)
    assert bf.dtype == torch.bfloat16
    assert torch.equal(bf, torch.from_numpy(out).float().to(torch.bfloat16))


@pytest.mark.parametrize("name", ["int4-g32-bf16", "e2m1-g64-bf16", "int4-g64-e8m0", "e2m1-g32-e8m0"])
def test_scales_are_tight(name):
    """Rounded up, but by no more than the encoding's step: bf16 1 ulp (2^-7 relative), e8m0 < 2x."""
    fmt = parse_quant4(name)
    x = features()
    q = encode(x, fmt=fmt)
    s = np_scales(q.group_scales.numpy(), None, fmt).astype(np.float64)
    need = np.abs(x.double().numpy()).reshape(*x.shape[:2], -1, fmt.group_size).max(-1) / fmt.qmax
    assert (s >= need).all()
    assert (s <= need * (1 + 2 ** -7) if fmt.scale == "bf16" else s < 2 * need).all()


def test_all_zero_groups_and_rows_decode_to_exact_zeros():
    x = features(T=6, K=2, D=256).float()
    x[0, 0, 32:64] = 0.0            # one zero group
    x[1, 1, 64:96] = -0.0           # negative zeros: still code 0, decoded +0
    x[2, 0] = 0.0                   # a whole zero row (e4m3 row scale 0)
    x[3] = 0.0                      # every tap of a token
    x[4, 1, 128:256] = 0.0          # a zero rotation block of 128
    for name in ALL + ["e2m1-g32-e4m3-h32", "int4-g32-bf16-h128"]:
        fmt = parse_quant4(name)
        q = encode(x, fmt=fmt)
        out = decode(q.codes, q.group_scales, q.row_scales, fmt=fmt, dtype=torch.float32)
        zero = (x == 0)
        if fmt.rotate:  # rotation mixes the channels of a block: only all-zero blocks stay zero
            r = fmt.rotate
            zero = zero.view(*x.shape[:2], -1, r).all(-1, keepdim=True).expand(-1, -1, -1, r).reshape(x.shape)
        assert torch.equal(out[zero], torch.zeros(int(zero.sum()))), name
        assert not torch.signbit(out[zero]).any(), name
        assert torch.isfinite(out).all(), name
        nib = torch.stack([q.codes & 15, q.codes >> 4], -1).view(x.shape)
        assert (nib[zero] == 0).all(), name
        if fmt.group_size == 32 and not fmt.rotate:
            assert int(q.group_scales[0, 0, 1]) == 0, name  # scale byte/bits 0 for the zero group
    fmt = parse_quant4("e2m1-g32-e4m3")
    assert float(encode(x, fmt=fmt).row_scales[2, 0]) == 0.0


@pytest.mark.parametrize("name", ["int4-g32-bf16", "e2m1-g32-e8m0", "int4-g64-e8m0", "e2m1-g64-bf16"])
def test_huge_outlier_stays_in_its_group(name):
    """A 1e30 outlier (and a 3e4 one) is reconstructed within its group's bound and leaves every other group's
    codes and scales bit-identical: per-group scales, not per-row."""
    fmt = parse_quant4(name)
    x = features(T=8, K=1, D=256).float()
    base = encode(x, fmt=fmt)
    for value in (3e4, -1e30):
        y = x.clone()
        y[3, 0, 70] = value
        q = encode(y, fmt=fmt)
        out = decode(q.codes, q.group_scales, q.row_scales, fmt=fmt, dtype=torch.float32)
        g = 70 // fmt.group_size
        assert torch.isfinite(out).all()
        s = float(torch.from_numpy(np_scales(q.group_scales.numpy(), None, fmt))[3, 0, g])
        assert abs(float(out[3, 0, 70]) - value) <= 0.5 * s * (2 if fmt.element == "e2m1" else 1)
        other = torch.ones_like(q.group_scales, dtype=torch.bool)
        other[3, 0, g] = False
        assert torch.equal(q.group_scales[other], base.group_scales[other])
        lo, hi = g * fmt.group_size // 2, (g + 1) * fmt.group_size // 2
        assert torch.equal(q.codes[3, 0, :lo], base.codes[3, 0, :lo])
        assert torch.equal(q.codes[3, 0, hi:], base.codes[3, 0, hi:])
        assert torch.equal(q.codes[:3], base.codes[:3]) and torch.equal(q.codes[4:], base.codes[4:])


def test_huge_outlier_under_two_level_e4m3_scales():
    """e4m3 group scales are relative to the row's largest group: with a 1e30 outlier the other groups' scales
    fall into e4m3 subnormals or to the smallest step, yet every element still meets its group's bound."""
    fmt = parse_quant4("e2m1-g32-e4m3")
    x = features(T=4, K=1, D=128).float()
    x[1, 0, 9] = 1e30
    q = encode(x, fmt=fmt)
    out = decode(q.codes, q.group_scales, q.row_scales, fmt=fmt, dtype=torch.float32).double()
    s = np_scales(q.group_scales.numpy(), q.row_scales.numpy(), fmt).astype(np.float64)[:, :, np.arange(128) // 32]
    xd = x.double().numpy()
    assert (np.abs(xd - out.numpy()) <= half_step(np.abs(xd) / s, "e2m1") * s * (1 + 1e-6)).all()
    assert torch.isfinite(out).all() and int(q.group_scales[1, 0, 0]) == 0x7E  # the outlier's group: 448


@pytest.mark.parametrize("name", ["int4-g32-bf16", "e2m1-g32-e8m0", "e2m1-g64-e4m3", "int4-g32-e8m0-h64"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_refused_at_write(name, bad):
    fmt = parse_quant4(name)
    x = features(T=10, K=3, D=128)
    x[7, 2, 100] = bad
    with pytest.raises(DataError, match=r"NaN/Inf in \d+ group.*packed token 7, tap index 2"):
        encode(x, fmt=fmt)
    # deferred check (no device sync): the bad group is marked in the scales and can never decode as numbers
    q = encode(x, fmt=fmt, check_finite=False)
    with pytest.raises(DataError, match="packed token 7"):
        raise_if_nonfinite(group_scales=q.group_scales, row_scales=q.row_scales, fmt=fmt)
    out = decode(q.codes, q.group_scales, q.row_scales, fmt=fmt, dtype=torch.float32)
    assert torch.isnan(out[7, 2, 100])
    ok = torch.ones(x.shape, dtype=torch.bool)
    ok[7, 2] = False
    assert torch.isfinite(out[ok]).all()


def test_nibble_packing_hand_example():
    """Channel 2c in the low nibble, 2c+1 in the high one; int4 two's complement, e2m1 = OCP FP4 bits."""
    x = torch.tensor([[[7.0, -7.0, 1.0, 0.0]]])
    q = encode(x, fmt=parse_quant4("int4-g4-bf16"))
    assert q.codes.tolist() == [[[0x97, 0x01]]]  # 7 | (-7 & 15 = 9) << 4, 1 | 0 << 4
    assert q.group_scales.view(torch.int16).tolist() == [[[0x3F80]]]  # bf16 1.0
    x = torch.tensor([[[6.0, -0.5, 1.5, -3.0]]])
    q = encode(x, fmt=parse_quant4("e2m1-g4-e8m0"))
    assert q.codes.tolist() == [[[0x97, 0xD3]]]  # 6 -> 7, -0.5 -> 8|1, 1.5 -> 3, -3 -> 8|5
    assert q.group_scales.tolist() == [[[127]]]  # 2^0
    q = encode(2 * x, fmt=parse_quant4("e2m1-g4-e4m3"))
    assert q.codes.tolist() == [[[0x97, 0xD3]]] and q.group_scales.tolist() == [[[0x7E]]]  # e4m3 448
    assert q.row_scales.item() == np.float32(12.0) / np.float32(6 * 448)  # float32 row absmax / (6 x 448)
    # rounding: ties go to the smaller e2m1 magnitude, int4 rounds half to even
    x = torch.tensor([[[6.0, 0.25, 0.75, 2.5, 5.0, 5.01, -1.74, -0.2]]])
    q = encode(x, fmt=parse_quant4("e2m1-g8-e8m0"))
    out = decode(q.codes, q.group_scales, fmt=parse_quant4("e2m1-g8-e8m0"), dtype=torch.float32)
    assert out.tolist() == [[[6.0, 0.0, 0.5, 2.0, 4.0, 6.0, -1.5, 0.0]]]
    assert q.codes[0, 0, 3] == 0x0B and not torch.signbit(out[0, 0, 7])  # -0.2 -> code 0, never -0 (0x8)
    fmt = parse_quant4("int4-g4-e8m0")  # scale 2^0 for absmax 7 > 3.5 ... exactly: ceil(log2(7/7)) = 0
    q = encode(torch.tensor([[[7.0, 2.5, -3.5, 0.5]]]), fmt=fmt)
    assert decode(q.codes, q.group_scales, fmt=fmt, dtype=torch.float32).tolist() == [[[7.0, 2.0, -4.0, 0.0]]]


def test_deterministic_and_independent_of_token_blocks(monkeypatch):
    fmt = parse_quant4("e2m1-g32-e4m3-h32")
    x = features(T=37, K=2, D=128)
    a, b = encode(x, fmt=fmt), encode(x, fmt=fmt)
    assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("codes", "group_scales", "row_scales"))
    monkeypatch.setattr(quant4, "_BLOCK_TOKENS", 8)  # the block loop gives the same bytes as one block
    c = encode(x, fmt=fmt)
    assert all(torch.equal(getattr(a, f), getattr(c, f)) for f in ("codes", "group_scales", "row_scales"))
    monkeypatch.undo()
    whole = decode(a.codes, a.group_scales, a.row_scales, fmt=fmt)
    monkeypatch.setattr(quant4, "_BLOCK_TOKENS", 5)
    assert torch.equal(decode(a.codes, a.group_scales, a.row_scales, fmt=fmt), whole)
    # tokens are independent: encoding a slice gives that slice of the bytes
    d = encode(x[10:20], fmt=fmt)
    assert torch.equal(d.codes, a.codes[10:20]) and torch.equal(d.group_scales, a.group_scales[10:20])


def write_shard_group(root, arrays: dict[str, np.ndarray], chunk_tokens=16):
    """A zarr v3 group of single-shard arrays with crc32c per chunk, via the cache's own ArrayWriter."""
    root.mkdir()
    (root / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
    for name, a in arrays.items():
        w = ArrayWriter(str(root / name), ndim=a.ndim)
        chunk = (chunk_tokens, *([1] if a.ndim > 1 else []), *a.shape[2:])
        grid = [range(-(-a.shape[0] // chunk_tokens))] + [range(a.shape[1])] * (a.ndim > 1) + [range(1)] * (a.ndim > 2)
        chunks = []
        for coords in np.ndindex(*[len(g) for g in grid]):
            sl = [slice(coords[0] * chunk_tokens, (coords[0] + 1) * chunk_tokens)] + list(coords[1:2])
            block = a[tuple(sl)]
            if block.shape[0] < chunk_tokens:  # the last chunk is stored whole (zarr pads it with the fill value)
                block = np.concatenate([block, np.zeros((chunk_tokens - block.shape[0], *block.shape[1:]), a.dtype)])
            chunks.append((coords, block.reshape(chunk)))
        w.write_chunks(chunks)
        w.finish(shape=a.shape, dtype=str(a.dtype), chunk_shape=chunk)


@pytest.mark.parametrize("name", ["int4-g64-bf16", "e2m1-g32-e8m0", "e2m1-g32-e4m3", "int4-g128-e8m0",
                                  "e2m1-g128-bf16", "int4-g64-bf16-h64", "e2m1-g32-e4m3-h32"])
def test_plain_zarr_read_back_and_numpy_decode_equal_decode(tmp_path, name):
    fmt = parse_quant4(name)
    x = features(T=40, K=3, D=D_RAGGED if fmt.group_size == 128 else D)
    q = encode(x, fmt=fmt)
    arrays = {"hidden": q.codes.numpy(), "group_scales": q.group_scales.numpy()}
    if q.row_scales is not None:
        arrays["scales"] = q.row_scales.numpy()
    layout = stored_arrays(fmt, num_taps=3, hidden_size=x.shape[2])  # what a writer would create
    assert {k: (str(a.dtype), a.shape[1:]) for k, a in arrays.items()} == layout
    write_shard_group(tmp_path / "shard", arrays)
    g = zarr.open_group(str(tmp_path / "shard"), mode="r")
    read = {k: g[k][...] for k in arrays}
    assert read["hidden"].dtype == np.uint8 and read["hidden"].shape == (40, 3, x.shape[2] // 2)
    assert read["group_scales"].dtype == (np.uint16 if fmt.scale == "bf16" else np.uint8)
    for k in arrays:
        assert np.array_equal(read[k], arrays[k])
    mine = np_decode(read["hidden"], read["group_scales"], read.get("scales"), fmt)
    ref = decode(q.codes, q.group_scales, q.row_scales, fmt=fmt, dtype=torch.float32).numpy()
    if fmt.rotate:  # matmul summation order differs between numpy and torch
        np.testing.assert_allclose(mine, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    else:
        assert np.array_equal(mine, ref)


def test_bytes_per_token_on_the_27b_shape():
    def total(n):
        return bytes_per_token(parse_quant4(n), num_taps=5, hidden_size=5120).total
    # codes 12,800 + scales + ids/mask 5; issue 16 bound: <= 14,340 B/token all in
    assert total("int4-g32-bf16") == 12800 + 1600 + 5 == 14405  # over the bound
    assert total("int4-g64-bf16") == 12800 + 800 + 5
    assert total("e2m1-g32-e8m0") == total("e2m1-g32-e8m0-h32") == 12800 + 800 + 5
    assert total("e2m1-g32-e4m3") == 12800 + 800 + 20 + 5
    assert total("e2m1-g128-e8m0") == 12800 + 200 + 5
    b = bytes_per_token(parse_quant4("e2m1-g128-bf16"), num_taps=5, hidden_size=576)  # ragged: 5 groups
    assert (b.codes, b.group_scales, b.row_scales, b.hidden) == (1440, 50, 0, 1490)
    assert rotation_flops_per_token(parse_quant4("e2m1-g32-e8m0-h128"), num_taps=5, hidden_size=5120) == 6_553_600


def test_names_and_refusals():
    for n in ALL + ROTATED:
        assert is_quant4(n) and parse_quant4(n).name == n
    assert not is_quant4("fp8") and not is_quant4("bf16")
    with pytest.raises(ConfigError, match="ELEMENT-gGROUP-SCALE"):
        parse_quant4("fp4")
    with pytest.raises(ConfigError, match="rotate"):
        Quant4Format(rotate=48)
    with pytest.raises(ConfigError, match="group_size"):
        Quant4Format(group_size=0)
    with pytest.raises(ConfigError, match="must be even"):
        encode(torch.randn(2, 1, 7), fmt=Quant4Format())
    with pytest.raises(ConfigError, match="does not divide hidden size 576.*largest: 64"):
        encode(torch.randn(2, 1, 576), fmt=parse_quant4("e2m1-g32-e8m0-h128"))
    with pytest.raises(ConfigError, match="float"):
        encode(torch.ones(2, 1, 8, dtype=torch.int32), fmt=Quant4Format())
    q = encode(torch.randn(2, 1, 64), fmt=parse_quant4("e2m1-g32-e4m3"))
    with pytest.raises(ConfigError, match="row scales are required"):
        decode(q.codes, q.group_scales, fmt=parse_quant4("e2m1-g32-e4m3"))
    with pytest.raises(ConfigError, match="group scales have shape"):
        decode(q.codes, q.group_scales, q.row_scales, fmt=parse_quant4("e2m1-g16-e4m3"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ALL + ROTATED)
def test_cuda_matches_cpu(name):
    """The GPU path (extraction encodes, the loader decodes there) gives the CPU's bytes: elementwise IEEE ops
    only; with a rotation the fp32 matmul may sum in another order, so a few codes may sit one step apart."""
    fmt = parse_quant4(name)
    x = features(T=300, K=3, D=D)
    cpu, gpu = encode(x, fmt=fmt), encode(x.cuda(), fmt=fmt)
    if fmt.rotate:
        assert (cpu.codes != gpu.codes.cpu()).float().mean() < 1e-3
    else:
        assert torch.equal(cpu.codes, gpu.codes.cpu()) and torch.equal(cpu.group_scales, gpu.group_scales.cpu())
        assert cpu.row_scales is None or torch.equal(cpu.row_scales, gpu.row_scales.cpu())
    out_cpu = decode(cpu.codes, cpu.group_scales, cpu.row_scales, fmt=fmt, dtype=torch.float32)
    out_gpu = decode(cpu.codes.cuda(), cpu.group_scales.cuda(), None if cpu.row_scales is None else
                     cpu.row_scales.cuda(), fmt=fmt, dtype=torch.float32).cpu()
    torch.testing.assert_close(out_gpu, out_cpu, rtol=0, atol=1e-5 * float(out_cpu.abs().max()))


def test_every_e8m0_byte_decodes_to_its_power_of_two():
    fmt = parse_quant4("int4-g2-e8m0")
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(1, 1, 256)
    codes = torch.full((1, 1, 256), 0x01, dtype=torch.uint8)  # channel 2c = 1, channel 2c+1 = 0
    out = decode(codes, b, fmt=fmt, dtype=torch.float32)[0, 0, 0::2]
    assert [math.ldexp(1.0, i - 127) for i in range(255)] == out[:255].tolist() and math.isnan(out[255])
    assert np.array_equal(np_scales(b.numpy(), None, fmt)[0, 0], out.numpy(), equal_nan=True)


@pytest.mark.parametrize("name", ALL)
def test_bound_holds_across_60_decades_of_group_magnitude(name):
    """Groups from 1e-30 to 1e30 in one row: bf16 and e8m0 scales cover the float32 range; e4m3 scales are
    relative to the row's largest group, so small groups fall to e4m3 subnormals or the smallest step (their
    codes round to 0) and still meet the bound of the scale actually stored."""
    fmt = parse_quant4(name)
    g = torch.Generator().manual_seed(3)
    G = -(-256 // fmt.group_size)
    mag = 10.0 ** (torch.rand(16, 2, G, generator=g, dtype=torch.float64) * 60 - 30)
    x = torch.randn(16, 2, 256, generator=g, dtype=torch.float64) * mag.repeat_interleave(fmt.group_size, -1)[..., :256]
    x = x.float()
    x[0, 0, :fmt.group_size] = torch.tensor([1e-45, -3e-45] * (fmt.group_size // 2))  # float32 subnormals
    q = encode(x, fmt=fmt)
    out = decode(q.codes, q.group_scales, q.row_scales, fmt=fmt, dtype=torch.float32).double().numpy()
    s = np_scales(q.group_scales.numpy(), None if q.row_scales is None else q.row_scales.numpy(), fmt)
    s = s.astype(np.float64)[:, :, np.arange(256) // fmt.group_size]
    xd = x.double().numpy()
    assert np.isfinite(out).all() and (s > 0).all()
    assert (np.abs(xd - out) <= half_step(np.abs(xd) / s, fmt.element) * s * (1 + 1e-6)).all()
