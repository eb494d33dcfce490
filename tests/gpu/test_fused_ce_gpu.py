"""GPU only: the fused CE's compiled epilogue (inductor's Triton kernels) against the eager fused path and the
chunk-checkpointed path at the 27B drafter head (H 5120, V 248320) under bf16 autocast, as training runs it."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_compiled_epilogue_at_the_27b_head():
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
    for impl in ("checkpoint", "eager", "compiled"):
        h = hidden.detach().clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if impl == "checkpoint":
                res = chunked_ce_loss(h, head, labels, weights, chunk=512, block_size=B)
            else:
                res = fused_ce_loss(h, head, labels, weights, chunk=512, block_size=B, num_supervised=n,
                                    compiled=impl == "compiled")
        res.weighted_ce_sum.backward()
        out[impl] = (res, h.grad)
    (ref, g_ref), (eager, g_eager), (comp, g_comp) = out["checkpoint"], out["eager"], out["compiled"]
    for res, grad in ((eager, g_eager), (comp, g_comp)):
        torch.testing.assert_close(res.loss, ref.loss, rtol=1e-4, atol=0)
        assert (grad - g_ref).norm() / g_ref.norm() < 1e-2
        assert torch.equal(res.count_B, ref.count_B)
    assert ref.correct_B.sum() > 0
    # compiled vs eager fused: the same bf16 logits, fp32 math in another order; the argmax hits may differ
    # only on exact fp32 ties, which random logits do not have
    torch.testing.assert_close(comp.loss, eager.loss, rtol=1e-5, atol=0)
    assert torch.equal(comp.correct_B, eager.correct_B)
    assert (g_comp - g_eager).norm() / g_eager.norm() < 1e-2
