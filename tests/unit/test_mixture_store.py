"""A mixture whose first cache is a URL on a real S3-compatible server (SeaweedFS on localhost), read
directly: the same steps and losses as the same mixture of local folders."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from store_server import s3_env, s3_server  # noqa: E402,F401  (fixtures)
from test_train_defects import _steps_and_losses  # noqa: E402
from train_helpers import tiny_cache, tiny_config, tiny_target  # noqa: E402


def test_a_weighted_run_reads_a_cache_url_like_its_folder(s3_env, tmp_path, monkeypatch):
    from dflash.store.sync import publish_cache
    from dflash.train.trainer import train

    monkeypatch.setenv("DFLASH_NO_PROGRESS", "1")
    target = tiny_target(tmp_path / "target")
    a = tiny_cache(tmp_path / "a", target, num_samples=12, seed=0)
    b = tiny_cache(tmp_path / "b", target, num_samples=12, seed=1)
    url = s3_env.create_bucket("dflash-mix") + "/a"
    publish_cache(local=str(a), url=url)
    kw = dict(extra_caches=(str(b),), cache_weights=(1, 3), model=str(target), steps=4)
    res = train(tiny_config(cache=url, output=str(tmp_path / "url"), **kw), device="cpu")
    train(tiny_config(cache=str(a), output=str(tmp_path / "local"), **kw), device="cpu")
    assert res.finished and res.cache_bytes_read > 0
    assert _steps_and_losses(tmp_path / "url") == _steps_and_losses(tmp_path / "local")
