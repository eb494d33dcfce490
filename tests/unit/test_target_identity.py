"""dflash.target.identity: the config hash (the model, not how its folder was saved) and the target weights hash
(content of every weight file, cached by file identity)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time

from dflash.target.identity import (sha256_json, target_config_hash, target_config_hashes, target_weights_hash,
                                   weights_hash_cache_path)


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


def _config_dir(path, config: dict):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def test_config_hash_is_the_model_not_how_it_was_saved(tmp_path):
    base = {"architectures": ["LlamaForCausalLM"], "hidden_size": 576, "num_hidden_layers": 30,
            "text_config": {"hidden_size": 576, "dtype": "bfloat16"}}
    a = _config_dir(tmp_path / "a", base | {"transformers_version": "4.57.1", "torch_dtype": "bfloat16"})
    # re-saved elsewhere by transformers 5: its version, dtype renamed, a local name: the same target
    b = _config_dir(tmp_path / "b", base | {"transformers_version": "5.17.0", "dtype": "bfloat16",
                                            "_name_or_path": "/models/smol", "text_config": {"hidden_size": 576}})
    c = _config_dir(tmp_path / "c", base | {"transformers_version": "4.57.1", "num_hidden_layers": 29})
    assert target_config_hash(a) == target_config_hash(b) != target_config_hash(c)
    # the whole file's hash (what caches and records carry from before) still names the target, but only its own
    whole_a = sha256_json(json.loads((a / "config.json").read_text()))
    assert target_config_hashes(a) == {target_config_hash(a), whole_a}
    assert whole_a not in target_config_hashes(b)


def test_check_target_accepts_the_whole_file_hash(tmp_path):
    import dataclasses

    import pytest

    from dflash.errors import CacheMismatchError
    from dflash.target.check import check_target_matches

    model = _config_dir(tmp_path / "m", {"hidden_size": 8, "transformers_version": "4.57.1"})
    whole = sha256_json(json.loads((model / "config.json").read_text()))

    @dataclasses.dataclass
    class Fp:  # the fields check_target_matches reads
        target_config_hash: str
        hidden_size: int = 8
        num_target_layers: int = 2
        target_weights_hash: str = ""

    for recorded in (target_config_hash(model), whole):
        check_target_matches(Fp(recorded), model_dir=model, tokenizer=None, embed_hidden=8, num_target_layers=2)
    with pytest.raises(CacheMismatchError) as e:
        check_target_matches(Fp("ab" * 32), model_dir=model, tokenizer=None, embed_hidden=8, num_target_layers=2)
    assert e.value.field == "target_config_hash"


def test_generate_job_begun_under_the_whole_file_hash_keeps_it(tmp_path):
    from dflash.generate.run import model_fingerprint

    model = _config_dir(tmp_path / "m", {"hidden_size": 8, "transformers_version": "4.57.1"})
    whole = sha256_json(json.loads((model / "config.json").read_text()))
    assert model_fingerprint(str(model))["config_hash"] == target_config_hash(model) != whole
    assert model_fingerprint(str(model), earlier={"config_hash": whole})["config_hash"] == whole
    # another target's job is not adopted: the output's job check then names the difference
    assert model_fingerprint(str(model), earlier={"config_hash": "ab" * 32})["config_hash"] == target_config_hash(model)
