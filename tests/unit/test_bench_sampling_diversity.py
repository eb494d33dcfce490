"""benchmarks/bench_sampling_diversity.py's measures: 8-gram overlap between two response sets to the same
prompts, and the responses read back from dflash generate records."""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def test_overlap_counts_shared_8grams_per_prompt():
    from bench_sampling_diversity import overlap

    a = {"p": list(range(20)), "q": list(range(100, 110))}     # 13 + 3 eight-grams
    assert overlap(a, a) == 1.0
    assert overlap(a, {"p": list(range(20, 40)), "q": []}) == 0.0
    assert overlap(a, {"p": list(range(10)), "q": list(range(100, 110))}) == (3 + 3) / 16
    assert overlap(a, {"q": list(range(20))}) == 0.0           # the same ids under another prompt do not count


def test_responses_are_the_first_loss_masked_span(tmp_path):
    from bench_sampling_diversity import responses

    p = tmp_path / "r.jsonl"
    p.write_text(json.dumps({"id": "a", "input_ids": [5, 6, 7, 8, 9, 10], "loss_mask": [0, 0, 1, 1, 0, 1]}) + "\n"
                 + json.dumps({"input_ids": [1, 2], "loss_mask": [0, 0]}) + "\n")
    assert responses(p) == {"a": [7, 8], "1": []}
