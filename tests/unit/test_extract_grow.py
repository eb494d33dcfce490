"""The pure parts of a growing cache: the run's sources, cross-source duplicates, and batches that never mix
sources (so a source is batched, and rounded, as in an extraction of it alone)."""

import numpy as np
import pytest

from dflash.errors import DataError
from dflash.extract.grow import content_hash, effective_sources, scan_sources, source_table
from dflash.extract.plan import extraction_batches, make_plan


def test_effective_sources_puts_the_caches_own_first(tmp_path):
    a, b, c = (tmp_path / n for n in ("a.jsonl", "b.jsonl", "c.jsonl"))
    for p, text in ((a, "A"), (b, "B"), (c, "C")):
        p.write_text(text)
    sha = {str(a): "sa", str(b): "sb", str(c): "sc"}
    existing = [{"path": str(a), "sha256": "sa"}]
    assert effective_sources([str(b)], existing, sha_of=sha.get) == [str(a), str(b)]
    assert effective_sources([str(a), str(b), str(c)], existing, sha_of=sha.get) == [str(a), str(b), str(c)]
    assert effective_sources([str(a)], existing, sha_of=sha.get) == [str(a)]  # a resume
    assert effective_sources([str(b)], [], sha_of=sha.get) == [str(b)]
    with pytest.raises(DataError, match="changed"):
        effective_sources([str(b)], [{"path": str(a), "sha256": "other"}], sha_of=sha.get)
    with pytest.raises(DataError, match="missing"):
        effective_sources([str(b)], [{"path": str(tmp_path / "gone"), "sha256": "sg"}], sha_of=sha.get)


class _S:
    def __init__(self, sample_id, ids, source_index):
        self.sample_id, self.source_index = sample_id, source_index
        self.input_ids = np.asarray(ids, np.int32)
        self.loss_mask = np.ones(len(ids), np.uint8)


def test_duplicates_are_content_repeats_of_an_earlier_source():
    samples = [_S(0, [1, 2], 0), _S(1, [1, 2], 0), _S(2, [3], 0), _S(3, [1, 2], 1), _S(4, [4], 1), _S(5, [3], 2)]
    src, dups = scan_sources(samples)
    assert src.tolist() == [0, 0, 0, 1, 1, 2]
    assert dups == {3: 0, 5: 2}  # the repeat inside source 0 (id 1) is kept
    rows = source_table(np.arange(6), src, ["a", "b", "c"], ["sa", "sb", "sc"], dups)
    assert [(r["first_id"], r["last_id"], r["samples"]) for r in rows] == [(0, 2, 3), (3, 4, 1), (5, 5, 0)]
    assert content_hash(np.array([1, 2]), np.array([1, 1])) != content_hash(np.array([1, 2]), np.array([0, 1]))


def test_batches_never_mix_sources_and_match_each_source_alone():
    rng = np.random.default_rng(0)
    lengths = rng.integers(10, 200, size=40)
    groups = np.repeat([0, 1], [25, 15])
    plan = make_plan(sample_ids=np.arange(40), lengths=lengths, committed=set(), world_size=1, max_tokens=600,
                     batch_fn=extraction_batches, groups=groups)
    batches = [b.members for bs in plan.rank_batches for b in bs]
    assert all(len(set(groups[m].tolist())) == 1 for m in batches)
    alone = make_plan(sample_ids=np.arange(25), lengths=lengths[:25], committed=set(), world_size=1, max_tokens=600,
                      batch_fn=extraction_batches)
    first = sorted(tuple(m.tolist()) for m in batches if groups[m[0]] == 0)
    assert first == sorted(tuple(b.members.tolist()) for bs in alone.rank_batches for b in bs)
