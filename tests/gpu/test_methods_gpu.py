"""GPU only: the methods options (DFlash 2, sliding-window and mixed layer_types drafters, the variable-prefix
objective) on CUDA, each against the CPU float32 reference computed in the same test.

- Training (the real trainer on the tiny target and cache of tests/unit/train_helpers): the CUDA step takes the
  paths the trainer picks there (compiled flex attention, never the dense fallback; compiled norms, RoPE and
  SiLU-gating; the fused CE with its compiled epilogue; bf16 autocast), every step's loss is finite, and its first
  micro-batch equals the CPU's: the same blocks and weights exactly, the same loss within bf16.
- The DFlash 2 drafter of a mixed layout, as the trainer runs it on CUDA (bf16 autocast, compiled element-wise ops
  and flex attention), against its fp32 CPU forward and backward (dense path), same weights and inputs.
- The flex kernel's windowed mask, pair by pair: which keys the compiled kernel on CUDA actually averages over
  (one-hot values) against the predicate block_attention_mask (dense_mask).
- `dflash eval`'s batched exact tau of a DFlash 2 drafter on CUDA against the CPU's: draft for draft wherever
  rounding cannot flip the selector's choice, which each draft proves from the measured score error.

The mask check runs on the CPU too (kernel_visibility(layout, attn, "cpu"): compiled flex has a CPU forward; it
matched the predicate there, but compiling it takes ~50 s on the 2-core CPU machine, so it is not in the CPU suite,
which checks the tile lists against the predicate instead: test_sliding_attention, test_attention_tiles).

Tolerances (bf16 on CUDA against fp32 on the CPU), from these very inputs measured on the CPU with bf16 autocast
against fp32 (dense path), beside what a one-off mask or a lost convolution tap does in fp32 or bf16:
- drafter output rows (final-normed), relative L2 error per row: bf16 at most 0.018 (median 0.010). A mask that
  lets each block see its anchor's own feature moves rows by up to 0.75 (82% of them past 0.06), a window one key
  too wide or too narrow by up to 0.73 / 0.61, in-block causality lost by 0.86, one convolution tap dropped by
  0.63. FORWARD_ROW_TOL = 0.06.
- gradients, relative L2 error per parameter: bf16 at most 0.034 (a norm weight's; an attention projection's 0.016
  at least); each error above takes the largest past 0.78 and every attention weight's past 0.24. GRAD_TOL = 0.1.
- a training micro-batch's weighted CE sum: bf16 moved it by at most 3e-5 relative (the trainer's 0.02-std init
  keeps every CE near log V, so this catches a lost or doubled term or chunk, not subtle errors: the blocks, their
  labels and loss weights are compared exactly beside it, and the drafter's numerics by the forward test).
  LOSS_RTOL = 1e-3.
- the DFlash 2 selector term of that micro-batch (~6 slots whose token is among the 32 candidates): the candidates
  are the top 32 of logits ~1e-3 apart there at init, so bf16 can add or drop a slot (~17% of the term each; on
  the CPU it did in one of two micro-batches). SELECTOR_RTOL = 0.5: a term lost, doubled or garbled shows.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import math
import pathlib
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "unit"))
from train_helpers import fingerprint_for, tiny_cache, tiny_config, tiny_target  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FORWARD_ROW_TOL = 0.06
GRAD_TOL = 0.1
LOSS_RTOL = 1e-3
SELECTOR_RTOL = 0.5
DFLASH2 = dict(arch="dflash2", selector_rank=8, selector_top_k=32, conv_group_size=8)
"""The DFlash 2 run: 32 candidates of the 264-token vocabulary, so at init 6-9 of a micro-batch's ~95 supervised
slots have their token among them and the selector term is not empty."""
MIXED = dict(num_layers=2, layer_types=("sliding_attention", "full_attention"), sliding_window=6)
"""The mixed layout trained below; the forward test uses the same (its compiled kernels are reused)."""


@pytest.fixture(scope="module", autouse=True)
def _compiled_or_fail():
    """A compiled function past dynamo's recompile limit silently runs eagerly (flex attention then materialises
    the scores): fail instead, so "the compiled path ran" holds. The limit is raised because this module compiles
    flex attention for several dtypes, masks and head counts in one process (a training run needs two or three);
    the caches are cleared after, so the files that follow start from none."""
    with torch._dynamo.config.patch(recompile_limit=16, fail_on_recompile_limit_hit=True):
        yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("DFLASH_NO_PROGRESS", "1")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("methods_gpu")
    target = tiny_target(d / "target")
    return target, tiny_cache(d / "cache", target, num_samples=12)


# ------------------------------------------------------------------------------------------------- the probe

def _to_cpu(x):
    return x.detach().to("cpu", copy=True) if isinstance(x, torch.Tensor) else x


def _fields_on_cpu(obj) -> dict:
    """A dataclass's fields, tensors copied to the CPU (device tensors and pinned buffers the trainer reuses)."""
    return {fld.name: _to_cpu(getattr(obj, fld.name)) for fld in dataclasses.fields(obj)}


