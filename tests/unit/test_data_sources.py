"""File formats, record normalisation, bad-input accounting and stable sample ids."""

import gzip
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest_data import smollm_tokenizer  # noqa: F401  (fixture)

from dflash.data import Record, Skip, SkipCounter, iter_records, iter_samples, load_samples, skips
from dflash.errors import DataError

OPENAI = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]}
SHAREGPT = {"id": "x_0", "conversations": [
    {"from": "system", "value": "Be kind."}, {"from": "human", "value": "Hey"}, {"from": "gpt", "value": "Hi, friend."},
]}
PRETOKENIZED = {"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]}
RECORDS = [OPENAI, SHAREGPT, PRETOKENIZED]


def check_normalised(items, location_of):
    assert all(isinstance(r, Record) for r in items), items
    assert items[0].messages == OPENAI["messages"]
    assert items[1].messages == [
        {"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hey"},
        {"role": "assistant", "content": "Hi, friend."},
    ]
    assert items[2].input_ids == [5, 6, 7, 8] and items[2].loss_mask == [0, 0, 1, 1]
    assert [r.location for r in items] == [location_of(i) for i in range(3)]


def write_arrow_folder(folder, rows, *, name="data-00000-of-00001.arrow"):
    folder.mkdir(parents=True)
    table = pa.Table.from_pylist(rows)
    with pa.ipc.new_stream(str(folder / name), table.schema) as w:  # datasets writes the stream format
        w.write_table(table)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": name}], "_split": "train"}))
    (folder / "dataset_info.json").write_text("{}")


def test_jsonl_round_trip(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n\n")
    check_normalised(list(iter_records(p)), lambda i: f"{p}:{i + 1}")


def test_jsonl_gz_round_trip(tmp_path):
    p = tmp_path / "d.jsonl.gz"
    with gzip.open(p, "wt") as f:
        f.write("\n".join(json.dumps(r) for r in RECORDS))
    check_normalised(list(iter_records(p)), lambda i: f"{p}:{i + 1}")


def test_json_list_round_trip(tmp_path):
    p = tmp_path / "d.json"
    p.write_text(json.dumps(RECORDS, indent=2))
    lines = p.read_text().splitlines()
    starts = [i + 1 for i, line in enumerate(lines) if line == "  {"]  # line of each record's opening brace
    check_normalised(list(iter_records(p)), lambda i: f"{p}:{starts[i]}")


def test_json_list_across_chunk_boundaries(tmp_path, monkeypatch):
    from dflash.data import readers

    monkeypatch.setattr(readers, "_CHUNK_CHARS", 7)  # every record is cut by several chunk boundaries
    p = tmp_path / "d.json"
    p.write_text(json.dumps(RECORDS * 3))
    items = list(iter_records(p))
    assert len(items) == 9 and all(isinstance(r, Record) for r in items)
    assert items[4].messages == items[1].messages


def test_truncated_json_list_stops_cleanly(tmp_path):
    p = tmp_path / "d.json"
    text = json.dumps(RECORDS, indent=1)
    p.write_text(text[: text.index("Hi, friend") + 4])  # cut mid-string inside the second record
    items = list(iter_records(p))
    assert isinstance(items[0], Record) and len(items) == 2
    assert isinstance(items[1], Skip) and items[1].reason == skips.TRUNCATED_FILE


def test_parquet_round_trip(tmp_path):
    p = tmp_path / "d.parquet"
    # one schema per file: parquet needs homogeneous rows, so write the three forms as three files
    for i, r in enumerate(RECORDS):
        pq.write_table(pa.Table.from_pylist([r]), tmp_path / f"{i}.parquet")
    items = [next(iter_records(tmp_path / f"{i}.parquet")) for i in range(3)]
    check_normalised(items, lambda i: f"{tmp_path / f'{i}.parquet'}:row 0")
    pq.write_table(pa.Table.from_pylist([OPENAI] * 3000), p, row_group_size=1000)
    items = list(iter_records(p))
    assert len(items) == 3000 and items[-1].location == f"{p}:row 2999"


def test_arrow_folder_round_trip(tmp_path):
    write_arrow_folder(tmp_path / "ds", [OPENAI, OPENAI])
    items = list(iter_records(tmp_path / "ds"))
    assert [r.messages for r in items] == [OPENAI["messages"]] * 2
    assert items[1].location.endswith("data-00000-of-00001.arrow:row 1")


def test_dataset_dict_folder(tmp_path):
    write_arrow_folder(tmp_path / "dd" / "train", [OPENAI])
    write_arrow_folder(tmp_path / "dd" / "test", [SHAREGPT])
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    items = list(iter_records(tmp_path / "dd"))
    assert [len(r.messages) for r in items] == [2, 3] and "/train/" in items[0].location


def test_missing_path_and_unknown_format_raise_before_any_work(tmp_path, smollm_tokenizer):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(OPENAI) + "\n")
    (tmp_path / "d.csv").write_text("a,b\n")
    (tmp_path / "plain_dir").mkdir()
    for bad, match in ((tmp_path / "nope.jsonl", "does not exist"), (tmp_path / "d.csv", "unknown data file format"),
                       (tmp_path / "plain_dir", "not a datasets save_to_disk folder")):
        with pytest.raises(DataError, match=match):
            iter_samples([good, bad], smollm_tokenizer)  # raises at the call, not at the first next()
        with pytest.raises(DataError, match=match):
            load_samples([good, bad], smollm_tokenizer)


def u(text):
    return {"role": "user", "content": text}


def a(text):
    return {"role": "assistant", "content": text}


BAD_LINES = [
    ("{not json", skips.BAD_JSON),
    ("[1, 2]", skips.WRONG_TYPE),
    (json.dumps({"messages": "hello"}), skips.WRONG_TYPE),
    (json.dumps({"messages": [u("hi"), {"role": "assistant", "content": 3}]}), skips.WRONG_TYPE),
    (json.dumps({"messages": [u("hi"), "assistant: yo"]}), skips.WRONG_TYPE),
    (json.dumps({"messages": [u("hi"), {"role": "assistant", "content": [{"type": "image"}]}]}), skips.WRONG_TYPE),
    (json.dumps({"input_ids": [1, "2"], "labels": [1, 2]}), skips.WRONG_TYPE),
    (json.dumps({"text": "plain text"}), skips.NO_CONVERSATION),
    (json.dumps({"messages": [u("hi"), {"role": "robot", "content": "beep"}]}), skips.UNKNOWN_ROLE),
    (json.dumps({"conversations": [{"from": "narrator", "value": "once"}]}), skips.UNKNOWN_ROLE),
    (json.dumps({"messages": []}), skips.EMPTY_CONVERSATION),
    (json.dumps({"conversations": []}), skips.EMPTY_CONVERSATION),
    (json.dumps({"messages": [u("hi"), u("anyone?")]}), skips.NO_ASSISTANT_TURN),
    (json.dumps({"messages": [a("I speak first"), u("ok")]}), skips.NO_ASSISTANT_TURN),
    (json.dumps({"input_ids": [1, 2, 3]}), skips.BAD_PRETOKENIZED),
    (json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 1]}), skips.BAD_PRETOKENIZED),
    (json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 2, 1]}), skips.BAD_PRETOKENIZED),
    (json.dumps({"input_ids": [1, 2, 3], "labels": [-100, -100, -100]}), skips.NO_LOSS_TOKENS),
    (json.dumps({"messages": [u("x " * 300), a("late answer")]}), skips.OVER_LENGTH),
]


