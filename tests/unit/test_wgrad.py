"""train.wgrad: the drafter's linear layers with their weight gradients added into .grad by the matmul. Forward
values are nn.Linear's bit for bit; gradients are autograd's (a layer used once under CPU bf16 autocast: bit for
bit, since both add the bf16 product; otherwise up to summation order), added to what .grad already holds (the
flat buffer of train.step.GradSync, several micro-batches a step)."""

import copy

import pytest
import torch
from torch import nn

from dflash.drafter.config import DrafterConfig
from dflash.drafter.model import DFlashDrafter
from dflash.train.wgrad import add_weight_grad, fuse_weight_grads


def _drafter() -> DFlashDrafter:
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, block_size=4, num_target_layers=8,
                        target_layer_ids=(1, 3, 5), mask_token_id=0, vocab_size=100)
    return DFlashDrafter(cfg)


def _loss_and_grads(model, feats, embeds, dtype, start):
    """One forward/backward of 8 query rows over a 12-token context (mask None: every query sees every key),
    .grad starting at `start`."""
    for p, s in zip(model.parameters(), start):
        p.grad = s.clone()
    q_pos = torch.tensor([4, 5, 6, 7, 8, 9, 10, 11])
    kv_pos = torch.cat([torch.arange(12), q_pos])
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        out = model(embeds, model.context(feats), q_pos=q_pos, kv_pos=kv_pos)
        loss = (out.float() ** 2).mean()
    loss.backward()
    return out, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_bit_for_bit_and_gradients_as_autograd(dtype, monkeypatch):
    import dflash.train.wgrad as wgrad

    calls = []
    monkeypatch.setattr(wgrad, "add_weight_grad", lambda p, *a, f=wgrad.add_weight_grad: calls.append(p) or f(p, *a))
    plain = _drafter()
    fused = copy.deepcopy(plain)
    assert fuse_weight_grads(fused) == 2 * 7 + 1      # q, k, v, o, gate, up, down per layer, and fc
    g = torch.Generator().manual_seed(1)
    feats, embeds = torch.randn(12, 3, 64, generator=g), torch.randn(8, 64, generator=g)
    start = [torch.randn(p.shape, generator=g) for p in plain.parameters()]   # .grad accumulates onto this
    out_p, grads_p = _loss_and_grads(plain, feats, embeds, dtype, start)
    out_f, grads_f = _loss_and_grads(fused, feats, embeds, dtype, start)
    assert torch.equal(out_p, out_f)
    assert len(calls) == 2 * 9 + 1                   # per layer: k and v twice (context and block rows); fc
    names = [n for n, _ in plain.named_parameters()]
    for name, a, b, s in zip(names, grads_p, grads_f, start):
        if a.dim() == 2:
            assert not torch.equal(a, s), name                               # every linear weight got one
        once = not name.endswith(("k_proj.weight", "v_proj.weight"))       # k, v: context rows and block rows
        if dtype == torch.bfloat16 and once:
            assert torch.equal(a, b), name
        else:   # fp32: the product summed into .grad by addmm; k/v: two additions where autograd sums first
            torch.testing.assert_close(a, b, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5, msg=name)


def test_add_weight_grad_creates_or_accumulates():
    w = nn.Parameter(torch.zeros(3, 2))
    gt, x = torch.ones(3, 4), torch.ones(4, 2)
    add_weight_grad(w, gt, x)
    assert torch.equal(w.grad, torch.full((3, 2), 4.0))
    add_weight_grad(w, gt.bfloat16(), x.bfloat16())   # bf16 product added into the fp32 .grad (CPU)
    assert w.grad.dtype == torch.float32 and torch.equal(w.grad, torch.full((3, 2), 8.0))


def test_layers_with_a_bias_or_frozen_keep_autograd():
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    m[2].weight.requires_grad_(False)
    assert fuse_weight_grads(m) == 1
    assert "forward" in vars(m[1]) and "forward" not in vars(m[0]) and "forward" not in vars(m[2])


def test_training_with_and_without_it_gives_the_same_losses(tmp_path, caplog):
    """A real `train` on CPU (fp32) with wgrad_fusion on and off: the same losses up to summation order, and its
    resume-mutable setting is checked like the other rounding-only ones."""
    from dflash.errors import ConfigError
    from dflash.train.config import RESUME_MUTABLE, TrainConfig
    from dflash.train.metrics import read_metrics
    from dflash.train.trainer import train
    from train_helpers import tiny_cache, tiny_config, tiny_target

    target = tiny_target(tmp_path / "target")
    cache = tiny_cache(tmp_path / "cache", target)
    losses, said = {}, {}
    for setting in ("off", "on"):
        cfg = tiny_config(cache=str(cache), model=str(target), output=str(tmp_path / setting), steps=6,
                          wgrad_fusion=setting, save_every=100)
        caplog.clear()
        with caplog.at_level("INFO", logger="dflash"):
            train(cfg, device="cpu")
        said[setting] = "add their weight gradients into .grad" in caplog.text
        losses[setting] = torch.tensor([x for r in read_metrics(cfg.output) for x in r["step_losses"]],
                                       dtype=torch.float64)
    assert len(losses["on"]) == 6 and said == {"off": False, "on": True}
    assert ((losses["on"] - losses["off"]).abs() / losses["off"]).max() < 1e-5, losses
    assert "wgrad_fusion" in RESUME_MUTABLE
    with pytest.raises(ConfigError, match="wgrad_fusion"):
        TrainConfig(cache="c", model="m", output="o", wgrad_fusion="maybe")
