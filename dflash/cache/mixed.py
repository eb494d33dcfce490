"""MixedReader: several caches of one target, taps and storage read as one sample axis.

Cache c's local sample j is global index offsets[c] + j. The index is the caches' indexes concatenated, and
read_many splits a batch of global indices into runs of one cache and reads each run with that cache's
CacheReader into its slice of the same output buffers, so a micro-batch mixing caches is still one packed
batch in one (pinned) buffer. Which global indices an epoch visits is the mixture plan's business
(train.mixture); this class only reads.

The caches must agree on everything that makes their features interchangeable: the target (config, weights,
layer count, hidden size, dtype), the tokenizer and chat template, the taps and the storage.
`check_compatible` refuses in one line naming the first field that differs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dflash.cache.reader import CacheReader, PackedBuffers, PackedSamples, SampleIndex, stored_samples
from dflash.errors import CacheMismatchError

MIXABLE_FIELDS = ("target_config_hash", "target_weights_hash", "num_target_layers", "hidden_size", "target_dtype",
                  "tokenizer_hash", "chat_template_hash", "tap_layer_ids", "storage")
"""Fingerprint fields that caches of one run must share (sources, lengths and greedy-ness may differ)."""


def check_compatible(readers: Sequence[CacheReader]) -> None:
    """CacheMismatchError naming the first MIXABLE_FIELDS field where a cache differs from the first one."""
    first = readers[0].fingerprint.to_json()
    for r in readers[1:]:
        other = r.fingerprint.to_json()
        for name in MIXABLE_FIELDS:
            if other[name] != first[name]:
                raise CacheMismatchError(name, first[name], other[name],
                                         "the caches of one run must share target, taps and storage",
                                         mine=f"cache {readers[0].path!r} has", theirs=f"cache {r.path!r}'s")


class MixedReader:
    """The CacheReader interface training uses (index, read_many, tap/storage attributes, bytes_read, close)
    over several caches (module docstring)."""

    def __init__(self, readers: Sequence[CacheReader]) -> None:
        assert len(readers) >= 1
        check_compatible(readers)
        self.readers = list(readers)
        first = self.readers[0]
        self.path = first.path
        self.paths = [r.path for r in self.readers]
        self.manifest, self.fingerprint = first.manifest, first.fingerprint
        self.tap_layer_ids, self.storage, self.hidden_size = first.tap_layer_ids, first.storage, first.hidden_size
        self.layout = first.layout
        self.counts = np.array([len(r) for r in self.readers], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)
        idx = [r.index for r in self.readers]
        # shard numbers unique across the caches (cache c's after every earlier cache's), so (shard, offset)
        # orders the mixture's samples by storage as it does one cache's (permutation.storage_order)
        first_shard = np.cumsum([0] + [len(i.shard_names) for i in idx[:-1]])
        self.index = SampleIndex(sample_id=np.concatenate([i.sample_id for i in idx]),
                                 length=np.concatenate([i.length for i in idx]),
                                 num_loss_tokens=np.concatenate([i.num_loss_tokens for i in idx]),
                                 shard=np.concatenate([i.shard + f for i, f in zip(idx, first_shard)]),
                                 offset=np.concatenate([i.offset for i in idx]), shard_names=[])

    @property
    def bytes_read(self) -> int:
        return sum(r.bytes_read for r in self.readers)

    def __len__(self) -> int:
        return int(self.counts.sum())

    def cache_of(self, indices) -> np.ndarray:
        """int64: the cache of each global index."""
        return np.searchsorted(self.offsets, np.asarray(indices, dtype=np.int64), side="right") - 1

    def tap_positions(self, taps):
        return self.readers[0].tap_positions(taps)

    def read_many(self, indices: Sequence[int], *, taps: Sequence[int] | None = None,
                  out: PackedBuffers | None = None, **kw) -> PackedSamples:
        """Samples of global `indices` in order, packed like CacheReader.read_many (stored, not dequantized)."""
        assert not kw.get("dequantize"), "MixedReader reads stored features; decode them on the device"
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        lengths = self.index.length[idx]
        T = int(lengths.sum())
        Kp = len(self.tap_positions(taps))
        if out is None:
            out = PackedBuffers.allocate(tokens=T, num_taps=Kp, hidden_size=self.hidden_size, storage=self.storage)
        which = self.cache_of(idx)
        brk = np.flatnonzero(which[1:] != which[:-1]) + 1
        t0 = 0
        for a, z in zip(np.concatenate([[0], brk]).tolist(), np.concatenate([brk, [len(idx)]]).tolist()):
            if a == z:
                continue
            c = int(which[a])
            sub = PackedBuffers(hidden=out.hidden[t0:], scales=None if out.scales is None else out.scales[t0:],
                                input_ids=out.input_ids[t0:], loss_mask=out.loss_mask[t0:],
                                group_scales=None if out.group_scales is None else out.group_scales[t0:])
            self.readers[c].read_many(idx[a:z] - self.offsets[c], taps=taps, out=sub)
            t0 += int(lengths[a:z].sum())
        return stored_samples(out, sample_ids=self.index.sample_id[idx], lengths=lengths, storage=self.storage,
                              layout=self.layout)

    def close(self) -> None:
        for r in self.readers:
            r.close()

    def __enter__(self) -> "MixedReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["MIXABLE_FIELDS", "MixedReader", "check_compatible"]
