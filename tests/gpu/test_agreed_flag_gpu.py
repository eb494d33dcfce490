"""GPU only: AgreedFlag's CUDA path (an NCCL all-reduce, the answer copied to pinned memory behind the step, an
event the next poll waits on) on a one-rank NCCL group described as a world of two, so the path runs on one GPU:
the answers lag the raised flag by exactly one poll, with GPU work queued between polls as a training step
queues it."""

import pytest
import torch
import torch.distributed as dist

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_the_cuda_path_answers_one_poll_late(monkeypatch):
    from dflash.procs import free_port
    from dflash.train.distributed import AgreedFlag, DistInfo

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
    try:
        flag = AgreedFlag(DistInfo(rank=0, world_size=2, local_rank=0, device=dev))
        x = torch.randn(4096, 4096, device=dev)
        answers = []
        for raised in (False, False, True, True, False, False):
            for _ in range(4):
                x = torch.tanh(x @ x.T / 64)   # a step's work, queued ahead of the poll
            answers.append(flag.poll(raised))
        torch.cuda.synchronize()
        assert answers == [False, False, False, True, True, False]
    finally:
        dist.destroy_process_group()
