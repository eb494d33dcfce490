"""Token-budget batching invariants (hypothesis) and padding on realistic length distributions."""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dflash.data import padding_fraction, token_budget_batches
from dflash.data.batching import round_batch_size
from dflash.errors import ConfigError


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=1, max_value=4096), max_size=300),
    max_tokens=st.integers(min_value=1, max_value=20000),
    max_batch_size=st.one_of(st.none(), st.integers(min_value=1, max_value=64)),
    round_sizes=st.booleans(),
)
@example(lengths=[1] * 9 + [6], max_tokens=10, max_batch_size=None, round_sizes=True)  # a 9-sample tail (CI found it)
def test_every_index_once_and_budget_respected(lengths, max_tokens, max_batch_size, round_sizes):
    lengths_N = np.asarray(lengths, dtype=np.int64)
    batches = token_budget_batches(lengths_N, max_tokens=max_tokens, max_batch_size=max_batch_size,
                                   round_sizes=round_sizes)
    flat = np.concatenate(batches) if batches else np.zeros(0, dtype=np.int64)
    assert sorted(flat.tolist()) == list(range(len(lengths)))
    for b in batches:
        assert len(b) >= 1 and b.dtype == np.int64
        assert max_batch_size is None or len(b) <= max_batch_size
        assert not round_sizes or round_batch_size(len(b)) == len(b)
        padded = len(b) * int(lengths_N[b].max())
        # over budget only as a lone sample longer than the budget
        assert padded <= max_tokens or (len(b) == 1 and lengths_N[b[0]] > max_tokens)
    # deterministic
    again = token_budget_batches(lengths_N, max_tokens=max_tokens, max_batch_size=max_batch_size,
                                 round_sizes=round_sizes)
    assert all(np.array_equal(x, y) for x, y in zip(batches, again)) and len(again) == len(batches)
    assert 0.0 <= padding_fraction(lengths_N, batches) < 1.0 or not lengths


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_padding_is_small_on_lognormal_lengths(seed):
    rng = np.random.default_rng(seed)
    # chat-like: median ~600 tokens, long tail, capped at max_length 4096
    lengths = np.clip(rng.lognormal(mean=6.4, sigma=0.9, size=20000).astype(np.int64), 8, 4096)
    batches = token_budget_batches(lengths, max_tokens=65536)
    frac = padding_fraction(lengths, batches)
    assert frac < 0.03, frac
    # against random batches of the same sizes, sorting is what removes the padding
    perm = rng.permutation(len(lengths))
    random_batches = np.split(perm, np.cumsum([len(b) for b in batches])[:-1])
    assert padding_fraction(lengths, random_batches) > 0.3
    # budget use: batches are full
    used = sum(len(b) * lengths[b].max() for b in batches) / (len(batches) * 65536)
    assert used > 0.9, used


def test_round_batch_sizes():
    assert [round_batch_size(n) for n in range(1, 10)] == [1, 2, 3, 4, 5, 6, 7, 8, 8]
    assert [round_batch_size(n) for n in (10, 11, 15, 16, 19, 20, 31, 32, 39, 40, 47, 48, 63, 64, 100, 1000)] == \
        [10, 10, 14, 16, 16, 20, 28, 32, 32, 40, 40, 48, 56, 64, 96, 896]
    sizes = {round_batch_size(n) for n in range(1, 257)}
    assert len(sizes) == 8 + 4 * 5  # 1-8, then four per doubling: 10-16, 20-32, ..., 160-256
    for n in range(1, 5000):
        r = round_batch_size(n)
        assert r <= n and r > 0.8 * n and round_batch_size(r) == r


def test_round_sizes_keep_padding_and_cut_distinct_sizes():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(mean=6.4, sigma=0.9, size=20000).astype(np.int64), 8, 4096)
    plain = token_budget_batches(lengths, max_tokens=32768)
    rounded = token_budget_batches(lengths, max_tokens=32768, round_sizes=True)
    assert len({len(b) for b in rounded}) * 2 < len({len(b) for b in plain})
    assert len(rounded) < 1.1 * len(plain)
    assert padding_fraction(lengths, rounded) <= padding_fraction(lengths, plain) + 0.001


def test_longest_batch_first_and_ties_by_index():
    batches = token_budget_batches([3, 5, 5, 1, 5], max_tokens=10)
    assert [b.tolist() for b in batches] == [[1, 2], [4, 0], [3]]


def test_padding_fraction_by_hand():
    assert padding_fraction([4, 2, 2], [np.array([0, 1]), np.array([2])]) == pytest.approx(1 - 8 / 10)
    assert padding_fraction([], []) == 0.0


@pytest.mark.parametrize("kwargs", [{"max_tokens": 0}, {"max_tokens": 10, "max_batch_size": 0}])
def test_bad_settings_raise_config_error(kwargs):
    with pytest.raises(ConfigError):
        token_budget_batches([1, 2], **kwargs)
