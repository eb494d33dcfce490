"""fused_ce_loss against chunked_ce_loss: value, hidden gradient, metrics; row selection; trainer parity."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from dflash.errors import ConfigError
from dflash.train.fused_ce import fused_ce_loss, supervised_rows
from dflash.train.objective import IGNORE_INDEX, build_blocks, chunked_ce_loss


def _case(*, seed=0, J=6, B=4, H=12, V=37, dtype=torch.float64, zero_frac=0.3):
    """Block rows with realistic weights: slot 0 zero, a tail past the sequence end (IGNORE_INDEX, weight 0),
    random zero-weight rows (loss mask), and logits peaked enough that some argmaxes hit the label."""
    g = torch.Generator().manual_seed(seed)
    N = J * B
    head = torch.randn(V, H, generator=g, dtype=torch.float64).to(dtype)
    labels = torch.randint(0, V, (N,), generator=g)
    hidden = (0.3 * torch.randn(N, H, generator=g, dtype=torch.float64)).to(dtype)
    hit = torch.rand(N, generator=g) < 0.5      # make about half the rows predict their label
    hidden[hit] += head[labels[hit]]
    weights = torch.rand(N, generator=g, dtype=torch.float64).float() + 0.05
    weights[torch.rand(N, generator=g) < zero_frac] = 0
    weights[::B] = 0
    labels[-3:] = IGNORE_INDEX
    weights[-3:] = 0
    return hidden.requires_grad_(True), head, labels, weights, B


def _both(hidden, head, labels, weights, B, *, chunk, count="host", backward="sum"):
    out = []
    for impl in ("checkpoint", "fused"):
        h = hidden.detach().clone().requires_grad_(True)
        if impl == "fused":
            n = int((weights > 0).sum()) if count == "host" else None
            res = fused_ce_loss(h, head, labels, weights, chunk=chunk, block_size=B, num_supervised=n)
        else:
            res = chunked_ce_loss(h, head, labels, weights, chunk=chunk, block_size=B)
        (res.weighted_ce_sum if backward == "sum" else res.loss).backward()
        out.append((res, h.grad))
    return out


def _same_metrics(a, b):
    for name in ("correct_B", "count_B", "accept_len_sum", "num_blocks", "weight_sum"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("chunk", [1, 5, 7, 16, 1000])
def test_fp64_value_gradient_and_metrics_equal_the_checkpointed_path(chunk):
    hidden, head, labels, weights, B = _case(seed=chunk)
    (ref, g_ref), (res, g) = _both(hidden, head, labels, weights, B, chunk=chunk)
    torch.testing.assert_close(res.weighted_ce_sum, ref.weighted_ce_sum, rtol=1e-6, atol=0)
    torch.testing.assert_close(res.loss, ref.loss, rtol=1e-6, atol=0)
    # both paths take the logits to fp32 (.float()), so even fp64 inputs agree only to fp32 rounding of the
    # softmax (the checkpointed path's log_softmax backward and exp_ here round differently by an ulp)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6 * g_ref.abs().max().item())
    assert (g - g_ref).norm() / g_ref.norm() < 1e-6
    assert g.dtype == torch.float64
    assert (g[weights == 0] == 0).all()
    _same_metrics(res, ref)
    assert ref.correct_B.sum() > 0 and ref.accept_len_sum > ref.num_blocks  # the metrics are not trivially 0


@pytest.mark.parametrize("backward", ["sum", "loss"])
def test_fp32_within_1e_5_relative(backward):
    hidden, head, labels, weights, B = _case(seed=11, J=10, H=24, V=301, dtype=torch.float32)
    (ref, g_ref), (res, g) = _both(hidden, head, labels, weights, B, chunk=9, backward=backward)
    torch.testing.assert_close(res.loss, ref.loss, rtol=1e-5, atol=0)
    rel = (g - g_ref).norm() / g_ref.norm()
    assert rel < 1e-5, rel
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-7)
    _same_metrics(res, ref)


def test_device_count_gives_the_same_result_as_the_host_count():
    hidden, head, labels, weights, B = _case(seed=4)
    (_, g_host), (res_host, _) = _both(hidden, head, labels, weights, B, chunk=6)
    (_, _), (res_dev, g_dev) = _both(hidden, head, labels, weights, B, chunk=6, count=None)
    assert torch.equal(res_dev.weighted_ce_sum, res_host.weighted_ce_sum)
    _same_metrics(res_dev, res_host)


def test_supervised_rows_static_count_matches_nonzero():
    g = torch.Generator().manual_seed(0)
    for n in (0, 1, 17, 200):
        w = torch.rand(n, generator=g) * (torch.rand(n, generator=g) < 0.6)
        want = (w > 0).nonzero().flatten()
        assert torch.equal(supervised_rows(w, count=int((w > 0).sum())), want)
        assert torch.equal(supervised_rows(w, count=None), want)


def test_too_large_a_count_only_adds_zero_weight_rows():
    hidden, head, labels, weights, B = _case(seed=5)
    n = int((weights > 0).sum())
    h = hidden.detach().clone().requires_grad_(True)
    res = fused_ce_loss(h, head, labels, weights, chunk=4, block_size=B, num_supervised=n + 5)  # IGNORE rows too
    res.weighted_ce_sum.backward()
    (ref, g_ref), _ = _both(hidden, head, labels, weights, B, chunk=4)
    torch.testing.assert_close(res.weighted_ce_sum, ref.weighted_ce_sum, rtol=1e-6, atol=0)
    torch.testing.assert_close(h.grad, g_ref, rtol=1e-5, atol=1e-6 * g_ref.abs().max().item())
    _same_metrics(res, ref)


def test_all_zero_weights_give_zero_loss_and_zero_gradient_not_nan():
    hidden, head, labels, _, B = _case(seed=6)
    weights = torch.zeros(labels.shape[0])
    for count in (0, None):
        h = hidden.detach().clone().requires_grad_(True)
        res = fused_ce_loss(h, head, labels, weights, chunk=3, block_size=B, num_supervised=count)
        assert res.loss.item() == 0.0 and res.weighted_ce_sum.item() == 0.0
        res.loss.backward()  # the graph exists even with no supervised row (a step always backpropagates)
        assert torch.equal(h.grad, torch.zeros_like(h))
        assert res.count_B.sum() == 0 and res.correct_B.sum() == 0
        assert res.accept_len_sum.item() == res.num_blocks.item() == labels.shape[0] // B


def test_empty_batch():
    h = torch.zeros(0, 8, requires_grad=True)
    res = fused_ce_loss(h, torch.randn(5, 8), torch.zeros(0, dtype=torch.long), torch.zeros(0), chunk=4,
                        block_size=4, num_supervised=0)
    res.weighted_ce_sum.backward()
    assert res.loss.item() == 0.0 and res.num_blocks.item() == 0 and h.grad.shape == (0, 8)


def test_no_grad_and_detached_inputs_skip_the_gradient():
    hidden, head, labels, weights, B = _case(seed=7)
    with torch.no_grad():
        a = fused_ce_loss(hidden, head, labels, weights, chunk=5, block_size=B)
    b = fused_ce_loss(hidden.detach(), head, labels, weights, chunk=5, block_size=B)
    ref = chunked_ce_loss(hidden.detach(), head, labels, weights, chunk=5, block_size=B)
    for r in (a, b):
        assert not r.loss.requires_grad
        torch.testing.assert_close(r.loss, ref.loss, rtol=1e-6, atol=0)
        _same_metrics(r, ref)


def test_bf16_autocast_matches_the_checkpointed_path():
    # the drafter's final norm output is fp32-or-bf16 under autocast; the head is kept in the compute dtype
    hidden, head, labels, weights, B = _case(seed=8, J=8, H=32, V=509, dtype=torch.float32)
    head = head.to(torch.bfloat16)
    out = []
    for impl in ("checkpoint", "fused"):
        h = hidden.detach().clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if impl == "fused":
                res = fused_ce_loss(h, head, labels, weights, chunk=6, block_size=B,
                                    num_supervised=int((weights > 0).sum()))
            else:
                res = chunked_ce_loss(h, head, labels, weights, chunk=6, block_size=B)
        res.weighted_ce_sum.backward()
        out.append((res, h.grad))
    (ref, g_ref), (res, g) = out
    assert g.dtype == torch.float32
    torch.testing.assert_close(res.loss, ref.loss, rtol=1e-5, atol=0)
    # same bf16 matmuls on the same bf16-cast operands; only fp32 summation order differs
    torch.testing.assert_close(g, g_ref, rtol=1e-2, atol=1e-3)
    assert (g - g_ref).norm() / g_ref.norm() < 1e-2
    _same_metrics(res, ref)


def test_a_trainable_head_is_refused():
    hidden, head, labels, weights, B = _case(seed=9)
    with pytest.raises(ConfigError, match="frozen"):
        fused_ce_loss(hidden, head.requires_grad_(True), labels, weights, chunk=4, block_size=B)


def test_host_supervised_count_equals_the_block_weights():
    # step.host_anchors counts supervised slots on the host; the fused path trusts that count
    import numpy as np

    from dflash.train.step import host_anchors

    class Packed:
        pass

    rng = np.random.default_rng(0)
    p = Packed()
    p.lengths = np.array([30, 7, 50])
    p.sample_ids = np.array([3, 4, 5])
    p.loss_mask = (rng.random(87) < 0.7).astype(np.uint8)
    p.loss_mask[37:] = 1
    ids = torch.from_numpy(rng.integers(0, 50, 87))
    hb = host_anchors(p, 0, seed=1, num_anchors=8, block_size=6, pin=False)
    per = torch.split(hb.anchors_J, hb.blocks_per_sample)
    total, off = 0, 0
    for n, a in zip(p.lengths.tolist(), per):
        blk = build_blocks(ids[off:off + n], torch.from_numpy(p.loss_mask[off:off + n]), a, block_size=6,
                           mask_token_id=1)
        total += int((blk.weights_JB > 0).sum())
        off += n
    assert total == hb.supervised_tokens > 0
    # full blocks: every anchor's block inside its sample, and the host count follows the smaller draw
    fb = host_anchors(p, 0, seed=1, num_anchors=8, block_size=6, pin=False, full_blocks=True)
    for n, a in zip(p.lengths.tolist(), torch.split(fb.anchors_J, fb.blocks_per_sample)):
        assert all(x + 6 <= n for x in a.tolist())
    assert 0 < fb.supervised_tokens


def test_training_runs_give_the_same_losses_with_both_impls(tmp_path):
    from dflash.train.metrics import read_metrics
    from dflash.train.trainer import train
    from train_helpers import tiny_cache, tiny_config, tiny_target

    target = tiny_target(tmp_path / "target")
    cache = tiny_cache(tmp_path / "cache", target)
    losses, accs = {}, {}
    for impl in ("checkpoint", "fused", "fused_eager"):
        cfg = tiny_config(cache=str(cache), model=str(target), output=str(tmp_path / impl), steps=6,
                          loss_impl=impl, loss_chunk_blocks=3, save_every=100)
        train(cfg, device="cpu")
        recs = read_metrics(cfg.output)
        losses[impl] = [x for r in recs for x in r["step_losses"]]
        accs[impl] = [r["acc"] for r in recs]
    assert len(losses["fused"]) == 6
    # fp32 CPU training: the loss of step 1 differs only by summation order; later steps by the drift that
    # order difference puts into the weights (measured ~1e-7 relative; bound 1e-5)
    np_l = torch.tensor(losses["fused"], dtype=torch.float64)
    ref = torch.tensor(losses["checkpoint"], dtype=torch.float64)
    assert ((np_l - ref).abs() / ref).max() < 1e-5, (losses["fused"], losses["checkpoint"])
    assert accs["fused"] == accs["checkpoint"]
    assert losses["fused_eager"] == losses["fused"]   # on CPU the drafter is not compiled: the same eager path


def test_loss_impl_config_is_checked_and_resume_mutable():
    from dflash.train.config import RESUME_MUTABLE, TrainConfig

    with pytest.raises(ConfigError, match="loss_impl"):
        TrainConfig(cache="c", model="m", output="o", loss_impl="liger")
    assert TrainConfig(cache="c", model="m", output="o").loss_impl == "fused"
    assert TrainConfig(cache="c", model="m", output="o", loss_impl="fused_eager").loss_impl == "fused_eager"
    assert "loss_impl" in RESUME_MUTABLE


def test_chunk_terms_are_the_cross_entropy_its_gradient_and_the_hits():
    """The compiled epilogue's math, run eagerly in fp64: sum(CE*w), d/dlogits by autograd, argmax hits."""
    import torch.nn.functional as F

    from dflash.train.fused_ce import chunk_terms, chunk_value_terms

    g = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(13, 41, generator=g, dtype=torch.float64)).requires_grad_(True)
    labels = torch.randint(0, 41, (13,), generator=g)
    labels[:4] = logits.detach()[:4].argmax(-1)            # some hits
    w = torch.rand(13, generator=g, dtype=torch.float64)
    w[5] = 0
    ce_sum, correct, grad = chunk_terms(logits.detach(), labels, w)
    want = (F.cross_entropy(logits, labels, reduction="none") * w).sum()
    want.backward()
    # chunk_terms works in fp32 (as the eager fused path), so fp64 inputs agree to fp32 rounding
    torch.testing.assert_close(ce_sum.double(), want.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(grad.double(), logits.grad, rtol=1e-5, atol=1e-6)
    assert grad.dtype == logits.dtype and (grad[5] == 0).all()
    assert torch.equal(correct, logits.detach().argmax(-1) == labels) and correct[:4].all()
    v_sum, v_correct, lse = chunk_value_terms(logits.detach(), labels, w)
    assert torch.equal(v_sum, ce_sum) and torch.equal(v_correct, correct)
    torch.testing.assert_close(lse.double(), torch.logsumexp(logits.detach(), -1), rtol=1e-6, atol=0)


def test_compiled_epilogue_matches_the_eager_fused_path():
    """fused_ce_loss(epilogue="compiled") (torch.compile of chunk_terms, here inductor's CPU backend) against the eager
    fused path in fp32: chunks of several sizes (one dynamic-shape compile), all rows masked, and the flag the
    trainer reads from the drafter (DFlashDrafter.compile_elementwise)."""
    from dflash.drafter.config import DrafterConfig
    from dflash.drafter.model import DFlashDrafter

    hidden, head, labels, weights, B = _case(seed=12, J=10, H=24, V=301, dtype=torch.float32)
    n = int((weights > 0).sum())
    out = []
    for epilogue in ("eager", "compiled"):
        h = hidden.detach().clone().requires_grad_(True)
        res = fused_ce_loss(h, head, labels, weights, chunk=7, block_size=B, num_supervised=n, epilogue=epilogue)
        res.weighted_ce_sum.backward()
        out.append((res, h.grad))
    (ref, g_ref), (res, g) = out
    torch.testing.assert_close(res.weighted_ce_sum, ref.weighted_ce_sum, rtol=1e-5, atol=0)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6 * g_ref.abs().max().item())
    _same_metrics(res, ref)
    h = hidden.detach().clone().requires_grad_(True)
    res = fused_ce_loss(h, head, labels, torch.zeros_like(weights), chunk=7, block_size=B, num_supervised=0,
                        epilogue="compiled")
    res.loss.backward()
    assert res.loss.item() == 0.0 and torch.equal(h.grad, torch.zeros_like(h))

    dc = DrafterConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=8, vocab_size=64, target_layer_ids=(0,),
                       num_target_layers=2, mask_token_id=3, block_size=4)
    drafter = DFlashDrafter(dc)
    assert drafter.elementwise_compiled is False
    drafter.compile_elementwise()
    assert drafter.elementwise_compiled is True


def test_training_runs_the_triton_epilogue_on_cuda_only():
    from dflash.train.fused_ce import train_epilogue

    assert train_epilogue("fused", compiled=True, device="cpu") == "compiled"
    assert train_epilogue("fused", compiled=False, device="cuda:0") == "eager"
    assert train_epilogue("fused_eager", compiled=True, device="cuda") == "eager"
    has_triton = importlib.util.find_spec("triton") is not None
    assert train_epilogue("fused", compiled=True, device="cuda:1") == ("triton" if has_triton else "compiled")