def test_every_bad_input_class_is_skipped_and_counted(tmp_path, smollm_tokenizer):
    p = tmp_path / "mixed.jsonl"
    good = json.dumps({"messages": [u("hi"), a("hello")]})
    lines = [good] + [line for line, _ in BAD_LINES] + [good]
    p.write_text("\n".join(lines) + "\n")
    samples, skipped = load_samples([p], smollm_tokenizer, max_length=128)
    expected = {}
    for _, reason in BAD_LINES:
        expected[reason] = expected.get(reason, 0) + 1
    assert skipped.counts == expected and skipped.total == len(BAD_LINES)
    assert [s.sample_id for s in samples] == [0, len(lines) - 1]
    # the first examples of each reason are kept with file and line
    first_line = {}
    for i, (_, reason) in enumerate(BAD_LINES):
        first_line.setdefault(reason, i + 2)
    kept = {e.reason: e for e in reversed(skipped.examples)}
    assert {r: e.location for r, e in kept.items()} == {r: f"{p}:{n}" for r, n in first_line.items()}
    summary = skipped.summary()
    assert f"skipped {len(BAD_LINES)} records" in summary and f"{p}:2" in summary


def test_skip_counter_keeps_first_examples_and_merges():
    a_, b_ = SkipCounter(max_examples=2), SkipCounter(max_examples=2)
    for i in range(5):
        a_.add(Skip(skips.BAD_JSON, f"a:{i}"))
        b_.add(Skip(skips.BAD_JSON, f"b:{i}"))
    b_.add(Skip(skips.UNKNOWN_ROLE, "b:9", "role 'robot'"))
    assert [e.location for e in a_.examples] == ["a:0", "a:1"]
    a_.merge(b_)
    assert a_.counts == {skips.BAD_JSON: 10, skips.UNKNOWN_ROLE: 1}
    assert [e.location for e in a_.examples] == ["a:0", "a:1", "b:9"]
    assert json.loads(json.dumps(a_.to_dict()))["counts"] == {"bad_json": 10, "unknown_role": 1}


