"""Data paths -> tokenized samples with stable global ids.

sample_id is a running index over all records of all sources in the order given (one id per record,
skipped or not), so it depends only on the input files, never on the tokenizer, max_length, or the rank:
every rank computes the same ids and can partition them (`rank`, `world_size`) without talking to the
others. Paths are checked before any work: a missing path or unknown format raises DataError at once.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Iterator, Sequence

import numpy as np

from dflash.data.chat import tokenize_conversation, truncate
from dflash.data import skips
from dflash.data.skips import Skip, SkipCounter
from dflash.data.sources import check_paths, iter_records
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
    max_records: int | None = None,
) -> Iterator[TokenizedSample]:
    """Stream the samples of `paths`; skips go to `skipped`. Only ids with id % world_size == rank are
    tokenized (and only their skips counted). `max_records` stops after that many records (ids).
    Paths and arguments are checked at the call, before the first record is read."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"rank={rank}, world_size={world_size}: need world_size >= 1 and 0 <= rank < world_size")
    if max_length is not None and max_length < 1:
        raise ConfigError(f"max_length={max_length}: must be a positive number of tokens, or None for no limit")
    checked = check_paths(paths)
    skipped = skipped if skipped is not None else SkipCounter()
    return _iter_checked(
        checked, tokenizer, max_length=max_length, template_kwargs=template_kwargs, skipped=skipped, rank=rank,
        world_size=world_size, max_records=max_records,
    )


def _iter_checked(
    checked, tokenizer, *, max_length, template_kwargs, skipped, rank, world_size, max_records,
) -> Iterator[TokenizedSample]:
    sample_id = 0
    for source_index, path in enumerate(checked):
        for item in iter_records(path):
            sid, sample_id = sample_id, sample_id + 1
            if max_records is not None and sid >= max_records:
                return
            if sid % world_size != rank:
                continue
            if isinstance(item, Skip):
                skipped.add(item)
                continue
            if item.messages is not None:
                result = tokenize_conversation(
                    tokenizer, item.messages, max_length=max_length, template_kwargs=template_kwargs,
                    location=item.location,
                )
            else:
                result = truncate(
                    np.asarray(item.input_ids, dtype=np.int32), np.asarray(item.loss_mask, dtype=np.uint8),
                    max_length=max_length, location=item.location,
                )
                if not isinstance(result, Skip) and not result[1].any():
                    result = Skip(skips.NO_LOSS_TOKENS, item.location, "pre-tokenized record with an all-zero mask")
            if isinstance(result, Skip):
                skipped.add(result)
                continue
            ids_T, mask_T = result
            yield TokenizedSample(sample_id=sid, input_ids=ids_T, loss_mask=mask_T, source_index=source_index)


def load_samples(
    paths: Sequence[str | pathlib.Path], tokenizer, *, max_length: int | None = None,
    template_kwargs: dict | None = None, rank: int = 0, world_size: int = 1, max_records: int | None = None,
) -> tuple[list[TokenizedSample], SkipCounter]:
    """All samples of `paths` in id order, and the skip accounting. See iter_samples for the arguments."""
    skipped = SkipCounter()
    samples = list(iter_samples(
        paths, tokenizer, max_length=max_length, template_kwargs=template_kwargs, skipped=skipped, rank=rank,
        world_size=world_size, max_records=max_records,
    ))
    return samples, skipped
