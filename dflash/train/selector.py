"""The DFlash 2 selector's training term: a cross-entropy over each drafted slot's top-k candidates.

Shapes: J = blocks, B = block size, Q = J*B block rows, R = supervised rows, n = rows of a chunk, k = top-k,
r = selector rank, D = hidden size, V = vocabulary.

Semantics (NeMo Automodel dflash2_core, the method's training objective): at a supervised slot t, the candidates
are the top-k of the frozen LM head's logits over the drafter's output; each is scored S_t(pred, c) (the
selector's edge score, dflash.drafter.dflash2) with pred = the TRUE token at slot t-1 (the anchor for t = 1: the
token the walk would hold had every earlier slot been right); the label is the index of the true token among
the candidates. A slot whose true token is not among them carries no selector signal (nothing to select) and
contributes 0. The term uses the block CE's weights w (decay, loss mask, loss_normalization), so the step's loss
is (sum w CE_block + selector_weight x sum w hit CE_selector) / sum w: one normaliser for both terms, which keeps
the one-divisor gradient step (train.step.GradSync) exact across micro-batches and ranks; the selector part is
therefore the selector CE times the candidate recall.
Gradients reach the selector (codebooks, projection) and, through the unary logits and the projection's input,
the backbone; the top-k choice itself is not differentiated.
Tradeoff: one more LM-head matmul (forward only, for the top-k) over the supervised rows; each chunk's
[n, k, D] and [n, k, r] gathers are recomputed in the backward (checkpoint) instead of kept.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from dflash.train.fused_ce import supervised_rows


def predecessor_ids(labels_JB: torch.Tensor) -> torch.Tensor:
    """int64 [J, B]: the true token before each slot (slot t: labels[t-1]; slot 0, never supervised: its own
    label). labels[:, 0] is the anchor token, so slot 1's predecessor is the anchor."""
    return torch.cat([labels_JB[:, :1], labels_JB[:, :-1]], dim=1).clamp(min=0)


def _chunk_sum(selector, hidden_nD, head_VD, labels_n, pred_n, w_n):
    with torch.no_grad():
        cand_nk = torch.topk(hidden_nD @ head_VD.T, selector.top_k, dim=-1).indices
    unary_nk = selector.unary(torch.einsum("nd,nkd->nk", hidden_nD, head_VD[cand_nk]))
    proj_nr = selector.hidden_projection(hidden_nD)
    scores_nk = selector.edge_scores(unary_nk=unary_nk, cand_nk=cand_nk, pred_n=pred_n, proj_nr=proj_nr)
    match_nk = cand_nk == labels_n[:, None]
    hit_n = match_nk.any(dim=1)
    target_n = match_nk.float().argmax(dim=1)
    ce_n = torch.logsumexp(scores_nk, dim=1) - scores_nk.gather(1, target_n[:, None]).squeeze(1)
    return (ce_n * w_n * hit_n).sum(), hit_n.float().mul(w_n > 0).sum()


def selector_ce_sum(selector, hidden_QD: torch.Tensor, *, lm_head_VD: torch.Tensor, labels_JB: torch.Tensor,
                    weights_Q: torch.Tensor, num_supervised: int | None, chunk: int = 2048
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over supervised slots of w x hit x CE_selector, number of supervised slots whose true token is a
    candidate), fp32 scalars, no host sync when num_supervised is given (the host's count of rows with w > 0).

    selector: the drafter's CandidateSelector; hidden_QD: the drafter's final-normed outputs, rows in block
    order; labels_JB: objective.Blocks.labels_JB; weights_Q: the block CE's weights of the rows."""
    J, B = labels_JB.shape
    rows_R = supervised_rows(weights_Q, count=num_supervised)
    labels_Q = labels_JB.reshape(-1)
    pred_Q = predecessor_ids(labels_JB).reshape(-1)
    head = lm_head_VD.to(dtype=hidden_QD.dtype)
    use_ckpt = torch.is_grad_enabled() and hidden_QD.requires_grad
    total = hidden_QD.new_zeros((), dtype=torch.float32)
    hits = hidden_QD.new_zeros((), dtype=torch.float32)
    for i in range(0, rows_R.shape[0], chunk):
        r = rows_R[i:i + chunk]
        # clamp: IGNORE_INDEX labels sit only on rows past a sequence's end, which have w = 0 (not selected)
        args = (selector, hidden_QD[r], head, labels_Q[r].clamp(min=0), pred_Q[r], weights_Q[r].float())
        part, hit = checkpoint(_chunk_sum, *args, use_reentrant=False) if use_ckpt else _chunk_sum(*args)
        total = total + part
        hits = hits + hit.detach()
    return total, hits
