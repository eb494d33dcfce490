"""Chat-template tokenization with the assistant loss mask.

The mask covers exactly the tokens the target generates in an assistant turn: the content and its
end-of-turn token (e.g. ChatML "<|im_end|>"), because at inference the drafter must predict the stop token
too. It does not cover the assistant header ("<|im_start|>assistant\\n") nor the separator after the end token
("\\n"): the header is part of the prompt (the generation prompt) and the separator is never generated.

Two ways to find the spans:
- Templates with `{% generation %}` markers: transformers' `return_assistant_tokens_mask` (the template
  author decides the span; most mark content + end token, as above).
- Otherwise, prefix rendering. For assistant turn i, render messages[:i] with the generation prompt: its
  longest common token prefix with the full render is where the turn's generated text starts (the common
  prefix, not the length, so templates that render a header differently once a later turn exists - Qwen3's
  empty think block - still line up). The turn ends at the last end-of-turn token before the end of the
  render of messages[:i+1] when that render is a prefix of the full one, else at the first end-of-turn token.
  A template whose history render is not a prefix of the full render (it rewrites earlier turns) is a skip
  (`template_prefix_mismatch`): add generation markers to such templates.
Cost of the prefix path: 3 renders per assistant turn (cheap jinja); the renders are compared as text and
only the full conversation is tokenized, with character boundaries mapped to tokens by the offset mapping.
When a boundary falls inside a token (or the tokenizer has no offsets) every render is tokenized and the
token lists compared instead (exact, ~4x slower on ShareGPT).
"""

from __future__ import annotations

import re
import weakref
from typing import Any

import numpy as np

from dflash.data import skips
from dflash.data.skips import Skip

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")

# End-of-turn tokens of common chat formats (ChatML, Llama 3, Gemma, Phi, GPT-2 style, SentencePiece).
_END_OF_TURN_STRINGS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>", "</s>")


def has_generation_markers(tokenizer) -> bool:
    """Whether the tokenizer's chat template marks assistant spans with {% generation %}."""
    template = tokenizer.chat_template
    if isinstance(template, dict):  # several named templates: the default one is used
        template = template.get("default", "")
    return isinstance(template, str) and bool(_GENERATION_TAG.search(template))