def test_pretokenized_labels_and_loss_mask(tmp_path, smollm_tokenizer):
    p = tmp_path / "tok.jsonl"
    rows = [{"input_ids": [1, 2, 3, 4, 5], "labels": [-100, -100, 3, 4, -100]},
            {"input_ids": [9, 8, 7], "loss_mask": [0, 1, 1]}]
    p.write_text("\n".join(json.dumps(r) for r in rows))
    samples, skipped = load_samples([p], smollm_tokenizer, max_length=4)
    assert skipped.total == 0
    assert samples[0].input_ids.tolist() == [1, 2, 3, 4] and samples[0].loss_mask.tolist() == [0, 0, 1, 1]
    assert samples[1].input_ids.dtype == np.int32 and samples[1].loss_mask.dtype == np.uint8
    assert samples[1].loss_mask.tolist() == [0, 1, 1]


def test_sample_ids_are_global_and_ranks_partition_them(tmp_path, smollm_tokenizer):
    p1, p2 = tmp_path / "a.jsonl", tmp_path / "b.json"
    p1.write_text("\n".join([json.dumps(OPENAI), "{bad", json.dumps(SHAREGPT)]))
    p2.write_text(json.dumps([PRETOKENIZED, OPENAI, {"messages": []}, SHAREGPT]))
    all_samples, skipped = load_samples([p1, p2], smollm_tokenizer)
    assert [s.sample_id for s in all_samples] == [0, 2, 3, 4, 6]
    assert [s.source_index for s in all_samples] == [0, 0, 1, 1, 1]
    assert skipped.counts == {skips.BAD_JSON: 1, skips.EMPTY_CONVERSATION: 1}
    # ids do not depend on max_length or on the rank; ranks see disjoint parts that cover everything
    by_rank = [load_samples([p1, p2], smollm_tokenizer, rank=r, world_size=3)[0] for r in range(3)]
    ids = sorted(s.sample_id for part in by_rank for s in part)
    assert ids == [0, 2, 3, 4, 6]
    assert all(s.sample_id % 3 == r for r, part in enumerate(by_rank) for s in part)
    first = {s.sample_id: s for s in all_samples}
    for part in by_rank:
        for s in part:
            assert s.input_ids.tolist() == first[s.sample_id].input_ids.tolist()
    limited, _ = load_samples([p1, p2], smollm_tokenizer, max_records=4)
    assert [s.sample_id for s in limited] == [0, 2, 3]


def test_worker_processes_give_the_same_samples_and_skips(tmp_path, smollm_tokenizer, monkeypatch):
    from dflash.data import samples as samples_mod

    p = tmp_path / "mixed.jsonl"
    good = [json.dumps({"messages": [u(f"question {i}"), a(f"answer {i}" + " more" * i)]}) for i in range(20)]
    lines = [x for pair in zip(good, [line for line, _ in BAD_LINES] + ["{bad"]) for x in pair]
    p.write_text("\n".join(lines))
    serial, serial_skips = load_samples([p], smollm_tokenizer, max_length=128)
    monkeypatch.setattr(samples_mod, "_CHUNK_RECORDS", 3)  # many chunks: exercises the window and the order
    import concurrent.futures
    import pickle

    started = []

    class Recording(concurrent.futures.ProcessPoolExecutor):
        def __init__(self, *a, **kw):
            started.append(kw["initargs"])
            super().__init__(*a, **kw)

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", Recording)
    parallel, parallel_skips = load_samples([p], smollm_tokenizer, max_length=128, num_workers=2)
    # a worker's start-up data fits a pipe's buffer (the parent does not wait for each child's imports), and the
    # tokenizer file it names is gone afterwards
    (initargs,) = started
    assert len(pickle.dumps(initargs)) < 65536 and not os.path.exists(initargs[0])
    assert [s.sample_id for s in parallel] == [s.sample_id for s in serial] == list(range(0, 40, 2))
    assert all(np.array_equal(x.input_ids, y.input_ids) and np.array_equal(x.loss_mask, y.loss_mask)
               for x, y in zip(serial, parallel))
    assert parallel_skips.to_dict() == serial_skips.to_dict()


def test_json_list_with_a_malformed_record_keeps_what_came_before(tmp_path):
    p = tmp_path / "d.json"
    p.write_text("[\n" + json.dumps(OPENAI) + ",\n{\"messages\": [}  ,\n" + json.dumps(OPENAI) + "\n]")
    items = list(iter_records(p))
    assert isinstance(items[0], Record) and len(items) == 2
    assert items[1].reason == skips.BAD_JSON and items[1].location == f"{p}:3"


def test_json_top_level_object_is_one_record(tmp_path):
    p = tmp_path / "one.json"
    p.write_text(json.dumps(OPENAI))
    (item,) = list(iter_records(p))
    assert item.messages == OPENAI["messages"] and item.location == f"{p}:1"
