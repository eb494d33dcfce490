"""Shared fixtures of the dflash.data tests (import the fixtures into a test module to use them).

The tokenizer is loaded once per process (functools.cache), not once per importing module: pytest would
otherwise build one session fixture per module that imports it. It is read from the machine's converted
SmolLM2 folder (dflash.target.assets.smollm2_hf_dir, the `smollm2_dir` fixture's), whose tokenizer files were
saved from the GGUF's tokenizer: same vocabulary, ids, special tokens and chat template, in ~1 s instead of
the GGUF's 28 s (measured under load ~7).
"""

import copy
import functools

import pytest

# ChatML exactly as SmolLM2's, with {% generation %} around what the assistant generates (content + end).
CHATML_WITH_GENERATION = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A Qwen3-like template without markers: with enable_thinking=False the generation prompt carries an empty
# think block, and the last assistant turn is rendered with it while earlier ones are not (so the render of
# messages[:i+1] is not a prefix of the full render for earlier turns).
QWEN3_LIKE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' and loop.last %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{{ message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)

# Rewrites history: the system prompt names the number of turns, so no prefix render is a prefix of the full.
HISTORY_REWRITING = (
    "{{ '<|im_start|>system\nturns: ' + (messages | length | string) + '<|im_end|>\n' }}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Raises on non-alternating roles, as many real templates do.
STRICT_ALTERNATION = (
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
)


@functools.cache
def _load_smollm2():
    from transformers import AutoTokenizer

    from dflash.target.assets import smollm2_hf_dir

    return AutoTokenizer.from_pretrained(smollm2_hf_dir())


def with_template(template: str):
    """A copy of the SmolLM2 tokenizer with another chat template (the cached one is never mutated)."""
    tok = copy.deepcopy(_load_smollm2())
    tok.chat_template = template
    return tok


@pytest.fixture(scope="session")
def smollm_tokenizer():
    """The real SmolLM2-135M-Instruct tokenizer with its own ChatML template (no generation markers)."""
    return _load_smollm2()


@pytest.fixture(scope="session")
def marker_tokenizer():
    """SmolLM2's tokenizer with CHATML_WITH_GENERATION."""
    return with_template(CHATML_WITH_GENERATION)