class Probe:
    """What the trainer (or eval) calls, recorded by wrappers that pass every call through to the library function
    they wrap: nothing is replaced. `stop()` ends the recording (the CPU reference runs the same functions)."""

    def __init__(self, monkeypatch) -> None:
        import dflash.drafter.model as model
        import dflash.eval.batched as batched
        import dflash.train.fused_ce as fused_ce
        import dflash.train.selector as selector
        import dflash.train.step as step
        import dflash.train.unit as unit

        self.active = True
        self.flex: list[tuple[bool, torch.dtype, str]] = []   # (compiled, q dtype, device type) per call
        self.dense = 0
        self.masks: list = []                                 # LayerAttention of every flex BlockMask built
        self.ce: list[dict] = []
        self.selector: list[tuple[float, float]] = []         # (selector CE sum, hits) per call
        self.compiled = collections.Counter()                 # calls of each compiled element-wise function
        self.first_step: dict | None = None                   # the first micro-batch: inputs, weights, terms
        self.first_blocks: dict | None = None                 # build_packed_blocks' first call: args, result
        self.drafts: list[dict] = []                          # eval: block_drafts' inputs and drafts per chunk
        self.accept: list[np.ndarray] = []                    # eval: accept_lengths_chunks' L per position

        def wrap(mod, name, make):
            monkeypatch.setattr(mod, name, make(getattr(mod, name)))

        def counted(real_compiled_op):
            def compiled_op(fn):
                real = real_compiled_op(fn)

                def run(*a, **k):
                    if self.active:
                        self.compiled[fn.__name__] += 1
                    return real(*a, **k)
                return run
            return compiled_op

        def flex_block_attention(real):
            def f(q, k, v, block_mask, *, compiled=True):
                if self.active:
                    self.flex.append((compiled, q.dtype, q.device.type))
                return real(q, k, v, block_mask, compiled=compiled)
            return f

        def flex_block_mask(real):
            def f(layout, **kw):
                if self.active:
                    self.masks.append(kw.get("attn"))
                return real(layout, **kw)
            return f

        def dense_block_attention(real):
            def f(*a, **kw):
                if self.active:
                    self.dense += 1
                return real(*a, **kw)
            return f

        def fused_ce_loss(real):
            def f(hidden, head, labels, weights, **kw):
                if self.active:
                    self.ce.append(dict(epilogue=kw.get("epilogue"), dtype=hidden.dtype,
                                        host_count=kw.get("num_supervised"), device_count=int((weights > 0).sum())))
                return real(hidden, head, labels, weights, **kw)
            return f

        def selector_ce_sum(real):
            def f(*a, **kw):
                total, hits = real(*a, **kw)
                if self.active:
                    self.selector.append((float(total.detach()), float(hits)))
                return total, hits
            return f

        def micro_batch_loss(real):
            def f(drafter, mb, hb, **kw):
                snap = None
                if self.active and self.first_step is None:   # the weights before the step changes them
                    snap = dict(cfg=drafter.cfg, state={n: _to_cpu(t) for n, t in drafter.state_dict().items()},
                                mb=dataclasses.replace(mb, **_fields_on_cpu(mb)),
                                hb=dataclasses.replace(hb, **_fields_on_cpu(hb)),
                                kw={k: _to_cpu(v) for k, v in kw.items()})
                terms = real(drafter, mb, hb, **kw)
                if snap is not None:
                    self.first_step = dict(snap, terms=_fields_on_cpu(terms))
                return terms
            return f

        def build_packed_blocks(real):
            def f(*a, **kw):
                blk = real(*a, **kw)
                if self.active and self.first_blocks is None:
                    self.first_blocks = dict(args=[_to_cpu(x) for x in a], kw={k: _to_cpu(v) for k, v in kw.items()},
                                             device=a[0].device.type, out=_fields_on_cpu(blk))
                return blk
            return f

        def block_drafts(real):
            def f(drafter, out_JBD, *, anchor_ids_J, lm_head_VD, rows_per_chunk):
                d = real(drafter, out_JBD, anchor_ids_J=anchor_ids_J, lm_head_VD=lm_head_VD,
                         rows_per_chunk=rows_per_chunk)
                if self.active:
                    self.drafts.append(dict(drafter=drafter, out=out_JBD.detach().clone(), anchors=anchor_ids_J.clone(),
                                            head=lm_head_VD, drafts=d.clone()))
                return d
            return f

        def accept_lengths_chunks(real):
            def f(*a, **kw):
                L = real(*a, **kw)
                if self.active:
                    self.accept.append(L.copy())
                return L
            return f

        wrap(model, "compiled_op", counted)
        wrap(fused_ce, "compiled_op", counted)
        wrap(model, "flex_block_attention", flex_block_attention)
        wrap(model, "flex_block_mask", flex_block_mask)
        wrap(model, "dense_block_attention", dense_block_attention)
        wrap(step, "fused_ce_loss", fused_ce_loss)
        wrap(step, "build_packed_blocks", build_packed_blocks)
        wrap(selector, "selector_ce_sum", selector_ce_sum)
        wrap(unit, "micro_batch_loss", micro_batch_loss)
        wrap(batched, "block_drafts", block_drafts)
        wrap(batched, "accept_lengths_chunks", accept_lengths_chunks)

    def stop(self) -> None:
        self.active = False


