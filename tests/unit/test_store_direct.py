"""A cache URL read straight from the store (dflash.store.direct) on a real S3 server (SeaweedFS on localhost):
the same samples as the local cache, the same bytes read, tap subsets fetching only their ranges, into the
caller's buffers, nothing written locally; corruption, orphans and the training loader."""

import numpy as np
import pytest
import torch
from store_server import make_cache, s3_env, s3_server  # noqa: F401  (fixtures)

from dflash.cache import CacheReader
from dflash.cache import commit as cm
from dflash.cache.reader import PackedBuffers
from dflash.errors import CacheFormatError
from dflash.store import protocol as sp
from dflash.store.objects import open_store
from dflash.store.sync import publish_cache
from dflash.train.loader import StreamingLoader, plan_epoch


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty $DFLASH_HOME: a direct read must leave it empty (no mirror, no staging)."""
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def published(s3_env, tmp_path, bucket, **kw) -> str:
    url = s3_env.create_bucket(bucket) + "/c"
    make_cache(tmp_path / "local", **kw)
    publish_cache(local=str(tmp_path / "local"), url=url)
    return url


def read_both(local, url, *, taps, order):
    with CacheReader(local) as a, CacheReader(url) as b:
        assert b.num_threads == 16 and a.num_threads == 1
        assert np.array_equal(a.index.sample_id, b.index.sample_id) and a.manifest == b.manifest
        pa, pb = a.read_many(order, taps=taps), b.read_many(order, taps=taps)
        assert torch.equal(pa.hidden, pb.hidden) and np.array_equal(pa.input_ids, pb.input_ids)
        assert np.array_equal(pa.loss_mask, pb.loss_mask) and np.array_equal(pa.sample_ids, pb.sample_ids)
        assert (pa.scales is None) == (pb.scales is None)
        if pa.scales is not None:
            assert torch.equal(pa.scales, pb.scales)
        assert a.bytes_read == b.bytes_read > 0  # the same byte ranges, each a ranged GET
        return b.bytes_read


@pytest.mark.parametrize("storage", ["fp8", "bf16", "int4"])
def test_direct_reads_equal_the_local_cache_and_copy_nothing_locally(s3_env, tmp_path, home, storage):
    url = published(s3_env, tmp_path, f"dflash-direct-{storage}", storage=storage)
    n = len(CacheReader(tmp_path / "local"))
    order = [3, 0, 1, 2, n - 1, 5, 4]  # runs of neighbours (one GET per tap) and jumps across shards
    full = read_both(tmp_path / "local", url, taps=None, order=order)
    sub = read_both(tmp_path / "local", url, taps=[9, 3], order=order)
    # 2 of 5 taps: only their byte ranges (fp8/int4 row scales are one [T, K] array read whole: at D=64 that
    # is 20 of every 340 bytes per token; at the 27B's D=5120 it is noise)
    assert sub <= (0.45 if storage == "bf16" else 0.5) * full
    assert not home.exists()


def test_reads_land_in_the_callers_buffers(s3_env, tmp_path, home):
    url = published(s3_env, tmp_path, "dflash-direct-out")
    with CacheReader(url) as r:
        T = int(r.index.length[:3].sum())
        out = PackedBuffers.allocate(tokens=T + 10, num_taps=2, hidden_size=r.hidden_size, storage=r.storage)
        p = r.read_many([0, 1, 2], taps=[1, 7], out=out)
        assert p.hidden.data_ptr() == out.hidden.data_ptr() and p.scales.data_ptr() == out.scales.data_ptr()
        want = CacheReader(tmp_path / "local").read_many([0, 1, 2], taps=[1, 7])
        assert torch.equal(out.hidden[:T], want.hidden) and torch.equal(out.scales[:T], want.scales)


def test_a_corrupted_object_is_a_checksum_error_naming_it_and_orphans_are_never_read(s3_env, tmp_path, home):
    url = published(s3_env, tmp_path, "dflash-direct-bad", storage="bf16")
    store = open_store(url)
    recs = cm.read_commit_logs(str(tmp_path / "local"))
    ghost = cm.shard_name(rank=0, seq=recs[-1].seq + 1)  # a killed publisher's objects, without a record
    for key in store.list_keys(sp.shard_prefix(recs[0].shard)):
        store.put(key.replace(recs[0].shard, ghost), store.get(key))
    assert len(CacheReader(url)) == len(CacheReader(tmp_path / "local"))
    key = next(k for k in store.list_keys(sp.shard_prefix(recs[0].shard) + "hidden/") if "/c/" in k)
    raw = bytearray(store.get(key))
    raw[100] ^= 0xFF  # inside the first chunk of tap 0
    store.put(key, bytes(raw))
    with CacheReader(url) as r, pytest.raises(CacheFormatError, match=f"shard {recs[0].shard} array hidden.*crc32c"):
        r.read_many([int(np.flatnonzero(r.index.shard == 0)[0])], taps=[1])


def test_the_training_loader_streams_a_url_like_the_folder(s3_env, tmp_path, home):
    url = published(s3_env, tmp_path, "dflash-direct-loader", num_samples=20)
    got = {}
    for where in (str(tmp_path / "local"), url):
        with CacheReader(where) as r:
            plan = plan_epoch(r.index.length, seed=3, epoch=0, batch_tokens=150, world_size=1, grad_accum=1)
            with StreamingLoader(r, plan, rank=0, start_step=0, taps=[5, 1], device=torch.device("cpu"),
                                 dtype=torch.float32, prefetch=3) as loader:
                got[where] = [(mb.sample_ids.tolist(), mb.hidden_TKD.clone(), mb.input_ids_T.clone())
                              for mb in loader]
    a, b = got.values()
    assert len(a) == len(b) > 3
    for (ia, ha, xa), (ib, hb, xb) in zip(a, b):
        assert ia == ib and torch.equal(ha, hb) and torch.equal(xa, xb)
    assert not home.exists()


def test_cache_info_of_a_url_reads_no_shard_and_names_a_running_extraction(s3_env, tmp_path, home):
    import json
    import time

    from click.testing import CliRunner

    from cli.main import cli
    from dflash.cache.verify import cache_info
    from dflash.store.lease import Lease
    url = published(s3_env, tmp_path, "dflash-direct-info")

    def info() -> dict:
        res = CliRunner().invoke(cli, ["cache", "info", url, "--json"])
        assert res.exit_code == 0, res.output
        return json.loads(res.output)
    got, want = info(), cache_info(tmp_path / "local")
    for k in ("samples", "tokens", "loss_tokens", "shards", "shard_bytes", "tap_layer_ids", "storage"):
        assert got[k] == want[k], k
    assert got["bytes_on_disk"] >= got["shard_bytes"] and got["being_written_by"] is None
    now = time.time()
    open_store(url).put(sp.LEASE_KEY, Lease(owner="j", host="node-b", pid=7, purpose="dflash extract",
                                            acquired=now, renewed=now, ttl_s=300.0).to_bytes())
    assert info()["being_written_by"].startswith("PID 7 on host node-b (dflash extract")
    assert not home.exists()


def test_one_ranged_get_per_contiguous_run_and_no_chunk_fetched_twice(s3_env, tmp_path, home, monkeypatch):
    """A sample longer than the local reader's 8 MB piece (1,500 rows of 8 KB per tap) within one write block
    is one GET per tap on a store (a request costs ~1 MB of payload time, bench_store); the bytes fetched are
    exactly the chunks its rows cover, each once (a piece cut inside a chunk fetched that chunk twice)."""
    from dflash.cache import CacheWriter, Fingerprint
    from dflash.store import direct

    D, taps = 4096, (3, 7)
    fp = Fingerprint(target="m", target_config_hash="h", num_target_layers=12, hidden_size=D,
                     target_dtype="bfloat16", tokenizer_hash="t", chat_template_hash="c", tap_layer_ids=taps,
                     storage="bf16")
    rng = np.random.default_rng(0)
    lengths = np.array([37, 1500, 20])
    T = int(lengths.sum())
    with CacheWriter(tmp_path / "local", fp, shard_tokens=4096) as w:
        w.append(sample_ids=np.arange(3), lengths=lengths, input_ids=np.zeros(T, np.int32),
                 loss_mask=np.ones(T, np.uint8), hidden=torch.randn(T, len(taps), D))
    url = s3_env.create_bucket("dflash-direct-runs") + "/c"
    publish_cache(local=str(tmp_path / "local"), url=url)
    got: list[tuple[str, int, int]] = []
    read_at = direct.ObjectRanges.read_at
    monkeypatch.setattr(direct.ObjectRanges, "read_at",
                        lambda self, off, n, scratch: got.append((self.key, off, n)) or read_at(self, off, n, scratch))
    with CacheReader(url) as r, CacheReader(tmp_path / "local") as local:
        a = r._array(0, "hidden")
        got.clear()  # the index's samples arrays
        p = r.read_many([1])
        assert torch.equal(p.hidden, local.read_many([1]).hidden)
        cr = a.chunk_shape[0]
        first, last = 37 // cr, (37 + 1500 - 1) // cr
        assert len(got) == len(taps) == sum(len(a.row_runs(37, 37 + 1500, (k, 0))) for k in range(len(taps)))
        per_chunk = int(a.index[0, 1])
        assert r.bytes_read == sum(n for _, _, n in got) == len(taps) * (last - first + 1) * per_chunk


def test_a_shuffle_block_plan_reads_the_store_in_fewer_ranged_gets(s3_env, tmp_path, home, monkeypatch):
    """train --shuffle-block: micro-batches of storage neighbours need far fewer ranged GETs for the same
    epoch (every sample once, the same bytes per sample) than shuffled samples (one GET per sample and tap)."""
    from dflash.store import direct
    from dflash.train.config import TrainConfig
    from dflash.train.loader import config_plan

    url = published(s3_env, tmp_path, "dflash-direct-blocks", num_samples=60, shard_tokens=1000)
    gets: list[int] = []
    read_at = direct.ObjectRanges.read_at
    monkeypatch.setattr(direct.ObjectRanges, "read_at",
                        lambda self, off, n, scratch: gets.append(n) or read_at(self, off, n, scratch))
    requests = {}
    with CacheReader(url) as r, CacheReader(tmp_path / "local") as local:
        for block in (0, 8):
            cfg = TrainConfig(cache=url, model="m", output="o", batch_tokens=300, shuffle_block=block)
            plan = config_plan(cfg, r.index, epoch=0, world_size=1)
            mbs = [mb for s in plan.steps for mb in s if len(mb)]
            assert sorted(np.concatenate(mbs).tolist()) == list(range(60))
            gets.clear()
            for mb in mbs:
                p, want = r.read_many(mb), local.read_many(mb)
                assert torch.equal(p.hidden, want.hidden) and np.array_equal(p.sample_ids, want.sample_ids)
            requests[block] = len(gets)
    assert requests[8] < 0.5 * requests[0], requests
