"""Input edge cases of dflash.data (issue 19): mislabelled or truncated gzip, BOM, invalid UTF-8, and a huge
line whose tokenization is bounded by max_length."""

from __future__ import annotations

import gzip
import json
import logging
import time

import numpy as np
import pytest
from conftest_data import marker_tokenizer, smollm_tokenizer  # noqa: F401  (fixtures)

from dflash.data import Record, iter_records, load_samples
from dflash.data.chat import max_chars_for, tokenize_conversation
from dflash.data.sources import check_paths
from dflash.errors import DataError

CONV = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]}


def lines(n=3) -> bytes:
    return b"".join(json.dumps(CONV).encode() + b"\n" for _ in range(n))


def test_non_gzip_file_named_gz_is_one_data_error_before_any_work(tmp_path):
    p = tmp_path / "d.jsonl.gz"
    p.write_bytes(lines())
    with pytest.raises(DataError, match="not gzip-compressed") as e:
        check_paths([str(p)])
    assert "\n" not in str(e.value)


def test_truncated_gzip_is_one_data_error(tmp_path):
    p = tmp_path / "d.jsonl.gz"
    full = gzip.compress(lines(2000))
    p.write_bytes(full[: len(full) // 2])
    check_paths([str(p)])  # the header is fine: only reading finds the cut
    with pytest.raises(DataError, match="gzip stream is corrupt or truncated") as e:
        list(iter_records(p))
    assert str(p) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_utf8_bom_is_accepted(tmp_path, suffix):
    p = tmp_path / f"d{suffix}"
    body = lines(2) if suffix == ".jsonl" else json.dumps([CONV, CONV]).encode()
    p.write_bytes(b"\xef\xbb\xbf" + body)
    items = list(iter_records(p))
    assert len(items) == 2 and all(isinstance(r, Record) for r in items), items


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_invalid_utf8_is_replaced_counted_and_reported(tmp_path, suffix, caplog):
    bad = dict(CONV, messages=[{"role": "user", "content": "caf\udce9 \udcff"}, CONV["messages"][1]])
    raw = json.dumps(bad, ensure_ascii=False).encode("utf-8", "surrogateescape")  # bytes e9 and ff: not UTF-8
    ok = json.dumps({"messages": [{"role": "user", "content": "\ufffd is fine"}, CONV["messages"][1]]},
                    ensure_ascii=False).encode()
    p = tmp_path / f"d{suffix}"
    p.write_bytes(raw + b"\n" + ok + b"\n" if suffix == ".jsonl" else b"[" + raw + b",\n" + ok + b"]")
    with caplog.at_level(logging.WARNING, logger="dflash.data.readers"):
        items = list(iter_records(p))
    assert items[0].messages[0]["content"] == "caf\ufffd \ufffd"
    assert "2 invalid UTF-8 byte sequence(s) replaced" in caplog.text and str(p) in caplog.text


def test_clean_file_reports_nothing(tmp_path, caplog):
    p = tmp_path / "d.jsonl"
    p.write_bytes(lines(3))
    with caplog.at_level(logging.WARNING, logger="dflash.data.readers"):
        list(iter_records(p))
    assert "replaced" not in caplog.text


@pytest.mark.parametrize("which", ["prefix", "markers"])
def test_char_bound_keeps_the_exact_tokens(which, smollm_tokenizer, marker_tokenizer):
    tok = smollm_tokenizer if which == "prefix" else marker_tokenizer
    rng = np.random.default_rng(0)
    words = ["alpha", "be", "gamma", "\u00e9t\u00e9", "  ", "x" * 40, "42", "\n"]
    long = "".join(rng.choice(words, size=30000))
    for messages in ([{"role": "user", "content": long}, {"role": "assistant", "content": "ok " * 50}],
                     [{"role": "user", "content": "hi"}, {"role": "assistant", "content": long},
                      {"role": "user", "content": "more"}, {"role": "assistant", "content": long}]):
        for max_length in (64, 300):
            assert max_chars_for(tok, max_length) < len(long)  # the bound really cuts here
            a = tokenize_conversation(tok, messages, max_length=max_length)
            b = tokenize_conversation(tok, messages, max_length=max_length, bound_chars=False)
            assert type(a) is type(b)
            if isinstance(a, tuple):
                assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def test_a_20mb_line_costs_what_max_length_needs(tmp_path, smollm_tokenizer):
    huge = {"messages": [{"role": "user", "content": "word " * 4_000_000}, {"role": "assistant", "content": "ok"}]}
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps(CONV) + "\n" + json.dumps(huge) + "\n")
    assert p.stat().st_size > 20_000_000
    t = time.perf_counter()
    samples, skipped = load_samples([str(p)], smollm_tokenizer, max_length=256)
    dt = time.perf_counter() - t
    assert len(samples) == 1 and skipped.counts == {"over_length": 1}  # the user turn fills the 256 tokens
    assert dt < 10, f"{dt:.1f}s"  # unbounded: ~1m48s and 2.7 GB (issue 19)