# ------------------------------------------------------------------------------------------- training on CUDA

def train_probed(monkeypatch, out: pathlib.Path, assets, *, device: str = "cuda", **kw):
    """A tiny run (train_helpers.tiny_config) on `device`, probed. Two steps compile flex attention twice, as a
    real run does: for the first micro-batch's shapes, then with dynamic shapes, which every later step runs."""
    from dflash.train.trainer import train

    target, cache = assets
    probe = Probe(monkeypatch)
    res = train(tiny_config(output=str(out), cache=str(cache), model=str(target), **kw), device=device)
    probe.stop()
    return res, probe


def check_cuda_paths(probe: Probe, *, attns: set, selector: bool) -> None:
    """The paths the CUDA trainer picks, and that each ran: compiled flex attention for every layer attention of
    the drafter (never the dense fallback), compiled element-wise ops, the fused CE with its Triton epilogue on
    bf16 rows whose host-side supervised count is the device's, and the DFlash 2 selector term when `selector`."""
    assert probe.flex and probe.dense == 0
    assert set(probe.flex) == {(True, torch.bfloat16, "cuda")}, set(probe.flex)
    assert set(probe.masks) == attns
    for name in ("rms_norm", "apply_rope", "silu_mul"):
        assert probe.compiled[name] > 0, (name, probe.compiled)
    assert probe.ce and all(c["epilogue"] == "triton" and c["dtype"] == torch.bfloat16 for c in probe.ce), probe.ce
    assert all(c["host_count"] == c["device_count"] for c in probe.ce), probe.ce
    if selector:
        assert probe.selector and all(math.isfinite(s) and s >= 0 for s, _ in probe.selector), probe.selector
        assert sum(s for s, _ in probe.selector) > 0 and sum(h for _, h in probe.selector) > 0, probe.selector
    else:
        assert not probe.selector


def check_losses_finite(res) -> None:
    from dflash.train.metrics import read_metrics

    losses = [x for r in read_metrics(res.run_dir) for x in r["step_losses"]]
    assert res.finished and len(losses) == res.global_step == res.total_steps
    assert all(math.isfinite(x) for x in losses) and math.isfinite(res.last_loss), losses


def check_first_step_against_cpu(probe: Probe) -> None:
    """The first micro-batch again on the CPU in fp32 (the same weights, tokens, features, anchors and prefixes,
    the embedding and head as the CUDA step had them in bf16): build_packed_blocks gives the very blocks, the loss
    weights and per-slot counts agree to fp32 summation, the block CE within bf16 (LOSS_RTOL) and the DFlash 2
    selector term within SELECTOR_RTOL."""
    from dflash.drafter.registry import build_drafter
    from dflash.train.objective import build_packed_blocks
    from dflash.train.step import micro_batch_loss

    blk = probe.first_blocks
    assert blk is not None and blk["device"] == "cuda"
    ref = build_packed_blocks(*blk["args"], **blk["kw"])
    for name in ("block_ids_JB", "positions_JB", "labels_JB"):
        assert torch.equal(getattr(ref, name), blk["out"][name]), name
    torch.testing.assert_close(blk["out"]["weights_JB"], ref.weights_JB, rtol=1e-6, atol=0)

    snap = probe.first_step
    drafter = build_drafter(snap["cfg"])
    drafter.load_state_dict(snap["state"])
    mb = dataclasses.replace(snap["mb"], hidden_TKD=snap["mb"].hidden_TKD.float())
    kw = {**snap["kw"], "embed_VD": snap["kw"]["embed_VD"].float(), "lm_head_VD": snap["kw"]["lm_head_VD"].float()}
    with torch.no_grad():
        block = micro_batch_loss(drafter, mb, snap["hb"], **{**kw, "selector_weight": 0.0})
    got = snap["terms"]
    assert torch.equal(got["count_B"], block.count_B) and torch.equal(got["num_blocks"], block.num_blocks)
    torch.testing.assert_close(got["weight_sum"], block.weight_sum, rtol=1e-5, atol=0)
    # the CUDA step's sum is block CE + selector_weight x its selector term (the probe's first selector call)
    weight = kw["selector_weight"] if probe.selector else 0.0
    selector_dev = probe.selector[0][0] if probe.selector else 0.0
    torch.testing.assert_close(got["weighted_ce_sum"] - weight * selector_dev, block.weighted_ce_sum,
                               rtol=LOSS_RTOL, atol=0)
    if weight:
        with torch.no_grad():
            full = micro_batch_loss(drafter, mb, snap["hb"], **kw)
        selector_cpu = float(full.weighted_ce_sum - block.weighted_ce_sum) / weight
        assert selector_cpu > 0 and abs(selector_dev - selector_cpu) <= SELECTOR_RTOL * selector_cpu, \
            (selector_dev, selector_cpu)


