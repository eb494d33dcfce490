"""Data paths -> tokenized samples with stable global ids.

sample_id is a running index over all records of all sources in the order given (one id per record,
skipped or not), so it depends only on the input files, never on the tokenizer, max_length, or the rank:
every rank computes the same ids and can partition them (`rank`, `world_size`) without talking to the
others. Paths are checked before any work: a missing path or unknown format raises DataError at once.
Tokenizing is the cost (~5-15 ms per multi-turn ShareGPT conversation on one core), so `num_workers`
spreads it over spawned processes; reading and normalising stay in the calling process, in order.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Iterator, Sequence

import numpy as np

from dflash.data import skips
from dflash.data.chat import tokenize_conversation, truncate
from dflash.data.skips import Skip, SkipCounter
from dflash.data.sources import Record, check_paths, iter_records
from dflash.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class TokenizedSample:
    """One training sample."""

    sample_id: int
    """Stable global id: running record index over all sources, in order."""
    input_ids: np.ndarray
    """int32 [T]."""
    loss_mask: np.ndarray
    """uint8 [T]: 1 on assistant tokens."""
    source_index: int
    """Index of its data path in the list given to load_samples."""

    def __len__(self) -> int:
        return len(self.input_ids)


def iter_samples(
    paths: Sequence[str | pathlib.Path], tokenizer, *, max_length: int | None = None,
    template_kwargs: dict | None = None, skipped: SkipCounter | None = None, rank: int = 0, world_size: int = 1,
    max_records: int | None = None, num_workers: int = 0,
) -> Iterator[TokenizedSample]:
    """Stream the samples of `paths` in id order; skips go to `skipped`. Only ids with id % world_size == rank
    are tokenized (and only their skips counted). `max_records` stops after that many records (ids).
    `num_workers` > 0 tokenizes in that many spawned processes (same output, same order).
    Paths and arguments are checked at the call, before the first record is read."""
    skipped = skipped if skipped is not None else SkipCounter()
    return _collect(iter_results(
        paths, tokenizer, max_length=max_length, template_kwargs=template_kwargs, rank=rank, world_size=world_size,
        max_records=max_records, num_workers=num_workers,
    ), skipped)


def iter_results(
    paths: Sequence[str | pathlib.Path], tokenizer, *, max_length: int | None = None,
    template_kwargs: dict | None = None, rank: int = 0, world_size: int = 1, max_records: int | None = None,
    num_workers: int = 0,
) -> Iterator[tuple[int, int, tuple[np.ndarray, np.ndarray] | Skip]]:
    """(sample_id, source_index, (input_ids, loss_mask) or Skip) for each of this rank's records in id order:
    iter_samples before skip accounting, for callers that keep the skips' ids (dflash.extract.tokenized).
    Same arguments as iter_samples, checked at the call."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"rank={rank}, world_size={world_size}: need world_size >= 1 and 0 <= rank < world_size")
    if max_length is not None and max_length < 1:
        raise ConfigError(f"max_length={max_length}: must be a positive number of tokens, or None for no limit")
    if num_workers < 0:
        raise ConfigError(f"num_workers={num_workers}: must be >= 0 (0 tokenizes in this process)")
    checked = check_paths(paths)
    items = _iter_items(checked, rank=rank, world_size=world_size, max_records=max_records)
    if num_workers == 0:
        results = (
            (sid, src, item if isinstance(item, Skip) else
             _tokenize_record(item, tokenizer, max_length, template_kwargs))
            for sid, src, item in items
        )
    else:
        results = _tokenize_in_workers(
            items, tokenizer, max_length=max_length, template_kwargs=template_kwargs, num_workers=num_workers,
        )
    return results


def _iter_items(checked, *, rank, world_size, max_records) -> Iterator[tuple[int, int, Record | Skip]]:
    """(sample_id, source_index, record or skip) for this rank's ids."""
    sample_id = 0
    for source_index, path in enumerate(checked):
        for item in iter_records(path):
            sid, sample_id = sample_id, sample_id + 1
            if max_records is not None and sid >= max_records:
                return
            if sid % world_size == rank:
                yield sid, source_index, item


