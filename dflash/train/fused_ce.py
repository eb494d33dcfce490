"""Fused linear cross-entropy for the frozen LM head: the loss, the metrics and the gradient w.r.t. the hidden
rows in one chunked forward pass (the Liger-kernel approach, in plain PyTorch).

Shapes: N = block rows (J*B), R = rows with a nonzero loss weight, H = hidden size, V = vocabulary.

Why: objective.chunked_ce_loss checkpoints each chunk, so the [rows x H] @ [H x V] head matmul runs three
times per step (forward, recompute, input-gradient) over every row, slot 0 and out-of-range slots included
(at the Qwen3.5-27B drafter shape that is ~6 H V N = 125 TFLOP of a ~250 TFLOP step). Here each chunk's
logits are computed once: the forward also forms dCE/dlogits = w * (softmax - onehot) and multiplies it by
the head right away, keeping only the [N x H] input-gradient (the head is frozen: no weight-gradient). The
backward is that stored gradient times grad_output. Only the R rows with weight > 0 go through the head: 2 H V R
forward + 2 H V R backward, which is exactly FlopModel's 4 H V (supervised tokens).

Math (identical to chunked_ce_loss up to fp32 rounding order): logits = (h @ W^T).float(),
lsm = log_softmax(logits), CE = -lsm[label], ce_sum = sum(CE * w); dce_sum/dlogits = (exp(lsm) - onehot) * w
(autograd's log_softmax/nll backward forms exp(lsm) * w - w onehot: one rounding apart at the label), cast to the
logits' dtype and multiplied by W in the ambient autocast state, as autograd does for the checkpointed path.
correct = argmax(logits) == label on the selected rows; unselected rows have w = 0, so they count in no metric
(objective.ce_metrics treats them as unsupervised).

Tradeoff: the forward does the backward's work even when the caller never calls backward (the train step always
does); under no_grad, or when the hidden rows do not require grad, the gradient part is skipped.

epilogue="compiled" (training with compile_elementwise where triton is missing): a chunk's elementwise work after the
head matmul (fp32 cast, argmax, log-softmax, exp, one-hot, weight, cast) is one torch.compile'd function,
chunk_terms, instead of the eager path's ~8 passes with fp32 [n, V] temporaries: by count ~6-10 instead of ~36
bytes of memory traffic per logit (inductor's CPU code for it is one kernel whose only [n, V] buffer is the bf16
gradient, seen with TORCH_LOGS=output_code). At the 27B drafter shape (~15K supervised rows x V = 248,320 per
step, 3.7e9 logits) that is ~100 GB less traffic per step; an H200 profile put this CE
elementwise work at ~46 ms of a ~480 ms step. On the H200 (results/fused_ce_h200.json, that shape, 13,789 supervised
rows of 16,384): compiled 0.114 s, eager 0.138 s, the checkpointed path 0.256 s, equal losses. Same math in the
log-sum-exp form (CE = lse - logit[label], grad = (exp(logit - lse) - onehot) * w), equal to the eager path up
to fp32 rounding (test_fused_ce). epilogue="triton" (train.ce_kernel; training on CUDA) does the same work as one
hand-written kernel that reads each row's logits twice and writes the gradient over them: x1.077 the compiled
epilogue for this loss, forward + backward, on an H100 (results/fused_ce_triton_h200.json).
"""

from __future__ import annotations

import torch

from dflash.compiled import compiled_op
from dflash.errors import ConfigError
from dflash.train.ce_kernel import ce_rows_inplace, triton_available
from dflash.train.objective import CELoss, ce_metrics

__all__ = ["EPILOGUES", "chunk_terms", "chunk_value_terms", "fused_ce_loss", "supervised_rows", "train_epilogue"]

EPILOGUES = ("eager", "compiled", "triton")


def supervised_rows(weights_N: torch.Tensor, *, count: int | None) -> torch.Tensor:
    """int64 [R] indices of the rows with weight > 0, ascending.

    `count` = the number of such rows when the host knows it (step.HostBlocks.supervised_tokens): a stable sort
    of the mask then selects them with a static output size, so no device sync. None = count on the device
    (nonzero: one host sync per call, ~tens of microseconds plus a pipeline drain on CUDA).
    A wrong `count` is a caller bug: too large takes zero-weight rows too (harmless, only wasted work), too small
    would drop supervised rows, so callers pass the count computed from the same loss mask.
    """
    mask_N = weights_N > 0
    if count is None:
        return mask_N.nonzero().flatten()
    assert 0 <= count <= mask_N.shape[0], f"count={count} outside [0, {mask_N.shape[0]}]"
    # stable descending sort of 1/0 keys: the selected rows first, in their original (ascending) order
    return torch.sort(mask_N.to(torch.uint8), descending=True, stable=True).indices[:count]


