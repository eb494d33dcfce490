"""GPU only: the live target's taps of an --online run (OnlineTaps.hidden: index maps copied from pinned memory,
rows moved by index) on CUDA equal the same model's taps on the CPU, per packed token, in several forward
batches; and OnlineTaps' own work around the model queues without waiting for the GPU (no host sync)."""

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_online_taps_on_cuda_equal_cpu(tmp_path):
    from dflash.target.load import load_target
    from dflash.target.testing import tiny_qwen35_dir
    from dflash.train.online import OnlineTaps

    src = tiny_qwen35_dir(tmp_path / "m", num_layers=4, seed=1)
    lengths = np.array([37, 5, 64, 20, 11])
    ids = torch.randint(0, 200, (int(lengths.sum()),), generator=torch.Generator().manual_seed(0))
    got = {}
    for device in ("cpu", "cuda"):
        model, _ = load_target(src, device=device, dtype=torch.float32)
        taps = OnlineTaps(model, (1, 3), dtype=torch.float32, batch_tokens=96)  # several forward batches
        got[device] = taps.hidden(ids.to(device), lengths)
        if device == "cuda":
            ids_dev = ids.to(device)
            forward = taps.tapped

            def model_unjudged(ids_BS):  # the model's own kernels (e.g. FLA's) are not what this checks
                torch.cuda.set_sync_debug_mode(0)
                try:
                    return forward(ids_BS)
                finally:
                    torch.cuda.set_sync_debug_mode("error")
            taps.tapped = model_unjudged
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")   # a host sync in OnlineTaps' own work raises
            try:
                again = taps.hidden(ids_dev, lengths)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            assert torch.equal(again, got["cuda"])
    a, b = got["cuda"].cpu(), got["cpu"]
    assert a.shape == b.shape == (int(lengths.sum()), 2, b.shape[2])
    assert float((a - b).norm() / b.norm()) < 5e-3   # fp32 (or TF32 where enabled) kernels, same math


def test_online_taps_of_an_sdpa_llama_never_wait_for_the_gpu(tmp_path):
    """A Llama target (SmolLM2's architecture; torch kernels only): the whole OnlineTaps.hidden, the model's
    forward included, queues without a host sync (transformers' mask builder is not run: CAUSAL_SDPA)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash.target.load import load_target
    from dflash.target.testing import tiny_tokenizer
    from dflash.train.online import OnlineTaps

    cfg = LlamaConfig(vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    tiny_tokenizer().save_pretrained(tmp_path / "llama")
    model, _ = load_target(tmp_path / "llama", device="cuda", dtype=torch.bfloat16)
    taps = OnlineTaps(model, (1, 3), dtype=torch.bfloat16, batch_tokens=96)
    lengths = np.array([37, 5, 64, 20, 11])
    ids = torch.randint(0, 256, (int(lengths.sum()),), device="cuda")
    first = taps.hidden(ids, lengths)   # warm-up: lazy initialisations may sync once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = taps.hidden(ids, lengths)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(again, first)
