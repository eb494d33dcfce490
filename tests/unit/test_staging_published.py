"""An extraction's staging folder after kill -9 in the middle of deleting a published shard: the shard is marked
published (the store committed it) and part of its folder is left. The resume check must take the store's word
for it, not fail the shard and ask for --repair (seen on a rerun of `dflash extract --output s3://...`)."""

import os
import shutil

from store_server import make_cache, s3_env, s3_server  # noqa: F401  (fixtures)

from dflash.cache import commit as cm
from dflash.cache.repair import check_committed


def test_a_published_shard_half_deleted_passes_the_resume_check(tmp_path):
    make_cache(tmp_path / "c", num_samples=8)
    path = str(tmp_path / "c")
    first = cm.read_commit_logs(path)[0].shard
    folder = os.path.join(path, cm.SHARDS, first)
    shutil.rmtree(os.path.join(folder, "hidden"))  # what a kill -9 during shutil.rmtree leaves
    faults = check_committed(path)
    assert [f.shard for f in faults] == [first]  # not published: a damaged local shard is a fault
    cm.mark_published(path, first)
    assert check_committed(path) == []


def test_a_folder_holding_only_commit_lines_is_refetched_as_a_mirror(s3_env, tmp_path):
    """A folder with commit lines whose shards were deleted after publishing (an extraction's staging folder,
    one of them left half deleted by a kill) is no mirror: fetching into it gets every shard from the store."""
    from dflash.cache import CacheReader
    from dflash.store.sync import Publisher, fetch_cache

    url = s3_env.create_bucket("dflash-stage") + "/cache"
    make_cache(tmp_path / "src", num_samples=8)
    shutil.copytree(tmp_path / "src", tmp_path / "staging")
    staging = str(tmp_path / "staging")
    Publisher(local=staging, url=url, drop_published=True).finish()
    records = cm.read_commit_logs(staging)
    assert len(records) >= 2 and not os.listdir(os.path.join(staging, cm.SHARDS))  # lines only: all published
    shutil.copytree(tmp_path / "src" / cm.SHARDS / records[0].shard,  # a kill mid-deletion: part of it left
                    os.path.join(staging, cm.SHARDS, records[0].shard), ignore=shutil.ignore_patterns("hidden"))
    st = fetch_cache(url=url, local=staging)
    assert st.shards == len(records)
    assert len(cm.read_commit_logs(staging)) == len(records)  # one line per shard, none added twice
    src, got = CacheReader(tmp_path / "src"), CacheReader(staging)
    for i in range(len(src)):
        a, b = src.read(i), got.read(i)
        assert a.sample_id == b.sample_id and (a.hidden == b.hidden).all() and (a.input_ids == b.input_ids).all()
