"""dflash.target.identity: the target weights hash (content of every weight file, cached by file identity)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time

from dflash.target.identity import target_config_hash, target_weights_hash, weights_hash_cache_path


def test_weights_replaced_in_place_change_the_hash(tmp_path, monkeypatch):
    from dflash.target.testing import tiny_qwen35_dir

    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "home"))
    a = tiny_qwen35_dir(tmp_path / "a", seed=0)
    b = tiny_qwen35_dir(tmp_path / "b", seed=1)
    assert target_config_hash(a) == target_config_hash(b)  # same config.json and tokenizer, other weights
    h0 = target_weights_hash(a)
    assert len(h0) == 64 and h0 == target_weights_hash(a)
    assert weights_hash_cache_path().is_file()  # computed once, then read back
    # Overwrite the weights in place and give them back the old mtime: the cache must not be fooled.
    w = a / "model.safetensors"
    st = os.stat(w)
    shutil.copyfile(b / "model.safetensors", w)
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(w).st_size == st.st_size
    assert target_weights_hash(a) == target_weights_hash(b) != h0


def test_cached_hash_is_reused_and_no_weights_hash_empty(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "home"))
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert target_weights_hash(model) == ""  # e.g. a hub name: nothing local to hash
    (model / "model-00001-of-00002.safetensors").write_bytes(os.urandom(1 << 20))
    (model / "model-00002-of-00002.safetensors").write_bytes(os.urandom(1 << 20))
    h = target_weights_hash(model)
    entries = json.loads(weights_hash_cache_path().read_text())
    assert len(entries) == 2
    # A cached entry is trusted while the file's identity holds: poison it and see it used.
    for e in entries.values():
        e["sha256"] = "0" * 64
    weights_hash_cache_path().write_text(json.dumps(entries))
    assert target_weights_hash(model) != h
    time.sleep(0.01)
    new = os.urandom(1 << 20)
    (model / "model-00002-of-00002.safetensors").write_bytes(new)  # new content: recomputed
    target_weights_hash(model)
    entries = json.loads(weights_hash_cache_path().read_text())
    assert entries[str((model / "model-00002-of-00002.safetensors").resolve())]["sha256"] == \
        hashlib.sha256(new).hexdigest()
