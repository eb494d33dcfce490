"""The static decode backend with one fixed cache length (DecodeConfig.cache_len): every batch meets the same
(rows, cache length) shape, and the responses are eager generate's (fp32, CPU: no compile)."""

import pytest
import torch

from dflash.errors import ConfigError
from dflash.generate.decode import DecodeConfig, GreedyDecoder, stop_token_ids
from dflash.target.load import load_target


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    torch.manual_seed(0)
    return load_target(str(smollm2_dir), device=torch.device("cpu"), dtype=torch.float32)


def _decoder(model, tok, **kw) -> GreedyDecoder:
    stops = stop_token_ids(tok, model.generation_config, {})
    return GreedyDecoder(model, stop_ids=stops, pad_id=tok.pad_token_id if tok.pad_token_id is not None else stops[0],
                         cfg=DecodeConfig(max_new_tokens=6, batch_size=2, **kw))


def test_fixed_cache_len_is_one_shape_and_equals_eager(smollm2):
    model, tok = smollm2
    texts = ["Hi", "Name three colours of the rainbow, please.", "What is 2 + 2?",
             "Write one sentence about the sea and one about the mountains, then stop."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                       tokenize=True, return_dict=True)["input_ids"] for t in texts]
    eager = _decoder(model, tok, backend="eager").decode(prompts)
    fixed = _decoder(model, tok, backend="static", cache_len=200)
    got = fixed.decode(prompts)
    assert [d.response_ids for d in got] == [d.response_ids for d in eager]
    assert fixed.shapes == {(2, 200)}  # 2 batches, one shape


def test_fixed_cache_too_small_is_refused(smollm2):
    model, tok = smollm2
    prompt = tok("word " * 80, add_special_tokens=False)["input_ids"]
    with pytest.raises(ConfigError, match="does not fit the static cache"):
        _decoder(model, tok, backend="static", cache_len=64).decode([prompt])
    with pytest.raises(ConfigError, match="cache_len"):
        DecodeConfig(max_new_tokens=8, cache_len=8)
