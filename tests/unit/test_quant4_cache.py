"""4-bit storage wired into the cache: writer -> shard arrays -> reader / loader decode, the fingerprint name,
NaN/Inf refusal at write, verify (crc32c on the new arrays), cache info, and the numpy-only decode recipe of
docs/CACHE_FORMAT_4BIT.md run as written against real shards read by plain zarr-python."""

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from click.testing import CliRunner

from cli.main import cli
from dflash.cache import CacheReader, CacheWriter, Fingerprint
from dflash.cache import quant4
from dflash.cache.format import DEFAULT_QUANT4, decode_stored, encode_stored, stored_layout
from dflash.cache.verify import cache_info, verify_cache
from dflash.errors import CacheMismatchError, ConfigError, DataError
from dflash.train.loader import StreamingLoader, plan_epoch

DOC = Path(__file__).resolve().parents[2] / "docs" / "CACHE_FORMAT_4BIT.md"
TAPS = (1, 4, 7)
D = 96  # 3 groups of 32, 3 rotation blocks of 32


def make_fp(storage="int4", D=D, taps=TAPS):
    return Fingerprint(target="m", target_config_hash="h", num_target_layers=12, hidden_size=D,
                       target_dtype="bfloat16", tokenizer_hash="t", chat_template_hash="c",
                       tap_layer_ids=taps, storage=storage)


def features(T, K=len(TAPS), D=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, D, generator=g) * torch.exp(torch.randn(T, K, 1, generator=g))
    x[:, :, 3] *= 30.0  # a massive channel, as real hidden states have
    return x


def write_cache(path, storage, lengths, *, shard_tokens=64, seed=0, encoded=False):
    """Samples 0..N-1 of the given lengths, written in two appends; returns the float features [T, K, D]."""
    rng = np.random.default_rng(seed)
    T = int(sum(lengths))
    x = features(T, seed=seed)
    ids = rng.integers(0, 1000, T).astype(np.int32)
    mask = rng.integers(0, 2, T).astype(np.uint8)
    half = len(lengths) // 2
    cut = int(sum(lengths[:half]))
    with CacheWriter(path, make_fp(storage), shard_tokens=shard_tokens) as w:
        for (a, b), (s0, s1) in (((0, cut), (0, half)), ((cut, T), (half, len(lengths)))):
            kw = dict(sample_ids=np.arange(s0, s1), lengths=np.array(lengths[s0:s1]), input_ids=ids[a:b],
                      loss_mask=mask[a:b])
            if encoded:  # what extraction hands over: the arrays encoded (on the GPU there), copied to the host
                enc = encode_stored(x[a:b], storage, check_finite=False)
                w.append(**kw, hidden=enc.hidden, scales=enc.scales, group_scales=enc.group_scales)
            else:
                w.append(**kw, hidden=x[a:b])
    return x, ids, mask


def expected(x, storage, dtype=torch.bfloat16):
    fmt = quant4.parse_quant4(storage)
    q = quant4.encode(x, fmt=fmt)
    return quant4.decode(q.codes, q.group_scales, q.row_scales, fmt=fmt, dtype=dtype)


def test_int4_names_the_recommended_layout_in_the_fingerprint():
    fp = make_fp("int4")
    assert fp.storage == DEFAULT_QUANT4 == "int4-g32-e4m3-h32"
    assert Fingerprint.from_json(fp.to_json()).storage == DEFAULT_QUANT4
    with pytest.raises(ConfigError, match="rotation block 32 does not divide hidden size 80"):
        make_fp("int4", D=80)
    with pytest.raises(ConfigError, match="int4 = int4-g32-e4m3-h32"):
        make_fp("int3")
    L = stored_layout("int4", 5120)  # the 27B shape: issue 16's bound is 14,340 B/token all in
    assert L.hidden_bytes_per_token(5) == 5 * (2560 + 160 + 4) == 13620
    assert L.array_names == ["hidden", "input_ids", "loss_mask", "samples", "scales", "group_scales"]