def end_of_turn_ids(tokenizer) -> frozenset[int]:
    """Token ids that end an assistant turn: the EOS token plus known end-of-turn special tokens."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab_special = set(tokenizer.all_special_tokens) | set(getattr(tokenizer, "added_tokens_encoder", {}))
    for s in _END_OF_TURN_STRINGS:
        if s in vocab_special:
            ids.add(int(tokenizer.convert_tokens_to_ids(s)))
    return frozenset(ids)


def _ids_of(encoded: Any) -> list[int]:
    """apply_chat_template returns a list or, in transformers 5, a BatchEncoding."""
    if isinstance(encoded, dict) or hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    return list(encoded)


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


_CHARS_MARGIN = 2
"""Normalizers (NFKC) can fold a few characters into one, so the bound allows twice the longest token."""
_MAX_TOKEN_CHARS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def max_token_chars(tokenizer) -> int:
    """Most characters one token can stand for: the longest vocabulary entry (byte-level BPE entries hold one
    character per byte, SentencePiece ones one per character, so this bounds the text a token covers)."""
    try:
        return _MAX_TOKEN_CHARS[tokenizer]
    except (KeyError, TypeError):
        pass
    n = max((len(t) for t in tokenizer.get_vocab()), default=1)
    try:
        _MAX_TOKEN_CHARS[tokenizer] = n
    except TypeError:
        pass
    return n


def max_chars_for(tokenizer, max_length: int) -> int:
    """Characters of message text that are certain to hold more than max_length tokens."""
    return _CHARS_MARGIN * max_token_chars(tokenizer) * max_length + 1024


def bound_messages(messages: list[dict], *, max_chars: int) -> tuple[list[dict], bool]:
    """Cut the message texts once their running length passes max_chars (later texts become ""); returns the
    messages and whether anything was cut. Every token covers at most max_token_chars characters, so the first
    max_length tokens lie well before the cut and tokenize exactly as without it, while a 20 MB line costs a
    few hundred KB of template and tokenizer work instead of minutes and GBs. Roles and turns stay,
    so the template sees the same structure."""
    left, cut, out = max_chars, False, []
    for m in messages:
        m2 = dict(m)
        for key in ("reasoning_content", "content"):
            text = m2.get(key)
            if isinstance(text, str):
                if len(text) > left:
                    m2[key], cut = text[:left], True
                left = max(0, left - len(text))
        out.append(m2)
    return out, cut


def tokenize_conversation(
    tokenizer, messages: list[dict], *, max_length: int | None = None, template_kwargs: dict | None = None,
    location: str = "", bound_chars: bool = True,
) -> tuple[np.ndarray, np.ndarray] | Skip:
    """Token ids int32 [T] and loss mask uint8 [T] of one conversation, or a Skip with the reason.

    `template_kwargs` go to apply_chat_template (e.g. enable_thinking=False). `max_length` truncates; a
    sample left with no loss token is skipped (over_length). With max_length, texts are first cut at
    max_chars_for(tokenizer, max_length) characters (bound_messages: same tokens, bounded work);
    bound_chars=False tokenizes everything (tests compare the two).
    """
    kwargs = dict(template_kwargs or {})
    cut = False
    if max_length is not None and bound_chars:
        messages, cut = bound_messages(messages, max_chars=max_chars_for(tokenizer, max_length))
    try:
        # return_assistant_tokens_mask needs a fast tokenizer (offsets); slow ones use the prefix path.
        if has_generation_markers(tokenizer) and getattr(tokenizer, "is_fast", False):
            ids, mask = _tokenize_with_markers(tokenizer, messages, kwargs)
        else:
            result = _tokenize_by_prefixes(tokenizer, messages, kwargs)
            if isinstance(result, str):
                return Skip(skips.TEMPLATE_PREFIX_MISMATCH, location, result)
            ids, mask = result
    except Exception as e:  # templates raise on data they dislike (e.g. roles must alternate)
        return Skip(skips.TEMPLATE_ERROR, location, f"{type(e).__name__}: {str(e)[:200]}")
    ids_T = np.asarray(ids, dtype=np.int32)
    mask_T = np.asarray(mask, dtype=np.uint8)
    if not mask_T.any():
        if cut:  # the assistant turns were past the cut, hence past max_length
            return Skip(skips.OVER_LENGTH, location, f"no assistant token within the first {max_length} tokens")
        return Skip(skips.NO_LOSS_TOKENS, location, f"{len(ids_T)} tokens, none from an assistant turn")
    return truncate(ids_T, mask_T, max_length=max_length, location=location)


def truncate(ids_T: np.ndarray, mask_T: np.ndarray, *, max_length: int | None, location: str = "",
             ) -> tuple[np.ndarray, np.ndarray] | Skip:
    """Cut to max_length tokens; a sample with no loss token left is skipped (over_length)."""
    if max_length is not None and len(ids_T) > max_length:
        ids_T, mask_T = ids_T[:max_length], mask_T[:max_length]
        if not mask_T.any():
            return Skip(skips.OVER_LENGTH, location, f"no assistant token within the first {max_length} tokens")
    return ids_T, mask_T


def _tokenize_with_markers(tokenizer, messages, kwargs) -> tuple[list[int], list[int]]:
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **kwargs
    )
    return list(out["input_ids"]), list(out["assistant_masks"])


def _render(tokenizer, messages, *, add_generation_prompt: bool, kwargs) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )


def _tokenize_by_prefixes(tokenizer, messages, kwargs) -> tuple[list[int], list[int]] | str:
    """See the module docstring. Returns (ids, mask) or a string saying why the template does not fit."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    full_text = _render(tokenizer, messages, add_generation_prompt=False, kwargs=kwargs)
    renders = [
        tuple(_render(tokenizer, messages[:j], add_generation_prompt=g, kwargs=kwargs) for j, g in
              ((i, False), (i, True), (i + 1, False)))
        for i in turns
    ]
    if getattr(tokenizer, "is_fast", False):
        result = _spans_by_text(tokenizer, full_text, renders, turns)
        if result is not None:
            return result
    return _spans_by_tokens(tokenizer, full_text, renders, turns)


