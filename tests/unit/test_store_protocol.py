"""The object-store commit protocol as pure functions over keys (no server): records decide, orphans and
faults are found, the upload order puts metadata last, URLs parse or fail in one line."""

import pytest

from dflash.cache import commit as cm
from dflash.errors import CacheFormatError, StoreError
from dflash.store import protocol as sp
from dflash.store.url import is_store_url, mirror_folder, parse_store_url


def shard_keys(shard):
    return [f"shards/{shard}/zarr.json", f"shards/{shard}/hidden/zarr.json", f"shards/{shard}/hidden/c/0/0/0",
            f"shards/{shard}/samples/zarr.json", f"shards/{shard}/samples/c/0/0"]


def test_shard_exists_iff_its_record_exists():
    a, b, c = cm.shard_name(rank=0, seq=0), cm.shard_name(rank=0, seq=1), cm.shard_name(rank=1, seq=0)
    keys = ([cm.MANIFEST] + shard_keys(a) + shard_keys(b) + shard_keys(c)
            + [sp.record_key(rank=0, shard=a), sp.record_key(rank=1, shard=c)])
    got = sp.classify_keys(reversed(keys))  # listing order does not matter
    assert list(got.records) == [a, c]
    assert got.orphans == tuple(sorted(shard_keys(b)))  # b's objects without a record: a killed publisher
    assert got.missing == () and got.has_manifest and got.strays == ()


def test_record_without_objects_is_a_fault_and_unknown_keys_are_strays():
    a = cm.shard_name(rank=2, seq=7)
    keys = [sp.record_key(rank=2, shard=a), "commits/rank-3/" + a + ".json", "notes.txt", "shards/junk/x",
            "commits/rank-2/not-a-shard.json"]
    got = sp.classify_keys(keys)
    assert got.records == {a: sp.record_key(rank=2, shard=a)} and got.missing == (a,)
    # a record filed under another rank's folder is not a commit: shard names carry their rank
    assert got.strays == tuple(sorted(keys[1:])) and not got.has_manifest


def test_upload_order_data_then_array_metadata_then_group():
    rels = ["zarr.json", "samples/zarr.json", "hidden/c/0/0/0", "hidden/zarr.json", "samples/c/0/0"]
    order = sp.upload_order(rels)
    assert order[-1] == "zarr.json"
    assert set(order[:2]) == {"hidden/c/0/0/0", "samples/c/0/0"}
    assert set(order[2:4]) == {"hidden/zarr.json", "samples/zarr.json"}


def test_record_round_trip_uses_the_local_line():
    r = cm.CommitRecord(shard=cm.shard_name(rank=1, seq=3), rank=1, seq=3, num_samples=2, num_tokens=9,
                        num_loss_tokens=4, nbytes=100, sample_ids=(5, 8))
    assert sp.parse_record(r.to_line(), key="k") == r
    with pytest.raises(CacheFormatError, match="exactly one complete line"):
        sp.parse_record(r.to_line()[:-1], key="k")  # torn (no newline): not a record
    with pytest.raises(CacheFormatError, match="exactly one"):
        sp.parse_record(r.to_line() * 2, key="k")


def test_urls():
    assert is_store_url("s3://b/p") and not is_store_url("/tmp/x") and not is_store_url("file:///tmp/x")
    u = parse_store_url("s3://bucket/a/b/")
    assert (u.scheme, u.bucket, u.prefix, u.url) == ("s3", "bucket", "a/b", "s3://bucket/a/b")
    with pytest.raises(StoreError, match=r"unknown URL scheme 'ftp'.*s3://"):
        parse_store_url("ftp://h/x")
    with pytest.raises(StoreError, match="no bucket"):
        parse_store_url("s3:///x")
    assert mirror_folder("s3://b/p", root="/r") == mirror_folder("s3://b/p/", root="/r") != mirror_folder(
        "s3://b/q", root="/r")


def test_missing_client_is_one_line(monkeypatch):
    import sys

    from dflash.store.objects import open_store
    monkeypatch.setitem(sys.modules, "obstore.store", None)  # what `import obstore.store` sees when not installed
    with pytest.raises(StoreError, match=r"^s3://bucket/c: caches on object stores need the obstore client: "
                                         r"pip install obstore$"):
        open_store("s3://bucket/c")
