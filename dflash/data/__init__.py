"""Conversation sources, chat-template tokenization with the assistant loss mask, skip accounting and
token-budget batching. Imports nothing above it in dflash (no cache, target, extract, ...)."""

from dflash.data.batching import padding_fraction, token_budget_batches
from dflash.data.chat import end_of_turn_ids, has_generation_markers, tokenize_conversation
from dflash.data.samples import TokenizedSample, iter_samples, load_samples
from dflash.data.skips import Skip, SkipCounter
from dflash.data.sources import Record, check_paths, iter_records

__all__ = [
    "Record", "Skip", "SkipCounter", "TokenizedSample", "check_paths", "end_of_turn_ids", "has_generation_markers",
    "iter_records", "iter_samples", "load_samples", "padding_fraction", "token_budget_batches",
    "tokenize_conversation",
]
