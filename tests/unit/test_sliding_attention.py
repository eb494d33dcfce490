"""Sliding-window and mixed layer_types drafters: the per-layer attention predicate (window W counting the query's
own slot, in-block causality) pinned by hand and against an independent re-statement of SpecForge's mask, both
kernels (dense CPU path and flex with its tile lists) against it, the packed forward against each block alone,
and the config.json fields engines read (layer_types, sliding_window, use_sliding_window, dflash_config.causal)."""

import dataclasses
import pathlib
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from test_drafter_model import embed, packed_case, packed_forward, tiny_model  # noqa: E402

from dflash.drafter.attention import (FULL, BlockLayout, LayerAttention, dense_block_attention,  # noqa: E402
                                      dense_mask, flex_block_mask, layout_tiles, own_block_mask)
from dflash.drafter.config import DrafterConfig  # noqa: E402
from dflash.errors import ConfigError  # noqa: E402
from dflash.train.objective import packed_layout  # noqa: E402

# SpecForge's configs/qwen3.6-27b-dflash.json (the published 27B layout: 4 sliding layers of 2,048 + 1 full)
QWEN36_27B = {
    "architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": 16, "bos_token_id": None,
    "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]}, "dtype": "bfloat16",
    "eos_token_id": 248044, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "initializer_range": 0.02,
    "intermediate_size": 17408, "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
    "max_position_embeddings": 262144, "max_window_layers": 5, "model_type": "qwen3", "num_attention_heads": 32,
    "num_hidden_layers": 5, "num_key_value_heads": 8, "num_target_layers": 64, "pad_token_id": 248044,
    "rms_norm_eps": 1e-06, "sliding_window": 2048, "tie_word_embeddings": False, "transformers_version": "5.5.3",
    "use_cache": True, "use_sliding_window": True, "vocab_size": 248320, "rope_theta": 10000000,
    "rope_scaling": None,
}
ATTNS = [LayerAttention(window=3, causal=True), LayerAttention(window=2, causal=False),
         LayerAttention(causal=True), LayerAttention(window=40, causal=True), FULL]


def one_block_layout(length=10, anchors=(3, 6), B=4):
    return packed_layout(lengths=[length], anchors=[torch.tensor(anchors)], block_size=B)


def specforge_mask(layout: BlockLayout, attn: LayerAttention) -> torch.Tensor:
    """SpecForge's create_dflash_sdpa_mask (sliding, is_causal) restated loop by loop over one packed batch:
    context key p visible to slot k of the block at anchor a iff same sequence, p < a and p >= a + k - (W-1);
    block key k' iff same block, k' <= k when causal and k' >= k - (W-1)."""
    B, C = layout.block_size, layout.num_ctx
    W = attn.window
    out = torch.zeros(layout.num_blocks * B, C + layout.num_blocks * B, dtype=torch.bool)
    for j in range(layout.num_blocks):
        a, s = int(layout.anchor_J[j]), int(layout.block_seq_J[j])
        for k in range(B):
            for c in range(C):
                p = int(layout.ctx_pos_C[c])
                out[j * B + k, c] = (int(layout.ctx_seq_C[c]) == s and p < a
                                     and (W is None or p >= a + k - (W - 1)))
            for k2 in range(B):
                out[j * B + k, C + j * B + k2] = ((not attn.causal or k2 <= k) and (W is None or k2 >= k - (W - 1)))
    return out


