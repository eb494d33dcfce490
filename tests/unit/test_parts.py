"""benchmarks/parts.py: a training checkpoint split into parts that cross GPU sessions (a tar of files and folders
packed and unpacked), and the wall time of a run trained in segments."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import parts  # noqa: E402


def test_split_join_round_trip_and_manifest(tmp_path):
    src = tmp_path / "ckpt.tar"
    src.write_bytes(os.urandom(2500))
    m = parts.split_file(src, tmp_path / "p", part_bytes=1000, step=96)
    assert [p["bytes"] for p in m["parts"]] == [1000, 1000, 500]
    assert m["step"] == 96 and m["bytes"] == 2500
    assert json.loads(parts.manifest_path(tmp_path / "p", "ckpt.tar").read_text()) == m
    assert parts.missing_parts(m, tmp_path / "p") == []
    out = parts.join_parts(m, tmp_path / "p", tmp_path / "joined.tar")
    assert out.read_bytes() == src.read_bytes()


def test_exact_multiple_has_no_empty_last_part(tmp_path):
    src = tmp_path / "f"
    src.write_bytes(b"x" * 2000)
    assert [p["bytes"] for p in parts.split_file(src, tmp_path / "p", part_bytes=1000)["parts"]] == [1000, 1000]


def test_missing_and_damaged_parts_are_named_and_refused(tmp_path):
    src = tmp_path / "f"
    src.write_bytes(os.urandom(3000))
    m = parts.split_file(src, tmp_path / "p", part_bytes=1000)
    (tmp_path / "p" / "f.part-000").unlink()
    damaged = tmp_path / "p" / "f.part-002"
    data = damaged.read_bytes()
    damaged.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])   # always a change (a fixed byte was one in 256)
    assert parts.missing_parts(m, tmp_path / "p") == ["f.part-000", "f.part-002"]
    with pytest.raises(parts.PartsError, match="2 of 3 parts of f are missing or damaged"):
        parts.join_parts(m, tmp_path / "p", tmp_path / "j")
    assert not (tmp_path / "j").exists()


def test_batches_respect_files_and_bytes_per_call():
    m = {"parts": [{"name": f"p{i}", "bytes": 15} for i in range(5)] + [{"name": "p5", "bytes": 5}]}
    assert parts.batches(m, max_files=3, max_bytes=40) == [["p0", "p1"], ["p2", "p3"], ["p4", "p5"]]
    assert parts.batches(m, ["p3", "p5"], max_files=1, max_bytes=40) == [["p3"], ["p5"]]
    with pytest.raises(parts.PartsError, match="more than a call"):
        parts.batches(m, max_bytes=10)


def test_save_interval_is_a_multiple_of_the_accumulation():
    assert parts.save_interval(seqs_per_step=8, seqs_per_s=7.9, seconds=60) == 472   # 59 optimizer steps
    assert parts.save_interval(seqs_per_step=8, seqs_per_s=0.01, seconds=1) == 8


def test_segment_totals_count_the_first_start_up_and_keep_restarts_apart():
    segs = [{"start_step": 0, "end_step": 3000, "startup_s": 40.0, "train_s": 380.0, "lost_s": 25.0},
            {"start_step": 3000, "end_step": 6000, "startup_s": 55.0, "train_s": 379.0, "lost_s": 10.0},
            {"start_step": 6000, "end_step": 9400, "startup_s": 50.0, "train_s": 430.0, "lost_s": 0.0}]
    t = parts.segment_totals(segs)
    assert t == {"wall_s": 1229.0, "train_s": 1189.0, "restart_overhead_s": 140.0, "micro_steps": 9400,
                 "segments": 3}
    with pytest.raises(ValueError, match="does not continue"):
        parts.segment_totals([segs[0], segs[2]])


def test_totals_on_card_time_other_cards_segments_at_the_cards_own_rate():
    segs = [{"start_step": 0, "end_step": 3000, "startup_s": 40.0, "train_s": 300.0, "lost_s": 25.0, "card": "A"},
            {"start_step": 3000, "end_step": 6000, "startup_s": 55.0, "train_s": 200.0, "lost_s": 10.0, "card": "B"},
            {"start_step": 6000, "end_step": 7000, "startup_s": 50.0, "train_s": 100.0, "lost_s": 0.0, "card": "A"}]
    on_a = parts.totals_on_card(segs, "A")   # A: 4,000 micro-steps in 400 s; B's 3,000 then take 300 s on A
    assert on_a["train_s"] == 700.0 and on_a["wall_s"] == 740.0 and on_a["estimated_train_s"] == 300.0
    assert on_a["micro_steps_per_s"] == 10.0 and on_a["measured_wall_s"] == 640.0
    assert on_a["restart_overhead_s"] == parts.segment_totals(segs)["restart_overhead_s"]
    assert parts.totals_on_card(segs, "C") is None   # no segment of C's to time the rest by
    same = [{**s, "card": "A"} for s in segs]
    assert parts.totals_on_card(same, "A") == {**parts.segment_totals(same), "card": "A"}
    unstamped = [{k: v for k, v in s.items() if k != "card"} for s in segs]   # recorded before segments had cards
    assert parts.totals_on_card(unstamped, "A")["wall_s"] == parts.segment_totals(segs)["wall_s"]


def test_cli_lists_what_remains_to_fetch(tmp_path, capsys):
    src = tmp_path / "f"
    src.write_bytes(os.urandom(3000))
    parts.split_file(src, tmp_path / "p", part_bytes=1000)
    have = tmp_path / "have"
    have.mkdir()
    (have / "f.part-001").write_bytes((tmp_path / "p" / "f.part-001").read_bytes())
    parts.main(["missing", str(parts.manifest_path(tmp_path / "p", "f")), str(have)])
    assert capsys.readouterr().out.split() == ["f.part-000", "f.part-002"]


def test_files_and_folders_packed_as_a_tar_in_parts_and_unpacked(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step-4.pt").write_bytes(os.urandom(2500))
    (run / "metrics.jsonl").write_text('{"step": 4}\n')
    m = parts.pack_tar({"run/checkpoints": run / "checkpoints", "run/metrics.jsonl": run / "metrics.jsonl"},
                       tmp_path / "run.tar", tmp_path / "p", part_bytes=1000, step=4)
    assert m["file"] == "run.tar" and m["step"] == 4 and len(m["parts"]) > 2
    assert not (tmp_path / "run.tar").exists()   # only the parts stay
    parts.unpack_tar(m, tmp_path / "p", tmp_path / "new")
    assert (tmp_path / "new" / "run" / "checkpoints" / "step-4.pt").read_bytes() == \
        (run / "checkpoints" / "step-4.pt").read_bytes()
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["run"]   # the joined tar removed
