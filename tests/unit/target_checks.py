"""A check shared by the per-architecture target tests."""

import torch

from dflash.target import forward as fw


def check_unmasked_forward_skips_the_mask_builder(model, batch_BS, taps, monkeypatch) -> None:
    """An unmasked TappedForward of an SDPA model runs transformers' SDPA as is_causal without building a mask:
    bit-identical taps to the forward under transformers' own mask builder, the packed-sequence check (a host
    sync on CUDA) never called, and the model's attention setting as it was afterwards."""
    import transformers.masking_utils as mu

    config = fw.text_decoder(model).config
    assert config._attn_implementation == "sdpa" and fw.mask_free_causal(config)
    tapped = fw.TappedForward(model, taps)
    with monkeypatch.context() as m:
        m.setattr(fw, "mask_free_causal", lambda config: False)
        built = tapped(batch_BS)
    with monkeypatch.context() as m:
        def packed_check(*args, **kwargs):
            raise AssertionError("the mask builder ran")
        m.setattr(mu, "find_packed_sequence_indices", packed_check)
        free = tapped(batch_BS)
    assert torch.equal(free, built)
    assert config._attn_implementation == "sdpa"
