"""Chat-template tokenization and the assistant loss mask, on the real SmolLM2 tokenizer."""

import numpy as np
import pytest
from conftest_data import (  # noqa: F401  (fixtures)
    HISTORY_REWRITING,
    QWEN3_LIKE,
    STRICT_ALTERNATION,
    marker_tokenizer,
    smollm_tokenizer,
    with_template,
)

from dflash.data import chat, skips
from dflash.data.chat import end_of_turn_ids, has_generation_markers, tokenize_conversation
from dflash.data.skips import Skip

SINGLE = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "2+2 equals 4."}]
MULTI = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "Name a prime number."},
    {"role": "assistant", "content": "Seven is a prime number."},
    {"role": "user", "content": "And an even one?"},
    {"role": "assistant", "content": "Two is the only even prime."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You are welcome.\nBye."},
]


def masked_runs(tok, ids, mask):
    """Decoded text of each maximal run of masked tokens."""
    runs, start = [], None
    for p, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = p
        elif not m and start is not None:
            runs.append(tok.decode(ids[start:p]))
            start = None
    return runs


def assistant_texts(messages, end="<|im_end|>"):
    return [m["content"] + end for m in messages if m["role"] == "assistant"]


def test_smollm2_template_is_chatml_without_markers(smollm_tokenizer, marker_tokenizer):
    assert "<|im_start|>" in smollm_tokenizer.chat_template
    assert not has_generation_markers(smollm_tokenizer)
    assert has_generation_markers(marker_tokenizer)
    assert smollm_tokenizer.convert_tokens_to_ids("<|im_end|>") in end_of_turn_ids(smollm_tokenizer)


@pytest.mark.parametrize("which", ["markers", "prefixes"])
@pytest.mark.parametrize("messages", [SINGLE, MULTI], ids=["single", "multi_turn_system"])
def test_mask_is_exactly_assistant_content_and_end_token(which, messages, smollm_tokenizer, marker_tokenizer):
    tok = marker_tokenizer if which == "markers" else smollm_tokenizer
    ids, mask = tokenize_conversation(tok, messages)
    assert ids.dtype == np.int32 and mask.dtype == np.uint8 and ids.shape == mask.shape
    # the same token ids as the template's own tokenization
    assert ids.tolist() == list(tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
    assert masked_runs(tok, ids, mask) == assistant_texts(messages)
    # not the header, not the separator after the end token
    unmasked = tok.decode(ids[mask == 0])
    assert unmasked.count("<|im_start|>assistant\n") == sum(m["role"] == "assistant" for m in messages)


def test_marker_and_prefix_paths_agree(smollm_tokenizer, marker_tokenizer):
    for messages in (SINGLE, MULTI):
        a_ids, a_mask = tokenize_conversation(marker_tokenizer, messages)
        b_ids, b_mask = tokenize_conversation(smollm_tokenizer, messages)
        assert a_ids.tolist() == b_ids.tolist() and a_mask.tolist() == b_mask.tolist()


def test_default_system_prompt_is_context_not_loss(smollm_tokenizer):
    ids, mask = tokenize_conversation(smollm_tokenizer, SINGLE)
    text = smollm_tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert masked_runs(smollm_tokenizer, ids, mask) == ["2+2 equals 4.<|im_end|>"]


def test_text_and_token_paths_agree(smollm_tokenizer):
    kwargs = {}
    turns = [i for i, m in enumerate(MULTI) if m["role"] == "assistant"]
    full = chat._render(smollm_tokenizer, MULTI, add_generation_prompt=False, kwargs=kwargs)
    renders = [
        tuple(chat._render(smollm_tokenizer, MULTI[:j], add_generation_prompt=g, kwargs=kwargs)
              for j, g in ((i, False), (i, True), (i + 1, False)))
        for i in turns
    ]
    fast = chat._spans_by_text(smollm_tokenizer, full, renders, turns)
    exact = chat._spans_by_tokens(smollm_tokenizer, full, renders, turns)
    assert fast is not None and fast == exact


def test_template_kwargs_reach_the_template():
    tok = with_template(QWEN3_LIKE)
    # enable_thinking=False: the empty think block is part of the prompt, so it is not loss
    ids, mask = tokenize_conversation(tok, MULTI[1:], template_kwargs={"enable_thinking": False})
    assert masked_runs(tok, ids, mask) == assistant_texts(MULTI[1:])
    assert "<think>" in tok.decode(ids[mask == 0])
    # thinking on (default): the model itself generates the (empty) think block of the last turn
    ids, mask = tokenize_conversation(tok, MULTI[1:])
    runs = masked_runs(tok, ids, mask)
    assert runs[:-1] == assistant_texts(MULTI[1:])[:-1]
    assert runs[-1] == "<think>\n\n</think>\n\n" + assistant_texts(MULTI[1:])[-1]


def test_truncation_keeps_prefix_and_drops_samples_without_loss(smollm_tokenizer):
    ids, mask = tokenize_conversation(smollm_tokenizer, MULTI)
    first_loss = int(np.flatnonzero(mask)[0])
    cut_ids, cut_mask = tokenize_conversation(smollm_tokenizer, MULTI, max_length=first_loss + 2)
    assert cut_ids.tolist() == ids[: first_loss + 2].tolist() and cut_mask.sum() == 2
    skip = tokenize_conversation(smollm_tokenizer, MULTI, max_length=first_loss, location="f.jsonl:3")
    assert isinstance(skip, Skip) and skip.reason == skips.OVER_LENGTH and skip.location == "f.jsonl:3"


def test_template_errors_and_unstable_templates_are_skips():
    skip = tokenize_conversation(with_template(STRICT_ALTERNATION), [{"role": "assistant", "content": "x"}])
    assert isinstance(skip, Skip) and skip.reason == skips.TEMPLATE_ERROR and "alternate" in skip.detail
    skip = tokenize_conversation(with_template(HISTORY_REWRITING), MULTI)
    assert isinstance(skip, Skip) and skip.reason == skips.TEMPLATE_PREFIX_MISMATCH


def test_empty_assistant_reply_still_masks_its_end_token(smollm_tokenizer):
    ids, mask = tokenize_conversation(smollm_tokenizer, [SINGLE[0], {"role": "assistant", "content": ""}])
    assert masked_runs(smollm_tokenizer, ids, mask) == ["<|im_end|>"]
