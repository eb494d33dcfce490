"""The recycled pinned-buffer pool of extraction and the writer's on_consumed hand-back."""

import threading

import numpy as np
import pytest
import torch

from dflash.cache import CacheReader, CacheWriter
from dflash.extract.pinned import PinnedPool, batch_nbytes, batch_views
from tests.unit.test_cache_roundtrip import make_fp


@pytest.mark.parametrize("storage", ["bf16", "fp8"])
def test_batch_views_fit_and_do_not_overlap(storage):
    T, K, D = 37, 3, 24
    buf = torch.zeros(batch_nbytes(tokens=T, num_taps=K, hidden=D, storage=storage), dtype=torch.uint8)
    dtype = torch.uint16 if storage == "bf16" else torch.uint8
    bits, scales = batch_views(buf, bits_shape=(T, K, D), bits_dtype=dtype,
                               scales_shape=(T, K) if storage == "fp8" else None)
    bits.fill_(7)
    if scales is not None:
        scales.fill_(1.5)
        assert (bits == 7).all()  # scales did not overwrite the bits
    assert bits.shape == (T, K, D) and bits.dtype == dtype


def test_pool_blocks_until_release_and_runs_check():
    pool = PinnedPool(count=1, nbytes=100, pin=False)
    buf = pool.acquire()
    calls = []

    def check():
        calls.append(1)
        if len(calls) == 3:
            threading.Timer(0.01, pool.release, args=(buf,)).start()

    assert pool.acquire(check=check) is buf
    assert len(calls) >= 3


def test_pool_check_error_propagates():
    pool = PinnedPool(count=1, nbytes=8, pin=False)
    pool.acquire()

    def boom():
        raise RuntimeError("writer died")

    with pytest.raises(RuntimeError, match="writer died"):
        pool.acquire(check=boom)


def test_writer_calls_on_consumed_after_copying(tmp_path):
    fp = make_fp(storage="bf16", taps=(1, 2), D=16)
    consumed = []
    hidden = torch.randn(10, 2, 16).to(torch.bfloat16)
    with CacheWriter(tmp_path / "c", fp, shard_tokens=64) as w:
        w.append(sample_ids=np.array([0, 1]), lengths=np.array([4, 6]), input_ids=np.arange(10, dtype=np.int32),
                 loss_mask=np.ones(10, np.uint8), hidden=hidden, on_consumed=lambda: consumed.append(True))
    assert consumed == [True]
    r = CacheReader(tmp_path / "c")
    assert torch.equal(r.read(1).hidden.view(torch.uint16), hidden[4:].view(torch.uint16))


def test_pool_allocates_on_demand_up_to_count():
    pool = PinnedPool(count=3, nbytes=10, pin=False)
    assert pool.allocated == 0
    a = pool.acquire()
    pool.release(a)
    assert pool.acquire() is a and pool.allocated == 1  # a released buffer is reused before a new one
    b, c = pool.acquire(), pool.acquire()
    assert pool.allocated == 3 and len({id(a), id(b), id(c)}) == 3
    threading.Timer(0.05, pool.release, args=(b,)).start()
    assert pool.acquire() is b and pool.allocated == 3  # at count: waits for a release


def test_pool_prefill_pins_every_buffer_in_the_background():
    pool = PinnedPool(count=3, nbytes=10, pin=False, prefill=True)
    got = [pool.acquire() for _ in range(3)]
    assert len({id(b) for b in got}) == 3 and pool.allocated == 3
    threading.Timer(0.05, pool.release, args=(got[1],)).start()
    assert pool.acquire() is got[1] and pool.allocated == 3