def test_dflash2_trains_on_cuda_on_the_compiled_paths(assets, tmp_path, monkeypatch):
    """Two DFlash 2 steps (block CE + selector CE): the CUDA paths, finite losses, the CPU's first micro-batch."""
    res, probe = train_probed(monkeypatch, tmp_path / "run", assets, **DFLASH2, steps=2)
    from dflash.drafter.attention import FULL

    check_cuda_paths(probe, attns={FULL}, selector=True)
    check_losses_finite(res)
    check_first_step_against_cpu(probe)
    assert probe.first_step["kw"]["selector_weight"] > 0


def test_mixed_layer_types_train_on_cuda(assets, tmp_path, monkeypatch):
    """The published 27B layout's kind (sliding-window layers beside a full one), two steps: one compiled flex
    BlockMask per layer attention, the CPU's first micro-batch."""
    from dflash.drafter.attention import FULL, LayerAttention

    res, probe = train_probed(monkeypatch, tmp_path / "run", assets, **MIXED, steps=2)
    check_cuda_paths(probe, attns={LayerAttention(window=MIXED["sliding_window"], causal=True), FULL},
                     selector=False)
    check_losses_finite(res)
    check_first_step_against_cpu(probe)


def test_variable_prefix_step_on_cuda(assets, tmp_path, monkeypatch):
    """One step of the variable-prefix objective: the blocks the CUDA step builds from the host's prefix draws
    (real tokens shown up to each prefix, only the masked rest weighted) are the CPU's, and so is its loss."""
    res, probe = train_probed(monkeypatch, tmp_path / "run", assets, objective="variable_prefix", steps=1)
    from dflash.drafter.attention import FULL

    check_cuda_paths(probe, attns={FULL}, selector=False)
    check_losses_finite(res)
    prefix = probe.first_step["hb"].prefix_J
    assert prefix is not None and int(prefix.max()) > 1   # some block shows more than its anchor
    check_first_step_against_cpu(probe)


# ----------------------------------------------------------------------- the DFlash 2 forward, CUDA vs CPU

def methods_drafter(*, layer_types, sliding_window=None, vocab_size=264, seed=0):
    """A DFlash 2 drafter of the trained runs' attention shape (hidden 64: default_heads) with weights whose
    attention and convolutions matter: linears of std 1/sqrt(hidden) (at the trainer's 0.02 the residual stream
    hides attention, and a mask error with it), random convolutions and codebooks, spread norm weights."""
    from dflash.drafter.dflash2 import DFlash2Config, DFlash2Drafter
    from dflash.train.build import default_heads

    heads, kv, head_dim, _ = default_heads(64)
    cfg = DFlash2Config(hidden_size=64, intermediate_size=64, target_layer_ids=(0, 1, 2), num_target_layers=4,
                        mask_token_id=vocab_size - 1, vocab_size=vocab_size, num_hidden_layers=len(layer_types),
                        num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, block_size=4,
                        layer_types=tuple(layer_types), sliding_window=sliding_window,
                        conv_group_size=8, selector_rank=8, selector_top_k=4)
    torch.manual_seed(seed)
    dr = DFlash2Drafter(cfg)
    dr.reset_parameters(std=64 ** -0.5)
    with torch.no_grad():
        for name, p in dr.named_parameters():
            if name.endswith("base_kernel"):
                p.normal_(0.5, 0.3)
            elif name.endswith("kernel_projection.weight"):
                p.normal_(0.0, 0.05)
            elif name.endswith("codebook"):
                p.normal_(0.0, 0.2)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return dr


