"""Weight gradients of the drafter's linear layers added into their fp32 .grad by the weight-gradient matmul
itself (TrainConfig.wgrad_fusion), instead of autograd's three passes after it.

Why: under bf16 autocast over fp32 master weights, autograd forms each linear weight's gradient in bf16 (the
matmul writes it), the cast's backward reads that and writes it in fp32, and AccumulateGrad reads that and the
.grad and writes the .grad (train.step.GradSync keeps every .grad as a view of one flat fp32 buffer, so it always
adds): ~20 bytes of memory traffic a parameter, ~35 GB a step at the 27B drafter's 1.73B parameters. Here the
matmul reads the .grad and writes the sum in its epilogue (cuBLAS with fp32 output from bf16 inputs:
torch.addmm(out_dtype=float32)), ~8 bytes a parameter.

Semantics: forward values are nn.Linear's under the ambient autocast, bit for bit. Gradients: on CUDA the sum is
formed from the fp32 accumulator, so it skips the bf16 rounding autograd's path applies to each weight gradient;
on CPU (no fp32-output matmul for bf16 inputs) the bf16 product is added, as autograd does. A weight used twice in
one forward (k_proj, v_proj: context and block rows) gets two additions in fp32 where autograd first sums the two
gradients in the compute dtype. Linear layers with a bias keep autograd's path (the drafter has none).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["add_weight_grad", "fuse_weight_grads"]


def add_weight_grad(param: nn.Parameter, gt_OI: torch.Tensor, x_NI: torch.Tensor) -> None:
    """param.grad += gt_OI @ x_NI with the product formed at param.grad's precision where the device can (fp32
    output from bf16 inputs on CUDA; fp32 inputs anywhere), else added after it (bf16 on CPU). A missing .grad
    is created. gt_OI: the output gradient transposed [out, N]; x_NI: the layer's input [N, in]."""
    grad = param.grad
    with torch.autocast(x_NI.device.type, enabled=False):   # autocast would cast the fp32 accumulator down
        if grad is None:
            param.grad = torch.mm(gt_OI, x_NI).to(param.dtype)
        elif gt_OI.dtype == grad.dtype:
            grad.addmm_(gt_OI, x_NI)
        elif grad.is_cuda:
            torch.addmm(grad, gt_OI, x_NI, out_dtype=grad.dtype, out=grad)
        else:
            grad.add_(torch.mm(gt_OI, x_NI))


class _LinearIntoGrad(torch.autograd.Function):
    """y = x @ W^T in `dtype`; the backward adds dL/dW into W.grad itself and returns no gradient for W."""

    @staticmethod
    def forward(ctx, x, weight, dtype):
        x_lp, w_lp = x.to(dtype), weight.to(dtype)
        ctx.save_for_backward(x_lp, w_lp)
        ctx.weight = weight
        return F.linear(x_lp, w_lp)

    @staticmethod
    def backward(ctx, g):
        x_lp, w_lp = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        with torch.autocast(g.device.type, enabled=False):
            gx = g2.mm(w_lp).view(*g.shape[:-1], w_lp.shape[1])    # autograd's grad_input of linear
        add_weight_grad(ctx.weight, g2.t(), x_lp.reshape(-1, x_lp.shape[-1]))
        return gx, None, None


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else self.weight.dtype
    return _LinearIntoGrad.apply(x, self.weight, dtype)


def fuse_weight_grads(model: nn.Module) -> int:
    """Route every bias-free nn.Linear of `model` whose weight trains through _LinearIntoGrad (module
    docstring); returns how many. Weights, names and state dicts are unchanged."""
    n = 0
    for m in model.modules():
        if type(m) is nn.Linear and m.bias is None and m.weight.requires_grad:
            m.forward = types.MethodType(_forward, m)
            n += 1
    return n
