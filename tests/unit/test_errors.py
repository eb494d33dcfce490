"""CacheMismatchError messages: which object disagrees on which field, short hashes, the differing source path
only; and the error survives pickling (a spawned rank reports it to its parent)."""

import pickle

from dflash.errors import CacheMismatchError, describe_difference


def test_message_names_both_objects_and_the_field():
    e = CacheMismatchError("num_target_layers", 6, 8, "train one for this target", mine="the drafter's",
                           theirs="the target's")
    assert str(e) == "the drafter's num_target_layers 6 != the target's 8. train one for this target"
    assert (e.field, e.expected, e.found) == ("num_target_layers", 6, 8)


def test_hashes_are_shortened_to_12_hex_digits():
    a, b = "0123456789ab" + "c" * 52, "fedcba987654" + "d" * 52
    msg = str(CacheMismatchError("tokenizer_hash", a, b))
    assert msg == "the requested tokenizer_hash 0123456789ab != the cache's fedcba987654"
    assert a not in msg and b not in msg
    assert describe_difference("not-a-hash", "x") == ("'not-a-hash'", "'x'")


def test_source_lists_show_only_the_differing_entry():
    h = "1" * 64
    ours = ({"path": "data/a.jsonl", "sha256": h}, {"path": "data/b.jsonl", "sha256": h})
    cached = ({"path": "data/a.jsonl", "sha256": h}, {"path": "data/c.jsonl", "sha256": "2" * 64})
    msg = str(CacheMismatchError("sources", ours, cached))
    assert msg == ("the requested sources [1] 'data/b.jsonl' (sha256 111111111111) != "
                   "the cache's [1] 'data/c.jsonl' (sha256 222222222222)")
    assert "a.jsonl" not in msg
    exp, found = describe_difference(ours, ours[:1])
    assert exp == "2 entries (first extra [1] 'data/b.jsonl' (sha256 111111111111))" and found == "1 entries"


def test_pickles_with_its_fields():
    e = CacheMismatchError("hidden_size", 64, 576, "hint", mine="the drafter's", theirs="the cache's")
    again = pickle.loads(pickle.dumps(e))
    assert type(again) is CacheMismatchError and str(again) == str(e) and again.found == 576