def packed_inputs(*, lengths, num_anchors, vocab_size, block_size, mask_token_id, seed):
    """A packed batch as the trainer feeds it: bf16 features and block embeddings (the cache's storage and the
    compute dtype), the layout of its anchors."""
    from dflash.train.objective import build_packed_blocks, packed_layout

    g = torch.Generator().manual_seed(seed)
    anchors = [torch.sort(torch.randperm(n - 1, generator=g)[:num_anchors])[0] for n in lengths]
    ids = torch.randint(0, vocab_size, (sum(lengths),), generator=g)
    feats = torch.randn(sum(lengths), 3, 64, generator=g).bfloat16()
    embed = torch.randn(vocab_size, 64, generator=g).bfloat16()
    layout = packed_layout(lengths=list(lengths), anchors=anchors, block_size=block_size)
    blk = build_packed_blocks(ids, torch.ones_like(ids, dtype=torch.bool), layout.anchor_J, lengths=list(lengths),
                              blocks_per_sample=[a.numel() for a in anchors], block_size=block_size,
                              mask_token_id=mask_token_id)
    return layout, embed[blk.block_ids_JB.reshape(-1)], feats


def forward_backward(dr, layout, embeds, feats, *, device, autocast_dtype=None):
    """The drafter's packed forward (the trainer's call) and the gradients of a fixed random projection of it."""
    from dflash.train.step import autocast

    dev = torch.device(device)
    dr.zero_grad(set_to_none=True)
    lay = layout.to(dev)
    with autocast(dev, autocast_dtype or torch.float32):
        dtype = autocast_dtype or torch.float32
        out = dr(embeds.to(dev, dtype), dr.context(feats.to(dev, dtype)), q_pos=lay.q_pos_Q, kv_pos=lay.kv_pos_K,
                 mask=lay)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dev)
    (out.float() * w).sum().backward()
    return out.detach().float().cpu(), {n: p.grad.cpu() for n, p in dr.named_parameters() if p.grad is not None}


def test_dflash2_forward_and_backward_on_cuda_track_cpu_fp32(monkeypatch):
    """The DFlash 2 drafter of the mixed layout as the CUDA trainer runs it (bf16 autocast over fp32 weights,
    compiled element-wise ops, compiled flex attention) against its fp32 CPU forward and backward (dense path):
    every output row within FORWARD_ROW_TOL, every parameter's gradient within GRAD_TOL (module docstring)."""
    ref = methods_drafter(layer_types=MIXED["layer_types"], sliding_window=MIXED["sliding_window"])
    layout, embeds, feats = packed_inputs(lengths=(37, 12, 50, 23, 61), num_anchors=8, vocab_size=264,
                                          block_size=4, mask_token_id=ref.cfg.mask_token_id, seed=3)
    out_ref, grads_ref = forward_backward(ref, layout, embeds, feats, device="cpu")
    probe = Probe(monkeypatch)   # before compile_elementwise, which binds the (counted) compiled ops
    dev = copy.deepcopy(ref).cuda()
    dev.compile_elementwise()
    out_dev, grads_dev = forward_backward(dev, layout, embeds, feats, device="cuda", autocast_dtype=torch.bfloat16)
    probe.stop()
    assert probe.dense == 0 and set(probe.flex) == {(True, torch.bfloat16, "cuda")}
    assert probe.compiled["rms_norm"] and probe.compiled["apply_rope"] and probe.compiled["silu_mul"]
    row_err = (out_dev - out_ref).norm(dim=-1) / out_ref.norm(dim=-1)
    assert float(row_err.max()) < FORWARD_ROW_TOL, (float(row_err.max()), float(row_err.median()))
    assert grads_ref.keys() == grads_dev.keys() and any("_conv." in n for n in grads_ref)
    errs = {n: float((grads_dev[n] - g).norm() / g.norm()) for n, g in grads_ref.items()}
    assert max(errs.values()) < GRAD_TOL, sorted(errs.items(), key=lambda kv: -kv[1])[:5]


# ------------------------------------------------------------------------- the windowed flex mask, pair by pair