def test_the_mask_of_one_block_by_hand():
    # one sequence of 10 tokens (context positions 0..9), blocks at anchors 3 and 6, B = 4, window 3, causal
    lay = one_block_layout()
    m = dense_mask(lay, LayerAttention(window=3, causal=True))
    ctx, blk = m[:4, :10].int().tolist(), m[:4, 10:14].int().tolist()   # the block at anchor 3
    assert ctx == [[0, 1, 1, 0, 0, 0, 0, 0, 0, 0],    # slot 0 (position 3): positions 1, 2 and itself
                   [0, 0, 1, 0, 0, 0, 0, 0, 0, 0],    # slot 1 (position 4): position 2, slots 0-1
                   [0, 0, 0, 0, 0, 0, 0, 0, 0, 0],    # slot 2 (position 5): slots 0-2 fill the window
                   [0, 0, 0, 0, 0, 0, 0, 0, 0, 0]]
    assert blk == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1]]
    assert not m[:4, 14:].any() and not m[4:, 10:14].any()   # blocks never see each other
    # the full layer of the same layout: context below the anchor, the whole block
    full = dense_mask(lay)
    assert full[:4, :10].int().tolist() == [[1, 1, 1, 0, 0, 0, 0, 0, 0, 0]] * 4 and full[:4, 10:14].all()


def test_own_block_masks():
    tri = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(own_block_mask(4, LayerAttention(causal=True)), tri)
    assert torch.equal(own_block_mask(4, LayerAttention(window=4, causal=True)), tri)
    # a non-causal window has a left bound only (SGLang's backends disagree on a right one; SpecForge sets none)
    assert own_block_mask(4, LayerAttention(window=2)).int().tolist() == [[1, 1, 1, 1], [1, 1, 1, 1],
                                                                          [0, 1, 1, 1], [0, 0, 1, 1]]
    assert own_block_mask(4, FULL) is None and own_block_mask(4, LayerAttention(window=4)) is None
    with pytest.raises(ConfigError, match="window 0"):
        LayerAttention(window=0)


@pytest.mark.parametrize("attn", ATTNS)
def test_predicate_equals_specforge_mask_on_packed_batches(attn):
    g = torch.Generator().manual_seed(0)
    lengths = [11, 4, 17]
    anchors = [torch.sort(torch.randperm(n - 1, generator=g)[:5])[0] for n in lengths]
    lay = packed_layout(lengths=lengths, anchors=anchors, block_size=4)
    assert torch.equal(dense_mask(lay, attn), specforge_mask(lay, attn))


