"""GPU only: train.wgrad's CUDA path, cuBLAS' fp32-output matmul of bf16 inputs (torch.addmm(out_dtype=float32))
adding into the fp32 .grad, against autograd's bf16 gradient, cast and add, at a 27B-drafter MLP shape under
bf16 autocast. Forward bit for bit; the gradient differs only by the bf16 rounding autograd's path applies to it."""

import copy

import pytest
import torch
from torch import nn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_weight_gradients_added_in_fp32_by_the_matmul():
    from dflash.train.wgrad import fuse_weight_grads

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(5120, 4096, bias=False), nn.Linear(4096, 5120, bias=False)).cuda()
    fused = copy.deepcopy(plain)
    assert fuse_weight_grads(fused) == 2
    x = torch.randn(4096, 5120, device="cuda")
    grads, outs = {}, {}
    for name, m in (("plain", plain), ("fused", fused)):
        for p in m.parameters():
            p.grad = torch.full_like(p, 0.5)        # GradSync's buffer holds earlier micro-batches' sums
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outs[name] = m(x)
            outs[name].float().pow(2).mean().backward()
        grads[name] = [p.grad - 0.5 for p in m.parameters()]
    assert torch.equal(outs["plain"], outs["fused"])
    for a, b in zip(grads["plain"], grads["fused"]):
        assert b.dtype == torch.float32 and (a - b).norm() / a.norm() < 1e-2
