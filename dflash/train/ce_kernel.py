"""The fused CE's per-chunk epilogue as one hand-written Triton kernel (CUDA): from a chunk's logits [n, V], each
row's weighted CE, whether its argmax is its label, and d(CE * w)/d logits written over the logits in place.

Why: the epilogue is memory-bound. Its least traffic is one read of the logits and one write of the gradient;
the torch.compile'd version (fused_ce.chunk_terms) took 22 ms of a 581 ms step at the 27B drafter shape on an
H100, ~5x that bound, and writes a second [n, V] buffer. Here each row is one program that reads its logits
twice: an online max / sum-exp / argmax pass, then the gradient pass, which overwrites the logits (the caller
no longer needs them, and the [n, V] gradient buffer is not allocated at all): ~9 ms of the step
(results/train_real_lengths_h200.json, h100_run against the last of earlier_runs).

Semantics, as fused_ce.chunk_terms: ce = logsumexp(x) - x[label] in fp32 from the logits' dtype; hit = the first
index of the row's largest logit equals the label (torch.argmax's tie rule: a later tile wins only when strictly
larger); grad = (exp(x - lse) - onehot(label)) * w, cast to the logits' dtype. Labels must be valid ids (the
caller clamps the ignored rows, whose weight is 0).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

__all__ = ["BLOCK", "NUM_WARPS", "ce_rows_inplace", "triton_available"]

BLOCK = 4096      # logits per tile of a row's loop: 8 KB of bf16, 16 a thread at 8 warps
NUM_WARPS = 8


def triton_available(device: torch.device | str) -> bool:
    """Whether the kernel can run on `device`: CUDA with triton installed."""
    return str(device).split(":")[0] == "cuda" and importlib.util.find_spec("triton") is not None


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def ce_rows(x_ptr, stride, labels_ptr, weights_ptr, ce_ptr, hit_ptr, V, BLOCK: tl.constexpr,
                WRITE_GRAD: tl.constexpr):
        row = tl.program_id(0)
        base = x_ptr + row.to(tl.int64) * stride
        label = tl.load(labels_ptr + row)
        w = tl.load(weights_ptr + row)
        m = tl.full((), float("-inf"), tl.float32)    # running max
        s = tl.zeros((), tl.float32)                   # running sum of exp(x - m)
        best = tl.full((), float("-inf"), tl.float32)
        best_i = tl.zeros((), tl.int64)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            tile_max, tile_arg = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
            best_i = tl.where(tile_max > best, start + tile_arg.to(tl.int64), best_i)
            best = tl.maximum(best, tile_max)
            m_new = tl.maximum(m, tile_max)
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
            m = m_new
        lse = m + tl.log(s)
        x_label = tl.load(base + label).to(tl.float32)
        tl.store(ce_ptr + row, (lse - x_label) * w)
        tl.store(hit_ptr + row, (best_i == label).to(tl.int8))
        if WRITE_GRAD:
            for start in range(0, V, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                inside = offs < V
                x = tl.load(base + offs, mask=inside, other=0.0).to(tl.float32)
                g = (tl.exp(x - lse) - (offs == label).to(tl.float32)) * w
                tl.store(base + offs, g.to(x_ptr.dtype.element_ty), mask=inside)

    return ce_rows


def ce_rows_inplace(logits_nV: torch.Tensor, labels_n: torch.Tensor, weights_n: torch.Tensor, *,
                    write_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of CE * w (fp32 scalar), hits [n] bool) of a chunk; with write_grad the logits are overwritten by
    d sum(CE * w) / d logits in their own dtype (module docstring). logits_nV: rows contiguous ([n, V] with
    stride(1) == 1), on CUDA."""
    n, V = logits_nV.shape
    assert logits_nV.stride(1) == 1, "logits rows must be contiguous"
    ce_n = torch.empty(n, dtype=torch.float32, device=logits_nV.device)
    hit_n = torch.empty(n, dtype=torch.int8, device=logits_nV.device)
    if n:
        _kernel()[(n,)](logits_nV, logits_nV.stride(0), labels_n.contiguous(),
                        weights_n.to(torch.float32).contiguous(), ce_n, hit_n, V, BLOCK=BLOCK,
                        WRITE_GRAD=write_grad, num_warps=NUM_WARPS)
    return ce_n.sum(), hit_n.bool()
