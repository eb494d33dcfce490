"""dflash.generate.sampling: counter-based Gumbel-max sampling, a pure function of (seed, request, position,
vocabulary id), so a sampled regeneration is the same whatever the batch, slot or resume; and its draws follow
softmax(logits / temperature)."""

import pytest
import torch

from dflash.generate.sampling import gumbel_noise, mix32, pick_tokens, request_key


def test_request_key_is_the_same_in_every_process():
    # pinned values: a different hash (e.g. Python's salted hash()) would change a resumed job's samples
    assert request_key(0, "c0.v0.t0") == 693488662
    assert request_key(1, "c0.v0.t0") == 604879271
    assert request_key(0, "c0.v1.t0") == 2746293112
    assert 0 <= request_key(123, "x" * 100) < 2 ** 32


def test_mix32_stays_in_32_bits_and_spreads_neighbours():
    x = torch.arange(0, 1 << 16, dtype=torch.int64)
    h = mix32(x)
    assert int(h.min()) >= 0 and int(h.max()) < 2 ** 32
    assert len(torch.unique(h)) == len(x)                      # no collisions among 65,536 neighbours
    bits = torch.stack([(h >> b) & 1 for b in range(32)]).float().mean(1)
    assert bits.min() > 0.48 and bits.max() < 0.52              # every output bit is about fair
    edge = mix32(torch.tensor([2 ** 32 - 1], dtype=torch.int64))
    assert 0 <= int(edge) < 2 ** 32


def test_noise_of_a_row_does_not_depend_on_the_other_rows():
    keys = torch.tensor([request_key(0, f"r{i}") for i in range(6)], dtype=torch.int64)
    pos = torch.tensor([0, 5, 5, 900, 17, 3], dtype=torch.int64)
    whole = gumbel_noise(keys, pos, 50)
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    assert torch.equal(gumbel_noise(keys[perm], pos[perm], 50), whole[perm])
    assert torch.equal(gumbel_noise(keys[2:3], pos[2:3], 50), whole[2:3])
    assert torch.isfinite(whole).all()
    assert not torch.equal(whole[1], whole[2])                  # same position, other request
    assert not torch.equal(gumbel_noise(keys[:1], pos[:1] + 1, 50), whole[:1])   # same request, next position


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_draws_follow_the_tempered_softmax(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    n = 40_000
    keys = torch.tensor([request_key(7, f"k{i}") for i in range(n)], dtype=torch.int64)
    got = pick_tokens(logits.expand(n, -1), temperature=temperature, key_B=keys,
                      pos_B=torch.full((n,), 11, dtype=torch.int64))
    freq = torch.bincount(got, minlength=5).float() / n
    want = torch.softmax(logits / temperature, -1)
    assert (freq - want).abs().max() < 0.01, (freq, want)    # binomial sd <= 0.0025 at n = 40,000


def test_temperature_zero_is_greedy():
    logits = torch.randn(4, 30)
    assert torch.equal(pick_tokens(logits, temperature=0.0), logits.argmax(-1))
