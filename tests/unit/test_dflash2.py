"""DFlash 2 semantics on tiny CPU shapes: what the in-block convolution lets a position see, the selector's path
on hand-made candidate tables (and against the full-lattice walk SGLang runs), the selector's training term,
the config round trip and the drafter's equivalence with DFlash at init."""

import pytest
import torch

from dflash.drafter.config import DrafterConfig
from dflash.drafter.dflash2 import (CandidateSelector, DFlash2Config, DFlash2Drafter, GroupedDynamicConv,
                                    grouped_block_conv, walk_path)
from dflash.drafter.model import DFlashDrafter
from dflash.errors import ConfigError

BASE = dict(hidden_size=32, intermediate_size=48, target_layer_ids=(0, 2), num_target_layers=4, mask_token_id=5,
            vocab_size=40, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            block_size=4)


def _cfg(**kw):
    return DFlash2Config(**{**BASE, "conv_group_size": 8, "selector_rank": 6, "selector_top_k": 5, **kw})


@pytest.mark.parametrize("taps", [2, 3])
def test_convolution_sees_only_itself_and_earlier_slots_of_its_own_block(taps):
    """d out[t] / d y[s] is nonzero only for s in t's block with slot(t) - taps < slot(s) <= slot(t): never a
    later slot, never another block (block position 0 reads nothing before it)."""
    torch.manual_seed(0)
    B, J, D, G = 4, 3, 16, 4
    y = torch.randn(J * B, D, requires_grad=True)
    delta = torch.randn(J * B, taps, G)
    base = torch.randn(taps, D)
    out = grouped_block_conv(y, delta, base, block_size=B)
    for t in range(J * B):
        (g,) = torch.autograd.grad(out[t].sum(), y, retain_graph=True)
        seen = {s for s in range(J * B) if g[s].abs().sum() > 0}
        allowed = {s for s in range(J * B) if s // B == t // B and 0 <= t - s < taps}
        assert seen == allowed, (t, seen, allowed)


def test_wrapped_sublayer_keeps_the_rule_and_starts_as_identity():
    """prepare/finish of one GroupedDynamicConv (dynamic coefficients from the rows themselves): the composed
    map never reaches past the block or forward in it; a fresh one is the identity."""
    torch.manual_seed(1)
    cfg = _cfg()
    conv = GroupedDynamicConv(cfg)
    h = torch.randn(3 * cfg.block_size, cfg.hidden_size)
    out, coef = conv.prepare(h)
    assert torch.equal(out, h) and torch.equal(conv.finish(h, coef), h)
    with torch.no_grad():
        conv.kernel_projection.weight.normal_()
        conv.base_kernel.normal_()
    h.requires_grad_(True)
    x, coef = conv.prepare(h)
    y = conv.finish(torch.tanh(x), coef)  # a row-wise "sublayer" between the two sides
    B = cfg.block_size
    for t in range(h.shape[0]):
        (g,) = torch.autograd.grad(y[t].sum(), h, retain_graph=True)
        seen = {s for s in range(h.shape[0]) if g[s].abs().sum() > 0}
        assert seen <= {s for s in range(t - 2, t + 1) if s >= 0 and s // B == t // B}, (t, seen)
        assert t in seen


def test_dflash2_at_init_computes_what_dflash_computes():
    """Identity convolutions: a fresh DFlash 2 backbone with DFlash's weights gives DFlash's outputs."""
    torch.manual_seed(2)
    cfg2 = _cfg()
    d1 = DFlashDrafter(DrafterConfig(**BASE))
    d2 = DFlash2Drafter(cfg2)
    missing = d2.load_state_dict(d1.state_dict(), strict=False).missing_keys
    assert missing and all("_conv." in k or k.startswith("candidate_selector.") for k in missing)
    B, T = cfg2.block_size, 6
    ctx = d1.context(torch.randn(T, 2, cfg2.hidden_size))
    x = torch.randn(B, cfg2.hidden_size)
    q_pos = torch.arange(T, T + B)
    kv_pos = torch.cat([torch.arange(T), q_pos])
    with torch.no_grad():
        assert torch.allclose(d1(x, ctx, q_pos=q_pos, kv_pos=kv_pos), d2(x, ctx, q_pos=q_pos, kv_pos=kv_pos),
                              atol=1e-6)


def test_walk_follows_the_hand_made_lattice():
    """Two blocks, three drafted slots, k = 3. S_t(pred, .) is a table per (slot, predecessor token): the path
    is anchor -> argmax -> argmax given that token, which here differs from the per-slot argmax of the
    unary scores (the pairwise term changes slots 2 and 3 of block 0)."""
    cand = torch.tensor([[[10, 11, 12], [20, 21, 22], [30, 31, 32]],
                         [[13, 14, 15], [23, 24, 25], [33, 34, 35]]])
    anchors = torch.tensor([1, 2])
    table = {  # (slot, predecessor token) -> scores of the slot's candidates
        (0, 1): [0.0, 2.0, 1.0], (1, 11): [0.5, 0.1, 0.9], (2, 22): [3.0, 0.0, 0.0],
        (0, 2): [5.0, 0.0, 0.0], (1, 13): [0.0, 0.0, 0.1], (2, 25): [0.0, 1.0, 1.0],
    }

    def scores(t, pred):
        return torch.tensor([table[(t, int(p))] for p in pred])

    path = walk_path(scores, cand_JWk=cand, anchor_J=anchors)
    # block 0: slot 0 from anchor 1 -> idx 1 (11); slot 1 given 11 -> idx 2 (22); slot 2 given 22 -> idx 0 (30)
    # block 1: 13; given 13 -> 25; given 25 -> a tie, the first maximum: 34
    assert path.tolist() == [[11, 22, 30], [13, 25, 34]]


def _lattice_path(sel, *, cand, unary, proj, anchors):
    """SGLang's greedy walk, independently: every edge's K x K scores at once (_score_edges), argmax maps per
    edge, followed from the argmax of slot 0's row (sample_path with greedy_mask)."""
    k = cand.shape[-1]
    pred_ids = torch.cat([anchors[:, None, None].expand(-1, 1, k), cand[:, :-1]], dim=1)
    lattice = unary[:, :, None] + torch.einsum("blpr,blcr->blpc", sel.predecessor_codebook[pred_ids] * proj[:, :, None],
                                               sel.successor_codebook[cand])
    idx = lattice[:, 0, 0].argmax(-1)
    path = [idx]
    for e in range(1, cand.shape[1]):
        idx = lattice[:, e].argmax(-1).gather(1, idx[:, None])[:, 0]
        path.append(idx)
    return cand.gather(2, torch.stack(path, 1)[..., None])[..., 0]


def test_drafts_are_the_selector_path_through_the_lm_head_top_k():
    """draft_tokens of random drafter outputs and a random head: top-k candidates of the head, the selector's
    walk, equal to the full-lattice walk; with large codebooks it departs from the per-slot argmax."""
    torch.manual_seed(3)
    cfg = _cfg()
    dr = DFlash2Drafter(cfg)
    sel = dr.candidate_selector
    with torch.no_grad():
        sel.predecessor_codebook.normal_(0, 3.0)
        sel.successor_codebook.normal_(0, 3.0)
    J, B, D = 8, cfg.block_size, cfg.hidden_size
    out = torch.randn(J, B, D)
    head = torch.randn(cfg.vocab_size, D)
    anchors = torch.randint(0, cfg.vocab_size, (J,))
    drafts = dr.draft_tokens(out, anchor_ids_J=anchors, lm_head_VD=head, rows_per_chunk=5)
    logits = out[:, 1:] @ head.T
    unary, cand = torch.topk(logits, cfg.selector_top_k, dim=-1)
    with torch.no_grad():
        ref = _lattice_path(sel, cand=cand, unary=unary, proj=sel.hidden_projection(out[:, 1:]), anchors=anchors)
    assert torch.equal(drafts, ref)
    assert not torch.equal(drafts, logits.argmax(-1)), "the pairwise term should change some drafts here"
    assert isinstance(sel, CandidateSelector)


def test_selector_term_counts_only_slots_whose_token_is_a_candidate():
    from dflash.train.selector import predecessor_ids, selector_ce_sum

    torch.manual_seed(4)
    cfg = _cfg(selector_top_k=3)
    sel = DFlash2Drafter(cfg).candidate_selector
    J, B, D = 2, cfg.block_size, cfg.hidden_size
    head = torch.randn(cfg.vocab_size, D)
    hidden = torch.randn(J * B, D, requires_grad=True)
    top = torch.topk(hidden.detach() @ head.T, 3, dim=-1).indices
    labels = torch.full((J, B), 7)
    labels[:, 0] = torch.tensor([1, 2])                        # anchors
    labels[0, 1] = top[1, 2]                                   # a candidate (the third)
    labels[0, 2] = top[2, 0]                                   # a candidate (the first)
    labels[0, 3] = [v for v in range(40) if v not in top[3].tolist()][0]   # a miss
    labels[1, 1:] = -100                                       # past the end: unsupervised
    w = torch.tensor([[0.0, 1.0, 0.5, 0.25], [0.0, 0.0, 0.0, 0.0]])
    assert predecessor_ids(labels).tolist()[0] == [1, 1, labels[0, 1].item(), labels[0, 2].item()]
    total, hits = selector_ce_sum(sel, hidden, lm_head_VD=head, labels_JB=labels, weights_Q=w.reshape(-1),
                                  num_supervised=3, chunk=2)
    assert hits.item() == 2.0
    expected = 0.0
    for row, slot, wt, pred in ((1, 1, 1.0, labels[0, 0]), (2, 2, 0.5, labels[0, 1])):
        u = hidden[row] @ head[top[row]].T
        s = sel.edge_scores(unary_nk=u[None], cand_nk=top[row][None], pred_n=pred[None],
                            proj_nr=sel.hidden_projection(hidden[row])[None])[0]
        expected = expected + wt * (torch.logsumexp(s, 0) - s[(top[row] == labels[0, slot]).nonzero()[0, 0]])
    assert torch.allclose(total, expected)
    total.backward()
    used = {int(labels[0, 0]), int(labels[0, 1])}  # the predecessors of the two hit slots
    assert {i for i in range(cfg.vocab_size) if sel.predecessor_codebook.grad[i].abs().sum() > 0} == used
    assert hidden.grad.abs().sum() > 0 and hidden.grad[3].abs().sum() == 0  # the miss sends nothing


def test_config_round_trip_and_refusals():
    cfg = _cfg(output_multiplier=2.0, final_logit_softcapping=30.0)
    hf = cfg.to_hf_config()
    assert DFlash2Config.from_hf_config(hf) == cfg
    from dflash.drafter.registry import config_from_hf, config_from_json

    assert config_from_json(cfg.to_json()) == cfg
    assert type(config_from_hf(hf)) is DFlash2Config
    assert type(config_from_hf(DrafterConfig(**BASE).to_hf_config())) is DrafterConfig
    bad = {**hf, "dflash_config": {k: v for k, v in hf["dflash_config"].items() if k != "selector_rank"}}
    with pytest.raises(ConfigError, match="selector_rank"):
        DFlash2Config.from_hf_config(bad)
    with pytest.raises(ConfigError, match="conv_group_size=7"):
        _cfg(conv_group_size=7)


def test_sweep_does_not_rank_different_methods_by_their_losses():
    """A DFlash 2 loss holds the selector term: without tau, a sweep over arch names no best run by loss."""
    from dflash.sweep.report import rank_runs

    def row(name, arch, loss, tau=None):
        return {"name": name, "finished": True, "tau": tau, "final_loss": loss, "arch": arch}

    mixed = rank_runs([row("a", "dflash", 2.0), row("b", "dflash2", 3.0)])
    assert mixed.criterion == "none_mixed_losses" and mixed.best is None and "eval cache" in mixed.describe()
    assert rank_runs([row("a", "dflash", 2.0, 1.1), row("b", "dflash2", 3.0, 1.3)]).best == "b"  # tau ranks
    assert rank_runs([row("a", "dflash2", 2.0), row("b", "dflash2", 3.0)]).best == "a"


def test_block_drafts_dispatch():
    """The evaluators' one draft rule: a DFlash 2 drafter's selector path, a DFlash drafter's per-slot argmax."""
    from dflash.eval.batched import block_drafts

    torch.manual_seed(5)
    out = torch.randn(3, BASE["block_size"], BASE["hidden_size"])
    head = torch.randn(BASE["vocab_size"], BASE["hidden_size"])
    anchors = torch.tensor([0, 1, 2])
    d2 = DFlash2Drafter(_cfg())
    assert torch.equal(block_drafts(d2, out, anchor_ids_J=anchors, lm_head_VD=head, rows_per_chunk=4),
                       d2.draft_tokens(out, anchor_ids_J=anchors, lm_head_VD=head))
    d1 = DFlashDrafter(DrafterConfig(**BASE))
    assert torch.equal(block_drafts(d1, out, anchor_ids_J=anchors, lm_head_VD=head, rows_per_chunk=4),
                       (out[:, 1:] @ head.T).argmax(-1))


def test_train_config_offers_every_registered_architecture():
    from dflash.drafter.registry import ARCHS
    from dflash.train.config import ARCHS as TRAIN_ARCHS

    assert tuple(ARCHS) == TRAIN_ARCHS