def _tokenize_record(record: Record, tokenizer, max_length, template_kwargs) -> tuple[np.ndarray, np.ndarray] | Skip:
    if record.messages is not None:
        return tokenize_conversation(
            tokenizer, record.messages, max_length=max_length, template_kwargs=template_kwargs,
            location=record.location,
        )
    result = truncate(
        np.asarray(record.input_ids, dtype=np.int32), np.asarray(record.loss_mask, dtype=np.uint8),
        max_length=max_length, location=record.location,
    )
    if not isinstance(result, Skip) and not result[1].any():
        return Skip(skips.NO_LOSS_TOKENS, record.location, "pre-tokenized record with an all-zero mask")
    return result


def _collect(results, skipped: SkipCounter) -> Iterator[TokenizedSample]:
    for sid, source_index, result in results:
        if isinstance(result, Skip):
            skipped.add(result)
        else:
            ids_T, mask_T = result
            yield TokenizedSample(sample_id=sid, input_ids=ids_T, loss_mask=mask_T, source_index=source_index)


# Records per task: large enough that pickling overhead (~0.1 ms a record) is small against tokenizing
# (~5-15 ms a ShareGPT conversation), small enough that the in-flight window holds little memory.
_CHUNK_RECORDS = 64
_worker_state: dict = {}


def _init_worker(tokenizer_file, max_length, template_kwargs) -> None:
    import pickle

    with open(tokenizer_file, "rb") as f:
        tokenizer = pickle.load(f)
    _worker_state.update(tokenizer=tokenizer, max_length=max_length, template_kwargs=template_kwargs)


def _work(chunk):
    st = _worker_state
    return [
        (sid, src, item if isinstance(item, Skip) else
         _tokenize_record(item, st["tokenizer"], st["max_length"], st["template_kwargs"]))
        for sid, src, item in chunk
    ]


def _chunks(items, size):
    chunk = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _tokenize_in_workers(items, tokenizer, *, max_length, template_kwargs, num_workers):
    """Tokenize chunks in spawned processes (spawn, not fork: the parent may hold torch / tokenizer threads),
    keeping at most 2 chunks per worker in flight and yielding results in id order.

    The tokenizer reaches the workers as a file, not pickled in their start-up arguments: the parent writes a
    child's start-up data into a pipe and blocks until the child has read it, and a child reads it only while it
    imports the parent's main module and, to unpickle a tokenizer, transformers; with a ~1.5 MB tokenizer in it
    the workers started one after another (seconds each: 16 workers took ~50 s on the H200 host, longer than
    tokenizing 2,000 conversations in one process)."""
    import collections
    import multiprocessing
    import os
    import pickle
    import tempfile
    from concurrent.futures import ProcessPoolExecutor

    with tempfile.TemporaryDirectory(prefix="dflash-tokenizer-") as tmp:
        tokenizer_file = os.path.join(tmp, "tokenizer.pkl")
        with open(tokenizer_file, "wb") as f:
            pickle.dump(tokenizer, f, protocol=pickle.HIGHEST_PROTOCOL)
        pool = ProcessPoolExecutor(
            max_workers=num_workers, mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker, initargs=(tokenizer_file, max_length, template_kwargs),
        )
        in_flight: collections.deque = collections.deque()
        try:
            for chunk in _chunks(items, _CHUNK_RECORDS):
                in_flight.append(pool.submit(_work, chunk))
                if len(in_flight) >= 2 * num_workers:
                    yield from in_flight.popleft().result()
            while in_flight:
                yield from in_flight.popleft().result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


def load_samples(
    paths: Sequence[str | pathlib.Path], tokenizer, *, max_length: int | None = None,
    template_kwargs: dict | None = None, rank: int = 0, world_size: int = 1, max_records: int | None = None,
    num_workers: int = 0,
) -> tuple[list[TokenizedSample], SkipCounter]:
    """All samples of `paths` in id order, and the skip accounting. See iter_samples for the arguments."""
    skipped = SkipCounter()
    samples = list(iter_samples(
        paths, tokenizer, max_length=max_length, template_kwargs=template_kwargs, skipped=skipped, rank=rank,
        world_size=world_size, max_records=max_records, num_workers=num_workers,
    ))
    return samples, skipped
