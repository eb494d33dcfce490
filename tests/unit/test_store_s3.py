"""Caches on a real S3 server (SeaweedFS on localhost, tests/store_server.py): publish and fetch round trips,
tap-subset reads, plain zarr reads, orphans of a killed publisher, and the one-line configuration errors."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
import zarr
from store_server import make_cache, s3_env, s3_server  # noqa: F401  (fixtures)

from dflash.cache import CacheReader
from dflash.cache import commit as cm
from dflash.errors import CacheMismatchError, CacheNotFoundError, StoreError
from dflash.store import protocol as sp
from dflash.store.objects import open_store, zarr_store
from dflash.store.sync import fetch_cache, publish_cache

def same_reads(a, b, taps=None):
    with CacheReader(a) as ra, CacheReader(b) as rb:
        assert len(ra) == len(rb) and np.array_equal(ra.index.sample_id, rb.index.sample_id)
        order = list(range(len(ra)))[::-1]
        pa, pb = ra.read_many(order, taps=taps), rb.read_many(order, taps=taps)
        assert torch.equal(pa.hidden, pb.hidden) and np.array_equal(pa.input_ids, pb.input_ids)
        assert (pa.scales is None) == (pb.scales is None)
        if pa.scales is not None:
            assert torch.equal(pa.scales, pb.scales)
        return rb.bytes_read


def test_publish_fetch_subset_and_plain_zarr(s3_env, tmp_path):
    url = s3_env.create_bucket("dflash-rt") + "/team/cache"
    make_cache(tmp_path / "local")
    st = publish_cache(local=str(tmp_path / "local"), url=url)
    assert st.shards == len(cm.read_commit_logs(str(tmp_path / "local"))) > 2 and st.skipped == 0
    again = publish_cache(local=str(tmp_path / "local"), url=url)  # idempotent
    assert (again.shards, again.skipped, again.bytes) == (0, st.shards, 0)

    full = fetch_cache(url=url, local=str(tmp_path / "all"))
    assert full.shards == st.shards
    same_reads(tmp_path / "local", tmp_path / "all")
    sub = fetch_cache(url=url, local=str(tmp_path / "sub"), taps=(3, 9))
    same_reads(tmp_path / "local", tmp_path / "sub", taps=[3, 9])
    assert sub.bytes <= 0.45 * full.bytes  # 2 of 5 taps: only their byte ranges (plus small arrays, indexes)
    with pytest.raises(Exception, match="crc32c"):  # an unfetched tap is never silently zeros
        CacheReader(tmp_path / "sub").read_many([0], taps=[1])

    shard = cm.read_commit_logs(str(tmp_path / "local"))[0].shard
    g = zarr.open_group(zarr_store(url), path=f"{cm.SHARDS}/{shard}", mode="r")
    plain = zarr.open_group(str(tmp_path / "local" / cm.SHARDS / shard), mode="r")
    assert np.array_equal(g["hidden"][:], plain["hidden"][:]) and np.array_equal(g["samples"][:], plain["samples"][:])


def test_killed_publisher_leaves_orphans_that_readers_ignore_and_publish_removes(s3_env, tmp_path, monkeypatch):
    url = s3_env.create_bucket("dflash-orphans") + "/c"
    make_cache(tmp_path / "local", storage="bf16")
    publish_cache(local=str(tmp_path / "local"), url=url)
    store = open_store(url)
    # what a publisher killed before its commit record leaves: all objects of a shard, no record
    recs = cm.read_commit_logs(str(tmp_path / "local"))
    ghost = cm.shard_name(rank=0, seq=recs[-1].seq + 1)
    for key in open_store(url).list_keys(sp.shard_prefix(recs[0].shard)):
        store.put(key.replace(recs[0].shard, ghost), store.get(key))
    listing = sp.classify_keys(store.list_keys())
    assert listing.orphans and all(ghost in k for k in listing.orphans) and ghost not in listing.records
    fetch_cache(url=url, local=str(tmp_path / "m"))
    assert len(CacheReader(tmp_path / "m")) == len(CacheReader(tmp_path / "local"))  # the ghost is not read
    from click.testing import CliRunner

    from cli.main import cli
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "home"))
    res = CliRunner().invoke(cli, ["cache", "verify", url])
    assert res.exit_code == 0, res.output
    assert f"uncommitted shards ({ghost})" in res.output and "ok:" in res.output
    assert publish_cache(local=str(tmp_path / "local"), url=url).orphans_removed == len(listing.orphans)
    assert not sp.classify_keys(store.list_keys()).orphans
    totals = json.loads(store.get(cm.MANIFEST))["totals"]
    assert totals == CacheReader(tmp_path / "local").manifest["totals"]


def test_fingerprint_mismatch_and_missing_cache(s3_env, tmp_path):
    url = s3_env.create_bucket("dflash-fp") + "/c"
    make_cache(tmp_path / "a", storage="bf16")
    make_cache(tmp_path / "b", storage="fp8")
    publish_cache(local=str(tmp_path / "a"), url=url)
    with pytest.raises(CacheMismatchError, match="storage"):
        publish_cache(local=str(tmp_path / "b"), url=url)
    with pytest.raises(CacheNotFoundError, match="no dflash cache at s3://dflash-fp/elsewhere"):
        fetch_cache(url="s3://dflash-fp/elsewhere", local=str(tmp_path / "m"))


def one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text and "dflash-test-secret" not in text and "dflash-test-key" not in text
    return text


def test_configuration_errors_are_one_line(s3_server, monkeypatch):
    from dflash.procs import free_port
    s3_server.create_bucket("dflash-errors")
    cases = [
        (dict(AWS_SECRET_ACCESS_KEY="wrong"), "s3://dflash-errors/c", "rejected the credentials"),
        ({}, "s3://dflash-no-such-bucket/c", "bucket does not exist"),
        (dict(AWS_ENDPOINT_URL=f"http://127.0.0.1:{free_port()}"), "s3://dflash-errors/c", "cannot reach"),
        ({}, "ftp://host/c", "unknown URL scheme 'ftp'"),
    ]
    for overrides, url, want in cases:
        for key, value in s3_server.env(**overrides).items():
            monkeypatch.setenv(key, value)
        with pytest.raises(StoreError) as err:
            open_store(url)
        assert want in one_line(err) and url.split("/")[2] in str(err.value)
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == "dflash-test-secret"


def test_server_stopped_mid_read_and_for_a_write_then_both_resume(s3_env, tmp_path, monkeypatch):
    url = s3_env.create_bucket("dflash-faults") + "/c"
    make_cache(tmp_path / "local", storage="bf16", num_samples=6)
    publish_cache(local=str(tmp_path / "local"), url=url)
    shutil.copytree(tmp_path / "local", tmp_path / "more")  # a later state of the same cache: more shards
    make_cache(tmp_path / "more", storage="bf16", num_samples=6, seed=1, first_id=100)
    from dflash.store import objects

    # fewer retries: a stopped server is reported within seconds, not after the 30 s retry budget
    monkeypatch.setattr(objects, "RETRY", {"max_retries": 1, "retry_timeout": objects.RETRY["retry_timeout"]})
    real_get = objects.Store.get_to_file

    def stop_then_get(self, key, path):  # the server dies after the fetch listed and opened the cache
        s3_env.stop()
        return real_get(self, key, path)
    monkeypatch.setattr(objects.Store, "get_to_file", stop_then_get)
    direct = CacheReader(url)  # a direct reader (train's default), opened while the server is up
    try:
        with pytest.raises(StoreError) as err:
            fetch_cache(url=url, local=str(tmp_path / "m"))
        assert "cannot reach" in one_line(err)
        with pytest.raises(StoreError) as err:  # its next read, with the server gone
            direct.read_many([0, 1], taps=[3])
        assert "cannot reach" in one_line(err) and url in str(err.value)
        monkeypatch.setattr(objects.Store, "get_to_file", real_get)
        with pytest.raises(StoreError) as err:
            publish_cache(local=str(tmp_path / "more"), url=url)
        assert "cannot reach" in one_line(err)
    finally:
        s3_env.start()
    assert fetch_cache(url=url, local=str(tmp_path / "m")).shards > 0  # the rerun completes the mirror
    with CacheReader(tmp_path / "local") as want:  # the same reader reads again once the server is back
        assert torch.equal(direct.read_many([0, 1], taps=[3]).hidden, want.read_many([0, 1], taps=[3]).hidden)
    direct.close()
    same_reads(tmp_path / "local", tmp_path / "m")
    publish_cache(local=str(tmp_path / "more"), url=url)
    fetch_cache(url=url, local=str(tmp_path / "m2"))
    same_reads(tmp_path / "more", tmp_path / "m2")


def test_unpublished_local_shard_with_a_name_the_store_committed_elsewhere_yields_to_the_store(s3_env, tmp_path):
    """Machine A is killed with a shard committed locally but not yet published; machine B resumes the same
    URL and commits other samples under that shard name; A fetches again: the store wins (A's shard is
    uncommitted locally so its samples get extracted again), A's mirror equals the store."""
    url = s3_env.create_bucket("dflash-conflict") + "/c"
    a, b = tmp_path / "a", tmp_path / "b"
    make_cache(a, storage="bf16", num_samples=6)
    publish_cache(local=str(a), url=url)
    fetch_cache(url=url, local=str(b))
    make_cache(b, storage="bf16", num_samples=6, seed=1, first_id=100)   # B's new shards, published
    publish_cache(local=str(b), url=url)
    make_cache(a, storage="bf16", num_samples=6, seed=2, first_id=200)   # A's, same names, never published
    fetch_cache(url=url, local=str(a))
    fetch_cache(url=url, local=str(tmp_path / "truth"))
    same_reads(tmp_path / "truth", a)
    assert not {200, 202} & set(CacheReader(a).index.sample_id.tolist())  # to be extracted again


def test_test_server_is_ready_only_when_its_port_speaks_s3(tmp_path):
    """The test server's readiness: another HTTP server on the S3 port (once, the filer of a server whose port
    pick collided: a test then listed the filer's HTML page) is not the gateway, even with a master that has
    volumes; an S3 XML error is. The picked ports differ."""
    import http.server
    import threading

    from store_server import SeaweedServer, distinct_free_ports

    ports = distinct_free_ports(50)
    assert len(set(ports)) == 50
    answer = {"s3": None}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            if self.path == "/dir/status":  # a master with writable volumes
                code, body = 200, json.dumps({"Topology": {"Max": 1}}).encode()
            elif answer["s3"] == "xml":
                code, body = 403, b'<?xml version="1.0"?><Error><Code>AccessDenied</Code></Error>'
            else:
                code, body = 200, b"<!DOCTYPE html><html><head><link rel=x></head></html>"
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    fake = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=fake.serve_forever, daemon=True).start()
    try:
        server = SeaweedServer(tmp_path)
        port = fake.server_address[1]
        server.endpoint, server.ports["master.port"] = f"http://127.0.0.1:{port}", port
        assert not server._answers()
        answer["s3"] = "xml"
        assert server._answers()
    finally:
        fake.shutdown()
