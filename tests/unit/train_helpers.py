"""Shared fixtures of the train tests: a tiny real target folder (random Qwen3.5, saved and reloaded through
the real path) and a real cache written with CacheWriter whose fingerprint matches that target."""

from __future__ import annotations

import os
import pathlib

import numpy as np
import torch

from dflash.cache import CacheWriter, Fingerprint
from dflash.extract.preflight import chat_template_hash, config_hash, tokenizer_hash


def tiny_target(path: pathlib.Path, num_layers: int = 4) -> pathlib.Path:
    from dflash.target.testing import tiny_qwen35_dir

    if not (path / "config.json").exists():
        tiny_qwen35_dir(path, num_layers=num_layers)
    return path


def fingerprint_for(target_dir: pathlib.Path, *, taps=(0, 1, 2), storage="bf16") -> Fingerprint:
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(target_dir)
    tok = AutoTokenizer.from_pretrained(target_dir)
    return Fingerprint(target=os.fspath(target_dir), target_config_hash=config_hash(target_dir),
                       num_target_layers=int(cfg.num_hidden_layers), hidden_size=int(cfg.hidden_size),
                       target_dtype="float32", tokenizer_hash=tokenizer_hash(tok),
                       chat_template_hash=chat_template_hash(tok), tap_layer_ids=tuple(taps), storage=storage,
                       max_length=512)


def tiny_cache(cache_dir: pathlib.Path, target_dir: pathlib.Path, *, num_samples=24, taps=(0, 1, 2),
               storage="bf16", seed=0, min_len=20, max_len=90, vocab=259) -> pathlib.Path:
    """Random token sequences whose 'hidden states' carry the next tokens (so a drafter can learn), written
    through the real CacheWriter in a few appends (several shards)."""
    fp = fingerprint_for(target_dir, taps=taps, storage=storage)
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    D, K = fp.hidden_size, len(taps)
    table = torch.randn(vocab, D, generator=g)
    with CacheWriter(cache_dir, fp, shard_tokens=400) as w:
        for start in range(0, num_samples, 6):
            ids_n = list(range(start, min(start + 6, num_samples)))
            lengths = rng.integers(min_len, max_len, size=len(ids_n))
            input_ids = rng.integers(0, vocab, size=int(lengths.sum())).astype(np.int32)
            loss_mask = np.ones(int(lengths.sum()), np.uint8)
            off = 0
            for n in lengths:  # a short prompt without loss in every sample
                loss_mask[off:off + 4] = 0
                off += int(n)
            nxt = torch.from_numpy(np.roll(input_ids, -1).astype(np.int64))
            hidden = table[nxt][:, None, :].expand(-1, K, -1) + 0.1 * torch.randn(len(nxt), K, D, generator=g)
            w.append(sample_ids=np.asarray(ids_n, np.int64), lengths=lengths, input_ids=input_ids,
                     loss_mask=loss_mask, hidden=hidden.contiguous())
    return cache_dir


def tiny_config(**kw):
    from dflash.train.config import TrainConfig

    base = dict(num_layers=1, block_size=4, num_anchors=8, batch_tokens=200, lr=3e-3, warmup_ratio=0.1,
                log_every=1, save_every=2, num_readers=1, prefetch=2, intermediate_size=64)
    base.update(kw)
    return TrainConfig(**base)