@pytest.mark.parametrize("attn", ATTNS[:4])
def test_dense_kernel_equals_whole_mask_sdpa_forward_and_backward(attn):
    g = torch.Generator().manual_seed(1)
    lengths = [37, 12, 50]
    anchors = [torch.sort(torch.randperm(n - 1, generator=g)[:9])[0] for n in lengths]
    lay = packed_layout(lengths=lengths, anchors=anchors, block_size=4)
    Q, K = lay.num_blocks * 4, lay.num_ctx + lay.num_blocks * 4
    q = torch.randn(4, Q, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, K, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    ref = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=dense_mask(lay, attn),
                                         enable_gqa=True)[0]
    out = dense_block_attention(q, k, v, lay, chunk_tokens=12, attn=attn)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad((out.sin() * out).sum(), (q, k, v)),
                    torch.autograd.grad((ref.sin() * ref).sum(), (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("window", [1, 8, 40, 1000])
def test_windowed_tiles_cover_the_windowed_mask_without_full_tiles(window):
    lay = packed_layout(lengths=[150, 90], anchors=[torch.arange(5, 140, 3), torch.arange(0, 80, 7)],
                        block_size=4)
    attn = LayerAttention(window=window, causal=True)
    std = layout_tiles(lay, tile=16)
    win = layout_tiles(lay, tile=16, full_tiles=False, window=window)
    assert int(win["full_kv_num_blocks"].sum()) == 0 < int(std["full_kv_num_blocks"].sum())
    nk = std["kv_indices"].shape[-1]

    def tiles(num, idx):
        out = torch.zeros(num.shape[-1], nk, dtype=torch.bool)
        for t in range(num.shape[-1]):
            out[t, idx[0, 0, t, :num[0, 0, t]].long()] = True
        return out

    listed = tiles(win["kv_num_blocks"], win["kv_indices"])
    union = tiles(std["kv_num_blocks"], std["kv_indices"]) | tiles(std["full_kv_num_blocks"], std["full_kv_indices"])
    m = dense_mask(lay, attn)
    Q, K = m.shape
    padded = torch.zeros(listed.shape[0] * 16, nk * 16, dtype=torch.bool)
    padded[:Q, :K] = m
    visible = padded.view(listed.shape[0], 16, nk, 16).permute(0, 2, 1, 3).flatten(2).any(-1)
    assert (visible <= listed).all(), "a tile with a visible pair is skipped"
    assert (listed <= union).all()
    if window <= 40:
        assert int(listed.sum()) < int(union.sum())  # far context tiles are skipped
    else:
        assert torch.equal(listed, union)


def test_compiled_flex_with_tiles_equals_dense_on_cpu_for_a_window():
    # compiled flex visits only the listed tiles and skips mask_mod on full ones: a window that cut into a tile
    # the full rule lists as full would show here (dynamic=False: see test_attention_tiles)
    from torch.nn.attention.flex_attention import flex_attention

    fa = torch.compile(flex_attention, dynamic=False)
    g = torch.Generator().manual_seed(3)
    lay = packed_layout(lengths=[120, 70], anchors=[torch.arange(40, 115, 5), torch.arange(2, 66, 9)],
                        block_size=4)
    Q, K = lay.num_blocks * 4, lay.num_ctx + lay.num_blocks * 4
    q, k, v = (torch.randn(2, n, 16, generator=g) for n in (Q, K, K))
    attn = LayerAttention(window=20, causal=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex = fa(q[None], k[None], v[None], block_mask=flex_block_mask(lay, tile=16, attn=attn))[0]
    dense = dense_block_attention(q, k, v, lay, chunk_tokens=64, attn=attn)
    torch.testing.assert_close(flex, dense, rtol=1e-4, atol=1e-5)


MIXED = dict(layer_types=("sliding_attention", "full_attention"), sliding_window=3)


def isolated(model, ids_s, feat_s, a, B=4):
    """One block alone over its context (positions < a), mask=None: the decode step engines run."""
    block_ids = torch.tensor([ids_s[a].item()] + [3] * (B - 1))
    q_pos = a + torch.arange(B)
    dtype = next(model.parameters()).dtype
    return model(embed(block_ids).to(dtype), model.context(feat_s[:a].to(dtype)), q_pos=q_pos,
                 kv_pos=torch.cat([torch.arange(a), q_pos]), mask=None)


@pytest.mark.parametrize("layout", [MIXED, dict(layer_types=("sliding_attention",) * 2, sliding_window=2, causal=False),
                                    dict(causal=True)])
def test_packed_forward_of_a_mixed_drafter_equals_each_block_alone(layout):
    model = tiny_model(seed=4, **layout)
    lengths, ids, masks, anchors, feats = packed_case(seed=4)
    with torch.no_grad():
        out = packed_forward(model, lengths, ids, masks, anchors, feats)
        j = 0
        for s in range(2):
            for a in anchors[s].tolist():
                torch.testing.assert_close(out[j], isolated(model, ids[s], feats[s], a), rtol=1e-10, atol=1e-10)
                j += 1
        full = packed_forward(tiny_model(seed=4), lengths, ids, masks, anchors, feats)
    assert not torch.allclose(out, full)  # the layout does change the drafter


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_flex_equals_dense_for_a_mixed_drafter_on_cpu():
    model = tiny_model(seed=6, **MIXED).float()
    lengths, ids, masks, anchors, feats = packed_case(seed=6)
    lay = packed_layout(lengths=lengths, anchors=anchors, block_size=4)
    from dflash.train.objective import build_blocks

    block_ids = torch.cat([build_blocks(i, m, a, block_size=4, mask_token_id=3).block_ids_JB
                           for i, m, a in zip(ids, masks, anchors)]).flatten()
    with torch.no_grad():
        ctx, emb = model.context(torch.cat(feats).float()), embed(block_ids).float()
        dense = model(emb, ctx, q_pos=lay.q_pos_Q, kv_pos=lay.kv_pos_K, mask=lay)
        model.attn_backend = "flex"
        flex = model(emb, ctx, q_pos=lay.q_pos_Q, kv_pos=lay.kv_pos_K, mask=lay)
    torch.testing.assert_close(flex, dense, rtol=1e-4, atol=1e-5)


def test_an_all_sliding_drafter_never_sees_context_beyond_its_window():
    # every layer sliding (window 3, causal): slot k's keys reach back to a + k - 2 at most, slot 0's to a - 2,
    # so context below a - 2 cannot reach any slot, whatever the depth; a full layer makes it reach
    lengths, ids, masks, anchors, feats = packed_case(seed=5)
    a = anchors[0][-1].item()
    j = anchors[0].numel() - 1
    assert a >= 4
    f2 = [feats[0].clone(), feats[1]]
    f2[0][:a - 2] += 3.0
    with torch.no_grad():
        slide = tiny_model(seed=5, layer_types=("sliding_attention",) * 2, sliding_window=3)
        torch.testing.assert_close(packed_forward(slide, lengths, ids, masks, anchors, f2)[j],
                                   packed_forward(slide, lengths, ids, masks, anchors, feats)[j], rtol=0, atol=1e-12)
        mixed = tiny_model(seed=5, **MIXED)
        moved = packed_forward(mixed, lengths, ids, masks, anchors, f2)[j] - \
            packed_forward(mixed, lengths, ids, masks, anchors, feats)[j]
        assert moved.abs().max() > 1e-3


def test_published_qwen36_27b_layout_reads_and_writes_back():
    cfg = DrafterConfig.from_hf_config(QWEN36_27B)
    assert cfg.layer_types == ("sliding_attention",) * 4 + ("full_attention",)
    assert cfg.sliding_window == 2048 and cfg.causal is None
    assert [cfg.layer_attention(i) for i in range(5)] == [LayerAttention(window=2048, causal=True)] * 4 + [FULL]
    hf = cfg.to_hf_config()
    for key in ("layer_types", "sliding_window", "use_sliding_window", "max_window_layers"):
        assert hf[key] == QWEN36_27B[key], key
    assert "causal" not in hf["dflash_config"]  # by layer type, as SGLang and vLLM default
    assert DrafterConfig.from_hf_config(hf) == cfg
    # dflash_config.causal (vLLM's override for every layer) is written when set and read back
    forced = dataclasses.replace(cfg, causal=False)
    assert forced.to_hf_config()["dflash_config"]["causal"] is False
    assert DrafterConfig.from_hf_config(forced.to_hf_config()).layer_attention(0) == LayerAttention(window=2048)
    # transformers reads the export as a Qwen3 config with the same per-layer types and window
    from transformers import Qwen3Config

    q = Qwen3Config(**{k: v for k, v in hf.items() if k not in ("architectures", "auto_map", "dflash_config")})
    assert list(q.layer_types) == QWEN36_27B["layer_types"] and q.sliding_window == 2048
    # the paper's drafter keeps its published fields
    paper = dataclasses.replace(cfg, layer_types=None, sliding_window=None)
    assert paper.to_hf_config()["layer_types"] == ["full_attention"] * 5
    assert (paper.to_hf_config()["use_sliding_window"], paper.to_hf_config()["sliding_window"]) == (False, None)


@pytest.mark.parametrize("change, match", [
    (dict(sliding_window=None), "sliding_window=None"),
    (dict(sliding_window=0), "sliding_window=0"),
    (dict(layer_types=("sliding_attention",) * 4), "4 entries for 5"),
    (dict(layer_types=("linear_attention",) * 5), "linear_attention"),
    (dict(layer_types=None), "no layer is sliding_attention"),
    (dict(causal="yes"), "causal='yes'"),
])
def test_layout_validation_names_the_field(change, match):
    with pytest.raises(ConfigError, match=match):
        dataclasses.replace(DrafterConfig.from_hf_config(QWEN36_27B), **change)


def test_config_json_without_layer_types_but_with_windows_is_refused():
    d = {**QWEN36_27B}
    d.pop("layer_types")
    with pytest.raises(ConfigError, match="give layer_types"):
        DrafterConfig.from_hf_config(d)
    # a Qwen3 config that carries a window but slides nowhere is a full-attention drafter
    d2 = {**QWEN36_27B, "layer_types": ["full_attention"] * 5, "use_sliding_window": False}
    assert DrafterConfig.from_hf_config(d2).sliding_window is None


def test_export_and_load_a_mixed_drafter_round_trip(tmp_path):
    from dflash.drafter.export import export_drafter, load_drafter

    model = tiny_model(seed=8, **MIXED).float()
    out = export_drafter(model, model.cfg, tmp_path / "d", dtype=torch.float32)
    loaded, cfg = load_drafter(out, device="cpu", dtype=torch.float32)
    assert cfg == model.cfg
    lengths, ids, masks, anchors, feats = packed_case(seed=8)
    with torch.no_grad():
        a = anchors[0][-1].item()
        torch.testing.assert_close(isolated(loaded, ids[0], feats[0].float(), a).float(),
                                   isolated(model, ids[0], feats[0].float(), a).float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("lengths,window", [((13, 9), 3), ((700, 300, 450), 200)])
def test_compiled_flex_equals_dense_for_a_mixed_drafter_on_cuda_forward_and_backward(lengths, window):
    # 128-tiles (the trainer's size): with the longer sequences a window cuts into context tiles the full layer
    # lists as full, which must be partial (masked) for the sliding layers
    from dflash.drafter.model import DFlashDrafter

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(9)
    anchors = [torch.sort(torch.randperm(n - 1, generator=g)[:min(60, n - 1)])[0] for n in lengths]
    ids = torch.randint(0, 40, (sum(lengths),), generator=g)
    feats = torch.randn(sum(lengths), 3, 32, generator=g)
    cfg = DrafterConfig(hidden_size=32, intermediate_size=48, target_layer_ids=(1, 3, 5), num_target_layers=8,
                        mask_token_id=3, vocab_size=40, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, block_size=4, rope_theta=1e4,
                        layer_types=("sliding_attention", "full_attention", "sliding_attention"),
                        sliding_window=window)
    results = []
    for backend in ("dense", "flex"):
        torch.manual_seed(0)
        model = DFlashDrafter(cfg).to(dev)
        model.attn_backend = backend
        lay = packed_layout(lengths=list(lengths), anchors=[a.to(dev) for a in anchors], block_size=4)
        from dflash.train.objective import build_packed_blocks

        blk = build_packed_blocks(ids.to(dev), torch.ones_like(ids).to(dev), lay.anchor_J, lengths=list(lengths),
                                  blocks_per_sample=[a.numel() for a in anchors], block_size=4, mask_token_id=3)
        emb = embed(blk.block_ids_JB.flatten().cpu()).float().to(dev)
        out = model(emb, model.context(feats.to(dev)), q_pos=lay.q_pos_Q, kv_pos=lay.kv_pos_K, mask=lay)
        out.pow(2).sum().backward()
        results.append((out.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=2e-3, atol=2e-3)
    for n, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][n], grad, rtol=2e-2, atol=2e-3, msg=n)


@pytest.mark.parametrize("attn", ATTNS)
def test_visible_key_count_of_the_flop_model_is_the_masks(attn):
    from dflash.train.objective import visible_keys

    anchors = torch.tensor([0, 1, 2, 5, 9, 30, 31])
    lay = packed_layout(lengths=[40], anchors=[anchors], block_size=4)
    assert visible_keys(anchors.numpy(), block_size=4, attn=attn) == int(dense_mask(lay, attn).sum())
