"""Stored, rank-split tokenization of `dflash extract` (dflash.extract.tokenized): the merged parts equal
load_samples exactly (samples, order, skip counts and examples), a rerun loads instead of tokenizing, the key
follows every tokenization input, and a cache with _tokenized still verifies."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

import dflash.data.samples as samples_mod
from dflash.data import load_samples
from dflash.extract import tokenized as tz

MAX_LENGTH = 48


def _conversations(n):
    words = "the cat sat on a mat while dogs ran far away and birds sang songs".split()
    out = []
    for i in range(n):
        q = " ".join(words[(i + k) % len(words)] for k in range(2 + i % 5))
        a = " ".join(words[(3 * i + k) % len(words)] for k in range(3 + i % 7))
        msgs = [{"role": "user", "content": f"{i}: {q}?"}, {"role": "assistant", "content": a}]
        if i % 3 == 0:
            msgs += [{"role": "user", "content": "and then?"}, {"role": "assistant", "content": a[::-1]}]
        out.append(json.dumps({"messages": msgs}))
    return out


BAD = [
    "{not json",
    json.dumps({"text": "no conversation"}),
    json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
    json.dumps({"messages": [{"role": "user", "content": "long " * 80}, {"role": "assistant", "content": "ok"}]}),
]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokdata")
    lines = _conversations(30)
    for k in range(5):  # every reason 5 times, spread over the ids so both ranks see some of each
        lines[4 + 5 * k: 4 + 5 * k] = BAD
    (d / "a.jsonl").write_text("\n".join(lines[:25]) + "\n")
    (d / "b.jsonl").write_text("\n".join(lines[25:]) + "\n")
    return [str(d / "a.jsonl"), str(d / "b.jsonl")]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def _forbid_tokenizing(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("tokenize_conversation called although the tokenization is stored")

    monkeypatch.setattr(samples_mod, "tokenize_conversation", boom)


def _same_as_reference(tok, ref_samples, ref_skips):
    assert len(tok.samples) == len(ref_samples)
    for got, want in zip(tok.samples, ref_samples):
        assert got.sample_id == want.sample_id and got.source_index == want.source_index
        assert got.input_ids.dtype == np.int32 and got.loss_mask.dtype == np.uint8
        assert np.array_equal(got.input_ids, want.input_ids) and np.array_equal(got.loss_mask, want.loss_mask)
    assert list(tok.samples.lengths) == [len(s.input_ids) for s in ref_samples]
    assert list(tok.skips.counts.items()) == list(ref_skips.counts.items())
    assert tok.skips.examples == ref_skips.examples
    assert tok.skips.summary() == ref_skips.summary()


def _call(folder, data, tokenizer, **kw):
    return tz.tokenize_or_load(paths=data, tokenizer=tokenizer, max_length=MAX_LENGTH, template_kwargs={},
                               folder=str(folder) if folder else None, num_workers=0, **kw)


def test_two_rank_parts_merge_to_load_samples_and_rerun_loads(data, tokenizer, tmp_path, monkeypatch):
    ref_samples, ref_skips = load_samples(data, tokenizer, max_length=MAX_LENGTH, template_kwargs={})
    assert ref_skips.counts["bad_json"] == 5 and len(ref_skips.examples) > 4  # examples are cut at 3 per reason
    one = _call(tmp_path / "k1", data, tokenizer)
    assert not one.loaded and (tmp_path / "k1" / "part-0-of-1.npz").is_file()
    _same_as_reference(one, ref_samples, ref_skips)
    # two ranks, each its own slice (what two processes write), then any rank loads both
    for rank in range(2):
        part = tz.tokenize_part(paths=data, tokenizer=tokenizer, max_length=MAX_LENGTH, template_kwargs={},
                                rank=rank, world_size=2, num_workers=0)
        assert all(int(s) % 2 == rank for s in part.sample_ids)
        tz.write_part(str(tmp_path / "k2"), part, rank=rank, world_size=2)
    _forbid_tokenizing(monkeypatch)
    two = _call(tmp_path / "k2", data, tokenizer, world_size=2)
    assert two.loaded
    _same_as_reference(two, ref_samples, ref_skips)
    assert isinstance(two.samples.parts[0].ids, np.memmap)  # views into the mapped file, not copies
    again = _call(tmp_path / "k1", data, tokenizer)  # rerun: loads, the tokenizer is never called
    assert again.loaded
    _same_as_reference(again, ref_samples, ref_skips)
    with pytest.raises(AssertionError, match="tokenize_conversation called"):
        _call(tmp_path / "k3", data, tokenizer)  # the guard is live: a new key must tokenize


def test_incomplete_parts_are_not_loaded(data, tokenizer, tmp_path):
    part = tz.tokenize_part(paths=data, tokenizer=tokenizer, max_length=MAX_LENGTH, template_kwargs={},
                            rank=1, world_size=2, num_workers=0)
    tz.write_part(str(tmp_path), part, rank=1, world_size=2)
    (tmp_path / "part-0-of-2.npz.tmp-123").write_bytes(b"torn")  # a crash mid-write
    assert tz.find_complete_parts(str(tmp_path), prefer_world_size=2) is None
    assert not _call(tmp_path, data, tokenizer).loaded


def test_key_follows_every_tokenization_input():
    base = dict(sources=[{"path": "/d/a.jsonl", "sha256": "aa"}], paths=["a.jsonl"], tokenizer_hash="t",
                chat_template_hash="c", template_kwargs={}, max_length=4096)
    key = tz.tokenization_key(**base)
    assert key == tz.tokenization_key(**dict(base))
    for change in (dict(max_length=2048), dict(template_kwargs={"enable_thinking": False}),
                   dict(tokenizer_hash="t2"), dict(chat_template_hash="c2"),
                   dict(sources=[{"path": "/d/a.jsonl", "sha256": "ab"}]), dict(paths=["./a.jsonl"])):
        assert tz.tokenization_key(**{**base, **change}) != key, change


def test_npz_memmap_matches_np_load(tmp_path):
    arrays = {"a": np.arange(1000, dtype=np.int32), "b": np.zeros(0, dtype=np.uint8),
              "c": np.arange(12, dtype=np.int64).reshape(3, 4)}
    np.savez(tmp_path / "x.npz", **arrays)
    got = tz.npz_memmap(str(tmp_path / "x.npz"))
    for k, v in arrays.items():
        assert got[k].dtype == v.dtype and np.array_equal(got[k], v)


def test_cache_with_tokenized_verifies_and_reruns_without_tokenizing(data, smollm2_dir, tmp_path, monkeypatch):
    from cli.main import cli
    from dflash.extract.driver import ExtractConfig
    from dflash.extract.launch import launch

    out = tmp_path / "cache"
    cfg = ExtractConfig(model=smollm2_dir, data=tuple(data[1:]), output=str(out), taps=(0, 2), max_length=MAX_LENGTH,
                        batch_tokens=256, dtype="float32", device="cpu", show_progress=False)
    lines = []
    first = launch(cfg, num_procs=1, echo=lines.append)
    assert first.num_samples > 0 and any("tokenization:" in m and "stored in" in m for m in lines)
    assert len(list((out / "_tokenized").glob("*/part-0-of-1.npz"))) == 1
    runner = CliRunner()
    for args in (["cache", "verify", str(out)], ["cache", "info", str(out)]):
        res = runner.invoke(cli, args)
        assert res.exit_code == 0, res.output
    _forbid_tokenizing(monkeypatch)
    lines.clear()
    again = launch(cfg, num_procs=1, echo=lines.append)
    assert again.num_samples == 0 and again.num_committed_before == first.num_samples
    assert again.skip_counts == first.skip_counts
    assert any("tokenization: loaded" in m for m in lines)


def test_pretokenized_sources_are_read_in_process(data, tokenizer, tmp_path, monkeypatch):
    """Worker processes only pay off for conversations: pre-tokenized input is read in the rank's process,
    with the same samples as a worker run would give."""
    pre = tmp_path / "pre.jsonl"
    pre.write_text("".join(json.dumps({"input_ids": list(range(5 + i)), "loss_mask": [0, 0] + [1] * (3 + i)}) + "\n"
                           for i in range(12)))
    assert tz.starts_pretokenized([str(pre)])
    assert not tz.starts_pretokenized([str(pre), data[0]])
    monkeypatch.setattr(tz, "SMALL_DATA_BYTES", 0)  # as if the data were large
    tok = tz.tokenize_or_load(paths=[str(pre)], tokenizer=tokenizer, max_length=MAX_LENGTH, template_kwargs={},
                              folder=None)
    assert tok.num_workers == 0
    assert [len(s.input_ids) for s in tok.samples] == [5 + i for i in range(12)]