def _spans_by_text(tokenizer, full_text, renders, turns) -> tuple[list[int], list[int]] | str | None:
    """Fast path: compare renders as text and tokenize only the full conversation, mapping character
    boundaries to tokens with the offset mapping. Tokenizing every prefix instead costs O(turns x length)
    tokenizer work (~21 ms vs ~4 ms per ShareGPT conversation with SmolLM2's tokenizer). Returns None when a
    boundary falls inside a token, so the exact token-level path decides."""
    enc = tokenizer(full_text, add_special_tokens=False, return_offsets_mapping=True)
    full = list(enc["input_ids"])
    starts_T = np.array([a for a, _ in enc["offset_mapping"]] + [len(full_text)], dtype=np.int64)
    is_end_T = np.isin(np.asarray(full, dtype=np.int64), list(end_of_turn_ids(tokenizer)))

    def token_at(char: int) -> int | None:
        t = int(np.searchsorted(starts_T, char, side="left"))
        return t if starts_T[t] == char else None  # None: the boundary is inside a token

    if np.any(np.diff(starts_T) < 0):
        return None  # offsets not monotonic (unusual tokenizer): let the token-level path decide
    mask_T = np.zeros(len(full), dtype=np.uint8)
    for (history, prompt, upto), i in zip(renders, turns):
        if not full_text.startswith(history):
            return f"turn {i}: the render of the earlier turns is not a prefix of the full conversation"
        if not prompt.startswith(history):
            return f"turn {i}: the generation prompt render does not start with the render of the earlier turns"
        start_char = len(history)
        while start_char < min(len(prompt), len(full_text)) and prompt[start_char] == full_text[start_char]:
            start_char += 1
        start = token_at(start_char)
        if start is None or token_at(len(history)) is None:
            return None
        if full_text.startswith(upto):
            stop = token_at(len(upto))
            if stop is None:
                return None
            ends = np.flatnonzero(is_end_T[start:stop])
            stop = start + int(ends[-1]) + 1 if len(ends) else stop
        else:
            ends = np.flatnonzero(is_end_T[start:])
            if not len(ends):
                return f"turn {i}: the turn render is not a prefix of the full one and has no end-of-turn token"
            stop = start + int(ends[0]) + 1
        mask_T[start:stop] = 1
    return full, mask_T.tolist()


def _spans_by_tokens(tokenizer, full_text, renders, turns) -> tuple[list[int], list[int]] | str:
    """Exact path: tokenize every prefix render and compare token lists."""
    texts = [full_text] + [t for r in renders for t in r]
    # The templates write the special tokens (BOS included) themselves, as apply_chat_template(tokenize=True).
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    full, per_turn = list(encoded[0]), encoded[1:]
    end_ids = end_of_turn_ids(tokenizer)
    mask = [0] * len(full)
    for k, i in enumerate(turns):
        history, prompt, upto = (list(x) for x in per_turn[3 * k: 3 * k + 3])
        if full[: len(history)] != history:
            return f"turn {i}: the render of the earlier turns is not a token prefix of the full conversation"
        start = _common_prefix_len(prompt, full)
        if start < len(history):
            return f"turn {i}: the generation prompt diverges from the full conversation inside earlier turns"
        if full[: len(upto)] == upto:  # prefix-stable: the turn ends within the render of messages[:i+1]
            ends = [p for p in range(start, len(upto)) if full[p] in end_ids]
            stop = ends[-1] + 1 if ends else len(upto)
        else:
            stop = next((p + 1 for p in range(start, len(full)) if full[p] in end_ids), None)
            if stop is None:
                return f"turn {i}: the turn render is not a prefix of the full one and has no end-of-turn token"
        for p in range(start, stop):
            mask[p] = 1
    return full, mask