def kernel_visibility(layout, attn, device) -> torch.Tensor:
    """bool [Q, K]: the keys each query's row of the compiled flex kernel averages over, with the trainer's
    BlockMask (flex_block_mask: tile lists and mask_mod) and kernel options (flex_block_attention). All scores are
    0 (q = k = 0), so a row is the mean of the visible keys' values; the values are one-hot over the keys (head g
    holds keys g*d .. g*d+d-1), so row q of head g is 1/n at exactly its visible keys of that head."""
    from dflash.drafter.attention import flex_block_attention, flex_block_mask

    lay = layout.to(device)
    Q, K, d = lay.num_blocks * lay.block_size, lay.num_ctx + lay.num_blocks * lay.block_size, 64
    h = -(-K // d)
    key = torch.arange(K, device=device)
    v = torch.zeros(h, K, d, device=device)
    v[key // d, key, key % d] = 1.0
    q, k = torch.zeros(h, Q, d, device=device), torch.zeros(h, K, d, device=device)
    with torch.no_grad():
        out = flex_block_attention(q, k, v, flex_block_mask(lay, attn=attn), compiled=True)   # [h, Q, d]
    rows = out.transpose(0, 1).reshape(Q, h * d)[:, :K].cpu()
    torch.testing.assert_close(rows.sum(1), torch.ones(Q))   # every query saw at least its own slot
    return rows > 0.5 / K


def test_compiled_flex_windowed_mask_is_the_predicate_on_cuda():
    """A sliding layer's attention (window 200, in-block causal, as sliding layers train) over three sequences of
    hundreds of tokens with anchor 0 among them, at the trainer's 128-tiles and 64 x 64 kernel tiles: the window
    cuts into context tiles the full rule lists as full. Every (query, key) pair the kernel uses is one the
    predicate allows, and every allowed pair is used."""
    from dflash.drafter.attention import LayerAttention, dense_mask
    from dflash.train.objective import packed_layout

    g = torch.Generator().manual_seed(5)
    lengths = (700, 300, 450)
    anchors = [torch.cat([torch.zeros(1, dtype=torch.long),
                          torch.sort(torch.randperm(n - 2, generator=g)[:59] + 1)[0]]) for n in lengths]
    layout = packed_layout(lengths=list(lengths), anchors=anchors, block_size=16)
    attn = LayerAttention(window=200, causal=True)
    want = dense_mask(layout, attn)
    got = kernel_visibility(layout, attn, "cuda")
    bad = (got != want).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} pairs differ, first (query, key): {bad[:5].tolist()}"
    assert 0 < int(want.sum()) < int(dense_mask(layout).sum())   # the window does hide keys


# ----------------------------------------------------------------------------------- exact tau, CUDA vs CPU

ACCEPTS = (0.15, 0.2, 0.25, 0.4)
"""How often eval_set makes the chain accept 0, 1, 2 or 3 drafts at an anchor (block size 4): tau ~2.9."""


def eval_set(cache_dir, target, dr, *, num_seqs=12, seed=0):
    """A target-greedy eval cache the drafter often drafts right: along each response's accept chain, the block
    at every anchor a takes the drafter's own first L drafts (L drawn from 0..B-1, the CPU fp32 drafter run on its
    block alone, mask=None) and then a token that is not its next draft, so the chain accepts L there. Features are
    random (the drafter reads only them and the anchor token). Returns (lengths, spans)."""
    from dflash.cache import CacheWriter
    from dflash.target.head import embedding_and_head

    embed, head, _ = embedding_and_head(target, dtype=torch.float32)
    B, V = dr.cfg.block_size, dr.cfg.vocab_size
    assert B == len(ACCEPTS)
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    lengths, spans, all_ids, all_mask, all_feats = [], [], [], [], []
    dr.eval()
    for _ in range(num_seqs):
        n, start = int(rng.integers(40, 80)), int(rng.integers(4, 9))
        ids = torch.from_numpy(rng.integers(0, V - 1, n))
        feats = torch.randn(n, 3, 64, generator=g).bfloat16()
        pos = start
        while pos < n - 1:
            block = torch.full((B,), dr.cfg.mask_token_id)
            block[0] = ids[pos]
            q_pos = pos + torch.arange(B)
            with torch.no_grad():
                out = dr(embed[block], dr.context(feats[:pos].float()), q_pos=q_pos,
                         kv_pos=torch.cat([torch.arange(pos), q_pos]))
                draft = dr.draft_tokens(out[None], anchor_ids_J=ids[pos:pos + 1], lm_head_VD=head)[0]
            L = min(int(rng.choice(B, p=ACCEPTS)), n - 1 - pos)
            ids[pos + 1:pos + 1 + L] = draft[:L]
            if pos + 1 + L < n:
                bonus = int(rng.integers(0, V - 1))
                if L < B - 1 and bonus == int(draft[L]):
                    bonus = (bonus + 1) % (V - 1)
                ids[pos + 1 + L] = bonus
            pos += L + 1
        mask = np.zeros(n, np.uint8)
        mask[start:] = 1
        lengths.append(n)
        spans.append((start, n))
        all_ids.append(ids.numpy().astype(np.int32))
        all_mask.append(mask)
        all_feats.append(feats)
    fp = dataclasses.replace(fingerprint_for(target), target_greedy=True)
    with CacheWriter(cache_dir, fp, shard_tokens=400) as w:
        w.append(sample_ids=np.arange(num_seqs, dtype=np.int64), lengths=np.asarray(lengths),
                 input_ids=np.concatenate(all_ids), loss_mask=np.concatenate(all_mask),
                 hidden=torch.cat(all_feats).float().contiguous())
    return np.asarray(lengths), np.asarray(spans)


@torch.no_grad()
def draft_scores(rec: dict, pred_JW: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, selector scores S(pred, c)) of every drafted slot for every vocabulary token c, float64 [N, V] on
    the CPU, as the drafter's own draft_tokens computes them on its device and dtype (the LM-head matmul in the
    output's dtype, the selector's modules), with the predecessors `pred_JW` (teacher forcing)."""
    dr, out, head = rec["drafter"], rec["out"], rec["head"]
    J, B, D = out.shape
    out_ND = out[:, 1:].reshape(J * (B - 1), D)
    sel = dr.candidate_selector
    logits = (out_ND @ head.to(out.dtype).T).float()
    V = logits.shape[1]
    proj = sel.hidden_projection(out_ND.to(sel.hidden_projection.weight.dtype))
    cand = torch.arange(V, device=out.device).expand(J * (B - 1), V)
    scores = sel.edge_scores(unary_nk=sel.unary(logits), cand_nk=cand, pred_n=pred_JW.reshape(-1).to(out.device),
                             proj_nr=proj)
    return logits.double().cpu(), scores.double().cpu()


def robust_slots(ref: dict, dev: dict, top_k: int, eps: float = 1e-6) -> torch.Tensor:
    """bool [J, W]: the drafted slots where the device must choose as the CPU did, given the device's measured
    logit and score errors on that slot (dL, dS: the largest |device - CPU| over the vocabulary, both with the CPU
    path's predecessors, plus eps for the order of this recomputation): the CPU's choice w stays among the
    device's top-k candidates (its logit beats the (k+1)-th by more than 2 dL) and beats by more than 2 dS the
    score of every token that could be a device candidate (a logit within 2 dL of the k-th). Where the slots
    before it are so too, the device holds the CPU's predecessor there, so it walks the CPU's path."""
    J, W = ref["drafts"].shape
    pred = torch.cat([ref["anchors"].cpu()[:, None], ref["drafts"].cpu()[:, :-1]], dim=1)
    log_r, s_r = draft_scores(ref, pred)
    log_d, s_d = draft_scores(dev, pred)
    d_log = (log_d - log_r).abs().amax(1) + eps
    d_s = (s_d - s_r).abs().amax(1) + eps
    w = ref["drafts"].cpu().reshape(-1)
    rows = torch.arange(w.shape[0])
    top = log_r.topk(top_k + 1, dim=1).values
    stays = log_r[rows, w] - top[:, top_k] > 2 * d_log
    could = log_r >= (top[:, top_k - 1] - 2 * d_log)[:, None]
    could[rows, w] = False
    rival = torch.where(could, s_r, -math.inf).amax(1)
    wins = s_r[rows, w] - rival > 2 * d_s
    return (stays & wins).view(J, W)


def deciding_slots(L_J: np.ndarray, W: int) -> torch.Tensor:
    """bool [J, W]: the slots an accept length L depends on, 1 .. min(L + 1, W): the L matches and the first miss."""
    return torch.arange(W)[None] < torch.from_numpy(np.minimum(L_J + 1, W))[:, None]


def chain_anchors(accept: np.ndarray, start: int, end: int) -> list[int]:
    """The anchors walk_accept_chain visits (accept: L by position of one sequence)."""
    pos, out = start, []
    while pos < end - 1:
        out.append(pos)
        pos += min(int(accept[pos]), end - 1 - pos) + 1
    return out


def test_dflash2_exact_tau_on_cuda_matches_cpu(assets, tmp_path, monkeypatch):
    """`dflash eval` (evaluate_cache: cache reads, compiled flex attention, the selector's path, the accept chain)
    of a DFlash 2 drafter on CUDA, in fp32 and in its default bf16, against the CPU in fp32.

    Where rounding cannot flip a draft the drafts are the CPU's, and that is proved per slot, not assumed
    (robust_slots, from the error measured on that slot): at every anchor whose deciding slots are so, the device
    drafted what the CPU drafted there and accepted as many; every sequence whose accept chain passes only such
    anchors has the CPU's tau. fp32: the kernels differ from the CPU's in summation order only (outputs within
    1e-3, ~1e-6 expected: no TF32), so that is nearly every anchor and sequence, and tau is the CPU's exactly when
    it is all of them. bf16 (`dflash eval`'s default on CUDA) rounds the drafter's weights, outputs (median row
    error 0.023) and logits, and this random drafter's candidates are close (logit spread ~0.16): on the CPU in bf16
    92% of the anchors decided their accept length as in fp32, 43% were proved so, no whole chain was (tau 2.55
    against 3.00). So bf16 is held per anchor (at least a quarter proved, every proved one equal), not per
    sequence."""
    from dflash.drafter.export import export_drafter
    from dflash.eval.batched import DEFAULT_CHUNK_ANCHORS, plan_chunks
    from dflash.eval.evaluate import EvalConfig, evaluate_cache
    from dflash.target.head import embedding_and_head

    target, _ = assets
    V = embedding_and_head(target)[2].vocab_size
    dr = methods_drafter(layer_types=("full_attention", "full_attention"), vocab_size=V, seed=7)
    drafter_dir = export_drafter(dr, dr.cfg, tmp_path / "drafter", dtype=torch.float32)
    lengths, spans = eval_set(tmp_path / "eval", target, dr)
    results, probes = {}, {}
    for name, device, dtype in (("cpu", "cpu", "float32"), ("fp32", "cuda", "float32"), ("bf16", "cuda", None)):
        probes[name] = probe = Probe(monkeypatch)
        results[name] = evaluate_cache(drafter_dir=str(drafter_dir), cache_dir=str(tmp_path / "eval"),
                                       model=str(target), cfg=EvalConfig(device=device, dtype=dtype), progress=False)
        probe.stop()
    for name, probe in probes.items():
        assert len(probe.drafts) == 1 and len(probe.accept) == 1   # one chunk: all anchors in one forward
        if name != "cpu":
            assert probe.dense == 0 and probe.flex and all(c and t == "cuda" for c, _, t in probe.flex)
    assert results["bf16"].dtype == "bfloat16" and results["fp32"].dtype == "float32"
    cpu = results["cpu"]
    assert cpu.target_greedy and cpu.overall.tau > 2.5, cpu.overall.tau   # the construction's long accepts

    # the packed position of every planned anchor, in the drafts' order (accept_lengths_chunks' rule)
    chunks = plan_chunks(lengths=lengths, spans=spans, chunk_anchors=DEFAULT_CHUNK_ANCHORS, block_size=4)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    anchor_pos = np.concatenate([np.arange(lo, hi) + offsets[c.first_seq + i] for c in chunks
                                 for i, (lo, hi) in enumerate(zip(c.anchor_lo.tolist(), c.anchor_hi.tolist()))])
    ref_rec, ref_L = probes["cpu"].drafts[0], probes["cpu"].accept[0]
    ref_drafts, W = ref_rec["drafts"], ref_rec["drafts"].shape[1]
    # the selector matters: its path leaves the per-slot argmax at some slots (so a wrong selector would show)
    assert (ref_drafts != (ref_rec["out"][:, 1:] @ ref_rec["head"].T).argmax(-1)).any()
    need = deciding_slots(ref_L[anchor_pos], W)
    want = dict(zip(cpu.overall.sequence_ids, cpu.overall.per_sequence_tau))
    # outputs: fp32 to summation order (its largest row error), bf16 to its rounding (its median row error; bf16
    # weights, unlike training's autocast over fp32 ones: 0.023 on the CPU, largest 0.12; a mask error moves the
    # median by 0.13-0.34, as in the forward test)
    for name, stat, row_tol, min_anchors, min_seqs in (("fp32", torch.amax, 1e-3, 0.95, 0.8),
                                                       ("bf16", torch.median, 0.06, 0.25, 0.0)):
        rec, L = probes[name].drafts[0], probes[name].accept[0]
        out, ref_out = rec["out"].float().cpu(), ref_rec["out"]
        row_err = float(stat((out - ref_out).norm(dim=-1) / ref_out.norm(dim=-1)))
        assert row_err < row_tol, (name, row_err, "fp32 matmul precision (TF32?)" if name == "fp32" else "")
        proved = (robust_slots(ref_rec, rec, top_k=dr.cfg.selector_top_k) | ~need).all(1)
        assert float(proved.float().mean()) >= min_anchors, (name, float(proved.float().mean()))
        same = ((rec["drafts"].cpu() == ref_drafts) | ~need).all(1)
        assert bool(same[proved].all()), (name, (proved & ~same).nonzero()[:5].flatten().tolist())
        at = anchor_pos[proved.numpy()]
        assert np.array_equal(L[at], ref_L[at]), name
        proved_pos = set(at.tolist())
        got = dict(zip(results[name].overall.sequence_ids, results[name].overall.per_sequence_tau))
        assert got.keys() == want.keys()
        sure = [i for i, (s, e) in enumerate(spans.tolist())
                if all(offsets[i] + a in proved_pos for a in chain_anchors(ref_L[offsets[i]:], s, e))]
        assert len(sure) >= min_seqs * len(spans), (name, len(sure))
        assert [got[i] for i in sure] == [want[i] for i in sure], name
        if len(sure) == len(spans):
            assert results[name].overall.tau == cpu.overall.tau, name
