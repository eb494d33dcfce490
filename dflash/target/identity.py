"""Hashes that identify a target for cache fingerprints: its config, weights, tokenizer and chat template.

One definition used by extraction (writes them into the manifest), training and evaluation (check that
--model is the target a cache was made with) and generation (marks target-greedy records). Each hash is
over canonical JSON, so key order, whitespace and file layout do not change it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


SAVE_RECORD_KEYS = frozenset({"transformers_version", "_name_or_path", "_commit_hash", "torch_dtype", "dtype"})
"""config.json keys that record how and where a folder was saved, not the model: save_pretrained writes its own
transformers version into every config (and transformers 5 renames torch_dtype to dtype), so the same target
re-saved on another machine would otherwise change identity. The weights' dtype is in the weights hash, the
compute dtype in the fingerprint's target_dtype."""


def _model_keys(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _model_keys(v) for k, v in obj.items() if k not in SAVE_RECORD_KEYS}
    if isinstance(obj, list):
        return [_model_keys(v) for v in obj]
    return obj


def _read_config(model_dir: str | os.PathLike) -> dict:
    with open(Path(model_dir) / "config.json") as f:
        return json.load(f)


def target_config_hash(model_dir: str | os.PathLike) -> str:
    """sha256 of config.json as canonical JSON, without the keys that record how it was saved (SAVE_RECORD_KEYS,
    at every depth)."""
    return sha256_json(_model_keys(_read_config(model_dir)))


def target_config_hashes(model_dir: str | os.PathLike) -> frozenset[str]:
    """Every hash that names this target's config: target_config_hash, and the hash of the whole file that
    caches, eval responses and generated records written before SAVE_RECORD_KEYS carry (so they stay this
    target's)."""
    config = _read_config(model_dir)
    return frozenset({sha256_json(_model_keys(config)), sha256_json(config)})


def tokenizer_hash(tokenizer: Any) -> str:
    """sha256 over the vocabulary, the special-token map and the tokenizer class."""
    vocab = sorted(tokenizer.get_vocab().items())
    specials = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    return sha256_json({"vocab": vocab, "special": specials, "class": type(tokenizer).__name__})


def chat_template_hash(tokenizer: Any) -> str:
    return sha256_json(tokenizer.chat_template)


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
"""Files of a model folder whose bytes are the weights (config and tokenizer have their own hashes)."""
_HASH_CHUNK = 1 << 24


def weights_hash_cache_path() -> Path:
    """Where file content hashes are kept: $DFLASH_HOME/weights-sha256.json (shared by every cache)."""
    from dflash.home import dflash_home

    return dflash_home() / "weights-sha256.json"


def _file_key(st: os.stat_result) -> dict:
    # ctime and inode too, not only size and mtime: `cp -p` or `os.utime` restores an mtime, but a rewrite
    # always moves ctime (users cannot set it), and a replaced file (mv, save_pretrained) is a new inode.
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "ino": st.st_ino,
            "dev": st.st_dev}


def _sha256_path(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while block := f.read(_HASH_CHUNK):
            h.update(block)  # releases the GIL: files hash in parallel threads
    return h.hexdigest()


def target_weights_hash(model_dir: str | os.PathLike) -> str:
    """sha256 over (file name, size, content sha256) of every weight file of a model folder; "" when it has
    none (a hub name, or weights elsewhere). Replacing the weights in place under the same config.json and
    tokenizer changes it.

    Cost: the first call reads every weight byte; the content hashes are then cached in
    weights_hash_cache_path() by (path, size, mtime, ctime, inode), so later calls only stat the files (0.6 ms).
    Measured on the shared 2-core CI machine (load ~9): SmolLM2's 269 MB model.safetensors (in page cache)
    hashed at 230-330 MB/s, sha256 of an in-memory buffer at 540 MB/s (SHA-NI). Extrapolated to a 54 GB 27B
    checkpoint: 100-230 s on one core; its ~11 files hash in parallel threads, so on a GPU node's cores it is
    bounded by the disk (~32 s at the H200 machine's 1.7 GB/s), once per checkpoint. Concurrent callers (the
    ranks of one extract) wait on a flock and reuse the first one's work.
    """
    import fcntl
    from concurrent.futures import ThreadPoolExecutor

    root = Path(model_dir)
    files = sorted(p for p in root.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)) \
        if root.is_dir() else []
    if not files:
        return ""
    cache_path = weights_hash_cache_path()
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    lock_fd = os.open(f"{cache_path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            cached = json.loads(cache_path.read_text()) if cache_path.exists() else {}
        except ValueError:
            cached = {}  # a torn cache file costs one recomputation, nothing else
        stats = {f: os.stat(f) for f in files}
        keys = {f: str(f.resolve()) for f in files}
        todo = [f for f in files if (e := cached.get(keys[f])) is None or
                {k: e.get(k) for k in _file_key(stats[f])} != _file_key(stats[f])]
        if todo:
            with ThreadPoolExecutor(max_workers=max(1, min(len(todo), os.cpu_count() or 1))) as pool:
                for f, digest in zip(todo, pool.map(_sha256_path, todo)):
                    cached[keys[f]] = {**_file_key(stats[f]), "sha256": digest}
            tmp = cache_path.with_name(f"{cache_path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cached, sort_keys=True, indent=0))
            os.replace(tmp, cache_path)
        return sha256_json([{"file": f.name, "size": stats[f].st_size, "sha256": cached[keys[f]]["sha256"]}
                            for f in files])
    finally:
        os.close(lock_fd)  # drops the flock