@pytest.mark.parametrize("storage", ["int4", "int4-g64-bf16-h32", "e2m1-g32-e8m0"])
@pytest.mark.parametrize("encoded", [False, True])
def test_round_trip_through_writer_and_reader(tmp_path, storage, encoded):
    storage = make_fp(storage).storage
    lengths = [5, 17, 40, 3, 29, 11]
    x, ids, mask = write_cache(tmp_path, storage, lengths, encoded=encoded)
    want = expected(x, storage)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    with CacheReader(tmp_path) as r:
        assert r.storage == storage and len(r) == len(lengths) and len(r.index.shard_names) > 1
        order = [4, 0, 5, 2]
        p = r.read_many(order, dequantize=True)
        rows = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in order])
        assert p.hidden.dtype == torch.bfloat16 and torch.equal(p.hidden, want[rows])
        assert np.array_equal(p.input_ids, ids[rows]) and np.array_equal(p.loss_mask, mask[rows])
        # a tap subset reads only its taps' codes and scales, and decodes to the same values
        sub = r.read_many(order, taps=[7, 1], dequantize=True)
        assert torch.equal(sub.hidden, want[rows][:, [2, 0]])
        # raw stored arrays: what the loader copies to the GPU
        raw = r.read(2, taps=[4])
        L = stored_layout(storage, D)
        assert raw.hidden.dtype == torch.uint8 and raw.hidden.shape == (40, 1, D // 2)
        assert raw.group_scales.shape == (40, 1, L.group_width) and (raw.scales is not None) == L.has_scales
        assert torch.equal(decode_stored(raw.hidden, raw.scales, raw.group_scales, storage=storage),
                           want[starts[2]:starts[3], 1:2])


def test_loader_decodes_on_its_device(tmp_path):
    lengths = [7, 30, 12, 21, 9]
    x, _, _ = write_cache(tmp_path, "int4", lengths)
    want = expected(x, DEFAULT_QUANT4, torch.float32)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    with CacheReader(tmp_path) as r:
        plan = plan_epoch(r.index.length, seed=0, epoch=0, batch_tokens=40, world_size=1, grad_accum=1)
        seen = 0
        with StreamingLoader(r, plan, rank=0, start_step=0, taps=[4, 7], device=torch.device("cpu"),
                             dtype=torch.float32) as loader:
            for mb in loader:
                rows = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in mb.sample_ids])
                assert mb.hidden_TKD.dtype == torch.float32 and torch.equal(mb.hidden_TKD, want[rows][:, 1:])
                seen += len(mb.sample_ids)
    assert seen == len(lengths)


def _append_then_close(path, storage, x, **encoded) -> DataError:
    """Append a 2-sample batch (float features x, or the already-encoded arrays) to a fresh cache and close it:
    the DataError the writer raised, nothing committed."""
    with pytest.raises(DataError) as e:
        with CacheWriter(path, make_fp(storage), shard_tokens=64) as w:
            w.append(sample_ids=np.array([0, 1]), lengths=np.array([10, 10]), input_ids=np.zeros(20, np.int32),
                     loss_mask=np.ones(20, np.uint8), hidden=x, **encoded)
    assert CacheReader(path).index.sample_id.size == 0  # nothing committed
    msg = str(e.value)
    assert "\n" not in msg and "NaN/Inf" in msg and re.search(rf"storage {storage}\S* refuses non-finite", msg)
    return e.value


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_features_are_refused_at_write(tmp_path, bad):
    x = features(20)
    x[13, 1, 40] = bad
    msg = str(_append_then_close(tmp_path / "float", "int4", x))
    assert "packed token 13, tap index 1" in msg and "channels 32..63" in msg  # the rotation block of channel 40
    # also when the arrays come encoded (extraction checks the host copy, not the device)
    enc = encode_stored(x, "int4", check_finite=False)
    _append_then_close(tmp_path / "encoded", "int4", enc.hidden, scales=enc.scales, group_scales=enc.group_scales)