def chunk_value_terms(logits_nV: torch.Tensor, labels_n: torch.Tensor,
                      weights_n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's sum(CE * w), argmax hits [n] and log-sum-exp [n] (fp32) from its logits (any float dtype).
    Labels must be valid ids (the caller clamps the IGNORE_INDEX rows, whose weight is 0)."""
    x_nV = logits_nV.float()
    lse_n = torch.logsumexp(x_nV, dim=-1)
    ce_n = lse_n - x_nV.gather(1, labels_n[:, None]).squeeze(1)
    return (ce_n * weights_n).sum(), x_nV.argmax(-1) == labels_n, lse_n


def chunk_terms(logits_nV: torch.Tensor, labels_n: torch.Tensor,
                weights_n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """chunk_value_terms' sum(CE * w) and hits, and d sum(CE * w) / d logits = (softmax - onehot) * w in the
    logits' dtype [n, V]. Written for torch.compile (eager it would hold several fp32 [n, V] temporaries)."""
    ce_sum, correct_n, lse_n = chunk_value_terms(logits_nV, labels_n, weights_n)
    x_nV = logits_nV.float()
    onehot_nV = torch.arange(x_nV.shape[1], device=x_nV.device)[None] == labels_n[:, None]
    g_nV = (torch.exp(x_nV - lse_n[:, None]) - onehot_nV.to(x_nV.dtype)) * weights_n[:, None]
    return ce_sum, correct_n, g_nV.to(logits_nV.dtype)


class _FusedHeadCE(torch.autograd.Function):
    """ce_sum = sum over the selected rows of CE * w; the gradient w.r.t. hidden_NH is computed in forward."""

    @staticmethod
    def forward(ctx, hidden_NH, lm_head_VH, labels_N, weights_N, rows_R, chunk: int, need_grad: bool,
                epilogue: str):
        ce_sum = torch.zeros((), dtype=torch.float32, device=hidden_NH.device)
        correct_R = torch.zeros(rows_R.shape[0], dtype=torch.bool, device=hidden_NH.device)
        grad_NH = torch.zeros_like(hidden_NH) if need_grad else None
        for i in range(0, rows_R.shape[0], chunk):
            r_n = rows_R[i:i + chunk]
            h_nH = hidden_NH.index_select(0, r_n)
            # clamp: a too-large host count may select zero-weight rows past the sequence end (IGNORE_INDEX
            # labels); their weight zeroes both their CE and their gradient
            l_n = labels_N.index_select(0, r_n).clamp(min=0)
            w_n = weights_N.index_select(0, r_n)
            logits_nV = h_nH @ lm_head_VH.T          # ambient autocast: the same matmul as the checkpointed path
            g_nV = None                                # d(sum CE*w)/dlogits in the logits' dtype, when need_grad
            if epilogue == "triton":
                part, correct_R[i:i + chunk] = ce_rows_inplace(logits_nV, l_n, w_n, write_grad=need_grad)
                if need_grad:
                    g_nV = logits_nV                   # overwritten by the gradient
            elif epilogue == "compiled":
                terms = chunk_terms if need_grad else chunk_value_terms
                part, correct_R[i:i + chunk], third = compiled_op(terms)(logits_nV, l_n, w_n)
                g_nV = third if need_grad else None
                del third                              # else it would hold the gradient into the next chunk
            else:
                low_dtype = logits_nV.dtype
                x_nV = logits_nV.float()
                logits_nV = None                                  # freed before the fp32 log-softmax is formed
                correct_R[i:i + chunk] = x_nV.argmax(-1) == l_n   # on the logits, as chunked_ce_loss (same ties)
                x_nV = torch.log_softmax(x_nV, dim=-1)            # x_nV's old buffer is freed once this returns
                part = (-x_nV.gather(1, l_n[:, None]).squeeze(1) * w_n).sum()
                if need_grad:
                    # (exp(lsm) - onehot) * w: exp and onehot in place over the log-softmax buffer, then one pass
                    # that multiplies by w and writes the logits' dtype (the cast autograd would apply) instead
                    # of a multiply pass and a cast pass
                    x_nV.exp_().scatter_add_(1, l_n[:, None], x_nV.new_full((l_n.shape[0], 1), -1.0))
                    g_nV = torch.mul(x_nV, w_n[:, None], out=torch.empty(x_nV.shape, dtype=low_dtype,
                                                                          device=x_nV.device))
                del x_nV
            del logits_nV
            ce_sum = ce_sum + part
            if g_nV is not None:
                # [n,V] @ [V,H]; ambient autocast, as the path it replaces
                grad_NH.index_copy_(0, r_n, (g_nV @ lm_head_VH).to(grad_NH.dtype))
                del g_nV
        ctx.mark_non_differentiable(correct_R)
        ctx.save_for_backward(grad_NH if need_grad else None)
        return ce_sum, correct_R

    @staticmethod
    def backward(ctx, grad_ce, grad_correct):
        grad_NH, = ctx.saved_tensors
        if grad_NH is None:
            return (None,) * 8
        return grad_NH * grad_ce.to(grad_NH.dtype), None, None, None, None, None, None, None


def train_epilogue(loss_impl: str, *, compiled: bool, device: torch.device | str) -> str:
    """The epilogue a training step runs for loss_impl ("fused" or "fused_eager") when the drafter's element-wise
    ops are `compiled` (TrainConfig.compile_elementwise): the Triton kernel on CUDA where triton is installed (it
    times faster than the compiled one: results/fused_ce_triton_h200.json), else the compiled one; eager when
    nothing is compiled or loss_impl says so."""
    if loss_impl != "fused" or not compiled:
        return "eager"
    return "triton" if triton_available(device) else "compiled"


def fused_ce_loss(hidden_NH: torch.Tensor, lm_head_VH: torch.Tensor, labels_N: torch.Tensor,
                  weights_N: torch.Tensor, *, chunk: int = 2048, block_size: int,
                  num_supervised: int | None = None, epilogue: str = "eager") -> CELoss:
    """objective.chunked_ce_loss with the head matmul once per supervised row (see the module docstring).

    `chunk` = rows of one logits chunk (transient memory ~ chunk x V x 10 bytes at most: bf16 logits, fp32
    logits and fp32 log-softmax; or fp32 log-softmax and the low-precision gradient; compiled: the logits and
    the gradient, ~ chunk x V x 4 bytes in bf16). `num_supervised` = rows with weight > 0 if the host knows
    it (no device sync), else None (one sync). `epilogue` = how each chunk's elementwise work runs: "eager"
    (torch ops), "compiled" (one torch.compile'd function, chunk_terms; the module docstring says why) or
    "triton" (train.ce_kernel: one hand-written kernel that writes the gradient over the logits; CUDA only).
    The head must be frozen
    (lm_head_VH.requires_grad False): a trainable head would need the weight gradient, which this path never
    forms; use chunked_ce_loss for that.
    """
    N = hidden_NH.shape[0]
    assert N % block_size == 0, "rows must be whole blocks"
    if chunk < 1:
        raise ConfigError(f"chunk={chunk}: must be >= 1 rows")
    if epilogue not in EPILOGUES:
        raise ConfigError(f"epilogue={epilogue!r}: choose {', '.join(EPILOGUES)}")
    if lm_head_VH.requires_grad and torch.is_grad_enabled():
        raise ConfigError("fused_ce_loss needs a frozen LM head (it forms no head gradient); "
                          "use loss_impl='checkpoint' (objective.chunked_ce_loss) to train the head")
    weights_N = weights_N.to(torch.float32)
    rows_R = supervised_rows(weights_N, count=num_supervised)
    need_grad = torch.is_grad_enabled() and hidden_NH.requires_grad
    ce_sum, correct_R = _FusedHeadCE.apply(hidden_NH, lm_head_VH, labels_N, weights_N, rows_R, chunk, need_grad,
                                           epilogue)
    correct_N = torch.zeros(N, dtype=torch.bool, device=hidden_NH.device).index_copy_(0, rows_R, correct_R)
    weight_sum = weights_N.sum()
    loss = ce_sum / weight_sum.clamp(min=torch.finfo(torch.float32).tiny)
    return ce_metrics(loss=loss, ce_sum=ce_sum, weight_sum=weight_sum, correct_N=correct_N, weights_N=weights_N,
                      block_size=block_size)
