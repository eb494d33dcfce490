"""4-bit storage on CUDA (GPU machine only): extraction's CUDA branch (encode on the GPU, pinned D2H views of
codes, row scales and group scales, NaN check on the host copy) and the loader's (pinned reads, H2D of the
three arrays, decode on the GPU), against the CPU decode of the same shards and a bf16 extraction.

    python -m pytest -q -m gpu tests/unit/test_quant4_gpu.py
"""

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_cuda_extract_int4_and_loader_decode(tmp_path):
    from dflash.cache import CacheReader
    from dflash.cache.format import DEFAULT_QUANT4, decode_stored
    from dflash.extract.driver import ExtractConfig
    from dflash.extract.launch import launch
    from dflash.target.testing import tiny_qwen35_dir
    from dflash.train.loader import StreamingLoader, plan_epoch
    from tests.e2e.helpers_extract import write_conversations

    model = tiny_qwen35_dir(tmp_path / "model", num_layers=4)
    data = write_conversations(tmp_path / "data.jsonl", num=12, seed=0)
    for storage in ("int4", "bf16"):
        launch(ExtractConfig(model=str(model), data=(str(data),), output=str(tmp_path / storage), storage=storage,
                             taps=(0, 1, 2), max_length=128, batch_tokens=512, shard_tokens=200, device="cuda",
                             dtype="float32", show_progress=False), num_procs=1, echo=lambda *_: None)
    with CacheReader(tmp_path / "int4") as r, CacheReader(tmp_path / "bf16") as b:
        assert r.storage == DEFAULT_QUANT4 and len(r) == len(b) == 12
        raw = r.read_many(range(len(r)))
        cpu = decode_stored(raw.hidden, raw.scales, raw.group_scales, storage=r.storage, dtype=torch.float32)
        gpu = r.read_many(range(len(r)), dequantize=True, device="cuda").hidden.float().cpu()
        torch.testing.assert_close(gpu, cpu.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-5 * float(cpu.abs().max()))
        ref = b.read_many(range(len(b)), dequantize=True).hidden.float()
        err = (cpu - ref).norm(dim=-1) / ref.norm(dim=-1).clamp(min=1e-30)
        assert float(err.median()) < 0.15 and float(err.max()) < 0.5  # the format's error, not a wrong layout
        starts = np.concatenate([[0], np.cumsum(r.index.length)])
        pos = {int(s): i for i, s in enumerate(r.index.sample_id)}  # the loader yields sample ids
        plan = plan_epoch(r.index.length, seed=0, epoch=0, batch_tokens=256, world_size=1, grad_accum=1)
        seen = 0
        with StreamingLoader(r, plan, rank=0, start_step=0, taps=[1, 2], device=torch.device("cuda"),
                             dtype=torch.float32) as loader:
            for mb in loader:
                rows = np.concatenate([np.arange(starts[pos[s]], starts[pos[s] + 1]) for s in mb.sample_ids])
                assert mb.hidden_TKD.is_cuda
                torch.testing.assert_close(mb.hidden_TKD.cpu(), cpu[rows][:, 1:], rtol=0,
                                           atol=1e-5 * float(cpu.abs().max()))
                seen += len(mb.sample_ids)
        assert seen == len(r)
