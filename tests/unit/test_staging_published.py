"""An extraction's staging folder after kill -9 in the middle of deleting a published shard: the shard is marked
published (the store committed it) and part of its folder is left. The resume check must take the store's word
for it, not fail the shard and ask for --repair (seen on a rerun of `dflash extract --output s3://...`)."""

import os
import shutil

from store_server import make_cache

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
