"""Tiny random targets for tests: real transformers classes saved to a folder and loaded by the real path.

`tiny_qwen35_dir` builds a Qwen3.5 hybrid text model (Gated-DeltaNet and full-attention layers, the
reference target's architecture at toy size), or its multimodal wrapper (`vl=True`, weights under
`model.language_model.`), plus a byte-level tokenizer with a ChatML template. Seconds on CPU, no downloads.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def tiny_tokenizer():
    """A byte-level tokenizer: 256 byte tokens + 3 ChatML specials (259 ids), with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML_TEMPLATE
    )


def tiny_qwen35_text_kwargs(*, num_layers: int = 6, vocab_size: int = 264, tie: bool = False) -> dict:
    """Qwen3_5TextConfig kwargs: hidden 64, attention every other layer (linear, full, linear, full, ...)."""
    return dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        layer_types=[("full_attention" if i % 2 else "linear_attention") for i in range(num_layers)],
        vocab_size=vocab_size, tie_word_embeddings=tie, max_position_embeddings=4096,
    )


def tiny_qwen35_dir(
    path: str | os.PathLike,
    *,
    num_layers: int = 6,
    tie: bool = False,
    vl: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Save a random tiny Qwen3.5 (text causal LM, or the VL wrapper if `vl`) and a tokenizer under `path`."""
    from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig

    out = Path(path)
    tokenizer = tiny_tokenizer()
    vocab_size = -(-len(tokenizer) // 8) * 8  # rounded up, as real checkpoints pad their vocab
    text = tiny_qwen35_text_kwargs(num_layers=num_layers, vocab_size=vocab_size, tie=tie)
    torch.manual_seed(seed)
    if vl:
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"])
        config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=tie)
        model = Qwen3_5ForConditionalGeneration(config)
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text))
    model.to(dtype).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
