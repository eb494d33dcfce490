"""GPU only: the fused CE's compiled epilogue (inductor's Triton kernels) and its hand-written Triton epilogue
(train.ce_kernel) against the eager fused path and the chunk-checkpointed path at the 27B drafter head (H 5120,
V 248320) under bf16 autocast, as training runs it; and the Triton kernel on hand-made logits (ties, a ragged
last tile, zero weights)."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_epilogues_at_the_27b_head():
    from dflash.train.fused_ce import fused_ce_loss
    from dflash.train.objective import chunked_ce_loss, decay_weights

    g = torch.Generator(device="cpu").manual_seed(0)
    J, B, H, V = 96, 16, 5120, 248320
    head = (0.02 * torch.randn(V, H, generator=g)).to("cuda", torch.bfloat16)
    hidden = torch.randn(J * B, H, generator=g).to("cuda")
    labels = torch.randint(0, V, (J * B,), generator=g).to("cuda")
    hidden[::3] += 40 * head[labels[::3]].float()   # some rows predict their label
    weights = (decay_weights(block_size=B, gamma=7.0).repeat(J) * (torch.rand(J * B, generator=g) > 0.1)).to("cuda")
    n = int((weights > 0).sum())
    out = {}
    for impl in ("checkpoint", "eager", "compiled", "triton"):
        h = hidden.detach().clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if impl == "checkpoint":
                res = chunked_ce_loss(h, head, labels, weights, chunk=512, block_size=B)
            else:
                res = fused_ce_loss(h, head, labels, weights, chunk=512, block_size=B, num_supervised=n,
                                    epilogue=impl)
        res.weighted_ce_sum.backward()
        out[impl] = (res, h.grad)
    (ref, g_ref), (eager, g_eager) = out["checkpoint"], out["eager"]
    for res, grad in (out["eager"], out["compiled"], out["triton"]):
        torch.testing.assert_close(res.loss, ref.loss, rtol=1e-4, atol=0)
        assert (grad - g_ref).norm() / g_ref.norm() < 1e-2
        assert torch.equal(res.count_B, ref.count_B)
    assert ref.correct_B.sum() > 0
    # compiled and triton vs eager fused: the same bf16 logits, fp32 math in another order; the hits follow one
    # tie rule (the first largest logit)
    for comp, g_comp in (out["compiled"], out["triton"]):
        torch.testing.assert_close(comp.loss, eager.loss, rtol=1e-5, atol=0)
        assert torch.equal(comp.correct_B, eager.correct_B)
        assert (g_comp - g_eager).norm() / g_eager.norm() < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_epilogue_on_hand_made_logits(dtype, device="cuda"):
    """ce_rows_inplace against chunk_terms (eager) on rows whose largest logit repeats within a tile and across
    tiles (the first index wins, as torch.argmax), whose label is the last id, in a ragged last tile, with
    weight 0 (zero gradient), and rows 5 elements wider than V in memory (the gap never written)."""
    from dflash.train.ce_kernel import BLOCK, ce_rows_inplace
    from dflash.train.fused_ce import chunk_terms

    g = torch.Generator(device="cpu").manual_seed(1)
    V = 2 * BLOCK + 37
    full = torch.randn(6, V + 5, generator=g)
    labels = torch.randint(0, V, (6,), generator=g)
    full[0, [3, 40]] = 9.0; labels[0] = 3                    # tie within the first tile: the first wins, a hit
    full[1, [5, BLOCK + 7]] = 9.0; labels[1] = BLOCK + 7     # tie across tiles: the later one is no hit
    full[2, V - 1] = 9.0; labels[2] = V - 1                  # the last id, in the ragged tile
    full[3, 2 * BLOCK + 1] = 9.0; labels[3] = 2 * BLOCK + 1
    weights = torch.tensor([1.0, 0.5, 1.0, 0.0, 0.25, 1.0], device=device)
    full, labels = full.to(device, dtype), labels.to(device)
    ce_ref, hit_ref, g_ref = chunk_terms(full[:, :V].contiguous(), labels, weights)
    y = full.clone()
    ce, hit = ce_rows_inplace(y[:, :V], labels, weights)
    assert hit.tolist() == hit_ref.tolist() and hit.tolist()[:4] == [True, False, True, True]
    torch.testing.assert_close(ce, ce_ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(y[:, :V].float(), g_ref.float(), rtol=0,
                               atol=1e-6 if dtype == torch.float32 else 2**-8)
    assert not y[3, :V].any() and torch.equal(y[:, V:], full[:, V:])
    z = full.clone()
    ce2, hit2 = ce_rows_inplace(z[:, :V], labels, weights, write_grad=False)
    assert torch.equal(z, full) and torch.equal(hit2, hit) and torch.equal(ce2, ce)