@pytest.mark.parametrize("storage", ["bf16", "fp8"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_bf16_and_fp8_refuse_nonfinite_features_at_write(tmp_path, storage, bad):
    """Their arrays carry no NaN mark: fp8's row scale (amax/448) turns nan/inf with its row, bf16's bits are
    tested; before, such a cache was written and only `cache verify` or a nan loss found it."""
    x = features(20)
    x[13, 1, 40] = bad
    msg = str(_append_then_close(tmp_path / "float", storage, x))
    assert "packed token 13, tap index 1" in msg and "in 1 " in msg
    assert ("channel 40" in msg) == (storage == "bf16")
    enc = encode_stored(x, storage)
    _append_then_close(tmp_path / "encoded", storage, enc.hidden, scales=enc.scales)
    with CacheWriter(tmp_path / "sound", make_fp(storage), shard_tokens=64) as w:  # finite extremes pass
        x = features(20)
        x[0, 0, 0], x[1, 0, 0] = torch.finfo(torch.bfloat16).max, -torch.finfo(torch.bfloat16).max
        w.append(sample_ids=np.array([0, 1]), lengths=np.array([10, 10]), input_ids=np.zeros(20, np.int32),
                 loss_mask=np.ones(20, np.uint8), hidden=x)
    assert CacheReader(tmp_path / "sound").index.sample_id.size == 2


def test_resume_with_another_layout_is_refused(tmp_path):
    write_cache(tmp_path, "int4", [4, 4])
    with pytest.raises(CacheMismatchError, match="storage"):
        CacheWriter(tmp_path, make_fp("int4-g64-bf16-h32"))
    CacheWriter(tmp_path, make_fp("int4")).close()  # the same --storage int4 resumes


def test_verify_checks_every_new_chunk_and_info_shows_the_format(tmp_path):
    write_cache(tmp_path, "int4", [30, 30, 30], shard_tokens=200)
    rep = verify_cache(tmp_path)
    assert rep.ok, rep.problems
    info = cache_info(tmp_path)
    assert info["storage"] == DEFAULT_QUANT4 and "groups of 32 channels" in info["storage_format"]
    assert info["hidden_bytes_per_token"] == 3 * (D // 2 + D // 32 + 4)
    out = CliRunner().invoke(cli, ["cache", "info", str(tmp_path)])
    assert out.exit_code == 0, out.output
    assert re.search(r"storage\s+int4-g32-e4m3-h32", out.output)
    assert "4-bit int4 codes (-7..7), groups of 32 channels, e4m3 group scales x a float32 row scale" in out.output
    assert re.search(r"bytes per token\s+[\d,.]+ \(hidden 165 B/token", out.output)
    # flip one byte inside a group_scales chunk: verify names the array's chunk
    shard = os.path.join(tmp_path, "shards", CacheReader(tmp_path).index.shard_names[0])
    f = os.path.join(shard, "group_scales", "c", "0", "0", "0")
    data = bytearray(open(f, "rb").read())
    data[5] ^= 0x40
    open(f, "wb").write(bytes(data))
    rep = verify_cache(tmp_path)
    assert not rep.ok and any("group_scales" in p for p in rep.problems)
    bad = CliRunner().invoke(cli, ["cache", "verify", str(tmp_path)])
    assert bad.exit_code == 1 and "group_scales" in bad.output


def doc_recipe() -> dict:
    """The python block of docs/CACHE_FORMAT_4BIT.md, executed with nothing but what it imports."""
    text = DOC.read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S)[1]
    imports = set(re.findall(r"^(?:import|from) (\w+)", code, re.M))
    assert imports <= {"math", "numpy"}, imports  # numpy only: no torch, no dflash
    ns: dict = {}
    exec(compile(code, str(DOC), "exec"), ns)  # noqa: S102 - our own documentation
    return ns


@pytest.mark.parametrize("storage", ["int4", "e2m1-g32-e4m3", "int4-g64-bf16", "e2m1-g32-e8m0-h32"])
def test_documented_numpy_decode_reads_real_shards(tmp_path, storage):
    storage = make_fp(storage).storage
    lengths = [9, 25, 14]
    x, _, _ = write_cache(tmp_path, storage, lengths, shard_tokens=30)
    decode_4bit = doc_recipe()["decode_4bit"]
    committed = [json.loads(line)["shard"] for name in sorted(os.listdir(tmp_path / "commits"))
                 for line in open(tmp_path / "commits" / name)]
    got = {}
    for name in committed:
        g = zarr.open_group(str(tmp_path / "shards" / name), mode="r")
        y = decode_4bit(g)
        for sid, off, n, _ in g["samples"][...]:
            got[int(sid)] = y[off:off + n]
    mine = np.concatenate([got[i] for i in range(len(lengths))])
    ref = expected(x, storage, torch.float32).numpy()
    if quant4.parse_quant4(storage).rotate:  # numpy's matmul sums in another order
        np.testing.assert_allclose(mine, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    else:
        assert np.array_equal(mine, ref)
    with CacheReader(tmp_path) as r:  # and the library's reader agrees with the recipe
        lib = r.read_many(range(len(lengths)), dequantize=False)
        lib = decode_stored(lib.hidden, lib.scales, lib.group_scales, storage=storage, dtype=torch.float32)
        assert torch.equal(lib, torch.from_numpy(ref))


def test_pinned_views_hold_every_encoded_array(tmp_path):
    """Extraction's D2H buffers (dflash.extract.pinned): batch_nbytes fits the 4-bit arrays and encoded_views
    carves non-overlapping views of the device batch's shapes and dtypes."""
    from dflash.extract.pinned import batch_nbytes, encoded_views

    for storage in ("int4", "int4-g64-bf16-h32", "e2m1-g32-e8m0", "fp8", "bf16"):
        enc = encode_stored(features(37), storage)
        buf = torch.zeros(batch_nbytes(tokens=37, num_taps=len(TAPS), hidden=D, storage=storage), dtype=torch.uint8)
        host = encoded_views(buf, enc)
        for name in ("hidden", "scales", "group_scales"):
            src, dst = getattr(enc, name), getattr(host, name)
            assert (src is None) == (dst is None)
            if src is not None:
                assert dst.shape == src.shape and dst.dtype == src.dtype
                dst.copy_(src)
        assert all(torch.equal(getattr(host, n), getattr(enc, n))
                   for n in ("hidden", "scales", "group_scales") if getattr(enc, n) is not None)


def test_extract_estimates_the_4bit_bytes():
    """`dflash extract`'s preflight estimate (and free-space check) counts the 4-bit arrays, not bf16's."""
    from dflash.extract.space import estimate_cache_bytes

    est = estimate_cache_bytes(num_tokens=1 << 16, num_samples=100, num_taps=5, hidden_size=5120, storage="int4",
                               shard_tokens=1 << 16, chunk_tokens=128)
    assert est.hidden == (1 << 16) * 5 * (2560 + 160) and est.scales == (1 << 16) * 5 * 4
    assert (est.hidden + est.scales) / (1 << 16) == stored_layout("int4", 5120).hidden_bytes_per_token(5)
